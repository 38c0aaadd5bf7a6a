-- aiooutbox 0009: every way a key's head leaves leads to the key's next event.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- Consumers of schema 5 to 9 keep working: one function is added, and lease recovery
-- is replaced with its signature and results unchanged (0007's plan setting restated:
-- CREATE OR REPLACE replaces a function's settings with the ones it lists). Consumers
-- of this release also sweep for keys left without a head every
-- `orphan_sweep_interval` (0006's `<table>_promote_orphans`, until now run only at
-- consumer start): that heals what no statement can promote by itself, such as an
-- operator's own DELETE of a head, or a promotion a producer's lock deferred past the
-- end of the consumer that was to retry it.

-- The operator's purge of dead events (`purge --status dead`, `dead purge`): up to
-- p_limit dead events (NULL: all) of the ids (NULL: any), the topic (NULL: any) and
-- finished more than p_age seconds ago (NULL: any age) are deleted, and the keys that a
-- deleted event kept blocked (`on_dead="block"`) move on to their next event. The
-- purge used to promote with a try-lock and dropped a key whose lock a producer held
-- (or, through `purge --status dead`, not promote at all): the key then hung until a
-- consumer restarted. Here the locks of those keys are taken first, in key order, and
-- waited for (a producer holds one only until its transaction ends; `dead retry` takes
-- the same locks in the same order, so the two never deadlock), so the promotion
-- cannot be skipped. Returns the deleted ids, how many keys moved on, and the keys that
-- could not (none, unless an event died blocking between the two statements: the
-- consumers' sweep promotes those).
CREATE FUNCTION "{{schema}}"."{{table}}_delete_dead"(
    p_ids BIGINT[], p_topic TEXT, p_age FLOAT8, p_limit INT)
RETURNS TABLE (deleted BIGINT[], promoted INT, skipped TEXT[])
LANGUAGE plpgsql
SET jit = off
AS $fn$
DECLARE
    ids BIGINT[];
    keys TEXT[];
    k TEXT;
BEGIN
    ids := ARRAY(
        SELECT d.id FROM "{{schema}}"."{{table}}" d
        WHERE d.status = 'dead' AND (p_ids IS NULL OR d.id = ANY (p_ids))
          AND (p_topic IS NULL OR d.topic = p_topic)
          AND (p_age IS NULL
               OR coalesce(d.finished_at, d.updated_at) < now() - make_interval(secs => p_age))
        LIMIT p_limit);
    FOR k IN SELECT DISTINCT d.ordering_key FROM "{{schema}}"."{{table}}" d
             WHERE d.id = ANY (ids) AND d.blocks_key AND d.ordering_key IS NOT NULL
             ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended('{{schema}}.{{table}}:' || k, 0));
    END LOOP;
    -- a statement after the locks: its snapshot sees what their last holders committed
    WITH d AS (
        DELETE FROM "{{schema}}"."{{table}}" AS e
        WHERE e.id = ANY (ids) AND e.status = 'dead'
        RETURNING e.id, e.ordering_key, e.blocks_key)
    SELECT coalesce(array_agg(d.id ORDER BY d.id), '{}'),
           array_agg(DISTINCT d.ordering_key) FILTER (WHERE d.blocks_key AND d.ordering_key IS NOT NULL)
    INTO deleted, keys FROM d;
    promoted := 0;
    skipped := '{}';
    IF keys IS NOT NULL THEN
        SELECT p.promoted, p.skipped INTO promoted, skipped
        FROM "{{schema}}"."{{table}}_promote"(keys) AS p;
    END IF;
    RETURN NEXT;
END
$fn$;

-- Lease recovery (p_worker NULL: expired leases, up to p_limit, exhausted ones to dead)
-- and a consumer's release of its own rows it does not hold (p_worker set, p_keep
-- excluded; never to dead), as in 0005, except in two cases 0005 got wrong when a
-- crashed consumer's run (a head and the waiting events claimed behind it, all with
-- one lease) was recovered in two batches (p_limit cut through it):
--   - the head went back to `retry` in the first batch and, in the second, the rest of
--     the run had no `processing` event before it left, so it went to `retry` too: a
--     second head, refused by the one-head-per-key index, which failed every later
--     recovery round (all expired leases stayed `processing`);
--   - after a dead head, a later event of the run jumped ahead of an earlier one that
--     the first batch had sent back to `waiting`.
-- An event now goes back to `retry` (or `dead`) only when no earlier event of its key
-- is unfinished; the others wait again with their attempt given back, and a key that
-- has no head after that (its head went dead, or was recovered in an earlier batch and
-- ran since) is promoted. A promotion a producer's lock skips is left to the sweep.
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
    -- MATERIALIZED: each row's check runs once, not once per column that reads it
    WITH x AS MATERIALIZED (
        SELECT c.id, c.ordering_key IS NOT NULL AND EXISTS (
                   SELECT 1 FROM "{{schema}}"."{{table}}" o
                   WHERE o.ordering_key = c.ordering_key AND o.id < c.id
                     AND (o.status IN ('pending', 'retry', 'processing', 'waiting')
                          OR o.blocks_key)) AS behind
        FROM "{{schema}}"."{{table}}" AS c WHERE c.id = ANY (ids)),
    r AS (
        UPDATE "{{schema}}"."{{table}}" AS e SET
            status = (CASE
                WHEN x.behind THEN 'waiting'
                WHEN p_worker IS NULL AND e.attempts >= e.max_attempts THEN 'dead'
                ELSE 'retry' END)::"{{schema}}"."{{table}}_status",
            attempts = CASE WHEN x.behind THEN e.attempts - 1 ELSE e.attempts END,
            available_at = now(),
            finished_at = CASE WHEN NOT x.behind AND p_worker IS NULL
                                    AND e.attempts >= e.max_attempts
                          THEN now() END,
            last_error = p_reason || ' (worker ' || coalesce(e.locked_by, '?')
                         || ', attempt ' || e.attempts || ')',
            lease_expires_at = NULL, updated_at = now()
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
