-- aiooutbox 0017: every failed attempt kept with its event; per-topic, per-minute
-- counts the consumers report; an index over the events that wait to be retried.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- Consumers of schema 2 keep working: the new column has a default (NULL: no failure
-- yet) and their inserts never set it; the two functions replaced here keep their
-- signatures and results, and each is restated from its latest body (`settle_failed_v5`
-- from 0013, `requeue_v5` from 0015), so consumers of every earlier schema write the
-- history too. A later migration that replaces one of them starts from the body below.
-- Nothing of the success path changes: `settle_done_v5` and the claims are untouched.
-- The index (3.) is built concurrently, in a last step of its own, so
-- producers and consumers keep writing while it reads the table; ALTER TABLE ADD COLUMN
-- is instant. Every statement before it may run again (an interrupted build leaves the
-- migration unrecorded, and the next `migrate` starts it over).
--
-- 1. `failures`: the last ten failed attempts of an event, oldest first, each
--    {"attempt", "at" (epoch seconds), "worker", "seconds" (from its claim to its
--    failure), "error" (the first 1,000 characters), "outcome" (retry, dead or released)}.
--    Written only by a failure's settlement and by lease recovery (an attempt cut short:
--    "lease expired"), in the statement that records the failure: a success writes
--    nothing more. At most ten entries of at most about 1,100 characters each.
-- 2. `<table>_rollups`: per topic and minute, what the consumers counted in memory and
--    flushed every 15 seconds (one upsert per consumer per flush): events done, failed
--    and retried, failed for good, and the lag at claim (how long each claimed event had
--    been due). The dashboard draws its charts from it, so they survive retention and
--    purges. Consumers delete minutes older than 8 days. Nothing of the hot path reads
--    or writes it; a consumer whose role may not write it logs one warning and runs on.
-- 3. `<table>_retry_idx`: the events waiting for their next attempt, by topic. With the
--    claim's index it counts pending, scheduled and retrying events exactly without
--    reading the table. Rows enter it only when an attempt fails.

ALTER TABLE "{{schema}}"."{{table}}" ADD COLUMN IF NOT EXISTS failures JSONB DEFAULT NULL;

-- The history with one more failed attempt, the oldest dropped past ten. Called by the
-- two functions below only when an attempt failed.
CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_failure_added"(
    p_history JSONB, p_attempt INT, p_worker TEXT, p_claimed TIMESTAMPTZ, p_error TEXT,
    p_outcome TEXT)
RETURNS JSONB
LANGUAGE sql STABLE
SET jit = off
AS $fn$
    SELECT coalesce((SELECT pg_catalog.jsonb_agg(h.x ORDER BY h.n)
                     FROM pg_catalog.jsonb_array_elements(p_history) WITH ORDINALITY AS h(x, n)
                     WHERE h.n OPERATOR(pg_catalog.>)
                           (pg_catalog.jsonb_array_length(p_history) OPERATOR(pg_catalog.-) 9)),
                    '[]'::jsonb)
        OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_array(pg_catalog.jsonb_build_object(
            'attempt', p_attempt,
            'at', pg_catalog.round(extract(epoch FROM now())::numeric, 3),
            'worker', pg_catalog.left(p_worker, 200),
            'seconds', pg_catalog.round(GREATEST(
                extract(epoch FROM now() OPERATOR(pg_catalog.-) p_claimed), 0)::numeric, 3),
            'error', pg_catalog.left(p_error, 1000),
            'outcome', p_outcome))
$fn$;

-- Per topic and minute, the consumers' counts (see 2. above).
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{table}}_rollups" (
    minute   TIMESTAMPTZ NOT NULL,  -- the minute's start
    topic    TEXT        NOT NULL,
    done     BIGINT      NOT NULL DEFAULT 0,
    retried  BIGINT      NOT NULL DEFAULT 0,  -- failed, to be tried again
    dead     BIGINT      NOT NULL DEFAULT 0,  -- failed for good
    claimed  BIGINT      NOT NULL DEFAULT 0,  -- claims whose lag is summed below
    lag_sum  FLOAT8      NOT NULL DEFAULT 0,  -- seconds each claimed event had been due
    lag_max  FLOAT8      NOT NULL DEFAULT 0,
    PRIMARY KEY (topic, minute)
);
-- the overview's chart over every topic, and the deletion of old minutes
CREATE INDEX IF NOT EXISTS "{{table}}_rollups_minute_idx" ON "{{schema}}"."{{table}}_rollups" (minute);

-- A raw INSERT may not set the new column either (0013's check, restated with it).
CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_refuse_insert"() RETURNS trigger
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
    IF NEW.failures IS NOT NULL THEN
        wrong := wrong || 'failures (the history of failed attempts)'::text;
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
DROP TRIGGER IF EXISTS "{{table}}_insert_check" ON "{{schema}}"."{{table}}";
CREATE TRIGGER "{{table}}_insert_check"
    BEFORE INSERT ON "{{schema}}"."{{table}}"
    FOR EACH ROW
    WHEN (NEW.status <> 'pending' OR NEW.attempts <> 0 OR NEW.locked_by IS NOT NULL
          OR NEW.locked_at IS NOT NULL OR NEW.lease_expires_at IS NOT NULL
          OR NEW.finished_at IS NOT NULL OR NEW.last_error IS NOT NULL
          OR NEW.blocks_key OR NEW.holds_key OR NEW.flow_counted IS NOT NULL
          OR NEW.failures IS NOT NULL OR jsonb_typeof(NEW.headers) <> 'object')
    EXECUTE FUNCTION "{{schema}}"."{{table}}_refuse_insert"();


-- Settle failures as 0013 left them, plus each failed attempt added to `failures`.
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
            -- the attempt's failure joins its history (a run member given back never ran)
            failures = CASE WHEN u.outcome = 'unrun' THEN e.failures
                ELSE "{{schema}}"."{{table}}_failure_added"(e.failures, e.attempts, p_worker,
                    e.locked_at, u.error, CASE
                        WHEN u.outcome = 'released' THEN 'released'
                        WHEN u.forced OR e.attempts >= e.max_attempts THEN 'dead'
                        ELSE 'retry' END) END,
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

-- Lease recovery and a consumer's release of its own rows as 0015 left them, plus each
-- attempt cut short added to `failures`.
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
    held TEXT[];
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
        -- the rest of each key's run, wherever the batch limit cut it: taken here too
        -- if it qualifies (its lease expired as well; for a release, it is this
        -- worker's and not kept), locked without waiting
        ids := ids || ARRAY(
            SELECT c.id FROM "{{schema}}"."{{table}}" AS c
            WHERE c.ordering_key = ANY (keys) AND c.status = 'processing'
              AND NOT (c.id = ANY (ids))
              AND (CASE WHEN p_worker IS NULL THEN c.lease_expires_at < now()
                        ELSE c.locked_by = p_worker AND NOT (c.id = ANY (p_keep)) END)
            FOR UPDATE SKIP LOCKED);
        -- a key goes back only whole: while any of its rows is processing outside this
        -- call (its lease still runs: its worker runs the rest of the run and will write
        -- the late outcomes; or another transaction holds it now), none of it goes back
        -- (rows taken but left for later stay locked only until this transaction ends)
        -- (the held keys first, through the key index: asked per row, as a NOT EXISTS,
        -- PostgreSQL 18 planned it as a hashed subplan over the whole table)
        held := ARRAY(SELECT DISTINCT o.ordering_key FROM "{{schema}}"."{{table}}" AS o
                      WHERE o.ordering_key = ANY (keys) AND o.status = 'processing'
                        AND NOT (o.id = ANY (ids)));
        ids := ARRAY(SELECT r.id FROM "{{schema}}"."{{table}}" AS r
                     WHERE r.id = ANY (ids)
                       AND (r.ordering_key IS NULL OR NOT (r.ordering_key = ANY (held))));
        IF cardinality(ids) = 0 THEN
            RETURN;
        END IF;
        -- the row that goes back to retry stands for the key from now on
        UPDATE "{{schema}}"."{{table}}" AS e SET holds_key = false
        WHERE e.id = ANY (ids) AND e.holds_key;
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
            -- an attempt cut short joins its history (a row that waits again behind an
            -- earlier one of its key gets its attempt back: it never ran)
            failures = CASE WHEN x.behind THEN e.failures
                ELSE "{{schema}}"."{{table}}_failure_added"(e.failures, e.attempts,
                    coalesce(e.locked_by, '?'), e.locked_at, p_reason, CASE
                        WHEN p_worker IS NOT NULL THEN 'released'
                        WHEN e.attempts >= e.max_attempts THEN 'dead'
                        ELSE 'retry' END) END,
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

-- 3. above, last: built without blocking writers (a step outside any transaction, see
-- the migration runner); the steps before it may run again if the build is interrupted.
-- step: concurrent index
CREATE INDEX CONCURRENTLY IF NOT EXISTS "{{table}}_retry_idx" ON "{{schema}}"."{{table}}"
    (topic, available_at) WHERE status = 'retry';
