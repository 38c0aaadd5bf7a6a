"""The idle advertisement: a consumer's row in ``<table>_idle``.

Producers' wake-up trigger sends NOTIFY only while some consumer is advertised there, so
busy consumers cost producers nothing. A consumer that is not advertised is therefore
never notified: when its advertisement could not be written, it must look again itself
rather than wait for a notification (`Dispatcher`).
"""

from __future__ import annotations

import asyncpg

from .._sql.db import bounded
from .options import ConsumerOptions


async def declare(
    pool: asyncpg.Pool, o: ConsumerOptions, topics: list[str] | None, *, busy: bool
) -> None:
    """Write (or delete) this consumer's row in the idle table; ``None`` topics = all."""
    q = o.queries
    if busy:
        await bounded(pool, "execute", q.declare_busy, o.worker_id, timeout=o.statement_timeout)
        return
    await bounded(
        pool,
        "execute",
        q.declare_idle,
        o.worker_id,
        topics if topics is not None else ["*"],
        o.poll_interval * 2 + 5.0,
        timeout=o.statement_timeout,
    )
