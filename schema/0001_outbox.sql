-- aiooutbox 0001: the outbox table, its indexes and the idle-gated wake-up trigger.
--
-- Placeholders: {{schema}}, {{table}} (validated to [a-z_][a-z0-9_]*, so they are safe
-- inside double quotes) and {{channel}} (the LISTEN/NOTIFY channel of this outbox).

CREATE TYPE "{{schema}}"."{{table}}_status" AS ENUM ('pending', 'retry', 'processing', 'done', 'dead');

CREATE TABLE "{{schema}}"."{{table}}" (
    id               BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    dedupe_key       TEXT,
    topic            TEXT        NOT NULL,
    payload          JSONB       NOT NULL,
    headers          JSONB       NOT NULL DEFAULT '{}'::jsonb,
    status           "{{schema}}"."{{table}}_status" NOT NULL DEFAULT 'pending',
    attempts         INT         NOT NULL DEFAULT 0,
    max_attempts     INT         NOT NULL DEFAULT 5,
    available_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    locked_by        TEXT,
    locked_at        TIMESTAMPTZ,
    lease_expires_at TIMESTAMPTZ,
    last_error       TEXT,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at      TIMESTAMPTZ,
    CONSTRAINT "{{table}}_topic_length" CHECK (length(topic) BETWEEN 1 AND 255),
    CONSTRAINT "{{table}}_attempts_range" CHECK (attempts >= 0 AND max_attempts >= 1)
) WITH (
    -- a queue table churns: vacuum it after 1% rather than 20% of its rows changed
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_analyze_scale_factor = 0.02
);

COMMENT ON TABLE "{{schema}}"."{{table}}" IS 'aiooutbox transactional outbox (see https://pypi.org/project/aiooutbox/)';

-- producers stay idempotent: a repeated key is a no-op; NULL keys never collide
CREATE UNIQUE INDEX "{{table}}_dedupe_key_idx" ON "{{schema}}"."{{table}}" (dedupe_key);

-- the claim reads only unfinished work, oldest first
CREATE INDEX "{{table}}_claimable_idx" ON "{{schema}}"."{{table}}" (available_at, id)
    WHERE status IN ('pending', 'retry');

-- Lease recovery finds expired leases without scanning history. Only rows being
-- processed have a lease. The predicate deliberately avoids `status`: a settle statement
-- (`... AND status = 'processing'`) must never be planned through this index, whose dead
-- entries grow with every settled row until vacuum; it goes through the primary key.
CREATE INDEX "{{table}}_lease_idx" ON "{{schema}}"."{{table}}" (lease_expires_at)
    WHERE lease_expires_at IS NOT NULL;

-- retention purges old finished rows in bounded batches
CREATE INDEX "{{table}}_finished_idx" ON "{{schema}}"."{{table}}" (finished_at)
    WHERE status = 'done';

-- Consumers that found no work advertise here before they wait on LISTEN. The wake-up
-- trigger only notifies when one of them waits for a topic it inserted, so producers
-- under steady load (nobody idle) never pay NOTIFY's commit-time lock.
CREATE UNLOGGED TABLE "{{schema}}"."{{table}}_idle" (
    worker_id  TEXT        PRIMARY KEY,
    topics     TEXT[]      NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
);

-- SECURITY DEFINER, so producers need no grant on the idle table. There is deliberately
-- no `SET search_path` clause: it costs a GUC save/restore on every insert statement
-- (more than half of the trigger's overhead with 32 one-event producers). Instead every
-- relation, function, type and operator below is schema-qualified, so a caller's
-- search_path cannot redirect anything this body runs.
CREATE FUNCTION "{{schema}}"."{{table}}_wakeup"() RETURNS trigger
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
                        AND d.topic OPERATOR(pg_catalog.=) ANY (i.topics))
    LOOP
        PERFORM pg_catalog.pg_notify('{{channel}}', woken);
    END LOOP;
    RETURN NULL;
END
$fn$;

CREATE TRIGGER "{{table}}_wakeup"
    AFTER INSERT ON "{{schema}}"."{{table}}"
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION "{{schema}}"."{{table}}_wakeup"();
