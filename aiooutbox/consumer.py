"""`OutboxConsumer` claims events from the outbox and runs your handlers on them.

Enter it (``async with OutboxConsumer(pool, concurrency=64) as consumer``), then
``await consumer.run(handlers)`` until `OutboxConsumer.stop`; `ConsumerStats` counts
what it did. Every option, its default and its risk is in `OutboxConsumer`'s docstring;
handlers, retries and stopping are in docs/consuming.md.
"""

# The façade over `_engine/`, which `_engine.engine` wires: the claim loop is
# `dispatcher`, running one handler is `executor`, writing outcomes is `settler`, what
# this consumer holds is `leases`, heartbeats, recovery and retention are `maintenance`,
# and the options are validated once in `options`. Every task is owned by `run()`,
# which returns after `stop()` once in-flight work is settled.

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping, Sequence
from datetime import timedelta

import anyio
import asyncpg
from anyio.abc import TaskStatus

from ._engine.engine import Engine
from ._engine.leases import Leases
from ._engine.listener import Listener
from ._engine.options import DEFAULT_MAX_CLAIM_BYTES, ConsumerOptions
from ._engine.rows import ConsumerStats
from ._engine.settler import Settler
from ._engine.signals import Signals
from ._engine.watchdog import MvccReport
from ._sql.db import PermanentDatabaseError
from ._sql.statements import DEFAULT_SCHEMA, DEFAULT_TABLE
from ._values.codec import Decoder
from .errors import InvalidArgument
from .handlers import ALL_TOPICS, Handler, HandlerFunc, resolve_handlers
from .migrations import check_schema
from .observe import Observer, Observers
from .retry import RetryPolicy

__all__ = ["ConsumerStats", "OutboxConsumer"]

logger = logging.getLogger("aiooutbox.consumer")

Handlers = Mapping[str, "HandlerFunc | Handler"]


def _sole(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error to raise from run() for a task group's errors, for a readable traceback.

    A database refusal that retrying cannot fix is often hit by several loops at once
    (claim, recovery, heartbeat): the first one says what to fix.
    """
    leaves: list[BaseException] = []

    def collect(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                collect(inner)
        else:
            leaves.append(error)

    collect(group)
    permanent = [e for e in leaves if isinstance(e, PermanentDatabaseError)]
    if permanent:
        return permanent[0]
    return leaves[0] if len(leaves) == 1 else group


class OutboxConsumer:
    """Runs async handlers for the events of one outbox table.

    ``async with OutboxConsumer(pool) as consumer: await consumer.run(handlers)``

    Defaults and the risk each carries:

    - ``concurrency=64``: handlers running at once, and the most rows this consumer holds.
      Higher drains faster but holds more leases if the process dies.
    - ``batch_size=None`` (= concurrency): the most rows one claim takes.
    - ``prefetch=None`` (= 512 - concurrency, at least 0; with batch handlers, at least
      enough to hold four of the largest batch): the most rows claimed ahead of the
      running handlers, waiting for a worker with their leases kept alive; no more than
      about 0.1 s of work at the recent rate (none under 10 events/s). It hides the
      claim's round trip behind the handlers; ``0`` holds at most ``concurrency`` rows.
      An explicit ``batch_size`` still caps each claim.
    - ``max_claim_bytes=16 MiB``: one claim stops adding rows once their stored payloads
      (after TOAST compression) reach this size; the first row is always taken. Memory
      per consumer is about ``concurrency`` decoded payloads at once.
    - ``poll_interval=5.0``: fallback poll (jittered ±20%) when no notification arrives;
      it bounds the delay of a missed wake-up and of delayed events' start.
    - ``lease_timeout=30.0``: a row held longer without a heartbeat is recovered by any
      consumer. Leases are extended every third of it while handlers run, so it only
      needs to exceed the time a crashed or frozen worker may take to be noticed. A
      handler starts only while its lease has more than a sixth of it left (by this
      process's clock): a loop blocked past it starts nothing more of what it claimed.
    - ``shutdown_grace=10.0``: on stop, running handlers get this long to finish; the
      rest are cancelled and released for another consumer at once. The attempt still
      counts (``attempts`` never decreases), but a release never sends a row to ``dead``.
    - ``retry=RetryPolicy()``: backoff after an exception (1 s doubling, capped at 1 h,
      full jitter); a per-topic `Handler(retry=...)` overrides it.
    - ``handler_timeout=None``: no limit; a timeout counts as a failure.
    - ``retention=7 days``: finished events older than this leave, at start and then
      every minute. Those in the ring of finished events (every event without a
      ``dedupe_key``) leave a slot at a time, by ``TRUNCATE``, once every event in the
      slot is older; those kept in the outbox are purged in batches of 1000,
      each its own short transaction; while batches
      come back full, rounds of back-to-back batches (0.25 s at most each) follow one
      another after nine times their duration, so the purge keeps up with up to about
      a tenth of what one connection deletes (5,000-11,000 rows/s per outbox, measured
      beside 10M rows) while taking at most a tenth of one connection's time. ``None``
      keeps them forever (the table then grows without bound).
    - ``listen=True``: wake on LISTEN/NOTIFY through a dedicated connection; set
      ``False`` behind PgBouncer in transaction mode (poll only), or pass ``listen_dsn``
      to listen directly on the server.
    - ``statement_timeout=10.0``: client-side limit on every statement we run, so a
      stalled network or lock never hangs the consumer.
    - ``observers=()``: `aiooutbox.observe.Observer` instances told about claims,
      handler runs and outcomes (metrics, tracing); none costs nothing.
    - ``listen_probe_interval=5.0``: the listener sends itself one notification this
      often and reconnects (claiming at once) if it does not come back; ``None``
      keeps only a keep-alive query, which misses a link that answers but is deaf.
    - ``watchdog_interval=60.0``, ``horizon_warning=300.0``,
      ``dead_tuples_warning=1_000_000``: the MVCC watchdog (docs/deployment.md, "The
      MVCC watchdog") logs a WARNING on the ``aiooutbox.watchdog`` logger about a
      transaction, prepared transaction or replication slot pinning the xmin horizon
      longer than ``horizon_warning`` seconds, and about the outbox table's dead
      tuples; ``watchdog_interval=None`` turns it off. Its last reading is `mvcc`,
      which the metrics serve.
    - ``orphan_sweep_interval=30.0``: how often (jittered ±20%) the consumer looks for
      ordered keys whose next event waits with no head left to promote it (an
      operator's own ``DELETE`` of a head, a promotion a producer's lock deferred past
      the stop of the consumer that was to retry it) and promotes them: such a key
      moves on within about this long. The look visits each key with unfinished
      events once (15-20 µs a key measured); once it takes longer than a fiftieth of the
      interval, the consumer looks less often, fifty times its duration apart.

    A handler registered for the topic ``"*"`` handles every topic without a handler
    of its own, and makes the consumer claim every topic (as relays do).
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        concurrency: int = 64,
        batch_size: int | None = None,
        prefetch: int | None = None,
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
        max_claim_bytes: int = DEFAULT_MAX_CLAIM_BYTES,
        observers: Sequence[Observer] = (),
        listen_probe_interval: float | timedelta | None = 5.0,
        watchdog_interval: float | timedelta | None = 60.0,
        horizon_warning: float | timedelta = 300.0,
        dead_tuples_warning: int = 1_000_000,
        orphan_sweep_interval: float | timedelta = 30.0,
    ) -> None:
        if not isinstance(pool, asyncpg.Pool):
            raise TypeError(
                f"OutboxConsumer needs an asyncpg.Pool (asyncpg.create_pool(...)), "
                f"not {type(pool).__name__}"
            )
        self._pool = pool
        self.options = ConsumerOptions.build(
            concurrency=concurrency,
            batch_size=batch_size,
            prefetch=prefetch,
            topics=topics,
            poll_interval=poll_interval,
            lease_timeout=lease_timeout,
            shutdown_grace=shutdown_grace,
            retry=retry,
            handler_timeout=handler_timeout,
            worker_id=worker_id,
            schema=schema,
            table=table,
            listen=listen,
            listen_dsn=listen_dsn,
            retention=retention,
            statement_timeout=statement_timeout,
            decoder=decoder,
            max_claim_bytes=max_claim_bytes,
            listen_probe_interval=listen_probe_interval,
            watchdog_interval=watchdog_interval,
            horizon_warning=horizon_warning,
            dead_tuples_warning=dead_tuples_warning,
            orphan_sweep_interval=orphan_sweep_interval,
        )
        if isinstance(observers, Observer) or not isinstance(observers, Sequence):
            raise TypeError("observers must be a list of aiooutbox.observe.Observer")
        self._observers = Observers(observers)
        self.worker_id = self.options.worker_id
        self.stats = ConsumerStats()
        self._state = "new"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requests = 0
        self._stopping = False
        self._hurry = False
        self._fatal: BaseException | None = None
        self._failure: BaseException | None = None
        self._leases = Leases()
        self._signals = Signals()
        self._settled_all = asyncio.Event()
        self._started = asyncio.Event()
        self._engine: Engine | None = None
        self._handlers: dict[str, Handler] = {}
        self._observers.attached(self)

    @classmethod
    def from_options(
        cls, pool: asyncpg.Pool, options: ConsumerOptions, *, observers: Sequence[Observer] = ()
    ) -> OutboxConsumer:
        """A consumer with settings validated earlier (the CLI and the integrations)."""
        consumer = cls(
            pool, worker_id=options.worker_id, schema=options.schema, observers=observers
        )
        consumer.options = options
        return consumer

    # -- lifecycle -----------------------------------------------------------------
    async def __aenter__(self) -> OutboxConsumer:
        if self._state != "new":
            raise RuntimeError(f"cannot enter an OutboxConsumer that is {self._state}")
        self._state = "entering"
        try:
            await self._check_schema()
        except BaseException:
            self._state = "new"
            raise
        self._state = "entered"
        return self

    async def _check_schema(self) -> None:
        # bounded: on a stalled network the pool's query has no timeout and never returns
        limit = 3 * self.options.statement_timeout
        try:
            with anyio.fail_after(limit):
                await check_schema(self._pool, schema=self.options.schema, table=self.options.table)
        except TimeoutError:
            raise TimeoutError(
                f"the outbox schema check got no answer within {limit:.1f}s "
                "(3 x statement_timeout): is the database reachable?"
            ) from None

    async def __aexit__(self, *exc_info: object) -> None:
        if self._state in ("starting", "running"):
            self.stop()
            with anyio.CancelScope(shield=True):
                await self._settled_all.wait()
        self._state = "closed"

    @property
    def running(self) -> bool:
        return self._state == "running"

    @property
    def pool(self) -> asyncpg.Pool:
        """The pool this consumer claims and settles through."""
        return self._pool

    @property
    def _listener(self) -> Listener | None:
        return None if self._engine is None else self._engine.listener

    @property
    def _settler(self) -> Settler | None:
        return None if self._engine is None else self._engine.settler

    @property
    def listening(self) -> bool:
        """True while the LISTEN connection is up."""
        return self._listener is not None and self._listener.connected

    @property
    def mvcc(self) -> MvccReport | None:
        """The MVCC watchdog's latest findings: what pins the xmin horizon, and the
        table's dead tuples (what the metrics serve).

        ``None`` while the watchdog is off, has not checked yet, or its last reading
        is older than three ``watchdog_interval`` (checks failing).
        """
        watchdog = None if self._engine is None else self._engine.watchdog
        return None if watchdog is None else watchdog.latest

    @property
    def settle_backlog(self) -> int:
        """Outcomes recorded but not yet written to the database."""
        return 0 if self._settler is None else self._settler.backlog

    async def wait_started(self) -> None:
        """Wait until `run()` is consuming: schema checked, LISTEN connection up.

        Raises `RuntimeError` (from the cause) if `run()` ended before that. Prefer
        ``await task_group.start(consumer.run, handlers)``, which does both at once.
        """
        finished = asyncio.ensure_future(self._settled_all.wait())
        started = asyncio.ensure_future(self._started.wait())
        try:
            await asyncio.wait({finished, started}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            finished.cancel()
            started.cancel()
        if not self._started.is_set():
            raise RuntimeError("the consumer's run() ended before it started") from self._failure

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
        self._signals.stop.set()
        self._signals.set_wake()
        self._signals.set_slot_freed()
        if self._engine is not None:
            self._engine.stop_requested()

    def _resolve(self, handlers: Handlers) -> tuple[dict[str, Handler], list[str] | None]:
        resolved = resolve_handlers(handlers)
        wanted = self.options.topics
        if ALL_TOPICS in resolved:
            return resolved, None if wanted is None else sorted(wanted)
        if wanted is not None:
            unknown = sorted(wanted - resolved.keys())
            if unknown:
                raise InvalidArgument(f"topics {unknown} have no handler")
            resolved = {t: h for t, h in resolved.items() if t in wanted}
        return resolved, sorted(resolved)

    async def run(
        self, handlers: Handlers, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Consume until `stop()`; return once in-flight events are settled.

        ``handlers`` maps topics to ``async def handler(event)`` (or `Handler`/`Router`).
        Only topics with a handler are claimed (every topic with a ``"*"`` handler).
        ``await task_group.start(consumer.run, handlers)`` returns once the consumer
        is consuming, and raises if it could not start. Raises on a fatal error (the
        listener cannot connect at start, the pool was closed, the database refuses
        in a way retrying cannot fix, a handler raised ``SystemExit``). Cancelling the
        task running ``run()`` stops gracefully; cancelling it again stops fast.
        """
        if self._state in ("starting", "running"):
            raise RuntimeError("this OutboxConsumer is already running")
        if self._state == "closed":
            raise RuntimeError("cannot run an OutboxConsumer again once it has stopped")
        before, self._state = self._state, "starting"  # set before any await: one run()
        try:
            resolved, topics = self._resolve(handlers)
            if before == "new":
                await self._check_schema()
        except BaseException:
            self._state = before
            raise
        self._loop = asyncio.get_running_loop()
        self._state = "running"
        if self._stopping:  # stop() before run(): nothing to do
            self._request_stop()
        try:
            await self._supervise(resolved, topics, task_status)
        except BaseException as exc:
            self._failure = exc
            raise
        finally:
            self._state = "closed"
            self._settled_all.set()

    async def _supervise(
        self,
        handlers: dict[str, Handler],
        topics: list[str] | None,
        task_status: TaskStatus[None],
    ) -> None:
        """Run the engine in its own task, so a cancelled run() stops it gracefully."""
        self._handlers = handlers
        self._engine = Engine(
            self._pool,
            self.options,
            handlers,
            topics,
            stats=self.stats,
            leases=self._leases,
            signals=self._signals,
            observers=self._observers,
            started=self._started,
            is_stopping=lambda: self._stopping,
            in_a_hurry=lambda: self._hurry,
            on_fatal=self._on_fatal,
        )
        engine = asyncio.ensure_future(self._engine.run())
        started = asyncio.ensure_future(self._started.wait())
        cancelled = reported = False
        try:
            while not engine.done():
                try:
                    with anyio.CancelScope(shield=cancelled):
                        # wait() never cancels the engine: a cancelled run() stops it gracefully
                        waiting = {engine} if reported else {engine, started}
                        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                    if not reported and self._started.is_set():
                        reported = True
                        task_status.started()  # from run()'s own task, as anyio requires
                except asyncio.CancelledError:
                    if engine.done() and engine.cancelled():
                        raise
                    cancelled = True
                    self.stop()
        finally:
            started.cancel()
        if cancelled:
            raise asyncio.CancelledError
        try:
            engine.result()
        except BaseExceptionGroup as group:
            raise _sole(group) from None
        if self._fatal is not None:
            raise self._fatal

    def _on_fatal(self, exc: BaseException) -> None:
        if self._fatal is None:
            self._fatal = exc
        self.stop()
