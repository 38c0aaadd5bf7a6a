-- aiooutbox 0019: low marks. Every transaction that makes an event claimable takes a
-- position lock first, and claims, the idle probe and lease recovery start where the
-- consumer's previous call left them instead of at the oldest entry of their index.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- Consumers of every earlier schema keep working: nothing they call changes its
-- signature or results. `claim_v6` and 0018's `claim_v7` (groups) are untouched
-- (`claim_v8` calls `claim_v7`, so its claims are fair across groups too); `requeue_v5`
-- keeps its signature and results and now calls `requeue_v6` (its body as 0017 left it,
-- plus a lower bound on the leases it looks at); `settle_failed_v5`, `promote` and
-- `requeue_dead` are restated (4. below). The insert triggers act on every producer,
-- and the restated functions are the ones consumers of older releases call too, so
-- they all take the position lock.
--
-- Why (docs/internals.md, "The hot path"): under a snapshot held for minutes (pg_dump,
-- an analytics query, a forgotten BEGIN), no dead index entry newer than it is removed,
-- and every scan that starts at the oldest entry of the claimable or the lease index
-- walks all of them, more with every event handled. A consumer now keeps, per topic,
-- a live low mark: a position (available_at, id) before which no claimable row exists
-- and none can appear. It may pass only positions no uncommitted transaction can still
-- fill, so:
--
-- 1. Position locks. A transaction that makes a row claimable (an INSERT, a retry, a
--    recovery or release, a promotion, a redrive) first takes a
--    shared transaction-level advisory lock keyed `namespace << 44 | milliseconds`
--    (the namespace: 19 bits of a hash of the table's name; the milliseconds:
--    clock_timestamp() when it is taken), once per transaction (a local setting
--    remembers it), and its rows then get positions from clock_timestamp(), after the
--    lock: `available_at` defaults to clock_timestamp(); an INSERT that sets it at or
--    before its statement's start gets clock_timestamp() instead; the functions that
--    make rows claimable (4.) take it and place their rows at clock_timestamp(). (A
--    BEFORE UPDATE row trigger did the same for every UPDATE, but its mere presence
--    costs every claim and settlement a fetch and lock of each row: a drain ran at
--    0.91x. An operator's UPDATE that makes an event due should set available_at to
--    clock_timestamp() in a transaction of its own.)
--    pg_locks shows every key held, to every role. A transaction ends (and its locks
--    leave pg_locks) only after its rows are visible.
-- 2. `claim_v8`: reads pg_locks first, claims through `claim_v7` (0018: groups in turn
--    from the consumer's group cursor) from the lowest of its topics' marks, then
--    probes each topic, without locking, for its first claimable row from its mark:
--    the first of the ungrouped range's and of each named group's (a skip scan of the
--    claimable index, one descent per group; 0018 put the group second in it, so a
--    topic's rows are in (available_at, id) order only within a group), rows another
--    claim holds locked still counting, and returns the new
--    marks: never past the oldest key held, nor past its reading minus 10 ms. A key held
--    longer than the grace the caller gives (a producer's transaction left open) no
--    longer holds the marks back: the caller awaits it, and when it leaves pg_locks the
--    marks go back to it once, so its rows are claimed after its commit.
-- 3. `requeue_v6`: lease recovery from a lower bound the consumer keeps.

-- 1. position locks ------------------------------------------------------------------
ALTER TABLE "{{schema}}"."{{table}}" ALTER COLUMN available_at SET DEFAULT clock_timestamp();

-- Take this transaction's position lock unless it holds one. No SET clause: its
-- local setting must outlive the call (a SET clause would undo it at the function's
-- exit; then a later statement takes a second, newer key, which is only one more lock).
CREATE FUNCTION "{{schema}}"."{{table}}_take_position"() RETURNS void
LANGUAGE plpgsql AS $fn$
DECLARE
    ns BIGINT := pg_catalog.hashtextextended('aiooutbox-position:{{schema}}.{{table}}', 0)
                 OPERATOR(pg_catalog.&) 524287;
    flag TEXT := 'aiooutbox.position_' OPERATOR(pg_catalog.||) ns::text;
BEGIN
    IF pg_catalog.current_setting(flag, true) IS DISTINCT FROM '1' THEN
        PERFORM pg_catalog.pg_advisory_xact_lock_shared(
            (ns OPERATOR(pg_catalog.<<) 44) OPERATOR(pg_catalog.|)
            pg_catalog.floor(pg_catalog.date_part('epoch', pg_catalog.clock_timestamp())
                             OPERATOR(pg_catalog.*) 1000)::bigint);
        PERFORM pg_catalog.set_config(flag, '1', true);
    END IF;
END
$fn$;

CREATE FUNCTION "{{schema}}"."{{table}}_positioned"() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM "{{schema}}"."{{table}}_take_position"();
    RETURN NULL;
END
$fn$;

-- every INSERT (COPY too), before its first row
CREATE TRIGGER "{{table}}_position"
    BEFORE INSERT ON "{{schema}}"."{{table}}"
    FOR EACH STATEMENT
    EXECUTE FUNCTION "{{schema}}"."{{table}}_positioned"();

-- a row's position, after the lock: for an INSERT that set available_at at or before
-- its statement's start (now(), a time in the past, -infinity)
CREATE FUNCTION "{{schema}}"."{{table}}_reposition"() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM "{{schema}}"."{{table}}_take_position"();
    NEW.available_at := GREATEST(NEW.available_at, pg_catalog.clock_timestamp());
    RETURN NEW;
END
$fn$;

-- named to fire after "<table>_insert_check" and "<table>_order" (name order)
CREATE TRIGGER "{{table}}_position_row"
    BEFORE INSERT ON "{{schema}}"."{{table}}"
    FOR EACH ROW WHEN (NEW.available_at <= statement_timestamp())
    EXECUTE FUNCTION "{{schema}}"."{{table}}_reposition"();


-- The milliseconds of every position lock held on this outbox, oldest first.
CREATE FUNCTION "{{schema}}"."{{table}}_open_positions"() RETURNS BIGINT[]
LANGUAGE sql STABLE AS $fn$
    SELECT coalesce(array_agg(DISTINCT ((l.classid::int8 OPERATOR(pg_catalog.&) 4095)
                                        OPERATOR(pg_catalog.<<) 32)
                                       OPERATOR(pg_catalog.|) l.objid::int8), '{}')
    FROM pg_catalog.pg_locks AS l
    WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory'
      AND l.objsubid OPERATOR(pg_catalog.=) 1
      AND l.database OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database AS d
                      WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
      AND (l.classid::int8 OPERATOR(pg_catalog.>>) 12) OPERATOR(pg_catalog.=)
          (pg_catalog.hashtextextended('aiooutbox-position:{{schema}}.{{table}}', 0)
           OPERATOR(pg_catalog.&) 524287)
$fn$;

-- A finite timestamp as epoch microseconds, exactly (a float8 epoch can be a microsecond
-- off, and a mark a microsecond past its row would hide it).
CREATE FUNCTION "{{schema}}"."{{table}}_epoch_us"(p_at TIMESTAMPTZ) RETURNS BIGINT
LANGUAGE sql IMMUTABLE AS $fn$
    SELECT pg_catalog.date_part('epoch', pg_catalog.date_trunc('second', p_at, 'UTC'))::bigint
           OPERATOR(pg_catalog.*) 1000000
           OPERATOR(pg_catalog.+) (pg_catalog.date_part('microseconds', p_at)::bigint
                                   OPERATOR(pg_catalog.%) 1000000)
$fn$;

-- Whether an event an ordered claim returns with attempts = 1 was claimed before: a
-- requeue that gave its attempt back (a run member recovered behind its head) left its
-- error. `Event.redelivered` read `available_at > created_at` for this before; positions
-- from clock_timestamp() (1. above) make that true of every ordered event. Its own
-- function, pinned to the primary key: the claims' statements call it per such row.
CREATE FUNCTION "{{schema}}"."{{table}}_requeued"(p_id BIGINT) RETURNS BOOLEAN
LANGUAGE sql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $fn$
    SELECT EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}" AS e
                   WHERE e.id = p_id AND e.last_error IS NOT NULL)
$fn$;

-- 2. the claim from low marks ----------------------------------------------------------
-- p_topics: the topics to claim (never NULL); p_mark_us, p_mark_id: each topic's mark as
-- epoch microseconds and id (NULL microseconds: from the start); p_awaited: the keys
-- (milliseconds) the caller awaits; p_grace: seconds a key may hold the marks back
-- before it is awaited instead; p_cursor, p_groups: the group cursor and the groups per
-- claim, as `claim_v7` (0018) takes them. The claimed rows come first, as `claim_v7`
-- returns them plus `redelivered` (claimed before: attempts > 1, or an ordered event a
-- requeue gave its attempt back, which left its error); the last row has a NULL id and,
-- in `payload`, {"us": [...], "id": [...], "awaited": [...]}: the new marks, in the
-- order of p_topics, and the keys to await.
CREATE FUNCTION "{{schema}}"."{{table}}_claim_v8"(
    p_worker TEXT, p_lease FLOAT8, p_topics TEXT[], p_limit INT, p_max_bytes BIGINT,
    p_run INT, p_run_rows INT, p_mark_us BIGINT[], p_mark_id BIGINT[], p_awaited BIGINT[],
    p_grace FLOAT8, p_cursor TEXT DEFAULT NULL, p_groups INT DEFAULT 32)
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
    marks TEXT;
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
    -- 10 ms before the oldest key held and before this reading: a transaction that
    -- takes its key after the reading has a later one; and a row an INSERT placed
    -- itself between its statement's start and its key (explicit values only: the
    -- trigger moves those at or before the start) is covered while the statement took
    -- less than that to reach its trigger
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
    SELECT c.id, c.topic, c.payload, c.dedupe_key, c.headers, c.attempts, c.max_attempts,
           c.created_at, c.available_at, c.message_id, c.ordering_key, c.is_head, c.grp,
           CASE WHEN c.attempts > 1 THEN true WHEN c.ordering_key IS NULL THEN false
                ELSE coalesce((SELECT e.last_error IS NOT NULL FROM "{{schema}}"."{{table}}" AS e
                               WHERE e.id = c.id), false) END
    FROM "{{schema}}"."{{table}}_claim_v7"(p_worker, p_lease, p_topics, p_limit, p_max_bytes,
                                           p_run, p_run_rows, after_at, after_id, p_cursor,
                                           p_groups) AS c;
    -- each topic's first claimable row from its mark (not locking: rows other claims
    -- hold locked count), the new mark just before it, and never past the bound. The
    -- claimable index is (topic, coalesce(grp, ''), available_at, id) (0018): the first
    -- row is the first of the ungrouped range's and of each named group's, the groups
    -- found by a skip scan that looks only at entries after the mark (in the index, so
    -- the dead entries before it cost no heap fetch), one descent per group
    SELECT json_build_object(
               'us', coalesce(json_agg(CASE WHEN n.at = '-infinity' THEN NULL
                   ELSE "{{schema}}"."{{table}}_epoch_us"(n.at) END ORDER BY n.ord), '[]'),
               'id', coalesce(json_agg(n.id ORDER BY n.ord), '[]'),
               'awaited', to_json(awaited))::text
    INTO marks
    FROM (SELECT x.ord,
                 CASE WHEN f.at IS NULL OR (bound, 0::bigint) < (f.at, f.id - 1)
                      THEN bound ELSE f.at END AS at,
                 CASE WHEN f.at IS NULL OR (bound, 0::bigint) < (f.at, f.id - 1)
                      THEN 0 ELSE f.id - 1 END AS id
          FROM unnest(p_topics, p_mark_us, p_mark_id) WITH ORDINALITY AS x(t, us, mid, ord)
          CROSS JOIN LATERAL (
              SELECT CASE WHEN back_to IS NOT NULL AND (back_to, 0::bigint) < (m0.at, m0.id)
                          THEN back_to ELSE m0.at END AS at,
                     CASE WHEN back_to IS NOT NULL AND (back_to, 0::bigint) < (m0.at, m0.id)
                          THEN 0 ELSE m0.id END AS id
              FROM (SELECT CASE WHEN x.us IS NULL THEN '-infinity'::timestamptz
                                ELSE 'epoch'::timestamptz + x.us * interval '1 microsecond' END AS at,
                           coalesce(x.mid, 0) AS id) AS m0) AS m
          LEFT JOIN LATERAL (
              SELECT p.at, p.id FROM (
                  (SELECT c.available_at AS at, c.id FROM "{{schema}}"."{{table}}" AS c
                   WHERE c.status IN ('pending', 'retry') AND c.topic = x.t
                     AND coalesce(c.grp, '') = ''
                     AND (c.available_at, c.id) > (m.at, m.id)
                   ORDER BY c.available_at, c.id LIMIT 1)
                  UNION ALL
                  (WITH RECURSIVE g(grp) AS (
                       (SELECT coalesce(c.grp, '') FROM "{{schema}}"."{{table}}" AS c
                        WHERE c.status IN ('pending', 'retry') AND c.topic = x.t
                          AND coalesce(c.grp, '') > ''
                          AND (c.available_at, c.id) > (m.at, m.id)
                        ORDER BY coalesce(c.grp, '') LIMIT 1)
                       UNION ALL
                       SELECT (SELECT coalesce(c.grp, '') FROM "{{schema}}"."{{table}}" AS c
                               WHERE c.status IN ('pending', 'retry') AND c.topic = x.t
                                 AND coalesce(c.grp, '') > g.grp
                                 AND (c.available_at, c.id) > (m.at, m.id)
                               ORDER BY coalesce(c.grp, '') LIMIT 1)
                       FROM g WHERE g.grp IS NOT NULL)
                   SELECT r.at, r.id FROM g CROSS JOIN LATERAL (
                       SELECT c.available_at AS at, c.id FROM "{{schema}}"."{{table}}" AS c
                       WHERE c.status IN ('pending', 'retry') AND c.topic = x.t
                         AND coalesce(c.grp, '') = g.grp
                         AND (c.available_at, c.id) > (m.at, m.id)
                       ORDER BY c.available_at, c.id LIMIT 1) AS r
                   WHERE g.grp IS NOT NULL)) AS p
              ORDER BY p.at, p.id LIMIT 1) AS f ON true) AS n;
    RETURN QUERY SELECT NULL::bigint, NULL::text, marks, NULL::text, NULL::text, NULL::int,
                        NULL::int, NULL::timestamptz, NULL::timestamptz, NULL::text,
                        NULL::text, NULL::boolean, NULL::text, NULL::boolean;
END
$fn$;

-- 3. lease recovery from a lower bound -----------------------------------------------
-- `requeue_v5` as 0017 left it, except that lease recovery (p_worker NULL) looks only at
-- leases that expired at or after p_after (the consumer's lease mark: no processing row
-- has an earlier lease; `Queries.lease_mark`).
CREATE FUNCTION "{{schema}}"."{{table}}_requeue_v6"(
    p_worker TEXT, p_keep BIGINT[], p_limit INT, p_reason TEXT, p_after TIMESTAMPTZ)
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
                       AND c.lease_expires_at >= p_after
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
    PERFORM "{{schema}}"."{{table}}_take_position"();  -- before any position is taken (1.)
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
            available_at = clock_timestamp(),
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

-- the signature consumers of schemas 5 to 19 call: recovery from the oldest lease
CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_requeue_v5"(
    p_worker TEXT, p_keep BIGINT[], p_limit INT, p_reason TEXT)
RETURNS TABLE (id BIGINT, topic TEXT, status TEXT, locked_by TEXT)
LANGUAGE sql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
SET plan_cache_mode = force_generic_plan
AS $fn$
    SELECT * FROM "{{schema}}"."{{table}}_requeue_v6"(p_worker, p_keep, p_limit, p_reason,
                                                      '-infinity')
$fn$;

-- 4. the functions that make events claimable, restated from their latest bodies
-- (`settle_failed_v5` from 0017, `promote` from 0006, `requeue_dead` from 0005), each
-- taking the position lock first and placing the rows it makes claimable at
-- clock_timestamp() (a retry: plus its delay; a promotion: not before its own
-- available_at). A later migration that replaces one of them starts from the body below.
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
    PERFORM "{{schema}}"."{{table}}_take_position"();  -- before any position is taken (1.)
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
                THEN clock_timestamp() + make_interval(secs => u.delay) ELSE e.available_at END,
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
    PERFORM "{{schema}}"."{{table}}_take_position"();  -- before any position is taken (1.)
    WITH nxt AS (
        SELECT (SELECT w.id FROM "{{schema}}"."{{table}}" w
                WHERE w.ordering_key = k.k AND w.status = 'waiting' ORDER BY w.id LIMIT 1) AS id
        FROM unnest(locked) AS k(k)
        WHERE NOT EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}" b
                          WHERE b.ordering_key = k.k
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

CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_requeue_dead"(p_ids BIGINT[], p_topic TEXT)
RETURNS TABLE (id BIGINT, topic TEXT, status TEXT, ordering_key TEXT)
LANGUAGE plpgsql
SET enable_seqscan = off
SET jit = off
AS $fn$
#variable_conflict use_column
DECLARE
    k TEXT;
BEGIN
    PERFORM "{{schema}}"."{{table}}_take_position"();  -- before any position is taken (1.)
    FOR k IN SELECT DISTINCT d.ordering_key FROM "{{schema}}"."{{table}}" d
             WHERE d.status = 'dead' AND d.ordering_key IS NOT NULL
               AND (p_ids IS NULL OR d.id = ANY (p_ids)) AND (p_topic IS NULL OR d.topic = p_topic)
             ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended('{{schema}}.{{table}}:' || k, 0));
    END LOOP;
    RETURN QUERY
    WITH chosen AS (
        SELECT d.id, d.ordering_key,
               row_number() OVER (PARTITION BY d.ordering_key ORDER BY d.id) AS n
        FROM "{{schema}}"."{{table}}" d
        WHERE d.status = 'dead' AND (p_ids IS NULL OR d.id = ANY (p_ids))
          AND (p_topic IS NULL OR d.topic = p_topic)),
    r AS (
        UPDATE "{{schema}}"."{{table}}" AS e SET
            status = (CASE
                WHEN c.ordering_key IS NULL THEN 'pending'
                WHEN c.n = 1 AND NOT EXISTS (
                    SELECT 1 FROM "{{schema}}"."{{table}}" h
                    WHERE h.ordering_key = c.ordering_key
                      AND h.status IN ('pending', 'retry', 'processing')) THEN 'pending'
                ELSE 'waiting' END)::"{{schema}}"."{{table}}_status",
            attempts = 0, available_at = clock_timestamp(), locked_by = NULL, locked_at = NULL,
            finished_at = NULL, blocks_key = false, updated_at = now()
        FROM chosen c
        WHERE e.id = c.id
        RETURNING e.id, e.topic, e.status::text AS status, e.ordering_key)
    SELECT r.id, r.topic, r.status, r.ordering_key FROM r;
END
$fn$;
