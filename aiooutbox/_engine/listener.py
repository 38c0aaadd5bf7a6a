"""A dedicated LISTEN connection that survives disconnects.

Pooled connections get ``UNLISTEN *`` when released, so the listener opens its own
connection with the pool's connect arguments (or ``dsn``). It connects once up front so
a bad DSN fails `run()` at once, then reconnects with capped, jittered backoff. A
keep-alive query detects a silently dead link. Every (re)connect wakes the consumer,
because notifications sent while disconnected are lost.

While the listener is down, notifications are lost, so a consumer never waits on it
then: losing the connection wakes the consumer (``on_lost``), a reconnect wakes it
again and cuts a claim's backoff short (``on_connected``: the server is back), and a
consumer whose claims work again while the listener still sits in its backoff asks it to
try at once (`reconnect_now`) and waits for that try before going idle.

A link can also stay up while notifications no longer arrive (a middlebox, a stalled
socket, a server-side cancel), so the listener proves it hears: every probe interval
it sends, through the pool as a producer would, one notification on its own channel
and expects it back within a bound. When it does not come, it wakes the consumer at
once (a claim catches up), logs why, and reconnects. A probe's payload is longer than
any topic can be (the table's CHECK caps topics at 255 characters), so no consumer,
this one or another, ever mistakes a probe for a wake-up.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Callable, Collection
from typing import Any

import anyio
import asyncpg
from anyio.abc import TaskStatus

from .._sql.db import TRANSIENT_ERRORS, bounded, check_permanent
from .._sql.flow import FLOW_NOTICE
from .._values.text import exception_summary

__all__ = ["PROBE_PREFIX", "Listener", "is_probe"]

logger = logging.getLogger("aiooutbox.listener")

# A probe payload: this prefix, the worker id and a sequence number, padded past the
# longest possible topic (MAX_TOPIC_LENGTH, enforced by the table's CHECK constraint).
PROBE_PREFIX = "\x01aiooutbox-probe:"
_PROBE_MIN_LENGTH = 256


def is_probe(payload: str) -> bool:
    """True for a listener probe, which no topic can ever be."""
    return len(payload) >= _PROBE_MIN_LENGTH and payload.startswith(PROBE_PREFIX)


def _probe_payload(worker_id: str, number: int) -> str:
    text = f"{PROBE_PREFIX}{worker_id}:{number}:"
    return text.ljust(_PROBE_MIN_LENGTH, ".")


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
        worker_id: str = "",
        probe_interval: float | None = None,
        on_flow: Callable[[], None] | None = None,
        on_lost: Callable[[], None] = lambda: None,
        on_connected: Callable[[], None] = lambda: None,
    ) -> None:
        self._pool = pool
        self._channel = channel
        self._topics = None if topics is None else frozenset(topics)  # None: every topic
        self._on_wake = on_wake
        self._on_flow = on_flow  # the flow controls changed (`FLOW_NOTICE`)
        self._dsn = dsn
        self._keepalive = keepalive
        self._timeout = timeout
        self._worker_id = worker_id
        # None: keep-alive queries only; else one probe per interval (see the docstring)
        self._probe_interval = probe_interval
        self._probe_numbers = itertools.count(1)
        self._probe_waiting: str | None = None
        self._probe_heard = asyncio.Event()
        self._on_lost = on_lost
        self._on_connected = on_connected
        self._try_now = asyncio.Event()  # cuts the wait before the next reconnect short
        self._tried = asyncio.Event()  # set when a connection attempt ends, either way
        self.down_since: float | None = None  # monotonic; None while connected
        self.connected = False
        self.reconnects = 0
        self.probes_sent = 0
        self.probes_missed = 0
        self.last_probe_rtt: float | None = None

    async def _connect(self) -> asyncpg.Connection:
        if self._dsn is not None:
            return await asyncpg.connect(self._dsn, timeout=self._timeout)
        args: Any = getattr(self._pool, "_connect_args", ())
        kwargs: dict[str, Any] = dict(getattr(self._pool, "_connect_kwargs", {}))
        kwargs.setdefault("timeout", self._timeout)
        return await asyncpg.connect(*args, **kwargs)

    def _notified(self, _conn: object, _pid: int, _channel: str, topic: str) -> None:
        if topic == FLOW_NOTICE:
            if self._on_flow is not None:
                self._on_flow()
            return
        if is_probe(topic):
            if topic == self._probe_waiting:
                self._probe_heard.set()
            return  # another consumer's probe, or one of ours that came back too late
        if self._topics is None or topic in self._topics:
            self._on_wake()

    def reconnect_now(self) -> asyncio.Event:
        """Try to reconnect at once rather than at the end of the backoff (the pool
        reaches the server again, so it is probably back). Returns an event set once
        that try has ended, either way (at once if the listener is up)."""
        tried = self._tried = asyncio.Event()
        if self.connected:
            tried.set()
        else:
            self._try_now.set()
        return tried

    @property
    def probe_timeout(self) -> float:
        """How long a probe may take to come back before the link counts as deaf."""
        interval = self._probe_interval or self._keepalive
        return max(0.5, min(interval, self._timeout))

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
            except BaseException as exc:
                # also when cancelled between the connect and the LISTEN (a stop at
                # start-up): the connection is ours to close, nobody else has it
                if conn is not None:
                    conn.terminate()
                if not isinstance(exc, TRANSIENT_ERRORS):
                    raise
                if not started:
                    check_permanent(exc, "the listener's LISTEN")  # e.g. a read-only standby
                    raise
                self._tried.set()
                logger.warning(
                    "listener reconnect failed (%s); next try in %.1fs",
                    exception_summary(exc),
                    delay,
                )
                self._try_now.clear()
                with anyio.move_on_after(delay * (0.5 + random.random())):
                    await self._try_now.wait()
                delay = min(delay * 2, 10.0)
                continue
            try:
                self.connected = True
                self._tried.set()
                if started:
                    self.reconnects += 1
                    down = time.monotonic() - (self.down_since or time.monotonic())
                    logger.info(
                        "listener reconnected after %.1fs down; claiming at once to catch up",
                        down,
                        extra={"down_seconds": round(down, 3)},
                    )
                else:
                    started = True
                    task_status.started()
                self.down_since = None
                delay = 0.1
                if self._on_flow is not None:  # a change may have been announced meanwhile
                    self._on_flow()
                self._on_wake()
                self._on_connected()
                if await self._watch(conn, lost):
                    logger.warning("listener connection lost; reconnecting")
            finally:
                self.connected = False
                self.down_since = time.monotonic()
                # notifications are lost until it is back: the consumer must not wait on it
                self._on_lost()
                with anyio.CancelScope(shield=True):
                    await _close_quietly(conn)

    async def _watch(self, conn: asyncpg.Connection, lost: asyncio.Event) -> bool:
        """Return when the connection is gone or stops answering (True), or stops
        hearing (False: the probe has said why)."""
        interval = self._probe_interval or self._keepalive
        while not lost.is_set():
            with anyio.move_on_after(interval * (0.9 + 0.2 * random.random())):
                await lost.wait()
            if lost.is_set() or conn.is_closed():
                return True
            heard = await self._probe() if self._probe_interval is not None else None
            if heard is False:
                return False
            if heard is None and not await self._keepalive_ok(conn):
                return True
        return True

    async def _keepalive_ok(self, conn: asyncpg.Connection) -> bool:
        try:
            await conn.execute("SELECT 1", timeout=self._timeout)
        except TRANSIENT_ERRORS as exc:
            logger.warning("listener keep-alive failed (%s)", exception_summary(exc))
            return False
        return True

    async def _probe(self) -> bool | None:
        """Send one probe through the pool: True if it came back in time, False if not,
        None if it could not be sent (the database, not the listener, is in trouble)."""
        payload = _probe_payload(self._worker_id, next(self._probe_numbers))
        self._probe_waiting = payload
        self._probe_heard.clear()
        timeout = self.probe_timeout
        sent = time.monotonic()
        try:
            await bounded(
                self._pool, "execute", "SELECT pg_notify($1, $2)", self._channel, payload,
                timeout=self._timeout,
            )  # fmt: skip
        except TRANSIENT_ERRORS as exc:
            logger.debug("listener probe not sent (%s)", exception_summary(exc))
            self._probe_waiting = None
            return None
        self.probes_sent += 1
        with anyio.move_on_after(timeout):
            await self._probe_heard.wait()
        self._probe_waiting = None
        if self._probe_heard.is_set():
            self.last_probe_rtt = time.monotonic() - sent
            return True
        self.probes_missed += 1
        logger.warning(
            "listener heard nothing for %.1fs after its probe notification although the"
            " database took it: notifications are not arriving (a stalled link or a"
            " middlebox); claiming at once and reconnecting",
            timeout,
        )
        self._on_wake()
        return False


async def _close_quietly(conn: asyncpg.Connection) -> None:
    if conn.is_closed():
        return
    try:
        with anyio.fail_after(2):
            await conn.close()
    except Exception:
        conn.terminate()
