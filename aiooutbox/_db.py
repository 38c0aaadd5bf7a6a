"""What counts as passing database trouble, and how to tell a closed pool from it."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

__all__ = ["TRANSIENT_ERRORS", "bounded", "pool_is_closed"]

# Connection resets, restarts, failovers, statement and acquire timeouts: log, back off,
# try again. (On Python 3.10 asyncio.TimeoutError is not the built-in TimeoutError.)
# asyncpg raises InternalClientError ("cannot switch to state 12; another operation (2)
# is in progress") when a query starts on a connection whose backend was just terminated
# (pg_terminate_backend, a server shutdown): the pool discards that connection.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    asyncio.TimeoutError,
    TimeoutError,
)


def pool_is_closed(pool: asyncpg.Pool) -> bool:
    """True once the application closed (or began closing) the pool we were given."""
    is_closing = getattr(pool, "is_closing", None)
    return bool(is_closing()) if callable(is_closing) else False


async def bounded(pool: asyncpg.Pool, method: str, query: str, *args: Any, timeout: float) -> Any:
    """``conn.<method>(query, *args)`` on a pooled connection, every step bounded.

    Not ``pool.fetch()`` and friends: they acquire without a timeout, so on a blackholed
    network a new connection waits for asyncpg's 60 s connect timeout and a released one
    may wait forever for its query cancellation (and a stop() would hang in the shielded
    cleanup). ``acquire(timeout=)`` also bounds the release.
    """
    async with pool.acquire(timeout=timeout) as conn:
        return await getattr(conn, method)(query, *args, timeout=timeout)
