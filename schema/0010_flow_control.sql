-- aiooutbox 0010: flow control per topic: pause and resume, a global limit on running
-- events, a rate limit; every change logged.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- Older code keeps working. `<table>_claim_v6` keeps its signature and results (its body
-- is 0008's, plus what leaves out paused and limited topics), so consumers of schema 6
-- to 8 already honour pauses and never take a limited topic (they leave it to consumers
-- of this release, which claim it through `<table>_claim_limited`). It reads the
-- controls through a SECURITY DEFINER function, so their roles need no new grant.
-- Consumers of schema 2 to 5 (the `claim`, `claim_v3`, `claim_v5` functions) know
-- nothing of flow control. CREATE INDEX here blocks writes to the outbox while it reads
-- the table once (seconds per million rows); ALTER TABLE ADD COLUMN is instant.
--
-- Exactness. Every claim (open or limited) first takes a shared transaction-level
-- advisory lock of this outbox; an operator's change takes it exclusively. A change
-- therefore waits for the claims under way and the claims after it wait for its
-- commit, and each statement of a claim reads the controls in a snapshot taken after
-- its lock: once a pause has committed, no claim of that topic starts or commits
-- unaware of it. A limited claim then locks its topic's control row, so the claimers
-- of one limited topic take turns (the other topics' claims do not wait for them),
-- and counts that topic's claimed rows through an index holding only those rows.

-- One row per topic with a control; the row with the empty topic ('') is the pause of
-- every topic at once (no event has an empty topic: see 0001's CHECK).
CREATE TABLE "{{schema}}"."{{table}}_flow" (
    topic       TEXT        PRIMARY KEY,
    paused      BOOLEAN     NOT NULL DEFAULT false,
    -- at most this many events of the topic claimed at once, across all consumers
    max_running INT,
    -- a token bucket: `rate` tokens per second, holding at most `burst`; a claim takes
    -- one per event. `rate_text` is the rate as the operator wrote it ("10/min").
    rate        FLOAT8,
    rate_text   TEXT,
    burst       FLOAT8,
    tokens      FLOAT8      NOT NULL DEFAULT 0,
    tokens_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_by  TEXT        NOT NULL,
    CONSTRAINT "{{table}}_flow_topic_length" CHECK (length(topic) <= 255),
    CONSTRAINT "{{table}}_flow_max_running" CHECK (max_running IS NULL OR max_running >= 1),
    CONSTRAINT "{{table}}_flow_rate" CHECK (
        (rate IS NULL AND burst IS NULL AND rate_text IS NULL)
        OR (rate > 0 AND rate <= 1e6 AND burst >= 1 AND burst <= 1e6 AND rate_text IS NOT NULL)),
    CONSTRAINT "{{table}}_flow_all_topics" CHECK (
        topic <> '' OR (max_running IS NULL AND rate IS NULL))
);

-- Every change, whoever made it (command line, Python, dashboard): who, when, what
-- the topic's controls were before and after.
CREATE TABLE "{{schema}}"."{{table}}_flow_log" (
    id      BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    actor   TEXT        NOT NULL,
    topic   TEXT        NOT NULL,
    action  TEXT        NOT NULL,
    before  JSONB,
    after   JSONB,
    CONSTRAINT "{{table}}_flow_log_actor_length" CHECK (length(actor) BETWEEN 1 AND 200)
);
CREATE INDEX "{{table}}_flow_log_idx" ON "{{schema}}"."{{table}}_flow_log" (topic, id);

-- Rows a limited claim took for a topic with a max_running limit; while such a row is
-- processing it counts against that limit. Unlimited claims leave it NULL, so rows of
-- topics without a limit never enter the index below: they pay nothing for it.
ALTER TABLE "{{schema}}"."{{table}}" ADD COLUMN flow_counted BOOLEAN;
CREATE INDEX "{{table}}_flow_running_idx" ON "{{schema}}"."{{table}}" (topic)
    WHERE flow_counted AND status = 'processing';

-- The topics the open claim must leave out (paused, or limited); '' in the result:
-- every topic is paused. SECURITY DEFINER so that roles granted only what older
-- releases needed can still claim; every name is schema-qualified (see 0001).
CREATE FUNCTION "{{schema}}"."{{table}}_flow_held"() RETURNS TEXT[]
LANGUAGE plpgsql STABLE SECURITY DEFINER AS $fn$
BEGIN
    RETURN ARRAY(SELECT f.topic FROM "{{schema}}"."{{table}}_flow" f
                 WHERE f.paused OR f.max_running IS NOT NULL OR f.rate IS NOT NULL);
END
$fn$;

-- The claim every consumer of schema 6 and later calls, as in 0008 but for the topics
-- held back (paused or limited), which it leaves out before it reads any row: from the
-- topics it was given, from the topics its skip scan finds, and from the runs behind
-- ordered heads.
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
        topics := ARRAY(SELECT x FROM unnest(topics) AS u(x) WHERE NOT (x = ANY (held)));
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
            SELECT t.topic FROM t WHERE t.topic IS NOT NULL AND NOT (t.topic = ANY (held)));
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
                                  AND ((p_topics IS NULL AND NOT (w.topic = ANY (held)))
                                       OR w.topic = ANY (topics))) AS ok
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

-- The claim of limited topics: for each topic (in name order, so claimers lock their
-- control rows in one order), up to its wanted count, bounded by the topic's free
-- running slots and its tokens; heads only (no run behind an ordered head: each
-- claimed row is one running handler). After each topic's rows comes one row with a
-- NULL id that says why fewer came than wanted (`held`): 'running' (max_running
-- reached), 'rate' (out of tokens; `retry_in` seconds until the next one), 'empty'
-- (nothing claimable), 'paused', or 'open' (no limit any more: the caller's view of
-- the controls is stale); NULL when every wanted row came.
CREATE FUNCTION "{{schema}}"."{{table}}_claim_limited"(
    p_worker TEXT, p_lease FLOAT8, p_topics TEXT[], p_wants INT[], p_max_bytes BIGINT)
RETURNS TABLE (id BIGINT, topic TEXT, payload TEXT, dedupe_key TEXT, headers TEXT,
               attempts INT, max_attempts INT, created_at TIMESTAMPTZ,
               available_at TIMESTAMPTZ, message_id TEXT, ordering_key TEXT, is_head BOOLEAN,
               held TEXT, retry_in FLOAT8)
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
    everything_paused BOOLEAN;
    allowed INT;
    v_running INT;
    v_tokens FLOAT8;
    v_clock TIMESTAMPTZ;
    ids BIGINT[];
    got INT;
    why TEXT;
    wait FLOAT8;
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock_shared(
        pg_catalog.hashtextextended('aiooutbox-flow:{{schema}}.{{table}}', 0));
    everything_paused := EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}_flow" f
                                 WHERE f.topic = '' AND f.paused);
    FOR w IN SELECT u.t, u.n FROM unnest(p_topics, p_wants) AS u(t, n) ORDER BY u.t LOOP
        why := NULL;
        wait := NULL;
        got := 0;
        v_running := 0;
        v_tokens := NULL;
        v_clock := NULL;
        IF everything_paused THEN
            RETURN QUERY SELECT NULL::bigint, w.t, NULL::text, NULL::text, NULL::text,
                NULL::int, NULL::int, NULL::timestamptz, NULL::timestamptz, NULL::text,
                NULL::text, NULL::boolean, 'paused'::text, NULL::float8;
            CONTINUE;
        END IF;
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
            SELECT array_agg(k.id) INTO ids FROM (
                SELECT s.id, sum(s.size) OVER (ORDER BY s.available_at, s.id) - s.size AS before
                FROM (SELECT e.id, e.available_at, pg_column_size(e.payload) AS size
                      FROM "{{schema}}"."{{table}}" AS e
                      WHERE e.status IN ('pending', 'retry') AND e.topic = w.t
                        AND e.available_at <= now()
                      ORDER BY e.available_at, e.id LIMIT allowed FOR UPDATE SKIP LOCKED) AS s
            ) AS k WHERE k.before < p_max_bytes;
            got := coalesce(cardinality(ids), 0);
        END IF;
        IF got > 0 THEN
            RETURN QUERY
            UPDATE "{{schema}}"."{{table}}" AS e SET status = 'processing',
                attempts = e.attempts + 1, locked_by = p_worker,
                locked_at = coalesce(v_clock, pg_catalog.clock_timestamp()),
                lease_expires_at = now() + make_interval(secs => p_lease), updated_at = now(),
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
                e.ordering_key, true, NULL::text, NULL::float8;
        END IF;
        IF why IS NULL AND c.rate IS NOT NULL THEN
            v_tokens := v_tokens - got;
            UPDATE "{{schema}}"."{{table}}_flow" AS f SET tokens = v_tokens, tokens_at = v_clock
            WHERE f.topic = w.t;
        END IF;
        IF why IS NULL AND got < w.n THEN
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
                NULL::text, NULL::boolean, why, wait;
        END IF;
    END LOOP;
END
$fn$;
