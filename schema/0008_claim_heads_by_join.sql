-- aiooutbox 0008: the claim tells its heads from the runs behind them by a join.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- 0006's claim marked which claimed rows were heads with `e.id = ANY (heads)` for
-- every row it updated, a scan of the heads array per row: a claim of H heads and R
-- run rows compared (H + R) x H ids, twice. At 2,000 heads and 4,000 run rows (a
-- consumer with prefetch=1500) that was 24M comparisons per claim, and keyed drains
-- ran at half the unordered rate, with half again as much server CPU per event
-- (docs/benchmarks.md, "Prefetch at high concurrency"). The update now joins the ids
-- with a head flag. Only the function's last statement changes; its signature and
-- results, and everything the claim takes, stay as in 0006 (0007's plan setting is
-- restated: CREATE OR REPLACE replaces a function's settings with the ones it lists).

CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_claim_v6"(
    p_worker TEXT, p_lease FLOAT8, p_topics TEXT[], p_limit INT, p_max_bytes BIGINT,
    p_run INT, p_run_rows INT, p_after_at TIMESTAMPTZ DEFAULT NULL, p_after_id BIGINT DEFAULT NULL)
RETURNS TABLE (id BIGINT, topic TEXT, payload TEXT, dedupe_key TEXT, headers TEXT,
               attempts INT, max_attempts INT, created_at TIMESTAMPTZ,
               available_at TIMESTAMPTZ, message_id TEXT, ordering_key TEXT, is_head BOOLEAN)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    topics TEXT[] := p_topics;
    cand BIGINT[];
    heads BIGINT[];
    runs BIGINT[] := '{}';
    after_at TIMESTAMPTZ := coalesce(p_after_at, '-infinity');
    after_id BIGINT := coalesce(p_after_id, 0);
    head_bytes BIGINT;
    keyed BOOLEAN;  -- an ordered head was claimed: only then look for runs
BEGIN
    IF topics IS NULL THEN
        -- every topic with claimable rows: a skip scan over the index's leading column
        topics := ARRAY(
            WITH RECURSIVE t(topic) AS (
                (SELECT c.topic FROM "{{schema}}"."{{table}}" c
                 WHERE c.status IN ('pending', 'retry') ORDER BY c.topic LIMIT 1)
                UNION ALL
                SELECT (SELECT c.topic FROM "{{schema}}"."{{table}}" c
                        WHERE c.status IN ('pending', 'retry') AND c.topic > t.topic
                        ORDER BY c.topic LIMIT 1)
                FROM t WHERE t.topic IS NOT NULL)
            SELECT t.topic FROM t WHERE t.topic IS NOT NULL);
    END IF;
    IF cardinality(topics) = 1 THEN
        -- one topic: lock while scanning, so concurrent consumers skip each other exactly
        SELECT array_agg(w.id), max(w.before + w.size), bool_or(w.keyed)
        INTO heads, head_bytes, keyed FROM (
            SELECT s.id, s.size, s.keyed,
                   sum(s.size) OVER (ORDER BY s.available_at, s.id) - s.size AS before
            FROM (SELECT c.id, c.available_at, pg_column_size(c.payload) AS size,
                         c.ordering_key IS NOT NULL AS keyed
                  FROM "{{schema}}"."{{table}}" AS c
                  WHERE c.status IN ('pending', 'retry') AND c.topic = topics[1]
                    AND c.available_at <= now()
                    AND (c.available_at, c.id) > (after_at, after_id)
                  ORDER BY c.available_at, c.id LIMIT p_limit FOR UPDATE SKIP LOCKED) AS s
        ) AS w WHERE w.before < p_max_bytes;
    ELSE
        -- several: the oldest rows of each topic, merged (twice the limit, so rows other
        -- consumers lock meanwhile still leave enough), then locked in that order
        cand := ARRAY(
            SELECT x.id FROM unnest(topics) AS t(topic) CROSS JOIN LATERAL (
                SELECT c.id, c.available_at FROM "{{schema}}"."{{table}}" AS c
                WHERE c.status IN ('pending', 'retry') AND c.topic = t.topic
                  AND c.available_at <= now()
                  AND (c.available_at, c.id) > (after_at, after_id)
                ORDER BY c.available_at, c.id LIMIT p_limit) AS x
            ORDER BY x.available_at, x.id LIMIT 2 * p_limit);
        SELECT array_agg(w.id), max(w.before + w.size), bool_or(w.keyed)
        INTO heads, head_bytes, keyed FROM (
            SELECT s.id, s.size, s.keyed,
                   sum(s.size) OVER (ORDER BY s.available_at, s.id) - s.size AS before
            FROM (SELECT c.id, c.available_at, pg_column_size(c.payload) AS size,
                         c.ordering_key IS NOT NULL AS keyed
                  FROM "{{schema}}"."{{table}}" AS c
                  WHERE c.id = ANY (cand) AND c.status IN ('pending', 'retry')
                    AND c.available_at <= now()
                  ORDER BY c.available_at, c.id LIMIT p_limit FOR UPDATE SKIP LOCKED) AS s
        ) AS w WHERE w.before < p_max_bytes;
    END IF;
    IF heads IS NULL THEN
        RETURN;
    END IF;
    IF keyed AND p_run > 0 AND p_run_rows > 0 AND head_bytes < p_max_bytes THEN
        runs := ARRAY(
            SELECT q.id FROM (
                SELECT r.id, sum(r.size) OVER (ORDER BY r.pos, k.h_at, k.h_id) AS upto
                FROM (SELECT h.ordering_key AS k, h.available_at AS h_at, h.id AS h_id
                      FROM "{{schema}}"."{{table}}" h
                      WHERE h.id = ANY (heads) AND h.ordering_key IS NOT NULL) AS k
                CROSS JOIN LATERAL (
                    SELECT x.id, x.size, row_number() OVER (ORDER BY x.id) AS pos,
                           bool_and(x.ok) OVER (ORDER BY x.id) AS ok
                    FROM (SELECT w.id, pg_column_size(w.payload) AS size,
                                 (w.available_at <= now()
                                  AND (p_topics IS NULL OR w.topic = ANY (topics))) AS ok
                          FROM "{{schema}}"."{{table}}" w
                          WHERE w.ordering_key = k.k AND w.status = 'waiting'
                          ORDER BY w.id LIMIT p_run) AS x) AS r
                WHERE r.ok
                ORDER BY r.pos, k.h_at, k.h_id
                LIMIT p_run_rows) AS q
            WHERE q.upto <= p_max_bytes - head_bytes);
    END IF;
    -- rows the byte cap left out were only locked: the locks end with the statement
    IF cardinality(runs) = 0 THEN
        -- heads only (every unordered claim): no per-row array membership tests
        RETURN QUERY
        UPDATE "{{schema}}"."{{table}}" AS e SET status = 'processing',
            attempts = e.attempts + 1, locked_by = p_worker, locked_at = now(),
            lease_expires_at = now() + make_interval(secs => p_lease), updated_at = now()
        WHERE e.id = ANY (heads)
    RETURNING e.id, e.topic, e.payload::text, e.dedupe_key, e.headers::text,
              e.attempts, e.max_attempts,
              least(greatest(e.created_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              least(greatest(e.available_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              coalesce(e.message_id, md5('aiooutbox:' || (SELECT d.oid FROM pg_catalog.pg_database d
                  WHERE d.datname = pg_catalog.current_database()) || ':' || e.tableoid
                  || ':' || e.id)::uuid)::text,
              e.ordering_key, true;
        RETURN;
    END IF;
    RETURN QUERY
    UPDATE "{{schema}}"."{{table}}" AS e SET status = 'processing',
        attempts = e.attempts + 1, locked_by = p_worker, locked_at = now(),
        lease_expires_at = now() + make_interval(secs => p_lease), updated_at = now()
    FROM (SELECT h.id, true AS head FROM unnest(heads) AS h(id)
          UNION ALL
          SELECT r.id, false FROM unnest(runs) AS r(id)) AS m
    WHERE e.id = m.id AND (m.head OR e.status = 'waiting')
    RETURNING e.id, e.topic, e.payload::text, e.dedupe_key, e.headers::text,
              e.attempts, e.max_attempts,
              least(greatest(e.created_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              least(greatest(e.available_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              coalesce(e.message_id, md5('aiooutbox:' || (SELECT d.oid FROM pg_catalog.pg_database d
                  WHERE d.datname = pg_catalog.current_database()) || ':' || e.tableoid
                  || ':' || e.id)::uuid)::text,
              e.ordering_key, m.head;
END
$fn$;

