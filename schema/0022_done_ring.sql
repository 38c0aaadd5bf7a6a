-- aiooutbox 0022: finished events leave the hot table for a ring of slots that
-- retention empties with TRUNCATE.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- Why: a `done` row kept in the outbox costs a row version and three index entries at
-- its settlement, then a DELETE, its index entries and a VACUUM at retention; while a
-- long transaction pins the xmin horizon none of it can be removed, and ten million
-- events a day is ten million deletions. Here the settlement moves the row out, in one
-- statement, into `<table>_done`: a table LIST-partitioned by `slot` into eight slots,
-- one of them current. Retention empties a whole slot with TRUNCATE once every row in
-- it is older than the retention, which costs no VACUUM and no dead row, with or
-- without a pinned horizon.
--
-- 1. `<table>_done` (partitions `<table>_done_0` to `_7`): a finished event's columns.
--    Indexes: `id` (event lookups), `(ordering_key, id)` for ordered events (the
--    redrive's count of a key's later finished events), a BRIN on `finished_at` (is
--    any row younger than the retention? read from block-range summaries).
-- 2. `<table>_done_ring`: one row, the current slot and since when.
-- 3. `<table>_settle_done_v5` (same signature and results; consumers of every release
--    since schema 5 call it) deletes the settled rows and inserts them into the current
--    slot in one statement. An event with a `dedupe_key` is finished in place, as
--    before: the table's unique index is what makes `ON CONFLICT (dedupe_key)` hold for
--    producers at every isolation level, so its key must stay in the table until
--    retention deletes it (as before). "Without a dedupe key" is written
--    `num_nulls(dedupe_key) = 1`, which no index answers: `dedupe_key IS NULL` is
--    answered by the unique dedupe index, and the generic plan of a table analyzed
--    while nearly empty chose it over the primary key, reading one entry per dead
--    version of every keyless event (under a pinned horizon, 35 ms a call after
--    minutes). It is SECURITY DEFINER (every name
--    schema-qualified, `search_path` pinned), so consumer roles need no grant on
--    `<table>_done`.
-- 4. `<table>_retire_done(age)`: retention's step, SECURITY DEFINER (consumers need no
--    ownership to TRUNCATE). It empties every slot but the current one whose rows are
--    all older than `age` (checked under the slot's ACCESS EXCLUSIVE lock, taken with a
--    200 ms lock_timeout: a slot that a long reader such as `pg_dump` holds is tried
--    again at the next run instead of queueing writers behind it). It moves the current
--    slot on once it has been current for age / 6 and the next slot is empty, so with
--    eight slots a slot comes round again only after its rows passed the retention, and
--    history holds about age * 7/6 of finished events. Calls at once: one proceeds, the
--    others return at once (a transaction-level advisory lock).
-- 5. `<table>_all`: a view of the outbox and the ring together, with the outbox's
--    columns and status names, for operators' SQL and the admin tools.
--
-- Compatible with schema 2: every function keeps its signature and results. Consumers
-- of earlier releases settle through the restated function and so move rows too; their
-- admin tools count the outbox table only, so upgrade those with the consumers.
-- Events already `done` in the outbox stay there until retention deletes them.

CREATE TABLE IF NOT EXISTS "{{schema}}"."{{table}}_done" (
    slot         SMALLINT    NOT NULL,
    id           BIGINT      NOT NULL,
    topic        TEXT        NOT NULL,
    payload      JSONB       NOT NULL,
    headers      JSONB       NOT NULL,
    attempts     INT         NOT NULL,
    max_attempts INT         NOT NULL,
    available_at TIMESTAMPTZ NOT NULL,
    locked_by    TEXT,
    locked_at    TIMESTAMPTZ,
    last_error   TEXT,
    created_at   TIMESTAMPTZ NOT NULL,
    finished_at  TIMESTAMPTZ NOT NULL,
    message_id   UUID,
    ordering_key TEXT,
    failures     JSONB,
    grp          TEXT COLLATE "C"
) PARTITION BY LIST (slot);

COMMENT ON TABLE "{{schema}}"."{{table}}_done" IS
    'aiooutbox: finished events, in slots that retention empties with TRUNCATE';

CREATE TABLE IF NOT EXISTS "{{schema}}"."{{table}}_done_0" PARTITION OF "{{schema}}"."{{table}}_done" FOR VALUES IN (0);
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{table}}_done_1" PARTITION OF "{{schema}}"."{{table}}_done" FOR VALUES IN (1);
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{table}}_done_2" PARTITION OF "{{schema}}"."{{table}}_done" FOR VALUES IN (2);
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{table}}_done_3" PARTITION OF "{{schema}}"."{{table}}_done" FOR VALUES IN (3);
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{table}}_done_4" PARTITION OF "{{schema}}"."{{table}}_done" FOR VALUES IN (4);
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{table}}_done_5" PARTITION OF "{{schema}}"."{{table}}_done" FOR VALUES IN (5);
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{table}}_done_6" PARTITION OF "{{schema}}"."{{table}}_done" FOR VALUES IN (6);
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{table}}_done_7" PARTITION OF "{{schema}}"."{{table}}_done" FOR VALUES IN (7);

CREATE INDEX IF NOT EXISTS "{{table}}_done_id_idx" ON "{{schema}}"."{{table}}_done" (id);
CREATE INDEX IF NOT EXISTS "{{table}}_done_key_idx" ON "{{schema}}"."{{table}}_done" (ordering_key, id)
    WHERE ordering_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS "{{table}}_done_finished_idx" ON "{{schema}}"."{{table}}_done"
    USING brin (finished_at) WITH (pages_per_range = 32, autosummarize = on);

CREATE TABLE IF NOT EXISTS "{{schema}}"."{{table}}_done_ring" (
    one   BOOLEAN     PRIMARY KEY DEFAULT true CHECK (one),
    slot  SMALLINT    NOT NULL DEFAULT 0 CHECK (slot BETWEEN 0 AND 7),
    since TIMESTAMPTZ NOT NULL DEFAULT now()
);
INSERT INTO "{{schema}}"."{{table}}_done_ring" DEFAULT VALUES ON CONFLICT DO NOTHING;

CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_settle_done_v5"(
    p_ids BIGINT[], p_worker TEXT, p_attempts INT)
RETURNS TABLE (settled INT, promoted INT, skipped TEXT[])
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    keys TEXT[];
    kept INT;
    kept_keys TEXT[];
BEGIN
    WITH m AS (
        DELETE FROM "{{schema}}"."{{table}}" AS e
        WHERE e.id = ANY (p_ids) AND e.status = 'processing'
          AND e.locked_by = p_worker AND e.attempts = p_attempts
          AND pg_catalog.num_nulls(e.dedupe_key) = 1  -- not `IS NULL`: see 3. above
        RETURNING e.*),
    i AS (
        INSERT INTO "{{schema}}"."{{table}}_done" (
            slot, id, topic, payload, headers, attempts, max_attempts, available_at,
            locked_by, locked_at, last_error, created_at, finished_at, message_id,
            ordering_key, failures, grp)
        SELECT (SELECT r.slot FROM "{{schema}}"."{{table}}_done_ring" AS r WHERE r.one),
               m.id, m.topic, m.payload, m.headers, m.attempts, m.max_attempts,
               m.available_at, m.locked_by, m.locked_at, m.last_error, m.created_at,
               now(), m.message_id, m.ordering_key, m.failures, m.grp
        FROM m
        RETURNING ordering_key)
    SELECT count(*)::int, array_agg(i.ordering_key) FILTER (WHERE i.ordering_key IS NOT NULL)
    INTO settled, keys FROM i;
    IF settled < cardinality(p_ids) THEN
        -- the rest: events with a dedupe key (finished in place), or rows no longer
        -- this worker's (nothing happens to them)
        WITH d AS (
            UPDATE "{{schema}}"."{{table}}" AS e SET status = 'done', lease_expires_at = NULL,
                finished_at = now(), updated_at = now()
            WHERE e.id = ANY (p_ids) AND e.status = 'processing'
              AND e.locked_by = p_worker AND e.attempts = p_attempts
            RETURNING e.ordering_key)
        SELECT count(*)::int, array_agg(d.ordering_key) FILTER (WHERE d.ordering_key IS NOT NULL)
        INTO kept, kept_keys FROM d;
        settled := settled + kept;
        keys := keys || kept_keys;
    END IF;
    promoted := 0;
    skipped := '{}';
    IF keys IS NOT NULL THEN
        SELECT p.promoted, p.skipped INTO promoted, skipped
        FROM "{{schema}}"."{{table}}_promote"(keys) AS p;
    END IF;
    RETURN NEXT;
END
$fn$;

CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_retire_done"(p_age FLOAT8)
RETURNS TABLE (truncated INT, rotated BOOLEAN)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '200ms'
AS $fn$
DECLARE
    cutoff TIMESTAMPTZ;
    ring RECORD;
    s INT;
    part TEXT;
    busy BOOLEAN;
    nxt INT;
    next_empty BOOLEAN;
BEGIN
    truncated := 0;
    rotated := false;
    -- at most about 95 years (NaN is above every number in PostgreSQL)
    IF p_age IS NULL OR NOT (p_age > 0 AND p_age <= 3e9) THEN
        RAISE EXCEPTION 'retire_done: the age must be a positive number of seconds, not %', p_age
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    cutoff := now() - make_interval(secs => p_age);
    IF NOT pg_try_advisory_xact_lock(
            hashtextextended('aiooutbox-retire:{{schema}}.{{table}}', 0)) THEN
        RETURN NEXT;
        RETURN;
    END IF;
    SELECT r.slot, r.since INTO ring FROM "{{schema}}"."{{table}}_done_ring" AS r;
    FOR s IN 0..7 LOOP
        CONTINUE WHEN s = ring.slot;
        part := format('%I.%I', '{{schema}}', '{{table}}_done_' || s);
        -- without a lock first: most slots are empty or hold young rows
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s)', part) INTO busy;
        CONTINUE WHEN NOT busy;
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s WHERE finished_at >= $1)', part)
            INTO busy USING cutoff;
        CONTINUE WHEN busy;
        BEGIN
            -- again under the lock, which waits for settlements still writing to it
            EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', part);
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s WHERE finished_at >= $1)', part)
                INTO busy USING cutoff;
            IF NOT busy THEN
                EXECUTE format('TRUNCATE %s', part);
                truncated := truncated + 1;
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- a reader holds it (pg_dump, a long report): the next run tries again
        END;
    END LOOP;
    nxt := (ring.slot + 1) % 8;
    IF clock_timestamp() - ring.since >= make_interval(secs => p_age / 6) THEN
        EXECUTE format('SELECT NOT EXISTS (SELECT 1 FROM %I.%I)',
                       '{{schema}}', '{{table}}_done_' || nxt) INTO next_empty;
        IF next_empty THEN
            UPDATE "{{schema}}"."{{table}}_done_ring" SET slot = nxt, since = clock_timestamp();
            rotated := true;
        END IF;
    END IF;
    RETURN NEXT;
END
$fn$;

CREATE OR REPLACE VIEW "{{schema}}"."{{table}}_all" AS
    SELECT e.id, e.dedupe_key, e.topic, e.payload, e.headers, e.status, e.attempts,
           e.max_attempts, e.available_at, e.locked_by, e.locked_at, e.lease_expires_at,
           e.last_error, e.created_at, e.updated_at, e.finished_at, e.message_id,
           e.ordering_key, e.blocks_key, e.flow_counted, e.holds_key, e.failures, e.grp
    FROM "{{schema}}"."{{table}}" AS e
    UNION ALL
    SELECT d.id, NULL::text, d.topic, d.payload, d.headers,
           'done'::"{{schema}}"."{{table}}_status", d.attempts, d.max_attempts,
           d.available_at, d.locked_by, d.locked_at, NULL::timestamptz, d.last_error,
           d.created_at, d.finished_at, d.finished_at, d.message_id, d.ordering_key,
           false, NULL::boolean, false, d.failures, d.grp
    FROM "{{schema}}"."{{table}}_done" AS d;

COMMENT ON VIEW "{{schema}}"."{{table}}_all" IS
    'aiooutbox: every event, in the outbox or finished in its ring';
