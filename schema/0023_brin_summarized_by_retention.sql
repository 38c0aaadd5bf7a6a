-- aiooutbox 0023: the ring's BRIN summaries come from retention, not from autovacuum's
-- work items.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- Why: 0022 built the BRIN on `<table>_done.finished_at` with `autosummarize = on`, so
-- every insert that starts a new page range of a slot (32 pages) asks autovacuum for a
-- work item. The queue holds 256 items for the whole cluster and is emptied only when
-- an autovacuum worker visits the database (every `autovacuum_naptime`); past about
-- 256 ranges a minute (some 4,000 finished events/s) or with autovacuum off, each
-- refused request writes "request for BRIN range summarization for index ... was not
-- recorded" to the server log, one line a page range.
--
-- 1. `autosummarize = off` on each slot's BRIN index (a partitioned index takes no
--    storage option, and no slot is added later). Each ALTER INDEX holds its index's
--    ACCESS EXCLUSIVE lock until `migrate` commits (milliseconds): settlements moving
--    events into the ring wait that long.
-- 2. `<table>_retire_done` (same signature and results) summarizes a slot's new page
--    ranges (`brin_summarize_new_values`) before it asks whether the slot holds a row
--    younger than the retention, so that question still skips the ranges that cannot.
--    A slot that a VACUUM is summarizing at that moment (its lock not had within the
--    function's 200 ms) is read unsummarized that once. VACUUM, autovacuum's included,
--    summarizes new ranges too.

DO $mig$
DECLARE
    idx REGCLASS;
BEGIN
    FOR idx IN
        SELECT h.inhrelid::regclass FROM pg_catalog.pg_inherits AS h
        WHERE h.inhparent = format('%I.%I', '{{schema}}', '{{table}}_done_finished_idx')::regclass
        ORDER BY 1
    LOOP
        EXECUTE format('ALTER INDEX %s SET (autosummarize = off)', idx);
    END LOOP;
END
$mig$;

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
    brin REGCLASS := format('%I.%I', '{{schema}}', '{{table}}_done_finished_idx')::regclass;
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
        -- its BRIN summarized where it is not yet (inserts no longer ask autovacuum):
        -- the check below then reads only the page ranges that may hold young rows
        BEGIN
            PERFORM pg_catalog.brin_summarize_new_values(x.indexrelid)
            FROM pg_catalog.pg_index AS x
            JOIN pg_catalog.pg_inherits AS h ON h.inhrelid = x.indexrelid
            WHERE h.inhparent = brin AND x.indrelid = part::regclass;
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- a VACUUM of the slot summarizes it now: read it unsummarized
        END;
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
