-- aiooutbox 0003: stable message ids, claims of every topic, claims capped by bytes.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- Additive only: consumers of schema 2 keep running on it (they call the 0002 claim,
-- which is left as it was), so this migration declares itself compatible with 2 and a
-- rolling upgrade may run `migrate` while old consumers still run or restart.

-- A message id that leaves the database: brokers and downstream consumers dedupe on it,
-- so it must be unique across databases, tables and re-creations, and the same for
-- every retry of one event. A random UUID filled at insert (a row id is not unique
-- beyond its table). ADD COLUMN without a default, then SET DEFAULT: no table rewrite,
-- no long lock on a big outbox; rows inserted before this migration have NULL and get
-- a deterministic id derived from the database, the table and the row id instead.
ALTER TABLE "{{schema}}"."{{table}}" ADD COLUMN message_id UUID;
ALTER TABLE "{{schema}}"."{{table}}" ALTER COLUMN message_id SET DEFAULT gen_random_uuid();

-- The claim of schema 3: as 0002's (same pinned index plans, same watermark), plus
--   p_topics NULL   claims every topic (relays);
--   p_max_bytes     stops adding rows once the rows before the next one already hold
--                   this many bytes of stored payload (pg_column_size: after TOAST
--                   compression, read without detoasting); the first row is always
--                   taken, so a claim always makes progress;
--   message_id      returned with every row.
-- Four statements rather than one with `p_topics IS NULL OR …`: in a cached plan only
-- plain conditions become index conditions.
CREATE FUNCTION "{{schema}}"."{{table}}_claim_v3"(
    p_worker TEXT, p_lease FLOAT8, p_topics TEXT[], p_limit INT, p_max_bytes BIGINT,
    p_after_at TIMESTAMPTZ DEFAULT NULL, p_after_id BIGINT DEFAULT NULL)
RETURNS TABLE (id BIGINT, topic TEXT, payload TEXT, dedupe_key TEXT, headers TEXT,
               attempts INT, max_attempts INT, created_at TIMESTAMPTZ,
               available_at TIMESTAMPTZ, message_id TEXT)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $fn$
#variable_conflict use_column
DECLARE
    ids BIGINT[];
BEGIN
    IF p_topics IS NULL AND p_after_at IS NULL THEN
        SELECT array_agg(w.id) INTO ids FROM (
            SELECT s.id, sum(s.size) OVER (ORDER BY s.available_at, s.id) - s.size AS before
            FROM (SELECT c.id, c.available_at, pg_column_size(c.payload) AS size
                  FROM "{{schema}}"."{{table}}" AS c
                  WHERE c.status IN ('pending', 'retry') AND c.available_at <= now()
                  ORDER BY c.available_at, c.id LIMIT p_limit FOR UPDATE SKIP LOCKED) AS s
        ) AS w WHERE w.before < p_max_bytes;
    ELSIF p_topics IS NULL THEN
        SELECT array_agg(w.id) INTO ids FROM (
            SELECT s.id, sum(s.size) OVER (ORDER BY s.available_at, s.id) - s.size AS before
            FROM (SELECT c.id, c.available_at, pg_column_size(c.payload) AS size
                  FROM "{{schema}}"."{{table}}" AS c
                  WHERE c.status IN ('pending', 'retry') AND c.available_at <= now()
                    AND (c.available_at, c.id) > (p_after_at, p_after_id)
                  ORDER BY c.available_at, c.id LIMIT p_limit FOR UPDATE SKIP LOCKED) AS s
        ) AS w WHERE w.before < p_max_bytes;
    ELSIF p_after_at IS NULL THEN
        SELECT array_agg(w.id) INTO ids FROM (
            SELECT s.id, sum(s.size) OVER (ORDER BY s.available_at, s.id) - s.size AS before
            FROM (SELECT c.id, c.available_at, pg_column_size(c.payload) AS size
                  FROM "{{schema}}"."{{table}}" AS c
                  WHERE c.status IN ('pending', 'retry') AND c.available_at <= now()
                    AND c.topic = ANY (p_topics)
                  ORDER BY c.available_at, c.id LIMIT p_limit FOR UPDATE SKIP LOCKED) AS s
        ) AS w WHERE w.before < p_max_bytes;
    ELSE
        SELECT array_agg(w.id) INTO ids FROM (
            SELECT s.id, sum(s.size) OVER (ORDER BY s.available_at, s.id) - s.size AS before
            FROM (SELECT c.id, c.available_at, pg_column_size(c.payload) AS size
                  FROM "{{schema}}"."{{table}}" AS c
                  WHERE c.status IN ('pending', 'retry') AND c.available_at <= now()
                    AND c.topic = ANY (p_topics)
                    AND (c.available_at, c.id) > (p_after_at, p_after_id)
                  ORDER BY c.available_at, c.id LIMIT p_limit FOR UPDATE SKIP LOCKED) AS s
        ) AS w WHERE w.before < p_max_bytes;
    END IF;
    IF ids IS NULL THEN
        RETURN;
    END IF;
    -- rows the byte cap left out were only locked: the locks end with the statement
    RETURN QUERY
    UPDATE "{{schema}}"."{{table}}" AS e SET status = 'processing',
        attempts = e.attempts + 1, locked_by = p_worker, locked_at = now(),
        lease_expires_at = now() + make_interval(secs => p_lease), updated_at = now()
    WHERE e.id = ANY (ids)
    RETURNING e.id, e.topic, e.payload::text, e.dedupe_key, e.headers::text,
              e.attempts, e.max_attempts,
              -- what a raw SQL producer may store beyond Python's datetime range (BC
              -- dates, year 10000+) would fail the whole claim's decoding: clamped
              least(greatest(e.created_at, '0001-01-01 00:00:00+00'),
                    '9999-12-31 23:59:59+00'),
              least(greatest(e.available_at, '0001-01-01 00:00:00+00'),
                    '9999-12-31 23:59:59+00'),
              coalesce(e.message_id, md5('aiooutbox:' || (SELECT d.oid FROM pg_catalog.pg_database d
                  WHERE d.datname = pg_catalog.current_database()) || ':' || e.tableoid
                  || ':' || e.id)::uuid)::text;
END
$fn$;

-- Idle consumers of every topic (relays) advertise the topic list '{*}'.
CREATE OR REPLACE FUNCTION "{{schema}}"."{{table}}_wakeup"() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $fn$
DECLARE
    woken TEXT;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}_idle" i
                   WHERE i.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()) THEN
        RETURN NULL;
    END IF;
    FOR woken IN
        SELECT d.topic
        -- delayed rows notify too: the woken consumer then sleeps until they are due
        FROM (SELECT DISTINCT n.topic FROM new_rows n
              WHERE n.status OPERATOR(pg_catalog.=)
                    ANY ('{pending,retry}'::"{{schema}}"."{{table}}_status"[])) AS d
        WHERE EXISTS (SELECT 1 FROM "{{schema}}"."{{table}}_idle" i
                      WHERE i.expires_at OPERATOR(pg_catalog.>) pg_catalog.now()
                        AND (d.topic OPERATOR(pg_catalog.=) ANY (i.topics)
                             OR '*' OPERATOR(pg_catalog.=) ANY (i.topics)))
    LOOP
        PERFORM pg_catalog.pg_notify('{{channel}}', woken);
    END LOOP;
    RETURN NULL;
END
$fn$;
