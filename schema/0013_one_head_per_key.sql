-- aiooutbox 0013: one run per key at every isolation level; inserts set only what a
-- producer owns.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- Consumers of schema 2 keep working: they insert, claim and settle unordered events
-- as before (a new event they insert is pending with its defaults). The functions
-- replaced here keep their signatures and results, and each is restated from its
-- latest body: the ordering trigger's function and `settle_failed_v5` from 0005,
-- `requeue_v5` from 0009 (heads move on), `claim_v6` and `claim_limited` from 0010
-- (flow control). A later migration that replaces one of them starts from the body
-- below. The one-head index is rebuilt: CREATE INDEX blocks writes to the table while
-- it reads it (seconds per million rows); ALTER TABLE ADD COLUMN is instant.
--
-- 1. A producer at REPEATABLE READ or SERIALIZABLE reads the key through its
--    transaction's snapshot, which may predate the key's current events: it inserted a
--    second head while the first was `processing`, and both ran at once (0005's unique
--    index held only pending and retry rows). Now every key with a run under way keeps
--    one of its `processing` rows in that index (`holds_key`: the head claimed alone, or
--    the last row of the run claimed behind it, which runs last), so a head inserted
--    beside it is refused with a unique violation whatever the snapshot. The trigger
--    also makes sure that a row it puts behind an event of the key is behind one that is
--    still unfinished: a snapshot can show an event that has finished since (the new row
--    would then wait for a promotion that already happened); when no row it sees is
--    provably current (untouched since it was written: `xmax` 0 or its writer's) it raises a
--    serialization failure, which those isolation levels ask callers to retry anyway.
--    READ COMMITTED producers decide as before (their statement's snapshot follows the
--    key's lock) and never see either error.
-- 2. A raw INSERT could set `status` ('processing': never handled, recovered or made
--    dead, and its key blocked for ever; 'waiting': handled by nobody or only after a
--    restart; 'done'/'dead'/'retry'), `attempts` (INT_MAX failed every claim of its
--    topic), the lease and finish columns, `last_error`, `blocks_key`, `flow_counted`
--    (counted against a topic's running limit for ever), and headers that are not a JSON
--    object (dead at the first claim). A new event is pending: such rows are refused with
--    a check violation that names the columns (docs/producers.md lists every column and
--    who owns it).
-- 3. Settlements and lease recovery hand a key on in every order their statements can
--    commit in (see the comments on `settle_failed_v5` and `requeue_v5`).

ALTER TABLE "{{schema}}"."{{table}}" ADD COLUMN holds_key BOOLEAN NOT NULL DEFAULT false;

-- runs under way as the migration runs: their highest processing row stands for the key
-- (unless the key already has a claimable row, which then does)
UPDATE "{{schema}}"."{{table}}" AS e SET holds_key = true
FROM (SELECT max(p.id) AS id FROM "{{schema}}"."{{table}}" p
      WHERE p.status = 'processing' AND p.ordering_key IS NOT NULL
        AND NOT EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}" c
                        WHERE c.ordering_key = p.ordering_key AND c.status IN ('pending', 'retry'))
      GROUP BY p.ordering_key) AS top
WHERE e.id = top.id;

-- at most one event per key is claimable or stands for a run under way
CREATE UNIQUE INDEX "{{table}}_key_head_new_idx" ON "{{schema}}"."{{table}}" (ordering_key)
    WHERE ordering_key IS NOT NULL
      AND (status IN ('pending', 'retry') OR (status = 'processing' AND holds_key));
DROP INDEX "{{schema}}"."{{table}}_key_head_idx";
ALTER INDEX "{{schema}}"."{{table}}_key_head_new_idx" RENAME TO "{{table}}_key_head_idx";

-- What a producer may not set: named in the error, so the fix is obvious. The trigger's
-- WHEN clause is the whole cost of a good row (no function call).
CREATE FUNCTION "{{schema}}"."{{table}}_refuse_insert"() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    wrong TEXT[] := '{}';
BEGIN
    IF NEW.status OPERATOR(pg_catalog.<>) 'pending' THEN
        wrong := wrong || pg_catalog.format('status %L (a new event is pending)', NEW.status);
    END IF;
    IF NEW.attempts OPERATOR(pg_catalog.<>) 0 THEN
        wrong := wrong || pg_catalog.format('attempts %s (0: consumers count them)', NEW.attempts);
    END IF;
    IF NEW.locked_by IS NOT NULL OR NEW.locked_at IS NOT NULL OR NEW.lease_expires_at IS NOT NULL THEN
        wrong := wrong || 'locked_by, locked_at, lease_expires_at (a consumer''s lease)'::text;
    END IF;
    IF NEW.finished_at IS NOT NULL THEN
        wrong := wrong || 'finished_at (set when the event is done or dead)'::text;
    END IF;
    IF NEW.last_error IS NOT NULL THEN
        wrong := wrong || 'last_error (a handler''s error)'::text;
    END IF;
    IF NEW.blocks_key OR NEW.holds_key THEN
        wrong := wrong || 'blocks_key, holds_key (the ordering of a key''s events)'::text;
    END IF;
    IF NEW.flow_counted IS NOT NULL THEN
        wrong := wrong || 'flow_counted (flow control''s count of running events)'::text;
    END IF;
    IF pg_catalog.jsonb_typeof(NEW.headers) OPERATOR(pg_catalog.<>) 'object' THEN
        wrong := wrong || pg_catalog.format('headers %s (must be a JSON object)',
                                            pg_catalog.left(NEW.headers::text, 40));
    END IF;
    RAISE EXCEPTION USING
        ERRCODE = 'check_violation',
        MESSAGE = pg_catalog.format('%s: a new event cannot set %s', TG_TABLE_NAME,
                                    pg_catalog.array_to_string(wrong, '; ')),
        HINT = 'Insert topic and payload, and if you like headers, dedupe_key, ordering_key,'
            ' max_attempts, available_at, message_id, created_at; leave the other columns'
            ' to their defaults.',
        TABLE = TG_TABLE_NAME,
        SCHEMA = TG_TABLE_SCHEMA;
END
$fn$;

-- fires before "<table>_order" (triggers of one kind fire in name order)
CREATE TRIGGER "{{table}}_insert_check"
    BEFORE INSERT ON "{{schema}}"."{{table}}"
    FOR EACH ROW
    WHEN (NEW.status <> 'pending' OR NEW.attempts <> 0 OR NEW.locked_by IS NOT NULL
          OR NEW.locked_at IS NOT NULL OR NEW.lease_expires_at IS NOT NULL
          OR NEW.finished_at IS NOT NULL OR NEW.last_error IS NOT NULL
          OR NEW.blocks_key OR NEW.holds_key OR NEW.flow_counted IS NOT NULL
          OR jsonb_typeof(NEW.headers) <> 'object')
    EXECUTE FUNCTION "{{schema}}"."{{table}}_refuse_insert"();

-- Head or waiting, decided per inserted row under the key's lock (see 0005). New: the
-- isolation level decides which snapshot the decision may trust (see 1. above).
CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_order"() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $fn$
BEGIN
    IF NEW.status OPERATOR(pg_catalog.<>) 'pending' THEN
        RETURN NEW;  -- only with the insert check disabled (a restore): as it was written
    END IF;
    PERFORM pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended(
        '{{schema}}.{{table}}:' OPERATOR(pg_catalog.||) NEW.ordering_key, 0));
    IF pg_catalog.current_setting('transaction_isolation')
           OPERATOR(pg_catalog.=) ANY ('{read committed,read uncommitted}'::text[]) THEN
        -- this statement's snapshot is taken after the lock: it sees what the key's
        -- previous lock holders committed
        IF EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}" k
                   WHERE k.ordering_key OPERATOR(pg_catalog.=) NEW.ordering_key
                     AND (k.status OPERATOR(pg_catalog.=) ANY
                          ('{pending,retry,processing,waiting}'::"{{schema}}"."{{table}}_status"[])
                          OR k.blocks_key)) THEN
            NEW.status := 'waiting';
        END IF;
        RETURN NEW;
    END IF;
    -- REPEATABLE READ or SERIALIZABLE: the transaction's snapshot, maybe older than the
    -- key's events. An unfinished event it shows that nobody has touched since it was
    -- written is unfinished still: wait behind it. (A version this snapshot sees whose
    -- xmax is another transaction's was updated, deleted or locked after it was written;
    -- xmax equal to xmin is its writer's own row lock, which ended with its commit.)
    IF EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}" k
               WHERE k.ordering_key OPERATOR(pg_catalog.=) NEW.ordering_key
                 AND (k.status OPERATOR(pg_catalog.=) ANY
                      ('{pending,retry,processing,waiting}'::"{{schema}}"."{{table}}_status"[])
                      OR k.blocks_key)
                 AND (k.xmax OPERATOR(pg_catalog.=) '0'::pg_catalog.xid
                      -- a lock its own writer carried onto it (a claim locks, then updates)
                      OR k.xmax OPERATOR(pg_catalog.=) k.xmin)) THEN
        NEW.status := 'waiting';
    ELSIF EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}" k
                  WHERE k.ordering_key OPERATOR(pg_catalog.=) NEW.ordering_key
                    AND (k.status OPERATOR(pg_catalog.=) ANY
                         ('{pending,retry,processing,waiting}'::"{{schema}}"."{{table}}_status"[])
                         OR k.blocks_key)) THEN
        -- every unfinished event it shows has changed since: they may all be finished,
        -- and a row put behind them would then wait for a promotion that came and went
        RAISE EXCEPTION USING
            ERRCODE = 'serialization_failure',
            MESSAGE = pg_catalog.format(
                'could not serialize access to ordering key %L: its events changed after'
                ' this transaction''s snapshot', NEW.ordering_key),
            HINT = 'Retry the transaction, or enqueue ordered events at READ COMMITTED.';
    END IF;
    -- else the head. If the key got a claimable event or a run after this snapshot, the
    -- one-head index refuses this row (a unique violation) rather than run both at once.
    RETURN NEW;
END
$fn$;


-- The claim of schema 6, as 0010 left it (paused and limited topics left out), plus
-- the flag of the one row that stands for its key while it runs: a head claimed alone
-- holds it; a head claimed with a run behind it leaves it to the run's highest row,
-- which runs last. Heads and runs are updated in two statements, heads first, so no
-- order within one statement can put two rows of a key in the one-head index at once.
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
                                  AND ((p_topics IS NULL AND NOT (w.topic = ANY (held)))
                                       OR w.topic = ANY (topics))) AS ok
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

-- The claim of limited topics, as in 0010; each head it claims (heads only) stands for
-- its key while it runs.
CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_claim_limited"(
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

-- Settle failures as in 0005, with three changes.
-- * A row that goes back to retry stands for its key in the one-head index from then
--   on, so the flag of its run's last row (processing, about to be given back) comes off
--   first. The rows of this call are locked as the update would lock them; a flag on
--   another row is taken only if nobody holds that row (a heartbeat may, while it waits
--   for ours): this function waits for no row the 0005 body did not.
-- * A row whose key still has another claimable event, or a flag that could not come
--   off, waits behind it instead of colliding with it in the index.
-- * The keys of rows that go back to waiting (a run given back, unrun) are promoted too,
--   as are those of rows that died: when a run's head dies and its unrun rows are written
--   by a later statement (another attempt count), the first promotion found the key
--   still busy and nothing promoted it afterwards.
CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_settle_failed_v5"(
    p_ids BIGINT[], p_delays FLOAT8[], p_errors TEXT[], p_outcomes TEXT[],
    p_worker TEXT, p_attempts INT)
RETURNS TABLE (settled INT, promoted INT, skipped TEXT[])
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    keys TEXT[];
    back TEXT[];  -- keys of the rows that go back to retry
BEGIN
    IF p_outcomes && '{retry,retry_block,released}'::text[] THEN
        -- through the primary key, like the update below (no `ordering_key IS NOT NULL`
        -- here: it would let the plan walk the key index instead)
        back := ARRAY(
            SELECT DISTINCT q.k FROM (
                SELECT r.ordering_key AS k FROM "{{schema}}"."{{table}}" AS r
                WHERE r.id = ANY (ARRAY(SELECT x.id FROM unnest(p_ids, p_outcomes) AS x(id, outcome)
                                        WHERE x.outcome IN ('retry', 'retry_block', 'released')))
                  AND r.status = 'processing' AND r.locked_by = p_worker
                  AND r.attempts = p_attempts
                OFFSET 0) AS q
            WHERE q.k IS NOT NULL);
    END IF;
    IF cardinality(back) > 0 THEN
        UPDATE "{{schema}}"."{{table}}" AS e SET holds_key = false
        WHERE e.id = ANY (p_ids) AND e.holds_key AND e.ordering_key = ANY (back);
        UPDATE "{{schema}}"."{{table}}" AS e SET holds_key = false
        WHERE e.id IN (SELECT f.id FROM "{{schema}}"."{{table}}" AS f
                       WHERE f.ordering_key = ANY (back) AND f.status = 'processing'
                         AND f.holds_key AND NOT (f.id = ANY (p_ids))
                       FOR UPDATE SKIP LOCKED);
    END IF;
    WITH u AS (
        SELECT x.id, x.delay, x.error, x.outcome,
               x.outcome IN ('dead', 'dead_block') AS forced,
               x.outcome IN ('retry_block', 'dead_block') AS blocking
        FROM unnest(p_ids, p_delays, p_errors, p_outcomes) AS x(id, delay, error, outcome)),
    f AS (
        UPDATE "{{schema}}"."{{table}}" AS e SET
            status = (CASE
                WHEN u.outcome = 'unrun' THEN 'waiting'
                WHEN u.forced OR (u.outcome IN ('retry', 'retry_block')
                                  AND e.attempts >= e.max_attempts) THEN 'dead'
                WHEN e.ordering_key IS NOT NULL AND EXISTS (
                    SELECT 1 FROM "{{schema}}"."{{table}}" o
                    WHERE o.ordering_key = e.ordering_key AND o.id <> e.id
                      AND (o.status IN ('pending', 'retry')
                           OR (o.status = 'processing' AND o.holds_key))) THEN 'waiting'
                ELSE 'retry' END)::"{{schema}}"."{{table}}_status",
            available_at = CASE
                WHEN u.outcome = 'released' OR (u.outcome IN ('retry', 'retry_block')
                                                AND e.attempts < e.max_attempts)
                THEN now() + make_interval(secs => u.delay) ELSE e.available_at END,
            finished_at = CASE
                WHEN u.forced OR (u.outcome IN ('retry', 'retry_block')
                                  AND e.attempts >= e.max_attempts) THEN now() END,
            blocks_key = e.ordering_key IS NOT NULL AND u.blocking
                AND (u.forced OR e.attempts >= e.max_attempts),
            attempts = CASE WHEN u.outcome = 'unrun' THEN e.attempts - 1 ELSE e.attempts END,
            last_error = CASE WHEN u.outcome = 'unrun' THEN e.last_error ELSE u.error END,
            lease_expires_at = NULL, holds_key = false, updated_at = now()
        FROM u
        WHERE e.id = u.id AND e.id = ANY (p_ids) AND e.status = 'processing'
          AND e.locked_by = p_worker AND e.attempts = p_attempts
        RETURNING e.ordering_key, e.status, e.blocks_key)
    SELECT count(*)::int,
           array_agg(DISTINCT f.ordering_key) FILTER (
               WHERE f.ordering_key IS NOT NULL
                 AND (f.status = 'waiting' OR (f.status = 'dead' AND NOT f.blocks_key)))
    INTO settled, keys FROM f;
    promoted := 0;
    skipped := '{}';
    IF keys IS NOT NULL THEN
        SELECT p.promoted, p.skipped INTO promoted, skipped
        FROM "{{schema}}"."{{table}}_promote"(keys) AS p;
    END IF;
    RETURN NEXT;
END
$fn$;

-- Lease recovery and a consumer's release of its own rows, as 0009 left them (an event
-- goes back to `retry` or `dead` only when no earlier event of its key is unfinished;
-- the others wait again with their attempt given back; a key left with no head is
-- promoted), with these changes.
-- * A row goes back only together with every lower processing row of its key (taken in
--   the same call): it was put back to waiting behind a lower row whose settlement was
--   committing at that moment, and that settlement's promotion, which could not see
--   this row yet, left the key with no head until the orphan sweep. A row behind a lower
--   one that is not taken (its lease still runs, or a settlement holds it now) is left
--   for a later call.
-- * The flags of the keys involved come off first (the row that goes back to retry
--   stands for the key); a flag on a row not taken here is locked without waiting (this
--   function never waits for a row; a heartbeat holding one may wait for ours), and a
--   key whose flag another transaction holds is left for a later call.
-- * A row whose key already has a claimable event waits behind it instead of colliding
--   with it in the one-head index.
CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_requeue_v5"(
    p_worker TEXT, p_keep BIGINT[], p_limit INT, p_reason TEXT)
RETURNS TABLE (id BIGINT, topic TEXT, status TEXT, locked_by TEXT)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
#variable_conflict use_column
DECLARE
    ids BIGINT[];
    topics TEXT[];
    statuses TEXT[];
    workers TEXT[];
    keys TEXT[];
    flags BIGINT[];
BEGIN
    IF p_worker IS NULL THEN
        ids := ARRAY(SELECT c.id FROM "{{schema}}"."{{table}}" AS c
                     WHERE c.status = 'processing' AND c.lease_expires_at < now()
                     ORDER BY c.lease_expires_at LIMIT p_limit FOR UPDATE SKIP LOCKED);
    ELSE
        ids := ARRAY(SELECT c.id FROM "{{schema}}"."{{table}}" AS c
                     WHERE c.lease_expires_at IS NOT NULL AND c.status = 'processing'
                       AND c.locked_by = p_worker AND NOT (c.id = ANY (p_keep))
                     ORDER BY c.lease_expires_at FOR UPDATE SKIP LOCKED);
    END IF;
    IF cardinality(ids) = 0 THEN
        RETURN;
    END IF;
    -- the keys taken, through the primary key (no `ordering_key IS NOT NULL` in the
    -- scan: it would let the plan walk the key index instead)
    keys := ARRAY(SELECT DISTINCT q.k FROM (
                      SELECT r.ordering_key AS k FROM "{{schema}}"."{{table}}" AS r
                      WHERE r.id = ANY (ids) OFFSET 0) AS q
                  WHERE q.k IS NOT NULL);
    IF cardinality(keys) > 0 THEN
        flags := ARRAY(SELECT f.id FROM "{{schema}}"."{{table}}" AS f
                       WHERE f.ordering_key = ANY (keys) AND f.status = 'processing'
                         AND f.holds_key AND NOT (f.id = ANY (ids))
                       FOR UPDATE SKIP LOCKED);
        -- (rows taken but left for later stay locked only until this transaction ends)
        ids := ARRAY(SELECT r.id FROM "{{schema}}"."{{table}}" AS r
                     WHERE r.id = ANY (ids)
                       AND NOT (r.ordering_key IS NOT NULL AND EXISTS (
                           SELECT 1 FROM "{{schema}}"."{{table}}" o
                           WHERE o.ordering_key = r.ordering_key AND o.status = 'processing'
                             AND NOT (o.id = ANY (ids))
                             AND (o.id < r.id OR (o.holds_key AND NOT (o.id = ANY (flags)))))));
        IF cardinality(ids) = 0 THEN
            RETURN;
        END IF;
        UPDATE "{{schema}}"."{{table}}" AS e SET holds_key = false
        WHERE e.id = ANY (ids || flags) AND e.holds_key;
    END IF;
    -- MATERIALIZED: each row's checks run once, not once per column that reads them
    WITH x AS MATERIALIZED (
        SELECT c.id,
               -- behind an earlier unfinished event of its key (taken here or not): waits
               c.ordering_key IS NOT NULL AND EXISTS (
                   SELECT 1 FROM "{{schema}}"."{{table}}" o
                   WHERE o.ordering_key = c.ordering_key AND o.id < c.id
                     AND (o.status IN ('pending', 'retry', 'processing', 'waiting')
                          OR o.blocks_key)) AS behind,
               -- its key has another claimable event already: waits behind it
               c.ordering_key IS NOT NULL AND EXISTS (
                   SELECT 1 FROM "{{schema}}"."{{table}}" o
                   WHERE o.ordering_key = c.ordering_key
                     AND o.status IN ('pending', 'retry') AND o.id <> c.id) AS beside
        FROM "{{schema}}"."{{table}}" AS c WHERE c.id = ANY (ids)),
    r AS (
        UPDATE "{{schema}}"."{{table}}" AS e SET
            status = (CASE
                WHEN x.behind THEN 'waiting'
                WHEN p_worker IS NULL AND e.attempts >= e.max_attempts THEN 'dead'
                WHEN x.beside THEN 'waiting'
                ELSE 'retry' END)::"{{schema}}"."{{table}}_status",
            attempts = CASE WHEN x.behind THEN e.attempts - 1 ELSE e.attempts END,
            available_at = now(),
            finished_at = CASE WHEN NOT x.behind AND p_worker IS NULL
                                    AND e.attempts >= e.max_attempts
                          THEN now() END,
            last_error = p_reason || ' (worker ' || coalesce(e.locked_by, '?')
                         || ', attempt ' || e.attempts || ')',
            lease_expires_at = NULL, holds_key = false, updated_at = now()
        FROM x
        WHERE e.id = x.id
        RETURNING e.id, e.topic, e.status::text AS status, e.locked_by, e.ordering_key)
    SELECT array_agg(r.id), array_agg(r.topic), array_agg(r.status), array_agg(r.locked_by),
           (SELECT array_agg(g.k) FROM (
                SELECT r2.ordering_key AS k FROM r AS r2 WHERE r2.ordering_key IS NOT NULL
                GROUP BY r2.ordering_key HAVING NOT bool_or(r2.status = 'retry')) AS g)
    INTO ids, topics, statuses, workers, keys FROM r;
    IF keys IS NOT NULL THEN
        PERFORM "{{schema}}"."{{table}}_promote"(keys);
    END IF;
    RETURN QUERY SELECT * FROM unnest(ids, topics, statuses, workers);
END
$fn$;
