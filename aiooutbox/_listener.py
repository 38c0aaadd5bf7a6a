"""A dedicated LISTEN connection that survives disconnects.

Pooled connections get ``UNLISTEN *`` when released, so the listener opens its own
connection with the pool's connect arguments (or ``dsn``). It connects once up front so
a bad DSN fails `run()` at once, then reconnects with capped, jittered backoff. A
keep-alive query detects a silently dead link. Every (re)connect wakes the consumer,
because notifications sent while disconnected are lost.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Collection
from typing import Any

import anyio
import asyncpg
from anyio.abc import TaskStatus

from ._db import TRANSIENT_ERRORS

__all__ = ["Listener"]

logger = logging.getLogger("aiooutbox.listener")


class Listener:
    def __init__(
        self,
        pool: asyncpg.Pool,
        channel: str,
        topics: Collection[str] | None,
        on_wake: Callable[[], None],
        *,
        dsn: str | None,
        keepalive: float,
        timeout: float,
    ) -> None:
        self._pool = pool
        self._channel = channel
        self._topics = None if topics is None else frozenset(topics)  # None: every topic
        self._on_wake = on_wake
        self._dsn = dsn
        self._keepalive = keepalive
        self._timeout = timeout
        self.connected = False
        self.reconnects = 0

    async def _connect(self) -> asyncpg.Connection:
        if self._dsn is not None:
            return await asyncpg.connect(self._dsn, timeout=self._timeout)
        args: Any = getattr(self._pool, "_connect_args", ())
        kwargs: dict[str, Any] = dict(getattr(self._pool, "_connect_kwargs", {}))
        kwargs.setdefault("timeout", self._timeout)
        return await asyncpg.connect(*args, **kwargs)

    def _notified(self, _conn: object, _pid: int, _channel: str, topic: str) -> None:
        if self._topics is None or topic in self._topics:
            self._on_wake()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; the first connection failure is raised to the caller."""
        started = False
        delay = 0.1
        while True:
            conn: asyncpg.Connection | None = None
            lost = asyncio.Event()
            try:
                conn = await self._connect()
                conn.add_termination_listener(lambda _c, lost=lost: lost.set())
                await conn.add_listener(self._channel, self._notified)
            except TRANSIENT_ERRORS as exc:
                if conn is not None:
                    conn.terminate()
                if not started:
                    raise
                logger.warning(
                    "listener reconnect failed (%s: %s); next try in %.1fs",
                    type(exc).__name__,
                    exc,
                    delay,
                )
                await anyio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 10.0)
                continue
            try:
                self.connected = True
                if started:
                    self.reconnects += 1
                    logger.info("listener reconnected; claiming at once to catch up")
                else:
                    started = True
                    task_status.started()
                delay = 0.1
                self._on_wake()
                await self._watch(conn, lost)
                logger.warning("listener connection lost; reconnecting")
            finally:
                self.connected = False
                with anyio.CancelScope(shield=True):
                    await _close_quietly(conn)

    async def _watch(self, conn: asyncpg.Connection, lost: asyncio.Event) -> None:
        """Return when the connection is gone or stops answering keep-alives."""
        while not lost.is_set():
            with anyio.move_on_after(self._keepalive):
                await lost.wait()
            if lost.is_set() or conn.is_closed():
                return
            try:
                await conn.execute("SELECT 1", timeout=self._timeout)
            except TRANSIENT_ERRORS as exc:
                logger.warning("listener keep-alive failed (%s: %s)", type(exc).__name__, exc)
                return


async def _close_quietly(conn: asyncpg.Connection) -> None:
    if conn.is_closed():
        return
    try:
        with anyio.fail_after(2):
            await conn.close()
    except Exception:
        conn.terminate()
