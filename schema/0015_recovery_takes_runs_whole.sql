-- aiooutbox 0015: lease recovery hands an ordered key on only when its whole run is
-- back.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- `requeue_v5` (lease recovery, and a consumer's release of its own rows) is restated
-- from its body in 0013; its signature and results are unchanged, so consumers of every
-- earlier schema keep working. A later migration that replaces it starts from the body
-- below.
--
-- A worker runs a key's run one event after another; the heartbeat renews only the
-- claims it still holds, so an event that finished, whose outcome waits in the settler,
-- keeps the lease its claim (or its last renewal) set. When that write came late (a
-- slow or retried flush on a loaded machine), the finished event's lease expired while
-- the later events of its run, renewed, still ran. 0013's recovery took the expired
-- row (no lower row of its key was unfinished), put it back to `retry` and took the
-- flag off the run's last row: the key had a claimable head while its run was under
-- way, and the next claim took it with the waiting events after the run, which then ran
-- before the run's own later events. A batch limit that cut a run did the same: the
-- rows left out stayed `processing` while the key's head was claimable again, and so
-- did two consumers recovering a killed consumer's rows at once (each skips the rows
-- the other locked, so one run could be split between them).
-- Now a key goes back only whole:
-- * the key's other processing rows that qualify (expired, or this worker's for a
--   release) are taken with it, whatever the batch limit;
-- * a key with a processing row not taken (its lease still runs, or another
--   transaction holds the row) is left entirely for a later call: its worker writes the
--   late outcome (fenced by worker and attempt, which still match), or its leases all
--   expire and a later call takes the run whole.
-- What happens to the rows taken is unchanged: the key's earliest unfinished event goes
-- back to `retry` (or `dead`), the rest wait again with their attempt given back.
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
