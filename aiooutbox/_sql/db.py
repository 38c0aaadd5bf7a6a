"""What counts as passing database trouble, what never heals by retrying, and how to
tell a closed pool from either."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from .._values.text import describe_exception, exception_summary
from ..errors import OutboxError

__all__ = [
    "TRANSIENT_ERRORS",
    "HeldConnection",
    "PermanentDatabaseError",
    "bounded",
    "check_permanent",
    "is_data_error",
    "permanent_message",
    "permanent_reason",
    "pool_is_closed",
    "pooled",
]

logger = logging.getLogger("aiooutbox.db")

# Everything a database call may raise that we handle at all: connection resets,
# restarts, failovers, statement and acquire timeouts, server errors. asyncpg raises
# InternalClientError ("cannot switch to state 12; another operation (2) is in
# progress") when a query starts on a connection whose backend was just terminated.
# `permanent_reason` then picks out the ones that retrying cannot fix.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    asyncio.TimeoutError,
    TimeoutError,
)

# SQLSTATEs (exact, or a two-character class) that a retry never fixes, with the fix.
_PERMANENT: dict[str, str] = {
    "42501": "grant the consumer's role the privileges listed in docs/guarantees.md",
    "42P01": "the outbox table is missing: run `python -m aiooutbox migrate`",
    "42883": "an outbox function is missing: run `python -m aiooutbox migrate`",
    "42703": "an outbox column is missing: run `python -m aiooutbox migrate`",
    "3F000": "the outbox schema is missing: run `python -m aiooutbox migrate`",
    "42": "the outbox schema does not match this aiooutbox: run `python -m aiooutbox migrate`",
    "25006": "the server is read-only (a standby): point the DSN at the primary "
    "(several hosts with target_session_attrs=read-write follow a failover)",
    "28": "the database refused the credentials: check the DSN's user and password",
    "0A": "the server lacks a feature aiooutbox needs",
    # asyncpg's named prepared statement met another server connection: a pooler in
    # transaction (or statement) mode, where a retry only picks another connection
    "26000": "the DSN goes through PgBouncer (or another pooler) in transaction mode, "
    "which does not keep prepared statements: pass --pgbouncer (run and relay also need "
    "--listen-dsn or --no-listen), or create the asyncpg pool with statement_cache_size=0",
}


class PermanentDatabaseError(OutboxError):
    """The database refused an operation in a way that retrying will not fix."""


def permanent_reason(exc: BaseException) -> str | None:
    """What to fix, when ``exc`` is a server error that retrying will not fix."""
    state = getattr(exc, "sqlstate", None)
    if not isinstance(exc, asyncpg.PostgresError) or not isinstance(state, str):
        return None
    return _PERMANENT.get(state) or _PERMANENT.get(state[:2])


def is_data_error(exc: BaseException) -> bool:
    """A value was refused (SQLSTATE class 22: bad encoding, out of range, ...)."""
    state = getattr(exc, "sqlstate", None)
    return isinstance(exc, asyncpg.PostgresError) and isinstance(state, str) and state[:2] == "22"


def pool_is_closed(pool: asyncpg.Pool) -> bool:
    """True once the application closed (or began closing) the pool we were given."""
    is_closing = getattr(pool, "is_closing", None)
    return bool(is_closing()) if callable(is_closing) else False


def check_permanent(exc: BaseException, doing: str) -> None:
    """Raise `PermanentDatabaseError` from ``exc`` if retrying cannot fix it."""
    reason = permanent_reason(exc)
    if reason is not None:
        raise PermanentDatabaseError(permanent_message(exc, doing, reason)) from exc


def permanent_message(exc: BaseException, doing: str, reason: str) -> str:
    """One line: what failed, the server's message (without asyncpg's multi-line
    DETAIL and HINT, which may run to 15 lines), its SQLSTATE and the fix."""
    summary = exception_summary(exc)
    state = getattr(exc, "sqlstate", None)
    return f"{doing} failed: {summary} (SQLSTATE {state}); {reason}"


@asynccontextmanager
async def pooled(pool: asyncpg.Pool, timeout: float) -> AsyncIterator[asyncpg.Connection]:
    """``pool.acquire(timeout=)`` whose release survives being cancelled.

    asyncpg releases in ``asyncio.shield(...)``; when the caller is cancelled during
    it (a ``fail_after`` deadline, a stop) while the reset is stalled, the shielded
    release goes on alone, and on Python 3.11 nobody retrieves its ``TimeoutError``:
    the loop reports "Task exception was never retrieved". Here the release is our own
    task, whose outcome we always read (the connection is terminated either way).
    """
    conn = await pool.acquire(timeout=timeout)
    try:
        yield conn
    finally:
        await _release(pool, conn)


async def _release(pool: asyncpg.Pool, conn: asyncpg.Connection) -> None:
    release = asyncio.ensure_future(pool.release(conn))
    release.add_done_callback(_note_failed_release)
    await asyncio.shield(release)


def _note_failed_release(release: asyncio.Future[None]) -> None:
    if not release.cancelled() and (exc := release.exception()) is not None:
        logger.debug(
            "a pooled connection's reset failed (%s); asyncpg closed it", describe_exception(exc)
        )


async def bounded(pool: asyncpg.Pool, method: str, query: str, *args: Any, timeout: float) -> Any:
    """``conn.<method>(query, *args)`` on a pooled connection, every step bounded.

    Not ``pool.fetch()`` and friends: they acquire without a timeout, so on a blackholed
    network a new connection waits for asyncpg's 60 s connect timeout and a released one
    may wait forever for its query cancellation (and a stop() would hang in the shielded
    cleanup). ``acquire(timeout=)`` also bounds the release.
    """
    async with pooled(pool, timeout) as conn:
        return await getattr(conn, method)(query, *args, timeout=timeout)


class HeldConnection:
    """One pooled connection kept from one statement to the next while they come often.

    Every release to an asyncpg pool resets the connection: one more round trip, and
    four statements on the server (advisory unlock, CLOSE ALL, UNLISTEN, RESET ALL).
    The claim loop and the settler send a statement every few milliseconds in a drain,
    so they keep theirs between statements and give it back (`release`)
    when they wait for work. Only a connection whose statement finished is kept: after
    any error or a cancellation it goes back to the pool, which closes a broken one.
    Pools smaller than ``min_pool`` are never held from (a handler or another part of
    the consumer might wait for the connection held here).
    """

    def __init__(self, pool: asyncpg.Pool, timeout: float, *, min_pool: int = 4) -> None:
        self._pool = pool
        self._timeout = timeout
        self._conn: asyncpg.Connection | None = None
        max_size = getattr(pool, "get_max_size", None)
        self._holds = not callable(max_size) or max_size() >= min_pool

    @property
    def held(self) -> bool:
        return self._conn is not None

    @asynccontextmanager
    async def use(self) -> AsyncIterator[asyncpg.Connection]:
        """The held connection (acquired first if none is), kept afterwards only if the
        body finished and nothing is left open on it."""
        conn, self._conn = self._conn, None
        if conn is not None and self._unusable(conn):
            await self._give_back(conn)  # a closing pool gets its connection back
            conn = None
        if conn is None:
            conn = await self._pool.acquire(timeout=self._timeout)
        kept = False
        try:
            yield conn
            kept = self._holds and not conn.is_in_transaction() and not conn.is_closed()
        finally:
            if kept:
                self._conn = conn
            else:
                await self._give_back(conn)

    def _unusable(self, conn: asyncpg.Connection) -> bool:
        try:
            return conn.is_closed() or pool_is_closed(self._pool)
        except asyncpg.InterfaceError:
            # its backend went away while held: asyncpg gave the pool's slot back and
            # detached this proxy, which refuses every call (a release is a no-op)
            return True

    async def release(self) -> None:
        """Give the held connection back to the pool (shielded: it is never lost)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await self._give_back(conn)

    async def _give_back(self, conn: asyncpg.Connection) -> None:
        # a failed reset: asyncpg closed the connection (and `_note_failed_release` said so)
        with contextlib.suppress(*TRANSIENT_ERRORS):
            await _release(self._pool, conn)
