-- aiooutbox 0016: a settled run hands its key on once, from the row that holds the key.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- `settle_done_v5` is restated from its body in 0005 (with 0007's generic plans); its
-- signature and results are unchanged, so consumers of every earlier schema keep
-- working. A later migration that replaces it starts from the body below.
--
-- Since 0013 one `processing` row of each key under way holds the key (`holds_key`):
-- the head claimed alone, or the last row of the run claimed behind it, which its worker
-- runs last. A settled row that does not hold its key cannot hand the key on: the
-- holder is still `processing`, so `promote` found the key busy and changed nothing,
-- after taking the key's advisory lock and reading its index entries. A done settlement
-- now promotes only the keys of the rows that held them (measured: a drain of 50,000
-- events over 10,000 keys spent about a third of its promotions on such rows). A key
-- whose holder is settled in an earlier flush than one of its other rows cannot occur
-- (a run's rows run and settle in id order; a failure gives the rest back through
-- `settle_failed_v5`, which promotes as before), and the orphan sweep
-- (`promote_orphans`) still finds any key left without a head.

CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_settle_done_v5"(
    p_ids BIGINT[], p_worker TEXT, p_attempts INT)
RETURNS TABLE (settled INT, promoted INT, skipped TEXT[])
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
DECLARE
    keys TEXT[];
BEGIN
    WITH d AS (
        UPDATE "{{schema}}"."{{table}}" SET status = 'done', lease_expires_at = NULL,
            finished_at = now(), updated_at = now()
        WHERE id = ANY (p_ids) AND status = 'processing'
          AND locked_by = p_worker AND attempts = p_attempts
        RETURNING ordering_key, holds_key)
    SELECT count(*)::int, array_agg(d.ordering_key) FILTER (WHERE d.holds_key)
    INTO settled, keys FROM d;
    promoted := 0;
    skipped := '{}';
    IF keys IS NOT NULL THEN
        SELECT p.promoted, p.skipped INTO promoted, skipped
        FROM "{{schema}}"."{{table}}_promote"(keys) AS p;
    END IF;
    RETURN NEXT;
END
$fn$;
