-- aiooutbox 0011: the dashboard's audit log, and an index over dead events.
-- compatible-with: 2
--
-- Placeholders: schema, table and channel, in double braces (see 0001).
--
-- Older code keeps working: nothing it reads or writes changes. CREATE INDEX here
-- blocks writes to the outbox while it reads the table once (seconds per million rows).

-- Every change an operator makes through the dashboard: who, when, what, how many rows.
CREATE TABLE "{{schema}}"."{{table}}_audit" (
    id       BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    actor    TEXT        NOT NULL,
    action   TEXT        NOT NULL,
    -- what was selected: event ids, or the filter that chose them
    target   JSONB       NOT NULL DEFAULT '{}'::jsonb,
    affected BIGINT      NOT NULL,
    CONSTRAINT "{{table}}_audit_actor_length" CHECK (length(actor) BETWEEN 1 AND 200),
    CONSTRAINT "{{table}}_audit_action_length" CHECK (length(action) BETWEEN 1 AND 64)
);

-- Dead events by topic: the dead list, its counts and its filters read only these rows
-- (a few, rarely changing) instead of the whole table. Rows enter it only when they
-- die: the hot path's inserts and settlements of live events never touch it.
CREATE INDEX "{{table}}_dead_idx" ON "{{schema}}"."{{table}}" (topic, id)
    WHERE status = 'dead';
