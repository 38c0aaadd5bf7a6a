"""What counts as passing database trouble, and how to tell a closed pool from it."""

from __future__ import annotations

import asyncio

import asyncpg

__all__ = ["TRANSIENT_ERRORS", "pool_is_closed"]

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
