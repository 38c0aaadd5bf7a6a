"""How a migration's transaction waits for the outbox's locks: at most `LOCK_TIMEOUT`
once it holds its advisory lock, then rolled back and tried again. `aiooutbox.migrations`
runs the migrations; docs/internals.md, "Migrations", says why.

Queued behind a long transaction that reads the outbox (a pg_dump, a forgotten BEGIN),
an ``ALTER TABLE``'s ACCESS EXCLUSIVE request would hold up every producer and consumer
behind it until that transaction ends; a transaction rolled back between tries lets the
writers queued meanwhile go on.
"""

from __future__ import annotations

import asyncio
import logging

import asyncpg

logger = logging.getLogger("aiooutbox.migrations")

LOCK_TIMEOUT = "2s"
SET_LOCK_TIMEOUT = f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"
RETRY_AFTER = 1.0  # seconds between tries
# What rolls a migration's transaction back to be tried again: a lock not had within
# the timeout, or this transaction chosen to end a deadlock with a session that took the
# same tables in the other order (a consumer of the previous release holding its flow
# control row while it waits for the outbox the migration has already locked).
TRIED_AGAIN = (asyncpg.LockNotAvailableError, asyncpg.DeadlockDetectedError)
_OLDEST = (
    "SELECT pid, extract(epoch FROM now() - xact_start)::int, left(query, 80)"
    " FROM pg_stat_activity WHERE datname = current_database() AND xact_start IS NOT NULL"
    " AND pid <> pg_backend_pid() ORDER BY xact_start LIMIT 1"
)


async def wait_to_try_again(
    conn: asyncpg.Connection, version: int, name: str, outbox: str, error: BaseException
) -> None:
    """Log why migration ``version`` was rolled back, naming the oldest open transaction
    (the likeliest holder), and wait `RETRY_AFTER` before it is tried again."""
    oldest = await conn.fetchrow(_OLDEST)
    why = (
        "was chosen to end a deadlock"
        if isinstance(error, asyncpg.DeadlockDetectedError)
        else f"waited {LOCK_TIMEOUT} for a lock"
    )
    logger.warning(
        "migration %04d_%s %s on %s; trying again in %.0f s (the oldest open"
        " transaction: backend %s, open %s s: %s)",
        version,
        name,
        why,
        outbox,
        RETRY_AFTER,
        *(oldest if oldest else ("?", "?", "?")),
        extra={"version": version, "outbox": outbox},
    )
    await asyncio.sleep(RETRY_AFTER)
