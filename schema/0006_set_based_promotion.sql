-- aiooutbox 0006: set-based promotion, a cheap orphan sweep, and claims that take runs
-- behind every head.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- Consumers of schema 5 keep working: 0005's claim is kept, and the two functions
-- replaced here keep their signatures and results.
--
-- Measured with `python -m benchmarks --only ordering` (docs/benchmarks.md): 0005's
-- promotion was a PL/pgSQL loop of four statements per key; its orphan sweep checked
-- every waiting event, so a key blocked with a large backlog made each consumer's start
-- walk that backlog.

-- Promote the next waiting event of each key that has no head left; a key whose lock a
-- producer holds is returned in `skipped` (the caller tries again later). Notifies
-- idle consumers of the promoted events' topics, as the insert trigger would. Three
-- statements for any number of keys: the try-locks, then (in a statement whose snapshot
-- is taken after them, so it sees what the keys' previous lock holders committed) the
-- head checks and the promotion, then the notifications.
CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_promote"(p_keys TEXT[])
RETURNS TABLE (promoted INT, skipped TEXT[])
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $fn$
DECLARE
    locked TEXT[];
    woken TEXT[];
BEGIN
    -- the locks first, in a statement of their own: the next statement's snapshot then
    -- sees everything the keys' previous lock holders committed
    SELECT coalesce(array_agg(l.k) FILTER (WHERE l.got), '{}'),
           coalesce(array_agg(l.k) FILTER (WHERE NOT l.got), '{}')
    INTO locked, skipped
    FROM (SELECT u.k, pg_try_advisory_xact_lock(hashtextextended('{{schema}}.{{table}}:' || u.k, 0)) AS got
          FROM (SELECT DISTINCT x.k FROM unnest(p_keys) AS x(k) WHERE x.k IS NOT NULL ORDER BY 1) AS u
          OFFSET 0) AS l;
    promoted := 0;
    IF cardinality(locked) = 0 THEN
        RETURN NEXT;
        RETURN;
    END IF;
    WITH nxt AS (
        SELECT (SELECT w.id FROM "{{schema}}"."{{table}}" w
                WHERE w.ordering_key = k.k AND w.status = 'waiting' ORDER BY w.id LIMIT 1) AS id
        FROM unnest(locked) AS k(k)
        WHERE NOT EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}" b
                          WHERE b.ordering_key = k.k
                            AND (b.status IN ('pending', 'retry', 'processing') OR b.blocks_key))),
    up AS (
        UPDATE "{{schema}}"."{{table}}" AS e SET status = 'pending', updated_at = now()
        FROM nxt WHERE e.id = nxt.id AND e.status = 'waiting'
        RETURNING e.topic)
    SELECT count(*)::int, array_agg(DISTINCT up.topic) INTO promoted, woken FROM up;
    IF woken IS NOT NULL THEN
        PERFORM pg_notify('{{channel}}', t.topic) FROM unnest(woken) AS t(topic)
        WHERE EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}_idle" i
                      WHERE i.expires_at > now() AND (t.topic = ANY (i.topics) OR '*' = ANY (i.topics)));
    END IF;
    RETURN NEXT;
END
$fn$;

-- Keys with waiting events and no head (a promotion lost with its consumer, events of
-- schema-3 consumers): promoted again. Run at consumer start; visits each key once (a
-- skip scan over the key index), not each waiting event.
CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_promote_orphans"()
RETURNS TABLE (promoted INT, skipped TEXT[])
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $fn$
BEGIN
    RETURN QUERY SELECT * FROM "{{schema}}"."{{table}}_promote"(ARRAY(
        WITH RECURSIVE k(k) AS (
            (SELECT w.ordering_key FROM "{{schema}}"."{{table}}" w
             WHERE w.ordering_key IS NOT NULL
               AND (w.status IN ('pending', 'retry', 'processing', 'waiting') OR w.blocks_key)
             ORDER BY w.ordering_key LIMIT 1)
            UNION ALL
            SELECT (SELECT w.ordering_key FROM "{{schema}}"."{{table}}" w
                    WHERE w.ordering_key > k.k
                      AND (w.status IN ('pending', 'retry', 'processing', 'waiting') OR w.blocks_key)
                    ORDER BY w.ordering_key LIMIT 1)
            FROM k WHERE k.k IS NOT NULL)
        SELECT k.k FROM k WHERE k.k IS NOT NULL
          AND NOT EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}" b
                          WHERE b.ordering_key = k.k
                            AND (b.status IN ('pending', 'retry', 'processing') OR b.blocks_key))
          AND EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}" w
                      WHERE w.ordering_key = k.k AND w.status = 'waiting')));
END
$fn$;

-- The claim of schema 6: 0005's claim, except that the runs behind ordered heads have
-- a budget of their own (p_run_rows) instead of the room the heads left under p_limit.
-- A claim full of heads of distinct keys (the common case: many keys, a few events
-- each) used to take no run at all, so every event cost a promotion and a claim of its
-- own. The budget is shared fairly: every head's first waiting event, then every
-- head's second, and so on; runs count towards the byte cap too.
CREATE FUNCTION "{{schema}}"."{{table}}_claim_v6"(
    p_worker TEXT, p_lease FLOAT8, p_topics TEXT[], p_limit INT, p_max_bytes BIGINT,
    p_run INT, p_run_rows INT, p_after_at TIMESTAMPTZ DEFAULT NULL, p_after_id BIGINT DEFAULT NULL)
RETURNS TABLE (id BIGINT, topic TEXT, payload TEXT, dedupe_key TEXT, headers TEXT,
               attempts INT, max_attempts INT, created_at TIMESTAMPTZ,
               available_at TIMESTAMPTZ, message_id TEXT, ordering_key TEXT, is_head BOOLEAN)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
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
    WHERE e.id = ANY (heads || runs)
      AND (e.id = ANY (heads) OR e.status = 'waiting')
    RETURNING e.id, e.topic, e.payload::text, e.dedupe_key, e.headers::text,
              e.attempts, e.max_attempts,
              least(greatest(e.created_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              least(greatest(e.available_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              coalesce(e.message_id, md5('aiooutbox:' || (SELECT d.oid FROM pg_catalog.pg_database d
                  WHERE d.datname = pg_catalog.current_database()) || ':' || e.tableoid
                  || ':' || e.id)::uuid)::text,
              e.ordering_key, e.id = ANY (heads);
END
$fn$;
