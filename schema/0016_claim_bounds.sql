-- aiooutbox 0016: a claim of limited topics bounded by bytes as a whole; held topics
-- looked up by hash.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- Consumers of every earlier schema keep working: `claim_v6` keeps its signature and
-- results (restated from its body in 0013), and `claim_limited`, which consumers of
-- schema 10 to 15 call, is left as 0013 made it. A later migration that replaces
-- `claim_v6` or `claim_limited_v2` starts from the body below.
--
-- 1. `claim_limited` applied `p_max_bytes` to each topic it claimed: one call over many
--    limited topics could take the cap's worth of each (20 rows, 41.9 MB under a
--    1,000,000-byte cap). `claim_limited_v2` applies it to the whole call: a row is
--    taken only while the stored payloads taken before it, every topic together, are
--    below the cap (so its first row is taken whatever its size, as in `claim_v6`), and
--    a topic the cap cut short, or never reached, gets no status row (it is not held:
--    its consumer asks again). Rows the same claim took of open topics before it
--    (`p_claimed`) count too, and it returns each row's stored payload size (`bytes`),
--    so that a consumer bounds its open claim, before or after, by what is left of the
--    cap. It serves the topics in the order given (the consumer's turns; the first gets
--    the cap's first row), after locking all their control rows in name order (claimers
--    of the same topics never wait for each other in two orders).
-- 2. `claim_v6` compared every topic it looked at with every held topic (paused or
--    limited): `NOT (topic = ANY (held))`, a linear scan of the array per topic. With a
--    thousand paused topics with events, a claim of every topic spent ~18 ms on it.
--    Those tests are now hashed subplans (`NOT IN (SELECT unnest(held))`): the array is
--    hashed once per statement. The rows read and the indexes used are unchanged.
-- 3. A claim of many limited topics at their max_running (or out of tokens) locked
--    each topic's control row and counted its claimed rows one topic after another: a
--    consumer of every topic beside a thousand topics held at their limit by others
--    ran that every 0.1 s (its recheck) and drained at a quarter of its speed.
--    `claim_limited_v2` first tells apart, in one statement and without locking
--    anything, the topics that can give nothing (paused, at their max_running, out of
--    tokens) and answers for them at once; only the others are locked and claimed.

-- The claim of schema 6, as 0013 left it, with the held topics looked up by hash (2.
-- above): from the topics it was given, from those its skip scan finds, and in the runs
-- behind ordered heads.
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
              e.ordering_key, true;
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
              e.ordering_key, true;
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
              e.ordering_key, false;
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

-- The claim of limited topics, as 0013 left `claim_limited`, with the byte cap over
-- the whole call (1. above), each claimed row's stored payload size, and the topics
-- that can give nothing told apart before any is locked (3. above).
CREATE FUNCTION "{{schema}}"."{{table}}_claim_limited_v2"(
    p_worker TEXT, p_lease FLOAT8, p_topics TEXT[], p_wants INT[], p_max_bytes BIGINT,
    p_claimed BIGINT[])
RETURNS TABLE (id BIGINT, topic TEXT, payload TEXT, dedupe_key TEXT, headers TEXT,
               attempts INT, max_attempts INT, created_at TIMESTAMPTZ,
               available_at TIMESTAMPTZ, message_id TEXT, ordering_key TEXT, is_head BOOLEAN,
               held TEXT, retry_in FLOAT8, bytes BIGINT)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    w RECORD;
    c "{{schema}}"."{{table}}_flow"%ROWTYPE;
    v_topics TEXT[];  -- p_topics, p_wants in the order given, and what holds each back
    v_wants INT[];
    v_whys TEXT[];
    v_waits FLOAT8[];
    allowed INT;
    v_running INT;
    v_tokens FLOAT8;
    v_clock TIMESTAMPTZ;
    ids BIGINT[];
    got INT;
    locked INT;  -- rows of the topic locked, before the byte cap
    got_bytes BIGINT;
    used BIGINT;  -- stored payload bytes claimed so far, every topic
    why TEXT;
    wait FLOAT8;
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock_shared(
        pg_catalog.hashtextextended('aiooutbox-flow:{{schema}}.{{table}}', 0));
    IF EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}_flow" f WHERE f.topic = '' AND f.paused) THEN
        RETURN QUERY SELECT NULL::bigint, u.t, NULL::text, NULL::text, NULL::text,
            NULL::int, NULL::int, NULL::timestamptz, NULL::timestamptz, NULL::text,
            NULL::text, NULL::boolean, 'paused'::text, NULL::float8, NULL::bigint
            FROM unnest(p_topics) AS u(t);
        RETURN;
    END IF;
    -- What can give nothing now, for every topic at once and without a lock: paused, at
    -- its max_running (its claimed rows counted through the index that holds only
    -- them), out of tokens. A slot or a token freed meanwhile is found at the next ask,
    -- as if this call had come a moment sooner. The other topics are locked, and checked
    -- again under their lock, before any row is claimed.
    SELECT array_agg(s.t ORDER BY s.i), array_agg(s.n ORDER BY s.i),
           array_agg(s.why ORDER BY s.i), array_agg(s.wait ORDER BY s.i)
    INTO v_topics, v_wants, v_whys, v_waits
    FROM (SELECT u.t, u.n, u.i,
                 CASE WHEN f.paused THEN 'paused'
                      WHEN f.max_running IS NOT NULL
                           AND (SELECT count(*) FROM "{{schema}}"."{{table}}" r
                                WHERE r.topic = u.t AND r.flow_counted
                                  AND r.status = 'processing') >= f.max_running
                      THEN 'running'
                      WHEN k.tokens < 1 THEN 'rate' END AS why,
                 (1 - k.tokens) / f.rate AS wait
          FROM unnest(p_topics, p_wants) WITH ORDINALITY AS u(t, n, i)
          LEFT JOIN "{{schema}}"."{{table}}_flow" f ON f.topic = u.t
          CROSS JOIN LATERAL (
              SELECT least(f.burst, f.tokens + f.rate * extract(epoch FROM
                     greatest(pg_catalog.clock_timestamp(), f.tokens_at) - f.tokens_at)::float8)
                     AS tokens) AS k) AS s;
    RETURN QUERY SELECT NULL::bigint, x.t, NULL::text, NULL::text, NULL::text,
        NULL::int, NULL::int, NULL::timestamptz, NULL::timestamptz, NULL::text,
        NULL::text, NULL::boolean, x.why, CASE WHEN x.why = 'rate' THEN x.wait END,
        NULL::bigint
        FROM unnest(v_topics, v_whys, v_waits) AS x(t, why, wait) WHERE x.why IS NOT NULL;
    -- the others' control rows, in name order, so that claimers of the same topics wait
    -- for each other in one order (no deadlock) whatever order they serve them in
    PERFORM 1 FROM "{{schema}}"."{{table}}_flow" f
    WHERE f.topic = ANY (ARRAY(SELECT x.t FROM unnest(v_topics, v_whys) AS x(t, why)
                               WHERE x.why IS NULL))
    ORDER BY f.topic FOR UPDATE;
    -- rows the same claim took before this call (of open topics) count against the cap
    used := 0;
    IF cardinality(p_claimed) > 0 THEN
        used := coalesce((SELECT sum(pg_catalog.pg_column_size(e.payload))
                          FROM "{{schema}}"."{{table}}" AS e WHERE e.id = ANY (p_claimed)), 0);
    END IF;
    -- served in the order given (the consumer's turns: the first gets the cap's first row)
    FOR w IN SELECT x.t, x.n FROM unnest(v_topics, v_wants, v_whys) WITH ORDINALITY
                 AS x(t, n, why, i)
             WHERE x.why IS NULL ORDER BY x.i LOOP
        IF used >= p_max_bytes THEN
            EXIT;  -- the claim is full: the topics after this one get nothing, not even a status
        END IF;
        why := NULL;
        wait := NULL;
        got := 0;
        locked := 0;
        v_running := 0;
        v_tokens := NULL;
        v_clock := NULL;
        SELECT * INTO c FROM "{{schema}}"."{{table}}_flow" f WHERE f.topic = w.t FOR UPDATE;
        allowed := greatest(w.n, 0);
        IF NOT FOUND OR NOT (c.paused OR c.max_running IS NOT NULL OR c.rate IS NOT NULL) THEN
            why := 'open';
        ELSIF c.paused THEN
            why := 'paused';
            allowed := 0;
        ELSE
            IF c.max_running IS NOT NULL THEN
                -- a statement after the row lock: it sees every claim committed before
                v_running := (SELECT count(*) FROM "{{schema}}"."{{table}}" r
                            WHERE r.topic = w.t AND r.flow_counted AND r.status = 'processing');
                allowed := least(allowed, greatest(c.max_running - v_running, 0));
            END IF;
            IF c.rate IS NOT NULL THEN
                v_clock := greatest(pg_catalog.clock_timestamp(), c.tokens_at);
                v_tokens := least(c.burst,
                                  c.tokens + c.rate * extract(epoch FROM v_clock - c.tokens_at)::float8);
                allowed := least(allowed, floor(v_tokens)::int);
            END IF;
        END IF;
        IF allowed > 0 THEN
            -- a row is taken while the bytes taken before it, this call's earlier topics
            -- included, are below the cap (rows it left out were only locked: the locks
            -- end with the statement)
            SELECT array_agg(k.id) FILTER (WHERE used + k.before < p_max_bytes),
                   coalesce(sum(k.size) FILTER (WHERE used + k.before < p_max_bytes), 0),
                   count(*)
            INTO ids, got_bytes, locked FROM (
                SELECT s.id, s.size,
                       sum(s.size) OVER (ORDER BY s.available_at, s.id) - s.size AS before
                FROM (SELECT e.id, e.available_at, pg_column_size(e.payload) AS size
                      FROM "{{schema}}"."{{table}}" AS e
                      WHERE e.status IN ('pending', 'retry') AND e.topic = w.t
                        AND e.available_at <= now()
                      ORDER BY e.available_at, e.id LIMIT allowed FOR UPDATE SKIP LOCKED) AS s
            ) AS k;
            got := coalesce(cardinality(ids), 0);
            used := used + got_bytes;
        END IF;
        IF got > 0 THEN
            RETURN QUERY
            UPDATE "{{schema}}"."{{table}}" AS e SET status = 'processing',
                attempts = e.attempts + 1, locked_by = p_worker,
                locked_at = coalesce(v_clock, pg_catalog.clock_timestamp()),
                lease_expires_at = now() + make_interval(secs => p_lease), updated_at = now(),
                holds_key = e.ordering_key IS NOT NULL,
                flow_counted = CASE WHEN c.max_running IS NOT NULL AND why IS NULL THEN true
                               ELSE e.flow_counted END
            WHERE e.id = ANY (ids)
            RETURNING e.id, e.topic, e.payload::text, e.dedupe_key, e.headers::text,
                e.attempts, e.max_attempts,
                least(greatest(e.created_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
                least(greatest(e.available_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
                coalesce(e.message_id, md5('aiooutbox:' || (SELECT d.oid FROM pg_catalog.pg_database d
                    WHERE d.datname = pg_catalog.current_database()) || ':' || e.tableoid
                    || ':' || e.id)::uuid)::text,
                e.ordering_key, true, NULL::text, NULL::float8,
                pg_catalog.pg_column_size(e.payload)::bigint;
        END IF;
        IF why IS NULL AND c.rate IS NOT NULL THEN
            v_tokens := v_tokens - got;
            UPDATE "{{schema}}"."{{table}}_flow" AS f SET tokens = v_tokens, tokens_at = v_clock
            WHERE f.topic = w.t;
        END IF;
        -- fewer rows than asked, unless the byte cap cut them (then nothing is held)
        IF why IS NULL AND got < w.n AND got = locked THEN
            IF c.max_running IS NOT NULL AND v_running + got >= c.max_running THEN
                why := 'running';
            ELSIF c.rate IS NOT NULL AND v_tokens < 1 THEN
                why := 'rate';
                wait := (1 - v_tokens) / c.rate;
            ELSE
                why := 'empty';
            END IF;
        END IF;
        IF why IS NOT NULL THEN
            RETURN QUERY SELECT NULL::bigint, w.t, NULL::text, NULL::text, NULL::text,
                NULL::int, NULL::int, NULL::timestamptz, NULL::timestamptz, NULL::text,
                NULL::text, NULL::boolean, why, wait, NULL::bigint;
        END IF;
    END LOOP;
END
$fn$;
