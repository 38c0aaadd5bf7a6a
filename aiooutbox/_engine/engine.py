"""One `run()` of a consumer: its parts built, run, and shut down in order.

`OutboxConsumer` (the façade) owns the lifecycle and the stop requests; the `Engine`
wires the listener, settler, maintenance, watchdog, executor and dispatcher of one
run, runs ``concurrency`` workers on the hand-off, and on the way out drains running
handlers, releases runs nobody took, flushes the settler and takes back what is still
claimed under this consumer's id. Collaborators are passed in, so it imports nothing
of the consumer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial

import anyio
import asyncpg

from .._engine.flow import Flow
from .._sql.db import TRANSIENT_ERRORS
from .._values.text import exception_summary
from ..handlers import Handler
from ..observe import Observers
from .batch_run import BatchExecutor, batch_worker
from .batches import BatchHandoff, Slots
from .dispatcher import Dispatcher
from .executor import Executor
from .handoff import Handoff, Run, Ticket
from .idle import declare
from .leases import Leases
from .listener import Listener
from .maintenance import Maintenance
from .options import ConsumerOptions
from .registry import Registry
from .rollups import Rollups, Tallies
from .rows import ConsumerStats
from .settler import Settler
from .signals import Signals
from .watchdog import Watchdog

__all__ = ["Engine"]

logger = logging.getLogger("aiooutbox.consumer")

# A handler starts only while its lease has at least this share of lease_timeout left
# by the consumer's clock. Heartbeats (every third of the lease, renewing what is held
# longer than a sixth) keep about half of it on a live loop; after a blocked loop the
# overdue heartbeat needs one round trip to renew, which this share leaves it.
LEASE_MARGIN = 1 / 6


class Engine:
    """The parts of one consumer run; `run` returns once everything is settled or released.

    ``is_stopping`` and ``in_a_hurry`` read the consumer's stop requests (first and
    second); `stop_requested` is how the consumer passes one on while this runs.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        options: ConsumerOptions,
        handlers: dict[str, Handler],
        topics: list[str] | None,
        *,
        stats: ConsumerStats,
        leases: Leases,
        signals: Signals,
        observers: Observers,
        started: asyncio.Event,
        is_stopping: Callable[[], bool],
        in_a_hurry: Callable[[], bool],
        on_fatal: Callable[[BaseException], None],
    ) -> None:
        self._pool = pool
        batches = [h.batch for h in handlers.values() if h.batch is not None]
        self._options = options.for_batches(max(batches)) if batches else options
        self._handlers = handlers
        self._topics = topics
        self._stats = stats
        self._leases = leases
        self._signals = signals
        self._observers = observers
        self._started = started
        self._is_stopping = is_stopping
        self._in_a_hurry = in_a_hurry
        self._on_fatal = on_fatal
        self.listener: Listener | None = None
        self.settler: Settler | None = None
        self.watchdog: Watchdog | None = None
        self.flow: Flow | None = None
        self.workers_scope: anyio.CancelScope | None = None
        self.startup_scope: anyio.CancelScope | None = None

    def stop_requested(self) -> None:
        """A stop while starting cancels the listener's first connect; in a hurry, the
        running handlers are cancelled too."""
        if self.startup_scope is not None:
            self.startup_scope.cancel()
        if self._in_a_hurry() and self.workers_scope is not None:
            self.workers_scope.cancel()

    async def run(self) -> None:
        topics = self._topics
        o = self._options
        signals = self._signals
        tallies = Tallies()
        settler = self.settler = Settler(
            self._pool,
            o.queries,
            o.worker_id,
            flush_interval=0.005,
            flush_size=max(64, o.concurrency + o.ahead),
            statement_timeout=o.statement_timeout,
            on_promoted=signals.set_wake,  # the key's next event may be ours to claim
            on_retry_due=signals.retry_written,
            on_written=lambda: written(),
            tallies=tallies,
        )
        logger.info(
            "consumer %s starting: topics=%s concurrency=%d",
            o.worker_id,
            "all" if topics is None else topics,
            o.concurrency,
            extra={"worker_id": o.worker_id, "topics": topics},
        )
        flow = self.flow = Flow(
            self._pool,
            o,
            topics,
            self._leases,
            unsettled=settler.unsettled_ids,
            wakes=lambda: signals.wakes,
            on_change=signals.set_wake,
        )

        def written() -> None:
            if flow.waiting_for_slot():  # a limited topic may claim again (even when idle)
                signals.set_wake()

        stats = self._stats

        def finished() -> None:
            signals.slot_finished(stats.in_flight)
            if flow.slot_wait:  # a limited topic's slot frees once the outcome is written
                settler.hurry()

        async with anyio.create_task_group() as services:
            if o.listen:
                self.listener = Listener(
                    self._pool,
                    o.queries.channel,
                    topics,
                    signals.set_wake,
                    dsn=o.listen_dsn,
                    keepalive=max(o.poll_interval, 5.0),
                    timeout=o.statement_timeout,
                    worker_id=o.worker_id,
                    probe_interval=o.listen_probe_interval,
                    on_flow=flow.notice,
                    on_lost=signals.set_wake,  # an idle consumer must not wait on it now
                    on_connected=signals.set_listener_back,
                )
                # a stop() during the first connect must not wait for its timeout
                with anyio.CancelScope() as self.startup_scope:
                    if self._is_stopping():
                        self.startup_scope.cancel()
                    await services.start(self.listener.run)
                self.startup_scope = None
            await services.start(flow.run)
            registry = Registry(self._pool, o, topics)
            await registry.register()
            self._started.set()
            services.start_soon(settler.run)
            maintenance = Maintenance(
                self._pool,
                o.queries,
                o.worker_id,
                leases=self._leases,
                on_recovered=self._recovered,
                lease_timeout=o.lease_timeout,
                retention=o.retention,
                statement_timeout=o.statement_timeout,
                orphan_sweep_interval=o.orphan_sweep_interval,
                registry=registry,
                tallies=tallies,
            )
            rollups = Rollups(self._pool, o, tallies)
            services.start_soon(rollups.run)
            services.start_soon(maintenance.heartbeat_loop)
            services.start_soon(maintenance.recovery_loop)
            services.start_soon(maintenance.retention_loop)
            services.start_soon(maintenance.sweep_loop)
            if o.watchdog_interval is not None:
                self.watchdog = Watchdog(self._pool, o)
                services.start_soon(self.watchdog.run)
            batching = any(h.batch is not None for h in self._handlers.values())
            executor = (BatchExecutor if batching else Executor)(
                handlers=self._handlers,
                settler=settler,
                leases=self._leases,
                stats=self._stats,
                retry=o.retry,
                handler_timeout=o.handler_timeout,
                decoder=o.decoder,
                is_stopping=self._is_stopping,
                is_hurried=lambda: (
                    self.workers_scope is not None and self.workers_scope.cancel_called
                ),
                on_finished=finished,
                on_fatal=self._on_fatal,
                observers=self._observers,
                lease_margin=o.lease_timeout * LEASE_MARGIN,
            )
            handoff: Handoff[Run]
            work: Callable[[], Awaitable[None]]
            if isinstance(executor, BatchExecutor):
                # batch handlers: their topics' events wait in pools, event slots count
                handoff = batches = BatchHandoff(self._handlers, o.concurrency, executor.give_back)
                slots = Slots(o.concurrency)
                executor.attach(batches, slots)
                work = partial(batch_worker, batches, executor, slots)
            else:
                handoff = Handoff()
                work = partial(_worker, handoff, executor)
            dispatcher = Dispatcher(
                self._pool,
                o,
                topics=topics,
                stats=self._stats,
                leases=self._leases,
                settler=settler,
                signals=signals,
                listener=self.listener,
                is_stopping=self._is_stopping,
                observers=self._observers,
                flow=flow,
            )
            try:
                async with anyio.create_task_group() as workers:
                    self.workers_scope = workers.cancel_scope
                    if self._in_a_hurry():
                        workers.cancel_scope.cancel()
                    # workers start as items find none waiting (`Handoff.staff`)
                    handoff.staff(partial(workers.start_soon, work), o.concurrency)
                    try:
                        await dispatcher.run(handoff)
                    finally:
                        handoff.close()
                    await self._drain()
                    workers.cancel_scope.cancel()
            finally:
                handoff.close()
                # runs handed out that no worker took (a fast stop): release them too
                while (run := handoff.take_nowait()) is not None:
                    if not isinstance(run, Ticket):  # a batch topic's pool: just below
                        executor.drop(run)
                if isinstance(handoff, BatchHandoff):
                    for unit in handoff.leftovers():
                        executor.drop(unit)
                await settler.close(timeout=max(o.statement_timeout, 5.0))
                with anyio.CancelScope(shield=True):
                    # no row claimed under our id may stay `processing` once run()
                    # returns; skipped when the final flush gave up (the database is gone)
                    if not settler.abandoned:
                        await _quietly(
                            dispatcher.take_back_orphans("still held at shutdown"), logging.WARNING
                        )
                    if o.listen:
                        await _quietly(declare(self._pool, o, topics, busy=True))
                    await _quietly(rollups.flush())
                    await registry.remove()
                services.cancel_scope.cancel()
        logger.info(
            "consumer %s stopped: %s", o.worker_id, self._stats, extra={"worker_id": o.worker_id}
        )

    async def _drain(self) -> None:
        """Give running handlers up to ``shutdown_grace`` to finish."""
        grace = self._options.shutdown_grace
        if self._stats.in_flight == 0 or self._in_a_hurry():
            return
        logger.info("waiting up to %.1fs for %d running handler(s)", grace, self._stats.in_flight)
        with anyio.move_on_after(grace):
            while self._stats.in_flight > 0 and not self._in_a_hurry():
                self._signals.clear_slot_freed()
                await self._signals.slot_freed.wait()
        if self._stats.in_flight:
            logger.warning(
                "cancelling %d handler(s) still running; their events are released",
                self._stats.in_flight,
            )

    def _recovered(self, count: int) -> None:
        self._stats.recovered += count
        self._signals.set_wake()


async def _worker(handoff: Handoff[Run], executor: Executor) -> None:
    handoff.joins()
    take, execute = handoff.take_nowait, executor.execute
    while True:
        # an item waiting is taken without a coroutine (the usual case in a drain: a
        # worker whose handler did not suspend takes the next one at once)
        if (run := take()) is None and (run := await handoff.get()) is None:
            return
        if isinstance(run, list):  # an ordered key's run
            await executor.execute_run(run)
        else:  # an unordered event (tickets are a batch consumer's: `batch_worker`)
            await execute(run)  # type: ignore[arg-type]


async def _quietly(awaitable: object, level: int = logging.DEBUG) -> None:
    try:
        await awaitable  # type: ignore[misc]
    except TRANSIENT_ERRORS as exc:
        logger.log(level, "ignored at shutdown (%s)", exception_summary(exc))
