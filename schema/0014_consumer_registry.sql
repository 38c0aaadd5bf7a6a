-- aiooutbox 0014: the consumer registry, what the dashboard's consumers page reads.
-- compatible-with: 2
--
-- One row per running consumer: who it is (worker id, host, pid), how it was started
-- (concurrency, prefetch, topics, lease timeout, library version), when it started and
-- when its heartbeat last touched the row. A consumer writes its row when it starts,
-- its heartbeat (every third of lease_timeout) moves `seen_at` and `expires_at` on, and
-- a clean stop deletes it; a consumer that stops beating (killed, partitioned) leaves
-- a row that expires, is shown as gone, and is purged an hour later by any consumer.
--
-- UNLOGGED, like the idle table: it is rewritten every few seconds and worthless after
-- a crash of the server (which truncates it; every live consumer writes its row again
-- at its next beat). Nothing of the hot path reads it: the claim, the settlement and
-- the wake-up trigger never touch it, so code of every earlier schema keeps working
-- beside it.
CREATE UNLOGGED TABLE IF NOT EXISTS "{{schema}}"."{{table}}_consumers" (
    worker_id     text        PRIMARY KEY,
    host          text        NOT NULL,
    pid           integer     NOT NULL,
    concurrency   integer     NOT NULL,
    prefetch      integer     NOT NULL,
    topics        text[],     -- NULL: every topic it has a handler for
    lease_timeout float8      NOT NULL,
    version       text        NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    seen_at       timestamptz NOT NULL DEFAULT now(),
    expires_at    timestamptz NOT NULL
);
