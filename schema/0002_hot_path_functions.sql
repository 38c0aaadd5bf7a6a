-- aiooutbox 0002: the claim and the settlements as functions with pinned index plans.
--
-- Placeholders: {{schema}}, {{table}} (see 0001).
--
-- Why functions: a consumer runs these statements thousands of times per connection,
-- so PostgreSQL soon switches them to a generic plan and keeps it for the life of the
-- connection. When that plan is made while the table is small (a fresh table, or one
-- that was just vacuumed or truncated), a sequential scan is the cheapest choice, and
-- the plan is kept while the backlog grows: measured at 30k pending rows, every claim
-- of 100 rows then took ~26 ms instead of ~2 ms, and a 4k events/s steady load fell
-- behind. Autovacuum's next ANALYZE fixes it eventually; a server with autovacuum
-- off or far behind never does. The `SET` clauses below pin these statements to their
-- indexes whatever the statistics say: a queue table is always read through an index.
-- PL/pgSQL keeps each statement's plan between calls, so a call costs about what the
-- bare statement did. SECURITY INVOKER (the default): callers need the same table
-- privileges as before. Every relation is schema-qualified.

-- Claim up to p_limit claimable rows, oldest first, for p_worker. With a watermark
-- (p_after_at, p_after_id) the scan starts just after it, skipping the dead index
-- entries of rows claimed since the last VACUUM. Two statements rather than one with
-- `p_after_at IS NULL OR …`: in a cached plan only the plain row comparison is an
-- index condition.
CREATE FUNCTION "{{schema}}"."{{table}}_claim"(
    p_worker TEXT, p_lease FLOAT8, p_topics TEXT[], p_limit INT,
    p_after_at TIMESTAMPTZ DEFAULT NULL, p_after_id BIGINT DEFAULT NULL)
RETURNS TABLE (id BIGINT, topic TEXT, payload TEXT, dedupe_key TEXT, headers TEXT,
               attempts INT, max_attempts INT, created_at TIMESTAMPTZ,
               available_at TIMESTAMPTZ)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $fn$
#variable_conflict use_column
BEGIN
    IF p_after_at IS NULL THEN
        RETURN QUERY
        UPDATE "{{schema}}"."{{table}}" AS e SET status = 'processing',
            attempts = e.attempts + 1, locked_by = p_worker, locked_at = now(),
            lease_expires_at = now() + make_interval(secs => p_lease), updated_at = now()
        WHERE e.id = ANY (ARRAY(
            SELECT c.id FROM "{{schema}}"."{{table}}" AS c
            WHERE c.status IN ('pending', 'retry') AND c.available_at <= now()
              AND c.topic = ANY (p_topics)
            ORDER BY c.available_at, c.id LIMIT p_limit FOR UPDATE SKIP LOCKED))
        RETURNING e.id, e.topic, e.payload::text, e.dedupe_key, e.headers::text,
                  e.attempts, e.max_attempts, e.created_at, e.available_at;
    ELSE
        RETURN QUERY
        UPDATE "{{schema}}"."{{table}}" AS e SET status = 'processing',
            attempts = e.attempts + 1, locked_by = p_worker, locked_at = now(),
            lease_expires_at = now() + make_interval(secs => p_lease), updated_at = now()
        WHERE e.id = ANY (ARRAY(
            SELECT c.id FROM "{{schema}}"."{{table}}" AS c
            WHERE c.status IN ('pending', 'retry') AND c.available_at <= now()
              AND c.topic = ANY (p_topics)
              AND (c.available_at, c.id) > (p_after_at, p_after_id)
            ORDER BY c.available_at, c.id LIMIT p_limit FOR UPDATE SKIP LOCKED))
        RETURNING e.id, e.topic, e.payload::text, e.dedupe_key, e.headers::text,
                  e.attempts, e.max_attempts, e.created_at, e.available_at;
    END IF;
END
$fn$;

-- Mark rows done; fenced: only rows p_worker still holds on attempt p_attempts.
-- Returns how many rows were settled.
CREATE FUNCTION "{{schema}}"."{{table}}_settle_done"(
    p_ids BIGINT[], p_worker TEXT, p_attempts INT)
RETURNS INT
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $fn$
DECLARE
    settled INT;
BEGIN
    UPDATE "{{schema}}"."{{table}}" SET status = 'done', lease_expires_at = NULL,
        finished_at = now(), updated_at = now()
    WHERE id = ANY (p_ids) AND status = 'processing'
      AND locked_by = p_worker AND attempts = p_attempts;
    GET DIAGNOSTICS settled = ROW_COUNT;
    RETURN settled;
END
$fn$;

-- Settle failures, fenced like settle_done: back to 'retry' after each delay, or 'dead'
-- (forced, or out of attempts). A release (the consumer stopped before the handler
-- finished) is not the event's fault: it goes back to retry even after its last attempt.
CREATE FUNCTION "{{schema}}"."{{table}}_settle_failed"(
    p_ids BIGINT[], p_delays FLOAT8[], p_errors TEXT[], p_force_dead BOOLEAN[],
    p_released BOOLEAN[], p_worker TEXT, p_attempts INT)
RETURNS INT
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $fn$
DECLARE
    settled INT;
BEGIN
    UPDATE "{{schema}}"."{{table}}" AS e SET
        status = CASE WHEN (u.force_dead OR (e.attempts >= e.max_attempts AND NOT u.released))
                 THEN 'dead' ELSE 'retry' END::"{{schema}}"."{{table}}_status",
        available_at = CASE WHEN (u.force_dead OR (e.attempts >= e.max_attempts AND NOT u.released))
                       THEN e.available_at ELSE now() + make_interval(secs => u.delay) END,
        finished_at = CASE WHEN (u.force_dead OR (e.attempts >= e.max_attempts AND NOT u.released))
                      THEN now() END,
        last_error = u.error, lease_expires_at = NULL, updated_at = now()
    FROM unnest(p_ids, p_delays, p_errors, p_force_dead, p_released)
             AS u(id, delay, error, force_dead, released)
    WHERE e.id = u.id AND e.id = ANY (p_ids) AND e.status = 'processing'
      AND e.locked_by = p_worker AND e.attempts = p_attempts;
    GET DIAGNOSTICS settled = ROW_COUNT;
    RETURN settled;
END
$fn$;
