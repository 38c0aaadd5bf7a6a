"""Prometheus metrics for consumers, the queue table's gauges, and a ``/metrics`` server.

Needs the ``prometheus`` extra (prometheus_client); ``import aiooutbox`` never imports
this module. Three parts:

- `OutboxMetrics`, an observer: ``OutboxConsumer(pool, observers=[metrics])`` counts
  outcomes, handler and claim durations, and reads the consumers' gauges (in flight,
  listener, settle backlog, and the MVCC watchdog's last reading: the xmin horizon's
  age and the table's dead tuples) at scrape time, with no query of its own. Families
  are registered on the registry given, by default prometheus_client's global
  ``REGISTRY`` (what an app exposing ``/metrics`` already serves); one `OutboxMetrics`
  per registry.
- `OutboxMetrics.queue_gauges(pool)`: ``aiooutbox_queue_depth`` and
  ``aiooutbox_queue_lag_seconds``, refreshed by ONE query per interval per process
  (`Queries.queue_gauges`), never per scrape.
- `MetricsServer`: a small asyncio HTTP server for ``/metrics`` and ``/healthz``, bound
  to 127.0.0.1 unless told otherwise. It runs on the consumer's event loop, so gauges
  are read without threads.

One process serving several databases (``relay --dsn A --dsn B``) names each:
``metrics.database("a")`` is the observer for that database's consumer and
``metrics.queue_gauges(pool_a, database="a")`` its table's gauges; every family then
carries a ``database`` label. Without names the families are as they always were.

Every metric, its labels and alert rules are in docs/observability.md.
"""

# The collectors that turn counts into families at scrape time are in
# `_observability.collectors`; the queue query's loop is `_observability.queue_gauges`,
# the server `_observability.http_server` (both importable from here).

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import numbers
import weakref
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
import asyncpg

from ._values.extras import install_hint

try:
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised by the packaging test
    raise ImportError(
        f"aiooutbox.metrics needs prometheus_client: {install_hint('prometheus')}"
    ) from exc

from ._observability.collectors import (
    BATCH_BUCKETS,
    ConsumerGauges,
    Consumers,
    EventCollector,
    EventCounts,
    MvccCollector,
    PlainHistogram,
    QueueCollector,
)
from ._observability.http_server import MetricsServer
from ._observability.queue_gauges import QueueGauges
from ._sql.statements import DEFAULT_SCHEMA, DEFAULT_TABLE
from .errors import InvalidArgument
from .events import Event
from .observe import ObservedConsumer, Observer

__all__ = ["HANDLER_BUCKETS", "DatabaseMetrics", "MetricsServer", "OutboxMetrics", "QueueGauges"]

logger = logging.getLogger("aiooutbox.metrics")

# from 1 ms to 5 min: fine enough for a 1 ms cache invalidation, wide enough for a 60 s
# report (prometheus_client's default stops at 10 s)
HANDLER_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


def _bounds(buckets: Any) -> tuple[float, ...]:
    """``handler_buckets`` as sorted floats; TypeError/InvalidArgument for anything but
    a sequence of distinct, positive, finite numbers."""
    if isinstance(buckets, (str, bytes, Mapping)) or not hasattr(buckets, "__iter__"):
        raise TypeError(
            f"handler_buckets must be a sequence of numbers, not {type(buckets).__name__}"
        )
    values = list(buckets)
    for b in values:
        if isinstance(b, bool) or not isinstance(b, numbers.Real):
            raise TypeError(f"handler_buckets must hold numbers, not {b!r:.60}")
    refused = InvalidArgument(
        "handler_buckets must be distinct, positive, finite upper bounds"
        " (the +Inf bucket is always added)"
    )
    try:
        bounds = tuple(sorted(float(b) for b in values))
    except OverflowError:  # an int past a float's range
        raise refused from None
    if not bounds or any(not 0 < b < math.inf for b in bounds) or len(set(bounds)) != len(bounds):
        raise refused
    return bounds


class _Counting(Observer):
    """The per-event hooks: counts on the event loop, in this object's `EventCounts`."""

    def __init__(self, handler_bounds: tuple[float, ...]) -> None:
        self._handler_bounds = handler_bounds
        self._counts = EventCounts(handler_bounds)
        self._outcomes = self._counts.outcomes  # the same dicts, one lookup less per event
        self._handler = self._counts.handler

    def claimed(self, rows: int, seconds: float) -> None:
        self._counts.claimed += rows
        self._counts.claim.observe(seconds)

    def handler_finished(
        self, event: Event, token: Any, outcome: str, seconds: float, error: BaseException | None
    ) -> None:
        histogram = self._handler.get(event.topic)
        if histogram is None:
            histogram = self._handler[event.topic] = PlainHistogram(self._handler_bounds)
        histogram.observe(seconds)

    def settled(self, topic: str, outcome: str) -> None:
        key = (topic, outcome)
        self._outcomes[key] = self._outcomes.get(key, 0) + 1

    def batch_finished(
        self,
        events: list[Event],
        token: Any,
        outcomes: Mapping[str, int],
        seconds: float,
        error: BaseException | None,
    ) -> None:
        # the events' outcomes are counted by `settled`, one by one; here the call
        if not events:
            return
        topic = events[0].topic
        histogram = self._handler.get(topic)
        if histogram is None:
            histogram = self._handler[topic] = PlainHistogram(self._handler_bounds)
        histogram.observe(seconds)
        sizes = self._counts.batch_sizes.get(topic)
        if sizes is None:
            sizes = self._counts.batch_sizes[topic] = PlainHistogram(BATCH_BUCKETS)
        sizes.observe(len(events))


# the instance whose families each registry holds (`OutboxMetrics.registered`); weak
# both ways, as an instance refers to its registry
_REGISTERED: weakref.WeakKeyDictionary[CollectorRegistry, weakref.ref[OutboxMetrics]] = (
    weakref.WeakKeyDictionary()
)


class OutboxMetrics(_Counting):
    """Registers aiooutbox's metric families on ``registry`` and feeds them as an observer.

    ``registry=None`` means prometheus_client's global ``REGISTRY``. Use one instance for
    every consumer of the process (counters add up; gauges sum over the consumers it was
    passed to; ``aiooutbox_listener_connected`` is 1 only if all of those that listen
    are connected, and absent when none listens). `unregister` removes the families.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        handler_buckets: tuple[float, ...] = HANDLER_BUCKETS,
    ) -> None:
        if registry is not None and (
            isinstance(registry, type)
            or not all(callable(getattr(registry, n, None)) for n in ("register", "unregister"))
        ):
            raise TypeError(
                f"registry must be a prometheus_client CollectorRegistry or None,"
                f" not {type(registry).__name__}"
            )
        self.registry = REGISTRY if registry is None else registry
        bounds = _bounds(handler_buckets)
        # Plain Python counters, read at scrape time by `EventCollector`: prometheus_client's
        # own Counter/Histogram take a lock per update (measured here: ~7 us per event for
        # the outcome and the duration, against ~2 us this way). Every update happens on
        # the event loop; a scrape from another thread copies them first.
        super().__init__(bounds)
        # per database name (None: unnamed); the named ones are `DatabaseMetrics`'
        self._all_counts: dict[str | None, EventCounts] = {None: self._counts}
        self._databases: dict[str, DatabaseMetrics] = {}
        self._consumers: Consumers = weakref.WeakKeyDictionary()
        self._queues: dict[str | None, QueueGauges] = {}
        self._collectors = (
            EventCollector(self._all_counts),
            ConsumerGauges(self._consumers),
            QueueCollector(lambda: self._queues),
            MvccCollector(self._consumers),
        )
        registered: list[Collector] = []
        try:
            for collector in self._collectors:
                self.registry.register(collector)
                registered.append(collector)
        except ValueError:
            for done in registered:
                self.registry.unregister(done)
            raise
        _REGISTERED[self.registry] = weakref.ref(self)

    @classmethod
    def registered(cls, registry: CollectorRegistry | None = None) -> OutboxMetrics | None:
        """The instance whose families ``registry`` (default: the global ``REGISTRY``)
        holds, if any: ``run --metrics-port`` reuses the one a handlers module made
        rather than fail on the duplicate names."""
        found = _REGISTERED.get(REGISTRY if registry is None else registry)
        return None if found is None else found()

    def unregister(self) -> None:
        """Remove every family from the registry (a test, or a second instance)."""
        for collector in self._collectors:
            with contextlib.suppress(KeyError):
                self.registry.unregister(collector)
        found = _REGISTERED.get(self.registry)
        if found is not None and found() is self:
            del _REGISTERED[self.registry]

    def tracks_queue(self, database: str | None = None) -> bool:
        """Whether `queue_gauges` is running for the queue table of ``database``."""
        return database in self._queues

    def database(self, name: str) -> DatabaseMetrics:
        """The observer for the consumer of the database called ``name``: its counts and
        gauges carry ``database=name``. The same object for the same name."""
        if not isinstance(name, str) or not name.strip():
            raise InvalidArgument(f"a database's name must be a non-empty str, not {name!r}")
        found = self._databases.get(name)
        if found is None:
            found = self._databases[name] = DatabaseMetrics(self, name)
            self._all_counts[name] = found._counts
        return found

    # -- Observer ------------------------------------------------------------------
    def attached(self, consumer: ObservedConsumer) -> None:
        self._consumers[consumer] = None

    # -- the table's gauges ----------------------------------------------------------
    @contextlib.asynccontextmanager
    async def queue_gauges(
        self,
        pool: asyncpg.Pool,
        *,
        schema: str = DEFAULT_SCHEMA,
        table: str = DEFAULT_TABLE,
        interval: float = 15.0,
        database: str | None = None,
    ) -> AsyncIterator[QueueGauges]:
        """Refresh ``aiooutbox_queue_depth``/``_lag_seconds`` every ``interval`` seconds
        until the block exits. The first refresh runs before the block starts.

        One queue table per database name; ``database`` (the name given to `database`)
        labels its gauges."""
        if database is not None and (not isinstance(database, str) or not database.strip()):
            raise InvalidArgument(f"a database's name must be a non-empty str, not {database!r}")
        if database in self._queues:
            which = "" if database is None else f" of database {database!r}"
            raise RuntimeError(f"this OutboxMetrics already tracks the queue table{which}")
        gauges = QueueGauges(pool, schema=schema, table=table, interval=interval)
        pause = await gauges.attempt()
        # a task of our own rather than a task group: the block's errors stay its own
        loop = asyncio.ensure_future(gauges.run(pause=pause))
        self._queues[database] = gauges
        try:
            yield gauges
        finally:
            del self._queues[database]
            loop.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait([loop])
            if not loop.cancelled() and loop.exception() is not None:
                logger.error("queue gauges loop failed", exc_info=loop.exception())


class DatabaseMetrics(_Counting):
    """`OutboxMetrics` for the consumer of one named database (`OutboxMetrics.database`):
    the same families, labelled ``database=<name>``."""

    def __init__(self, metrics: OutboxMetrics, name: str) -> None:
        super().__init__(metrics._handler_bounds)
        self.metrics = metrics
        self.name = name

    def attached(self, consumer: ObservedConsumer) -> None:
        self.metrics._consumers[consumer] = self.name
