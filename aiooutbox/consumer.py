"""`OutboxConsumer`: claim, run, settle, recover.

One dispatch loop claims rows with a single statement sized to the free handler slots,
a fixed set of worker tasks runs the handlers, a `Settler` writes outcomes in batches,
and background loops keep leases alive, recover expired ones and purge old rows. Every
task is owned by `run()`, which returns after `stop()` once in-flight work is settled.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import socket
import sys
import time
import traceback
import uuid
from collections.abc import Awaitable, Collection, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import anyio
import asyncpg

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from ._codec import Decoder, decode_json
from ._db import TRANSIENT_ERRORS, bounded, pool_is_closed
from ._handoff import Handoff
from ._listener import Listener
from ._maintenance import Maintenance
from ._settler import Failure, Settler
from ._sql import DEFAULT_SCHEMA, DEFAULT_TABLE, queries
from .errors import Dead, InvalidArgument, OutboxError, Retry
from .events import Event
from .handlers import Handler, resolve_handlers
from .migrations import check_schema
from .retry import RetryPolicy

__all__ = ["ConsumerStats", "OutboxConsumer"]

logger = logging.getLogger("aiooutbox.consumer")

_MAX_ERROR = 4000
# After an empty claim, look again after these pauses before declaring idle, so that
# under steady load a consumer never waits on NOTIFY (and producers never pay for it).
_LINGER = (0.002, 0.004, 0.008, 0.016, 0.032)
# Full claims run at least every _FULL_CLAIM_EVERY[1] s, and more often (down to
# [0] s) while they are cheap: at most _FULL_CLAIM_SHARE of the time goes to them.
_FULL_CLAIM_EVERY = (0.02, 0.25)
_FULL_CLAIM_SHARE = 0.05
_WATERMARK_LAG = timedelta(milliseconds=10)


@dataclass
class ConsumerStats:
    """Counters since the consumer started; cheap to read at any time."""

    claimed: int = 0
    done: int = 0
    retried: int = 0
    dead: int = 0
    released: int = 0
    in_flight: int = 0
    claims: int = 0
    recovered: int = 0


def _seconds(name: str, value: object, *, minimum: float = 0.0) -> float:
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds or a timedelta, not {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise InvalidArgument(f"{name} must be a finite number >= {minimum}, got {value!r}")
    return float(value)


def _optional_seconds(name: str, value: object, *, minimum: float) -> float | None:
    return None if value is None else _seconds(name, value, minimum=minimum)


def _count(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {value!r}")
    if not low <= value <= high:
        raise InvalidArgument(f"{name} must be between {low} and {high}, got {value}")
    return value


def _sole(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """Unwrap a task group's error when it holds exactly one, for a readable traceback."""
    while isinstance(group, BaseExceptionGroup) and len(group.exceptions) == 1:
        group = group.exceptions[0]  # type: ignore[assignment,unused-ignore]
    error: BaseException = group
    return error


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__qualname__}: {exc}"
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-8))
    return (text + "\n" + trace[-(_MAX_ERROR - len(text) - 1) :])[:_MAX_ERROR]


class OutboxConsumer:
    """Runs async handlers for the events of one outbox table.

    ``async with OutboxConsumer(pool) as consumer: await consumer.run(handlers)``

    Defaults and the risk each carries:

    - ``concurrency=64``: handlers running at once, and the most rows this consumer holds.
      Higher drains faster but holds more leases if the process dies.
    - ``batch_size=None`` (= concurrency): the most rows one claim takes.
    - ``poll_interval=5.0``: fallback poll (jittered ±20%) when no notification arrives;
      it bounds the delay of a missed wake-up and of delayed events' start.
    - ``lease_timeout=30.0``: a row held longer without a heartbeat is recovered by any
      consumer. Leases are extended every third of it while handlers run, so it only
      needs to exceed the time a crashed or frozen worker may take to be noticed.
    - ``shutdown_grace=10.0``: on stop, running handlers get this long to finish; the
      rest are cancelled and released for another consumer at once. The attempt still
      counts (``attempts`` never decreases), but a release never sends a row to ``dead``.
    - ``retry=RetryPolicy()``: backoff after an exception (1 s doubling, capped at 1 h,
      full jitter); a per-topic `Handler(retry=...)` overrides it.
    - ``handler_timeout=None``: no limit; a timeout counts as a failure.
    - ``retention=7 days``: ``done`` rows older than this are purged in batches of 1000;
      ``None`` keeps them forever (the table then grows without bound).
    - ``listen=True``: wake on LISTEN/NOTIFY through a dedicated connection; set
      ``False`` behind PgBouncer in transaction mode (poll only), or pass ``listen_dsn``
      to listen directly on the server.
    - ``statement_timeout=10.0``: client-side limit on every statement we run, so a
      stalled network or lock never hangs the consumer.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        concurrency: int = 64,
        batch_size: int | None = None,
        topics: Collection[str] | None = None,
        poll_interval: float | timedelta = 5.0,
        lease_timeout: float | timedelta = 30.0,
        shutdown_grace: float | timedelta = 10.0,
        retry: RetryPolicy | None = None,
        handler_timeout: float | timedelta | None = None,
        worker_id: str | None = None,
        schema: str = DEFAULT_SCHEMA,
        table: str = DEFAULT_TABLE,
        listen: bool = True,
        listen_dsn: str | None = None,
        retention: float | timedelta | None = timedelta(days=7),
        statement_timeout: float | timedelta = 10.0,
        decoder: Decoder | None = None,
    ) -> None:
        if not isinstance(pool, asyncpg.Pool):
            raise TypeError(
                f"OutboxConsumer needs an asyncpg.Pool (asyncpg.create_pool(...)), "
                f"not {type(pool).__name__}"
            )
        self._pool = pool
        self._q = queries(schema, table)
        self._concurrency = _count("concurrency", concurrency, 1, 100_000)
        self._batch_size = (
            self._concurrency
            if batch_size is None
            else _count("batch_size", batch_size, 1, self._concurrency)
        )
        if topics is not None and (isinstance(topics, str) or not isinstance(topics, Collection)):
            raise TypeError("topics must be a collection of topic names, not a single string")
        if topics is not None:
            for topic in topics:
                if not isinstance(topic, str):
                    raise TypeError(f"topics must hold topic names (str), not {topic!r}")
            if not topics:
                raise InvalidArgument("topics is empty: pass None to consume every handled topic")
        self._topic_filter = None if topics is None else frozenset(topics)
        self._poll_interval = _seconds("poll_interval", poll_interval, minimum=0.01)
        self._lease_timeout = _seconds("lease_timeout", lease_timeout, minimum=1.0)
        self._shutdown_grace = _seconds("shutdown_grace", shutdown_grace)
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be an aiooutbox.RetryPolicy, not {retry!r}")
        self._retry = retry or RetryPolicy()
        self._handler_timeout = _optional_seconds("handler_timeout", handler_timeout, minimum=0.001)
        if worker_id is not None and not isinstance(worker_id, str):
            raise TypeError(f"worker_id must be a str, not {type(worker_id).__name__}")
        if worker_id is not None and (
            not worker_id.strip() or len(worker_id) > 200 or "\x00" in worker_id
        ):
            raise InvalidArgument("worker_id must be a non-empty string of 1-200 characters")
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        if not isinstance(listen, bool):
            raise TypeError(f"listen must be True or False, not {listen!r}")
        self._listen = listen
        if listen_dsn is not None and not isinstance(listen_dsn, str):
            raise TypeError(f"listen_dsn must be a str or None, not {type(listen_dsn).__name__}")
        if listen_dsn is not None and not listen_dsn.strip():
            raise InvalidArgument("listen_dsn is empty: pass None to listen through the pool")
        self._listen_dsn = listen_dsn
        self._retention = _optional_seconds("retention", retention, minimum=1.0)
        self._timeout = _seconds("statement_timeout", statement_timeout, minimum=0.1)
        if decoder is not None and not callable(decoder):
            raise TypeError(f"decoder must be a callable taking the JSON text, not {decoder!r}")
        self._decode = decoder or decode_json

        self.stats = ConsumerStats()
        self._state = "new"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requests = 0
        self._stopping = False
        self._hurry = False
        self._fatal: BaseException | None = None
        self._handlers: dict[str, Handler] = {}
        self._topics: list[str] = []
        self._held: dict[int, tuple[int, float]] = {}  # id -> (attempts, lease extended at)
        self._watermark: tuple[datetime, int] | None = None  # see _claim
        self._full_claim_every = _FULL_CLAIM_EVERY[1]
        self._full_claim_at = 0.0
        self._wake = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._stop_event = asyncio.Event()
        self._settled_all = asyncio.Event()
        self._started = asyncio.Event()
        self._workers_scope: anyio.CancelScope | None = None
        self._startup_scope: anyio.CancelScope | None = None
        self._settler: Settler | None = None
        self._listener: Listener | None = None

    # -- lifecycle -----------------------------------------------------------------
    async def __aenter__(self) -> OutboxConsumer:
        if self._state != "new":
            raise RuntimeError(f"cannot enter an OutboxConsumer that is {self._state}")
        await self._check_schema()
        self._state = "entered"
        return self

    async def _check_schema(self) -> None:
        # bounded: on a stalled network the pool's query has no timeout and never returns
        limit = 3 * self._timeout
        try:
            with anyio.fail_after(limit):
                await check_schema(self._pool, schema=self._q.schema, table=self._q.table)
        except TimeoutError:
            raise TimeoutError(
                f"the outbox schema check got no answer within {limit:.1f}s "
                "(3 x statement_timeout): is the database reachable?"
            ) from None

    async def __aexit__(self, *exc_info: object) -> None:
        if self._state == "running":
            self.stop()
            with anyio.CancelScope(shield=True):
                await self._settled_all.wait()
        self._state = "closed"

    @property
    def running(self) -> bool:
        return self._state == "running"

    @property
    def listening(self) -> bool:
        """True while the LISTEN connection is up."""
        return self._listener is not None and self._listener.connected

    async def wait_started(self) -> None:
        """Wait until `run()` is consuming: schema checked, LISTEN connection up.

        If `run()` fails before that, this keeps waiting and the task running `run()` is
        the one that raises: wait on both, as `aiooutbox.integrations.background` does.
        """
        await self._started.wait()

    def stop(self) -> None:
        """Ask `run()` to return: stop claiming, let handlers finish, settle, close.

        Synchronous and safe from a signal handler or another thread. A second call
        stops fast: running handlers are cancelled and their rows released at once.
        """
        self._stop_requests += 1
        loop = self._loop
        if loop is None or loop.is_closed():
            self._stopping = True
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._request_stop()
        else:
            loop.call_soon_threadsafe(self._request_stop)

    def _request_stop(self) -> None:
        if not self._stopping:
            logger.info("stop requested; no new claims", extra={"worker_id": self.worker_id})
        self._stopping = True
        if self._stop_requests > 1 and not self._hurry:
            logger.warning("second stop request: cancelling running handlers now")
            self._hurry = True
        self._stop_event.set()
        self._wake.set()
        self._slot_freed.set()
        if self._startup_scope is not None:
            self._startup_scope.cancel()
        if self._hurry and self._workers_scope is not None:
            self._workers_scope.cancel()

    async def run(self, handlers: Mapping[str, Any]) -> None:
        """Consume until `stop()`; return once in-flight events are settled.

        ``handlers`` maps topics to ``async def handler(event)`` (or `Handler`/`Router`).
        Only topics with a handler are claimed. Raises on a fatal error (the listener
        cannot connect at start, the pool was closed, a handler raised ``SystemExit``).
        Cancelling the task running ``run()`` stops gracefully; cancelling it again
        stops fast.
        """
        resolved = resolve_handlers(handlers)
        if self._topic_filter is not None:
            unknown = sorted(self._topic_filter - resolved.keys())
            if unknown:
                raise InvalidArgument(f"topics {unknown} have no handler")
            resolved = {t: h for t, h in resolved.items() if t in self._topic_filter}
        if self._state == "running":
            raise RuntimeError("this OutboxConsumer is already running")
        if self._state == "closed":
            raise RuntimeError("cannot run an OutboxConsumer again once it has stopped")
        if self._state == "new":
            await self._check_schema()
        self._handlers = resolved
        self._topics = sorted(resolved)
        self._loop = asyncio.get_running_loop()
        self._state = "running"
        if self._stopping:  # stop() before run(): nothing to do
            self._request_stop()
        engine = asyncio.ensure_future(self._engine())
        cancelled = False
        try:
            while not engine.done():
                try:
                    with anyio.CancelScope(shield=cancelled):
                        # wait() never cancels the engine: a cancelled run() stops it gracefully
                        await asyncio.wait({engine})
                except asyncio.CancelledError:
                    if engine.done() and engine.cancelled():
                        raise
                    cancelled = True
                    self.stop()
        finally:
            self._state = "closed"
            self._settled_all.set()
        if cancelled:
            raise asyncio.CancelledError
        try:
            engine.result()
        except BaseExceptionGroup as group:
            raise _sole(group) from None
        if self._fatal is not None:
            raise self._fatal

    # -- the engine ------------------------------------------------------------------
    async def _engine(self) -> None:
        settler = self._settler = Settler(
            self._pool,
            self._q,
            self.worker_id,
            flush_interval=0.005,
            flush_size=max(64, self._concurrency),
            statement_timeout=self._timeout,
        )
        logger.info(
            "consumer %s starting: topics=%s concurrency=%d",
            self.worker_id,
            self._topics,
            self._concurrency,
            extra={"worker_id": self.worker_id, "topics": self._topics},
        )
        async with anyio.create_task_group() as services:
            if self._listen:
                self._listener = Listener(
                    self._pool,
                    self._q.channel,
                    self._topics,
                    self._wake.set,
                    dsn=self._listen_dsn,
                    keepalive=max(self._poll_interval, 5.0),
                    timeout=self._timeout,
                )
                # a stop() during the first connect must not wait for its timeout
                with anyio.CancelScope() as self._startup_scope:
                    if self._stopping:
                        self._startup_scope.cancel()
                    await services.start(self._listener.run)
                self._startup_scope = None
            self._started.set()
            services.start_soon(settler.run)
            maintenance = Maintenance(
                self._pool,
                self._q,
                self.worker_id,
                held=self._held,
                on_recovered=self._recovered,
                lease_timeout=self._lease_timeout,
                retention=self._retention,
                statement_timeout=self._timeout,
            )
            services.start_soon(maintenance.heartbeat_loop)
            services.start_soon(maintenance.recovery_loop)
            handoff: Handoff[Event] = Handoff()
            try:
                async with anyio.create_task_group() as workers:
                    self._workers_scope = workers.cancel_scope
                    if self._hurry:
                        workers.cancel_scope.cancel()
                    for _ in range(self._concurrency):
                        workers.start_soon(self._worker, handoff)
                    try:
                        await self._dispatch(handoff)
                    finally:
                        handoff.close()
                    await self._drain()
                    workers.cancel_scope.cancel()
            finally:
                handoff.close()
                await settler.close(timeout=max(self._timeout, 5.0))
                with anyio.CancelScope(shield=True):
                    await self._forget_idle()
                services.cancel_scope.cancel()
        logger.info(
            "consumer %s stopped: %s",
            self.worker_id,
            self.stats,
            extra={"worker_id": self.worker_id},
        )

    async def _drain(self) -> None:
        """Give running handlers up to ``shutdown_grace`` to finish."""
        if self.stats.in_flight == 0 or self._hurry:
            return
        logger.info(
            "waiting up to %.1fs for %d running handler(s)",
            self._shutdown_grace,
            self.stats.in_flight,
        )
        with anyio.move_on_after(self._shutdown_grace):
            while self.stats.in_flight > 0 and not self._hurry:
                self._slot_freed.clear()
                await self._slot_freed.wait()
        if self.stats.in_flight:
            logger.warning(
                "cancelling %d handler(s) still running; their events are released",
                self.stats.in_flight,
            )

    async def _dispatch(self, handoff: Handoff[Event]) -> None:
        backoff = 0.05
        linger = 0
        idle = False
        advertised_on = -1  # the listener connection (reconnect count) idle was declared on
        full = False
        settler = self._settler
        assert settler is not None
        refill = max(1, self._batch_size // 4)
        while not self._stopping:
            free = self._concurrency - self.stats.in_flight
            want = min(free, self._batch_size)
            if settler.backlog > 4 * self._concurrency:
                await self._wait_for(settler.wait_flushed(), self._poll_interval)
                continue
            if want <= 0 or (full and want < refill):
                # a backlog is waiting: claim again as soon as enough slots free
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            self._wake.clear()
            try:
                rows = await self._claim(want)
            except TRANSIENT_ERRORS as exc:
                if pool_is_closed(self._pool):
                    raise OutboxError(
                        "the asyncpg pool was closed under a running consumer"
                    ) from exc
                logger.warning(
                    "claim failed (%s: %s); retrying in %.2fs", type(exc).__name__, exc, backoff
                )
                await self._wait_for(self._stop_event.wait(), backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.05
            if rows:
                # start the handlers first: the advert only gates NOTIFY, and a stale
                # one for a round trip costs at most one extra notification
                self._hand_out(rows, handoff)
                if idle:
                    idle = False
                    await self._declare(busy=True)
            full = len(rows) == want
            if full:
                linger = 0
                continue
            if rows:
                linger = 0
            if linger < len(_LINGER):
                await self._wait_for(self._wake.wait(), _LINGER[linger])
                linger += 1
                continue
            listener = self._listener
            if idle and listener is not None and listener.reconnects != advertised_on:
                # the listener reconnected: after a server crash the unlogged idle table
                # is empty, so producers would notify nobody until we advertise again
                idle = False
            # leaving the fast path: the next claim starts from the oldest entry, so a row
            # the watermark hid is never left waiting for a poll
            self._full_claim_at = -math.inf
            if self._listen and not idle and self.listening:
                # advertise, then look once more: an insert that committed before the
                # advertisement saw no idle consumer and sent no notification
                idle = await self._declare(busy=False)
                if idle:
                    advertised_on = listener.reconnects if listener is not None else -1
                    continue
            await self._wait_for(self._wake.wait(), await self._idle_timeout())
            if idle and not self._wake.is_set():
                idle = await self._declare(busy=False)  # refresh before it expires

    async def _claim(self, want: int) -> list[Any]:
        """Claim up to ``want`` rows, usually starting after the last claim's watermark.

        Every row that leaves 'pending' leaves a dead entry at the head of the claimable
        index until VACUUM, so a claim that always starts from the oldest entry walks
        more of them with every event handled. Most claims therefore start just before
        the ``available_at`` of the oldest row the previous claim returned; a full
        claim catches rows the watermark hides (a producer transaction that committed
        late with an older ``now()``, rows another consumer skipped or released), so
        their extra delay is bounded by the full claims' interval: at most 250 ms, and
        as little as 20 ms while full claims are cheap (few dead entries to walk).
        """
        now = time.monotonic()
        args: tuple[Any, ...] = (self.worker_id, self._lease_timeout, self._topics, want)
        full = self._watermark is None or now - self._full_claim_at >= self._full_claim_every
        if full:
            sql = self._q.claim
            self._full_claim_at = now
        else:
            sql = self._q.claim_after
            args += self._watermark  # type: ignore[operator]
        async with self._pool.acquire(timeout=self._timeout) as conn:
            rows: list[Any] = await conn.fetch(sql, *args, timeout=self._timeout)
        self.stats.claims += 1
        if full:
            low, high = _FULL_CLAIM_EVERY
            cost = time.monotonic() - now
            self._full_claim_every = min(high, max(low, cost / _FULL_CLAIM_SHARE))
        if rows:
            # trail the oldest row by a few milliseconds: concurrent producers commit
            # out of their now() order all the time, and a row that sorts just behind
            # the watermark would otherwise wait for the next full claim (measured at
            # 4k events/s from 4 producers: worst latency ~270 ms without, ~55 ms with;
            # a longer lag re-reads recently claimed rows and slows every claim)
            oldest = (min(r[8] for r in rows) - _WATERMARK_LAG, 0)
            if full or self._watermark is None or oldest > self._watermark:
                self._watermark = oldest
        return rows

    async def _sql(self, method: str, query: str, *args: Any) -> Any:
        return await bounded(self._pool, method, query, *args, timeout=self._timeout)

    def _hand_out(self, rows: list[Any], handoff: Handoff[Event]) -> None:
        now = time.monotonic()
        self.stats.claimed += len(rows)
        for row in rows:
            event_id, topic, payload, dedupe_key, headers, attempts, max_attempts, created, _ = row
            self.stats.in_flight += 1
            self._held[event_id] = (attempts, now)
            try:
                decoded = self._decode(payload)
                header_map = decode_json(headers) if headers != "{}" else {}
            except Exception as exc:
                self._record_failure(event_id, topic, attempts, max_attempts, exc)
                self._finished(event_id, attempts)
                continue
            handoff.put(
                Event(
                    event_id,
                    topic,
                    decoded,
                    dedupe_key,
                    header_map,
                    attempts,
                    max_attempts,
                    created,
                )
            )

    async def _idle_timeout(self) -> float:
        """Jittered poll interval, shortened to when the next delayed event becomes due."""
        timeout = self._poll_interval * random.uniform(0.8, 1.2)
        try:
            due: float | None = await self._sql("fetchval", self._q.next_available, self._topics)
        except TRANSIENT_ERRORS:
            return timeout
        if due is not None:
            timeout = min(timeout, max(due, 0.0) + 0.001)
        return timeout

    async def _declare(self, *, busy: bool) -> bool:
        """Advertise this consumer as idle (or withdraw it); return whether it is idle."""
        try:
            if busy:
                await self._sql("execute", self._q.declare_busy, self.worker_id)
                return False
            await self._sql(
                "execute",
                self._q.declare_idle,
                self.worker_id,
                self._topics,
                self._poll_interval * 2 + 5.0,
            )
            return True
        except TRANSIENT_ERRORS as exc:
            logger.debug("idle advertisement failed: %s", exc)
            return busy

    async def _forget_idle(self) -> None:
        if self._listen:
            await self._declare(busy=True)

    @staticmethod
    async def _wait_for(awaitable: Awaitable[Any], timeout: float) -> None:
        with anyio.move_on_after(timeout):
            await awaitable

    # -- running handlers ------------------------------------------------------------
    async def _worker(self, handoff: Handoff[Event]) -> None:
        while (event := await handoff.get()) is not None:
            await self._execute(event)

    async def _execute(self, event: Event) -> None:
        extra = {"event_id": event.id, "topic": event.topic, "attempt": event.attempts}
        try:
            if self._stopping:
                self._release(event)
                return
            handler = self._handlers[event.topic]
            timeout = handler.timeout if handler.timeout is not None else self._handler_timeout
            try:
                if timeout is None:
                    await handler.func(event)
                else:
                    with anyio.fail_after(timeout):
                        await handler.func(event)
            except Retry as exc:
                self._fail(event, exc, delay=exc.delay)
            except Dead as exc:
                self._fail(event, exc, dead=True)
            except anyio.get_cancelled_exc_class() as exc:
                if self._workers_scope is not None and self._workers_scope.cancel_called:
                    self._release(event)
                    raise
                # the handler raised CancelledError on its own: a failure like any other
                self._fail(event, exc, handler=handler)
            except Exception as exc:
                self._fail(event, exc, handler=handler)
            except BaseException as exc:
                # SystemExit, KeyboardInterrupt and friends: settle this event, then stop
                # the consumer gracefully and re-raise from run()
                self._fail(event, exc, handler=handler)
                logger.error("handler raised %r; stopping the consumer", exc, extra=extra)
                if self._fatal is None:
                    self._fatal = exc
                self.stop()
            else:
                assert self._settler is not None
                self._settler.done(event.id, event.attempts)
                self.stats.done += 1
        finally:
            self._finished(event.id, event.attempts)

    def _finished(self, event_id: int, attempts: int) -> None:
        held = self._held.get(event_id)
        # if this consumer re-claimed the row after losing its lease, keep the newer claim
        if held is not None and held[0] == attempts:
            del self._held[event_id]
        self.stats.in_flight -= 1
        self._slot_freed.set()

    def _release(self, event: Event) -> None:
        assert self._settler is not None
        self.stats.released += 1
        self._settler.failed(
            Failure(
                event.id,
                event.attempts,
                0.0,
                "released: the consumer stopped before the handler finished",
                force_dead=False,
                released=True,
            )
        )

    def _fail(self, event: Event, exc: BaseException, **options: Any) -> None:
        self._record_failure(
            event.id, event.topic, event.attempts, event.max_attempts, exc, **options
        )

    def _record_failure(
        self,
        event_id: int,
        topic: str,
        attempts: int,
        max_attempts: int,
        exc: BaseException,
        *,
        dead: bool = False,
        delay: float | None = None,
        handler: Handler | None = None,
    ) -> None:
        assert self._settler is not None
        if delay is None:
            policy = (handler.retry if handler is not None else None) or self._retry
            delay = policy.delay(attempts)
        if dead or attempts >= max_attempts:
            self.stats.dead += 1
        else:
            self.stats.retried += 1
        extra = {"event_id": event_id, "topic": topic, "attempt": attempts}
        if isinstance(exc, (Retry, Dead)):
            error = f"{type(exc).__name__}: {exc.reason}"
            logger.info("event %d: %s", event_id, error, extra=extra)
        else:
            error = _describe(exc)
            logger.warning(
                "event %d (%s) attempt %d failed: %s: %s",
                event_id,
                topic,
                attempts,
                type(exc).__name__,
                exc,
                extra=extra,
            )
        self._settler.failed(Failure(event_id, attempts, delay, error, dead))

    def _recovered(self, count: int) -> None:
        self.stats.recovered += count
        self._wake.set()
