-- aiooutbox 0021: cheaper ordered claims and promotions. The claim tells `redelivered`
-- from the rows it updates; promotion and the orphan sweep walk a key's entries once.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- Consumers of every earlier schema keep working: `claim_v7`, `claim_v9`, `requeued`
-- and the rest stay as they were; `promote` and `promote_orphans` keep their signatures
-- and results (every schema's settlements call them, so every consumer gains). A later
-- migration that replaces `claim_v10`, `claim_v11`, `promote` or `promote_orphans`
-- starts from the body below.
--
-- Why (measured with `track_functions` and auto_explain, 50,000 events over 10,000
-- keys against 50,000 unordered, one consumer at concurrency 500; the keyed drain ran
-- at 0.46-0.6x the unordered one, with 1.75x its shared buffer reads):
-- * `claim_v7` (0018) does not return `last_error`, so whether an ordered event on its
--   first attempt was claimed before (a requeue that gave its attempt back left its
--   error; 0019, `requeued`) cost every ordered row a second lookup through the primary
--   key after the claim: `requeued(id)` per row in the statements that call `claim_v7`,
--   a correlated subquery in `claim_v9`: 29,000-43,000 calls, 180-445 ms per drain.
-- * `promote` looked up each key twice from its first index entry (a blocker? the first
--   waiting row?): 12 shared buffers per event of the drain, a quarter of its
--   settlements' reads. The orphan sweep at a consumer's start made three descents per
--   key: 130-180 ms with 10,000 keys.
--
-- 1. `claim_v10`: `claim_v7` as 0018 left it, plus `redelivered` (attempts > 1, or an
--    ordered event whose error a requeue left), read from the version each UPDATE
--    writes and returns (the claim does not change `last_error`), so no row is read
--    again. Same arguments; the consumer's `claim`, `claim_after` and `claim_in_turn`.
-- 2. `claim_v11`: `claim_v9` (0020) claiming through `claim_v10`; same arguments and
--    results. The consumer's claim from low marks.
-- 3. `promote`: one look at the key's first row, a second only from a waiting row on.
-- 4. `promote_orphans`: the skip scan keeps the row it lands on, a key's first.

-- 1. the claim, with `redelivered` --------------------------------------------------
CREATE FUNCTION "{{schema}}"."{{table}}_claim_v10"(
    p_worker TEXT, p_lease FLOAT8, p_topics TEXT[], p_limit INT, p_max_bytes BIGINT,
    p_run INT, p_run_rows INT, p_after_at TIMESTAMPTZ DEFAULT NULL, p_after_id BIGINT DEFAULT NULL,
    p_cursor TEXT DEFAULT NULL, p_groups INT DEFAULT 32)
RETURNS TABLE (id BIGINT, topic TEXT, payload TEXT, dedupe_key TEXT, headers TEXT,
               attempts INT, max_attempts INT, created_at TIMESTAMPTZ,
               available_at TIMESTAMPTZ, message_id TEXT, ordering_key TEXT, is_head BOOLEAN,
               grp TEXT, redelivered BOOLEAN)
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
    run_heads BIGINT[] := '{}';  -- the head each run row was claimed behind
    got INT;
    after_at TIMESTAMPTZ := coalesce(p_after_at, '-infinity');
    after_id BIGINT := coalesce(p_after_id, 0);
    head_bytes BIGINT;
    keyed BOOLEAN;  -- an ordered head was claimed: only then look for runs
    held TEXT[];  -- topics paused or limited (flow control): never claimed here
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock_shared(
        pg_catalog.hashtextextended('aiooutbox-flow:{{schema}}.{{table}}', 0));
    -- a statement of its own: its snapshot is taken after the lock
    held := "{{schema}}"."{{table}}_flow_held"();
    IF '' = ANY (held) THEN
        RETURN;  -- every topic is paused
    END IF;
    IF topics IS NOT NULL AND cardinality(held) > 0 THEN
        topics := ARRAY(SELECT x FROM unnest(topics) AS u(x)
                         WHERE x NOT IN (SELECT unnest(held)));
    END IF;
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
            SELECT t.topic FROM t WHERE t.topic IS NOT NULL
                AND t.topic NOT IN (SELECT unnest(held)));
    END IF;
    IF cardinality(topics) = 0 THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}" AS c
               WHERE c.status IN ('pending', 'retry') AND c.topic = ANY (topics)
                 AND coalesce(c.grp, '') > '') THEN
        -- named groups: each topic's groups in turn after the cursor, the ungrouped range
        -- one of them (`fair_rows`); a round of every group's first rows, then the
        -- second rows, ..., locked in that order
        cand := ARRAY(
            SELECT f.id FROM unnest(topics) WITH ORDINALITY AS t(topic, i)
            CROSS JOIN LATERAL "{{schema}}"."{{table}}_fair_rows"(
                t.topic, p_cursor, p_limit, p_groups, after_at, after_id) AS f
            ORDER BY f.rank, t.i, f.pos LIMIT 2 * p_limit);
        SELECT array_agg(w.id), max(w.before + w.size), bool_or(w.keyed)
        INTO heads, head_bytes, keyed FROM (
            SELECT s.id, s.size, s.keyed,
                   sum(s.size) OVER (ORDER BY s.ord) - s.size AS before
            FROM (SELECT c.id, u.ord, pg_column_size(c.payload) AS size,
                         c.ordering_key IS NOT NULL AS keyed
                  FROM unnest(cand) WITH ORDINALITY AS u(id, ord)
                  JOIN "{{schema}}"."{{table}}" AS c ON c.id = u.id
                  WHERE c.status IN ('pending', 'retry') AND c.available_at <= now()
                  ORDER BY u.ord LIMIT p_limit FOR UPDATE OF c SKIP LOCKED) AS s
        ) AS w WHERE w.before < p_max_bytes;
    ELSIF cardinality(topics) = 1 THEN
        -- one topic: lock while scanning, so concurrent consumers skip each other exactly
        SELECT array_agg(w.id), max(w.before + w.size), bool_or(w.keyed)
        INTO heads, head_bytes, keyed FROM (
            SELECT s.id, s.size, s.keyed,
                   sum(s.size) OVER (ORDER BY s.available_at, s.id) - s.size AS before
            FROM (SELECT c.id, c.available_at, pg_column_size(c.payload) AS size,
                         c.ordering_key IS NOT NULL AS keyed
                  FROM "{{schema}}"."{{table}}" AS c
                  WHERE c.status IN ('pending', 'retry') AND c.topic = topics[1]
                    AND coalesce(c.grp, '') = ''
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
                  AND coalesce(c.grp, '') = ''
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
        SELECT coalesce(array_agg(q.id), '{}'), coalesce(array_agg(q.h_id), '{}')
        INTO runs, run_heads FROM (
                SELECT r.id, k.h_id, sum(r.size) OVER (ORDER BY r.pos, k.h_at, k.h_id) AS upto
                FROM (SELECT h.ordering_key AS k, h.available_at AS h_at, h.id AS h_id
                      FROM "{{schema}}"."{{table}}" h
                      WHERE h.id = ANY (heads) AND h.ordering_key IS NOT NULL) AS k
                CROSS JOIN LATERAL (
                    SELECT x.id, x.size, row_number() OVER (ORDER BY x.id) AS pos,
                           bool_and(x.ok) OVER (ORDER BY x.id) AS ok
                    FROM (SELECT w.id, pg_column_size(w.payload) AS size,
                                 (w.available_at <= now()
                                  AND ((p_topics IS NULL AND w.topic NOT IN (SELECT unnest(held)))
                                       OR w.topic IN (SELECT unnest(topics)))) AS ok
                          FROM "{{schema}}"."{{table}}" w
                          WHERE w.ordering_key = k.k AND w.status = 'waiting'
                          ORDER BY w.id LIMIT p_run) AS x) AS r
                WHERE r.ok
                ORDER BY r.pos, k.h_at, k.h_id
                LIMIT p_run_rows) AS q
        WHERE q.upto <= p_max_bytes - head_bytes;
    END IF;
    -- rows the byte cap left out were only locked: the locks end with the statement
    IF cardinality(runs) = 0 THEN
        -- heads only (every unordered claim): no per-row array membership tests
        RETURN QUERY
        UPDATE "{{schema}}"."{{table}}" AS e SET status = 'processing',
            attempts = e.attempts + 1, locked_by = p_worker, locked_at = now(),
            lease_expires_at = now() + make_interval(secs => p_lease), updated_at = now(),
            holds_key = e.ordering_key IS NOT NULL
        WHERE e.id = ANY (heads)
    RETURNING e.id, e.topic, e.payload::text, e.dedupe_key, e.headers::text,
              e.attempts, e.max_attempts,
              least(greatest(e.created_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              least(greatest(e.available_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              coalesce(e.message_id, md5('aiooutbox:' || (SELECT d.oid FROM pg_catalog.pg_database d
                  WHERE d.datname = pg_catalog.current_database()) || ':' || e.tableoid
                  || ':' || e.id)::uuid)::text,
              e.ordering_key, true, e.grp,
              e.attempts > 1 OR (e.ordering_key IS NOT NULL AND e.last_error IS NOT NULL);
        RETURN;
    END IF;
    -- heads: each joined with whether a run was claimed behind it (set operations, so
    -- no scan of one array per element of the other)
    RETURN QUERY
    UPDATE "{{schema}}"."{{table}}" AS e SET status = 'processing',
        attempts = e.attempts + 1, locked_by = p_worker, locked_at = now(),
        lease_expires_at = now() + make_interval(secs => p_lease), updated_at = now(),
        holds_key = e.ordering_key IS NOT NULL AND m.alone
    FROM (SELECT a.id, true AS alone
          FROM (SELECT h.id FROM unnest(heads) AS h(id)
                EXCEPT SELECT x.h FROM unnest(run_heads) AS x(h)) AS a
          UNION ALL
          SELECT DISTINCT x.h, false FROM unnest(run_heads) AS x(h)) AS m
    WHERE e.id = m.id
    RETURNING e.id, e.topic, e.payload::text, e.dedupe_key, e.headers::text,
              e.attempts, e.max_attempts,
              least(greatest(e.created_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              least(greatest(e.available_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              coalesce(e.message_id, md5('aiooutbox:' || (SELECT d.oid FROM pg_catalog.pg_database d
                  WHERE d.datname = pg_catalog.current_database()) || ':' || e.tableoid
                  || ':' || e.id)::uuid)::text,
              e.ordering_key, true, e.grp,
              e.attempts > 1 OR (e.ordering_key IS NOT NULL AND e.last_error IS NOT NULL);
    RETURN QUERY
    UPDATE "{{schema}}"."{{table}}" AS e SET status = 'processing',
        attempts = e.attempts + 1, locked_by = p_worker, locked_at = now(),
        lease_expires_at = now() + make_interval(secs => p_lease), updated_at = now(),
        holds_key = m.last
    FROM (SELECT x.id, x.id = max(x.id) OVER (PARTITION BY x.h) AS last
          FROM unnest(runs, run_heads) AS x(id, h)) AS m
    WHERE e.id = m.id AND e.status = 'waiting'
    RETURNING e.id, e.topic, e.payload::text, e.dedupe_key, e.headers::text,
              e.attempts, e.max_attempts,
              least(greatest(e.created_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              least(greatest(e.available_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              coalesce(e.message_id, md5('aiooutbox:' || (SELECT d.oid FROM pg_catalog.pg_database d
                  WHERE d.datname = pg_catalog.current_database()) || ':' || e.tableoid
                  || ':' || e.id)::uuid)::text,
              e.ordering_key, false, e.grp,
              e.attempts > 1 OR (e.ordering_key IS NOT NULL AND e.last_error IS NOT NULL);
    GET DIAGNOSTICS got = ROW_COUNT;
    IF got < cardinality(runs) THEN
        -- a run row changed between the look and the update (rare): re-flag each key of
        -- this claim on the highest run row actually claimed, else on its head
        UPDATE "{{schema}}"."{{table}}" AS e SET holds_key = false
        WHERE e.id = ANY (heads || runs) AND e.status = 'processing' AND e.locked_by = p_worker
          AND e.holds_key;
        UPDATE "{{schema}}"."{{table}}" AS e SET holds_key = true
        FROM (SELECT coalesce(max(c.id) FILTER (WHERE c.id = ANY (runs)),
                              max(c.id) FILTER (WHERE c.id = ANY (heads))) AS id
              FROM "{{schema}}"."{{table}}" c
              WHERE c.id = ANY (heads || runs) AND c.status = 'processing'
                AND c.locked_by = p_worker AND c.ordering_key IS NOT NULL
              GROUP BY c.ordering_key) AS f
        WHERE e.id = f.id;
    END IF;
END
$fn$;

-- 2. the claim from low marks, through `claim_v10` -------------------------------------
CREATE FUNCTION "{{schema}}"."{{table}}_claim_v11"(
    p_worker TEXT, p_lease FLOAT8, p_topics TEXT[], p_limit INT, p_max_bytes BIGINT,
    p_run INT, p_run_rows INT, p_mark_us BIGINT[], p_mark_id BIGINT[], p_awaited BIGINT[],
    p_grace FLOAT8, p_cursor TEXT, p_groups INT, p_probe_after TEXT[], p_probe_us BIGINT[],
    p_probe_id BIGINT[], p_probe_groups INT)
RETURNS TABLE (id BIGINT, topic TEXT, payload TEXT, dedupe_key TEXT, headers TEXT,
               attempts INT, max_attempts INT, created_at TIMESTAMPTZ,
               available_at TIMESTAMPTZ, message_id TEXT, ordering_key TEXT, is_head BOOLEAN,
               grp TEXT, redelivered BOOLEAN)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    read_at TIMESTAMPTZ := clock_timestamp();
    read_ms BIGINT;
    open_keys BIGINT[];
    awaited BIGINT[];
    back_to TIMESTAMPTZ;
    bound TIMESTAMPTZ;
    after_at TIMESTAMPTZ;
    after_id BIGINT;
    probe_n INT := greatest(coalesce(p_probe_groups, 1), 1);
    i INT;
    m_at TIMESTAMPTZ;  -- topic i's mark (taken back to an awaited key that left)
    m_id BIGINT;
    low_at TIMESTAMPTZ;  -- its sweep's lowest candidate (NULL: none yet)
    low_id BIGINT;
    f_at TIMESTAMPTZ;
    f_id BIGINT;
    grps TEXT[];  -- the groups probed (and one more, if any), their first rows
    ats TIMESTAMPTZ[];
    fids BIGINT[];
    new_us BIGINT[] := '{}';
    new_id BIGINT[] := '{}';
    new_after TEXT[] := '{}';
    new_low_us BIGINT[] := '{}';
    new_low_id BIGINT[] := '{}';
BEGIN
    -- pg_locks first: every statement below takes its snapshot after this reading
    read_ms := floor(date_part('epoch', read_at) * 1000)::bigint;
    open_keys := "{{schema}}"."{{table}}_open_positions"();
    -- held longer than the grace, or awaited already: awaited
    awaited := ARRAY(SELECT k FROM unnest(open_keys) AS u(k)
                     WHERE k = ANY (coalesce(p_awaited, '{}')) OR read_ms - k > p_grace * 1000
                     ORDER BY k);
    -- an awaited key that left: its rows are visible now; the marks go back to it
    -- (10 ms before it, as below)
    SELECT to_timestamp(min(a) / 1000.0) - interval '10 ms' INTO back_to
    FROM unnest(coalesce(p_awaited, '{}')) AS u(a) WHERE NOT (a = ANY (open_keys));
    -- 10 ms before the oldest key held and before this reading (as `claim_v8`)
    SELECT least(read_at, to_timestamp(min(k) / 1000.0)) - interval '10 ms' INTO bound
    FROM unnest(open_keys) AS u(k) WHERE NOT (k = ANY (awaited));
    -- where this claim starts: the lowest of its topics' marks
    SELECT s.at, s.id INTO after_at, after_id FROM (
        SELECT CASE WHEN back_to IS NOT NULL AND (back_to, 0::bigint) < (m.at, m.id)
                    THEN back_to ELSE m.at END AS at,
               CASE WHEN back_to IS NOT NULL AND (back_to, 0::bigint) < (m.at, m.id)
                    THEN 0 ELSE m.id END AS id
        FROM (SELECT CASE WHEN x.us IS NULL THEN '-infinity'::timestamptz
                          ELSE 'epoch'::timestamptz + x.us * interval '1 microsecond' END AS at,
                     coalesce(x.mid, 0) AS id
              FROM unnest(p_topics, p_mark_us, p_mark_id) AS x(t, us, mid)) AS m) AS s
    ORDER BY s.at, s.id LIMIT 1;
    RETURN QUERY
    SELECT * FROM "{{schema}}"."{{table}}_claim_v10"(p_worker, p_lease, p_topics, p_limit,
        p_max_bytes, p_run, p_run_rows, after_at, after_id, p_cursor, p_groups);
    -- each topic's probe (not locking: rows other claims hold locked count)
    FOR i IN 1 .. coalesce(cardinality(p_topics), 0) LOOP
        m_at := CASE WHEN p_mark_us[i] IS NULL THEN '-infinity'::timestamptz
                     ELSE 'epoch'::timestamptz + p_mark_us[i] * interval '1 microsecond' END;
        m_id := coalesce(p_mark_id[i], 0);
        IF back_to IS NOT NULL AND (back_to, 0::bigint) < (m_at, m_id) THEN
            m_at := back_to;
            m_id := 0;
        END IF;
        low_at := NULL;
        low_id := NULL;
        IF p_probe_after[i] IS NOT NULL THEN  -- a sweep goes on (NULL microseconds: -infinity)
            low_at := CASE WHEN p_probe_us[i] IS NULL THEN '-infinity'::timestamptz
                           ELSE 'epoch'::timestamptz + p_probe_us[i] * interval '1 microsecond' END;
            low_id := coalesce(p_probe_id[i], 0);
            -- an awaited key that left: the groups probed before did not see its rows
            IF back_to IS NOT NULL AND (back_to, 0::bigint) < (low_at, low_id) THEN
                low_at := back_to;
                low_id := 0;
            END IF;
        END IF;
        -- this call's bound
        IF low_at IS NULL OR (bound, 0::bigint) < (low_at, low_id) THEN
            low_at := bound;
            low_id := 0;
        END IF;
        -- the ungrouped range's first row after the mark
        SELECT c.available_at, c.id INTO f_at, f_id FROM "{{schema}}"."{{table}}" AS c
        WHERE c.status IN ('pending', 'retry') AND c.topic = p_topics[i]
          AND coalesce(c.grp, '') = '' AND (c.available_at, c.id) > (m_at, m_id)
        ORDER BY c.available_at, c.id LIMIT 1;
        IF FOUND AND (f_at, f_id - 1) < (low_at, low_id) THEN
            low_at := f_at;
            low_id := f_id - 1;
        END IF;
        -- up to probe_n + 1 groups after the sweep's last, each with its first row after
        -- the mark: a skip scan that looks only at entries after the mark (in the index),
        -- one descent per group (the index orders a group's rows by position)
        SELECT coalesce(array_agg(g.grp ORDER BY g.n), '{}'),
               coalesce(array_agg(g.at ORDER BY g.n), '{}'),
               coalesce(array_agg(g.id ORDER BY g.n), '{}')
        INTO grps, ats, fids
        FROM (WITH RECURSIVE g(grp, at, id, n) AS (
                  (SELECT coalesce(c.grp, ''), c.available_at, c.id, 1
                   FROM "{{schema}}"."{{table}}" AS c
                   WHERE c.status IN ('pending', 'retry') AND c.topic = p_topics[i]
                     AND coalesce(c.grp, '') > coalesce(p_probe_after[i], '')
                     AND (c.available_at, c.id) > (m_at, m_id)
                   ORDER BY coalesce(c.grp, ''), c.available_at, c.id LIMIT 1)
                  UNION ALL
                  SELECT s.grp, s.at, s.id, g.n + 1 FROM g CROSS JOIN LATERAL (
                      SELECT coalesce(c.grp, '') AS grp, c.available_at AS at, c.id
                      FROM "{{schema}}"."{{table}}" AS c
                      WHERE c.status IN ('pending', 'retry') AND c.topic = p_topics[i]
                        AND coalesce(c.grp, '') > g.grp
                        AND (c.available_at, c.id) > (m_at, m_id)
                      ORDER BY coalesce(c.grp, ''), c.available_at, c.id LIMIT 1) AS s
                  WHERE g.n <= probe_n)
              SELECT * FROM g) AS g;
        SELECT u.at, u.id INTO f_at, f_id
        FROM unnest(ats[1:probe_n], fids[1:probe_n]) AS u(at, id)
        ORDER BY u.at, u.id LIMIT 1;
        IF FOUND AND (f_at, f_id - 1) < (low_at, low_id) THEN
            low_at := f_at;
            low_id := f_id - 1;
        END IF;
        IF cardinality(grps) <= probe_n THEN
            -- the sweep has seen every group: the new mark, and a sweep starts anew
            new_us := new_us || CASE WHEN low_at = '-infinity' THEN NULL
                                     ELSE "{{schema}}"."{{table}}_epoch_us"(low_at) END;
            new_id := new_id || low_id;
            new_after := new_after || NULL::text;
            new_low_us := new_low_us || NULL::bigint;
            new_low_id := new_low_id || NULL::bigint;
        ELSE
            -- groups left: the mark stays, the sweep goes on after the last probed
            new_us := new_us || CASE WHEN m_at = '-infinity' THEN NULL
                                     ELSE "{{schema}}"."{{table}}_epoch_us"(m_at) END;
            new_id := new_id || m_id;
            new_after := new_after || grps[probe_n];
            new_low_us := new_low_us || CASE WHEN low_at = '-infinity' THEN NULL
                                             ELSE "{{schema}}"."{{table}}_epoch_us"(low_at) END;
            new_low_id := new_low_id || low_id;
        END IF;
    END LOOP;
    RETURN QUERY SELECT NULL::bigint, NULL::text,
                        json_build_object('us', to_json(new_us), 'id', to_json(new_id),
                                          'awaited', to_json(awaited),
                                          'after', to_json(new_after),
                                          'low_us', to_json(new_low_us),
                                          'low_id', to_json(new_low_id))::text,
                        NULL::text, NULL::text, NULL::int,
                        NULL::int, NULL::timestamptz, NULL::timestamptz, NULL::text,
                        NULL::text, NULL::boolean, NULL::text, NULL::boolean;
END
$fn$;

-- 3. promotion, one walk of a key's entries -----------------------------------------------
-- `promote` as 0019 left it (same signature and results; every caller of every schema
-- runs it), except how it finds a key's next event. It looked twice, each time from the
-- key's first entry in the key index: for a row that blocks the key (pending, retry,
-- processing, or dead and blocking), then for the first waiting row; the entries of
-- the key's events handled so far (their dead versions until vacuum) were walked twice.
-- Now one look finds the key's first row in id order that the key index holds (a
-- blocker or a waiting row): a blocker ends it (so a key with a backlog behind its
-- head costs one descent, as before); a waiting row is promoted unless a blocker comes
-- after it (a second look that starts at that row). The same rows qualify as before:
-- no row blocks the key, and its waiting row with the lowest id is promoted.
CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_promote"(p_keys TEXT[])
RETURNS TABLE (promoted INT, skipped TEXT[])
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan  -- as 0007 set it
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
    PERFORM "{{schema}}"."{{table}}_take_position"();  -- before any position is taken (0019)
    WITH nxt AS (
        SELECT f.id
        FROM unnest(locked) AS k(k)
        CROSS JOIN LATERAL (
            SELECT w.id, w.status = 'waiting' AS waiting
            FROM "{{schema}}"."{{table}}" w
            WHERE w.ordering_key = k.k
              AND (w.status IN ('pending', 'retry', 'processing', 'waiting') OR w.blocks_key)
            ORDER BY w.id LIMIT 1) AS f
        WHERE f.waiting
          AND NOT EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}" b
                          WHERE b.ordering_key = k.k AND b.id > f.id
                            AND (b.status IN ('pending', 'retry', 'processing') OR b.blocks_key))),
    up AS (
        UPDATE "{{schema}}"."{{table}}" AS e SET status = 'pending',
            available_at = greatest(e.available_at, clock_timestamp()), updated_at = now()
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

-- 4. the orphan sweep, from each key's first row ------------------------------------------
-- `promote_orphans` as 0006 left it (same results), except that the skip scan over the
-- key index keeps the row it lands on: the key's first row in id order that the index
-- holds. A key whose first row blocks it (the common case: its head) is passed over
-- at once, where each key cost two more descents (a look for a blocker, a look for a
-- waiting row: 130-180 ms per consumer start with 10,000 keys, measured). A key whose
-- first row waits is handed to `promote` unless a blocker comes after it; `promote`
-- looks again under the key's lock, as before.
CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_promote_orphans"()
RETURNS TABLE (promoted INT, skipped TEXT[])
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $fn$
BEGIN
    RETURN QUERY SELECT * FROM "{{schema}}"."{{table}}_promote"(ARRAY(
        WITH RECURSIVE k(k, id, waiting) AS (
            (SELECT w.ordering_key, w.id, w.status = 'waiting'
             FROM "{{schema}}"."{{table}}" w
             WHERE w.ordering_key IS NOT NULL
               AND (w.status IN ('pending', 'retry', 'processing', 'waiting') OR w.blocks_key)
             ORDER BY w.ordering_key, w.id LIMIT 1)
            UNION ALL
            SELECT f.ordering_key, f.id, f.waiting FROM k CROSS JOIN LATERAL (
                SELECT w.ordering_key, w.id, w.status = 'waiting' AS waiting
                FROM "{{schema}}"."{{table}}" w
                WHERE w.ordering_key > k.k
                  AND (w.status IN ('pending', 'retry', 'processing', 'waiting') OR w.blocks_key)
                ORDER BY w.ordering_key, w.id LIMIT 1) AS f)
        SELECT k.k FROM k WHERE k.waiting
          AND NOT EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}" b
                          WHERE b.ordering_key = k.k AND b.id > k.id
                            AND (b.status IN ('pending', 'retry', 'processing') OR b.blocks_key))));
END
$fn$;
