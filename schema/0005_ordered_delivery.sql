-- aiooutbox 0005: per-key ordered delivery, and claims that reach only their own topics.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- Consumers of schema 2 and 3 keep working on unordered events: their claim functions
-- are kept (they now read the topic-first index below and sort). Ordered events
-- (ordering_key set) need every consumer at schema 5: older ones never promote a key's
-- next event. CREATE INDEX here blocks writes while it builds over the claimable rows.
--
-- How order works. At most one event of a key is claimable (status pending or retry,
-- enforced by a unique index); the later ones are 'waiting', outside every claim index,
-- so a key's backlog costs claims nothing. An insert decides under a per-key advisory
-- lock (held to its commit) whether it is the head or waits. When a head reaches done,
-- or dead without blocking, the settlement promotes the key's lowest waiting id under
-- the same lock, taken with try-lock so a slow producer never stalls a settlement: a
-- key whose lock was busy is returned to the consumer, which promotes it again later.
-- A claim takes a head together with the run of waiting events behind it, handed to
-- one worker that runs them in order.
--
-- Every function pins index plans with `enable_seqscan = off` (see 0002) and turns JIT
-- off: a node the setting could not avoid (the idle table's scan) costs 1e10, which
-- made PostgreSQL JIT-compile the statement on every call (measured: 65-215 ms per
-- promotion check, settlements past the statement timeout).

ALTER TABLE "{{schema}}"."{{table}}" ADD COLUMN ordering_key TEXT;
-- a dead head of a topic whose handler says on_dead="block" keeps its key blocked
ALTER TABLE "{{schema}}"."{{table}}" ADD COLUMN blocks_key BOOLEAN NOT NULL DEFAULT false;
ALTER TABLE "{{schema}}"."{{table}}" ADD CONSTRAINT "{{table}}_ordering_key_length"
    CHECK (ordering_key IS NULL OR octet_length(ordering_key) BETWEEN 1 AND 512) NOT VALID;

-- Claims walk one topic at a time (a backlog of a topic nobody consumes is never
-- visited); this replaces 0001's (available_at, id) index.
CREATE INDEX "{{table}}_topic_claimable_idx" ON "{{schema}}"."{{table}}" (topic, available_at, id)
    WHERE status IN ('pending', 'retry');
DROP INDEX "{{schema}}"."{{table}}_claimable_idx";

-- at most one claimable event per key
CREATE UNIQUE INDEX "{{table}}_key_head_idx" ON "{{schema}}"."{{table}}" (ordering_key)
    WHERE ordering_key IS NOT NULL AND status IN ('pending', 'retry');
-- a key's unfinished events in id order: is the key busy, which event is next
CREATE INDEX "{{table}}_key_idx" ON "{{schema}}"."{{table}}" (ordering_key, id)
    WHERE ordering_key IS NOT NULL
      AND (status IN ('pending', 'retry', 'processing', 'waiting') OR blocks_key);

-- Head or waiting, decided per inserted row. SECURITY DEFINER: producers need no
-- SELECT on the table; every name is schema-qualified (see 0001's wake-up trigger).
-- Pinned to the key index like the consumer's functions: beside one key with a large
-- backlog the statistics say that key fills the table, and a cached plan turned the
-- check into a sequential scan (measured: 150 ms per ordered insert beside 1M rows).
-- The SET clauses cost a little per ordered insert; unordered inserts skip the trigger.
CREATE FUNCTION "{{schema}}"."{{table}}_order"() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $fn$
BEGIN
    IF NEW.status OPERATOR(pg_catalog.=) ANY ('{pending,retry}'::"{{schema}}"."{{table}}_status"[]) THEN
        PERFORM pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended(
            '{{schema}}.{{table}}:' OPERATOR(pg_catalog.||) NEW.ordering_key, 0));
        IF EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}" k
                   WHERE k.ordering_key OPERATOR(pg_catalog.=) NEW.ordering_key
                     AND (k.status OPERATOR(pg_catalog.=) ANY
                          ('{pending,retry,processing,waiting}'::"{{schema}}"."{{table}}_status"[])
                          OR k.blocks_key)) THEN
            NEW.status := 'waiting';
        END IF;
    END IF;
    RETURN NEW;
END
$fn$;

CREATE TRIGGER "{{table}}_order"
    BEFORE INSERT ON "{{schema}}"."{{table}}"
    FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL)
    EXECUTE FUNCTION "{{schema}}"."{{table}}_order"();

-- Promote the next waiting event of each key that has no head left; a key whose lock a
-- producer holds is returned in `skipped` (the caller tries again later). Notifies
-- idle consumers of the promoted events' topics, as the insert trigger would.
CREATE FUNCTION "{{schema}}"."{{table}}_promote"(p_keys TEXT[])
RETURNS TABLE (promoted INT, skipped TEXT[])
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $fn$
DECLARE
    k TEXT;
    woken TEXT;
BEGIN
    promoted := 0;
    skipped := '{}';
    FOR k IN SELECT DISTINCT u.k FROM unnest(p_keys) AS u(k) WHERE u.k IS NOT NULL ORDER BY 1 LOOP
        IF NOT pg_try_advisory_xact_lock(hashtextextended('{{schema}}.{{table}}:' || k, 0)) THEN
            skipped := skipped || k;
            CONTINUE;
        END IF;
        IF EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}" b
                   WHERE b.ordering_key = k
                     AND (b.status IN ('pending', 'retry', 'processing') OR b.blocks_key)) THEN
            CONTINUE;
        END IF;
        UPDATE "{{schema}}"."{{table}}" AS e SET status = 'pending', updated_at = now()
        WHERE e.id = (SELECT w.id FROM "{{schema}}"."{{table}}" w
                      WHERE w.ordering_key = k AND w.status = 'waiting' ORDER BY w.id LIMIT 1)
        RETURNING e.topic INTO woken;
        IF FOUND THEN
            promoted := promoted + 1;
            IF EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}_idle" i
                       WHERE i.expires_at > now() AND (woken = ANY (i.topics) OR '*' = ANY (i.topics))) THEN
                PERFORM pg_notify('{{channel}}', woken);
            END IF;
        END IF;
    END LOOP;
    RETURN NEXT;
END
$fn$;

-- Keys with waiting events and no head (a promotion lost with its consumer, events of
-- schema-3 consumers): promoted again. Walks the waiting events; run at consumer start.
CREATE FUNCTION "{{schema}}"."{{table}}_promote_orphans"()
RETURNS TABLE (promoted INT, skipped TEXT[])
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $fn$
BEGIN
    RETURN QUERY SELECT * FROM "{{schema}}"."{{table}}_promote"(ARRAY(
        SELECT DISTINCT w.ordering_key FROM "{{schema}}"."{{table}}" w
        WHERE w.ordering_key IS NOT NULL AND w.status = 'waiting'
          AND NOT EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}" b
                          WHERE b.ordering_key = w.ordering_key
                            AND (b.status IN ('pending', 'retry', 'processing') OR b.blocks_key))));
END
$fn$;

-- The claim of schema 5: up to p_limit claimable rows of p_topics (NULL: every topic),
-- oldest first, each topic read through its own range of the topic-first index; then,
-- for every ordered head claimed, the run of up to p_run waiting events behind it (in
-- id order, while due and of a claimed topic), within the same p_limit. Byte cap and
-- watermark as in 0003. `is_head` tells run members from heads.
CREATE FUNCTION "{{schema}}"."{{table}}_claim_v5"(
    p_worker TEXT, p_lease FLOAT8, p_topics TEXT[], p_limit INT, p_max_bytes BIGINT,
    p_run INT, p_after_at TIMESTAMPTZ DEFAULT NULL, p_after_id BIGINT DEFAULT NULL)
RETURNS TABLE (id BIGINT, topic TEXT, payload TEXT, dedupe_key TEXT, headers TEXT,
               attempts INT, max_attempts INT, created_at TIMESTAMPTZ,
               available_at TIMESTAMPTZ, message_id TEXT, ordering_key TEXT, is_head BOOLEAN)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $fn$
#variable_conflict use_column
DECLARE
    topics TEXT[] := p_topics;
    cand BIGINT[];
    heads BIGINT[];
    runs BIGINT[] := '{}';
    after_at TIMESTAMPTZ := coalesce(p_after_at, '-infinity');
    after_id BIGINT := coalesce(p_after_id, 0);
BEGIN
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
            SELECT t.topic FROM t WHERE t.topic IS NOT NULL);
    END IF;
    IF cardinality(topics) = 1 THEN
        -- one topic: lock while scanning, so concurrent consumers skip each other exactly
        SELECT array_agg(w.id) INTO heads FROM (
            SELECT s.id, sum(s.size) OVER (ORDER BY s.available_at, s.id) - s.size AS before
            FROM (SELECT c.id, c.available_at, pg_column_size(c.payload) AS size
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
        SELECT array_agg(w.id) INTO heads FROM (
            SELECT s.id, sum(s.size) OVER (ORDER BY s.available_at, s.id) - s.size AS before
            FROM (SELECT c.id, c.available_at, pg_column_size(c.payload) AS size
                  FROM "{{schema}}"."{{table}}" AS c
                  WHERE c.id = ANY (cand) AND c.status IN ('pending', 'retry')
                    AND c.available_at <= now()
                  ORDER BY c.available_at, c.id LIMIT p_limit FOR UPDATE SKIP LOCKED) AS s
        ) AS w WHERE w.before < p_max_bytes;
    END IF;
    IF heads IS NULL THEN
        RETURN;
    END IF;
    IF p_run > 0 AND cardinality(heads) < p_limit THEN
        runs := ARRAY(
            SELECT r.id
            FROM (SELECT h.ordering_key AS k, h.available_at AS h_at, h.id AS h_id
                  FROM "{{schema}}"."{{table}}" h
                  WHERE h.id = ANY (heads) AND h.ordering_key IS NOT NULL) AS k
            CROSS JOIN LATERAL (
                SELECT x.id, bool_and(x.ok) OVER (ORDER BY x.id) AS ok
                FROM (SELECT w.id,
                             (w.available_at <= now()
                              AND (p_topics IS NULL OR w.topic = ANY (topics))) AS ok
                      FROM "{{schema}}"."{{table}}" w
                      WHERE w.ordering_key = k.k AND w.status = 'waiting'
                      ORDER BY w.id LIMIT p_run) AS x) AS r
            WHERE r.ok
            ORDER BY k.h_at, k.h_id, r.id
            LIMIT p_limit - cardinality(heads));
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
    WHERE e.id = ANY (heads || runs)
      AND (e.id = ANY (heads) OR e.status = 'waiting')
    RETURNING e.id, e.topic, e.payload::text, e.dedupe_key, e.headers::text,
              e.attempts, e.max_attempts,
              least(greatest(e.created_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              least(greatest(e.available_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'),
              coalesce(e.message_id, md5('aiooutbox:' || (SELECT d.oid FROM pg_catalog.pg_database d
                  WHERE d.datname = pg_catalog.current_database()) || ':' || e.tableoid
                  || ':' || e.id)::uuid)::text,
              e.ordering_key, e.id = ANY (heads);
END
$fn$;

-- Settle done, fenced as in 0002; then promote the keys that may have no head left.
CREATE FUNCTION "{{schema}}"."{{table}}_settle_done_v5"(
    p_ids BIGINT[], p_worker TEXT, p_attempts INT)
RETURNS TABLE (settled INT, promoted INT, skipped TEXT[])
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $fn$
DECLARE
    keys TEXT[];
BEGIN
    WITH d AS (
        UPDATE "{{schema}}"."{{table}}" SET status = 'done', lease_expires_at = NULL,
            finished_at = now(), updated_at = now()
        WHERE id = ANY (p_ids) AND status = 'processing'
          AND locked_by = p_worker AND attempts = p_attempts
        RETURNING ordering_key)
    SELECT count(*)::int, array_agg(d.ordering_key) FILTER (WHERE d.ordering_key IS NOT NULL)
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

-- Settle failures, fenced as in 0002, with an outcome per row:
--   retry        back to retry after its delay, or dead once out of attempts (key moves on)
--   retry_block  the same, but dead keeps its key blocked until an operator acts
--   dead         dead now; its key moves on
--   dead_block   dead now; its key stays blocked
--   released     back to retry at once, even on its last attempt (the consumer stopped)
--   unrun        a run member that never started: back to waiting, attempt given back
CREATE FUNCTION "{{schema}}"."{{table}}_settle_failed_v5"(
    p_ids BIGINT[], p_delays FLOAT8[], p_errors TEXT[], p_outcomes TEXT[],
    p_worker TEXT, p_attempts INT)
RETURNS TABLE (settled INT, promoted INT, skipped TEXT[])
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $fn$
DECLARE
    keys TEXT[];
BEGIN
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
            lease_expires_at = NULL, updated_at = now()
        FROM u
        WHERE e.id = u.id AND e.id = ANY (p_ids) AND e.status = 'processing'
          AND e.locked_by = p_worker AND e.attempts = p_attempts
        RETURNING e.ordering_key, e.status, e.blocks_key)
    SELECT count(*)::int,
           array_agg(f.ordering_key) FILTER (
               WHERE f.ordering_key IS NOT NULL AND f.status = 'dead' AND NOT f.blocks_key)
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

-- Return processing rows to the queue: expired leases (p_worker NULL: anyone's, up to
-- p_limit, exhausted ones to dead), or a consumer's own rows it does not hold
-- (p_worker set, p_keep excluded; never to dead). Per key, only the lowest-id
-- processing event goes back to retry (its head); the rest of its run waits again
-- with its attempt given back.
CREATE FUNCTION "{{schema}}"."{{table}}_requeue_v5"(
    p_worker TEXT, p_keep BIGINT[], p_limit INT, p_reason TEXT)
RETURNS TABLE (id BIGINT, topic TEXT, status TEXT, locked_by TEXT)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
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
    WITH r AS (
        UPDATE "{{schema}}"."{{table}}" AS e SET
            status = (CASE
                WHEN e.ordering_key IS NOT NULL AND EXISTS (
                    SELECT 1 FROM "{{schema}}"."{{table}}" o
                    WHERE o.ordering_key = e.ordering_key AND o.status = 'processing'
                      AND o.id < e.id) THEN 'waiting'
                WHEN p_worker IS NULL AND e.attempts >= e.max_attempts THEN 'dead'
                ELSE 'retry' END)::"{{schema}}"."{{table}}_status",
            attempts = CASE
                WHEN e.ordering_key IS NOT NULL AND EXISTS (
                    SELECT 1 FROM "{{schema}}"."{{table}}" o
                    WHERE o.ordering_key = e.ordering_key AND o.status = 'processing'
                      AND o.id < e.id) THEN e.attempts - 1
                ELSE e.attempts END,
            available_at = now(),
            finished_at = CASE WHEN p_worker IS NULL AND e.attempts >= e.max_attempts
                          THEN now() END,
            last_error = p_reason || ' (worker ' || coalesce(e.locked_by, '?')
                         || ', attempt ' || e.attempts || ')',
            lease_expires_at = NULL, updated_at = now()
        WHERE e.id = ANY (ids)
        RETURNING e.id, e.topic, e.status::text AS status, e.locked_by, e.ordering_key)
    SELECT array_agg(r.id), array_agg(r.topic), array_agg(r.status), array_agg(r.locked_by),
           array_agg(r.ordering_key) FILTER (WHERE r.ordering_key IS NOT NULL AND r.status = 'dead')
    INTO ids, topics, statuses, workers, keys FROM r;
    IF keys IS NOT NULL THEN
        PERFORM "{{schema}}"."{{table}}_promote"(keys);
    END IF;
    RETURN QUERY SELECT * FROM unnest(ids, topics, statuses, workers);
END
$fn$;

-- An operator's redrive of dead events (`dead retry`): back to pending with attempts
-- reset, except that per key only one event may be claimable. A dead event of an
-- ordered key that has a head already (the key moved on past it) waits behind that
-- head, out of its original order; the lowest retried event of a key without a head
-- becomes the head. Its key is no longer blocked by it. Returns the requeued rows.
CREATE FUNCTION "{{schema}}"."{{table}}_requeue_dead"(p_ids BIGINT[], p_topic TEXT)
RETURNS TABLE (id BIGINT, topic TEXT, status TEXT, ordering_key TEXT)
LANGUAGE plpgsql
SET enable_seqscan = off
SET jit = off
AS $fn$
#variable_conflict use_column
DECLARE
    k TEXT;
BEGIN
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
            attempts = 0, available_at = now(), locked_by = NULL, locked_at = NULL,
            finished_at = NULL, blocks_key = false, updated_at = now()
        FROM chosen c
        WHERE e.id = c.id
        RETURNING e.id, e.topic, e.status::text AS status, e.ordering_key)
    SELECT r.id, r.topic, r.status, r.ordering_key FROM r;
END
$fn$;
