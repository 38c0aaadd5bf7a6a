"""Prometheus metrics for consumers, the queue table's gauges, and a ``/metrics`` server.

Needs the ``prometheus`` extra (``pip install "aiooutbox[prometheus]"``); ``import
aiooutbox`` never imports this module. Three parts:

- `OutboxMetrics`, an observer: ``OutboxConsumer(pool, observers=[metrics])`` counts
  outcomes, handler and claim durations, and reads the consumers' gauges (in flight,
  listener, settle backlog) at scrape time. Families are registered on the registry
  given, by default prometheus_client's global ``REGISTRY`` (what an app exposing
  ``/metrics`` already serves); one `OutboxMetrics` per registry.
- `OutboxMetrics.queue_gauges(pool)`: ``aiooutbox_queue_depth`` and
  ``aiooutbox_queue_lag_seconds``, refreshed by ONE query per interval per process
  (`Queries.queue_gauges`), never per scrape.
- `MetricsServer`: a small asyncio HTTP server for ``/metrics`` and ``/healthz``, bound
  to 127.0.0.1 unless told otherwise. It runs on the consumer's event loop, so gauges
  are read without threads.

Every metric, its labels and alert rules are in docs/observability.md.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import random
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import anyio
import asyncpg
from anyio.abc import TaskStatus

try:
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.exposition import choose_encoder
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised by the packaging test
    raise ImportError(
        'aiooutbox.metrics needs prometheus_client: pip install "aiooutbox[prometheus]"'
    ) from exc

from ._db import TRANSIENT_ERRORS, bounded
from ._sql import DEFAULT_SCHEMA, DEFAULT_TABLE, queries
from .errors import InvalidArgument
from .events import Event
from .health import ConsumerHealth
from .observe import Observer

if TYPE_CHECKING:
    from .consumer import OutboxConsumer

__all__ = ["HANDLER_BUCKETS", "MetricsServer", "OutboxMetrics", "QueueGauges"]

logger = logging.getLogger("aiooutbox.metrics")

# from 1 ms to 5 min: fine enough for a 1 ms cache invalidation, wide enough for a 60 s
# report (prometheus_client's default stops at 10 s)
HANDLER_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
CLAIM_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
# the queue query may take at most this share of the wall time (it slows with the backlog)
_QUEUE_QUERY_SHARE = 0.05


class OutboxMetrics(Observer):
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
        self.registry = REGISTRY if registry is None else registry
        bounds = tuple(sorted(float(b) for b in handler_buckets))
        if not bounds or any(not b > 0 for b in bounds) or len(set(bounds)) != len(bounds):
            raise InvalidArgument("handler_buckets must be distinct positive upper bounds")
        # Plain Python counters, read at scrape time by `_EventCollector`: prometheus_client's
        # own Counter/Histogram take a lock per update (measured here: ~7 us per event for
        # the outcome and the duration, against ~2 us this way). Every update happens on
        # the event loop; a scrape from another thread copies them first.
        self._handler_bounds = bounds
        self._outcomes: dict[tuple[str, str], int] = {}
        self._handler: dict[str, _Histogram] = {}
        self._claim = _Histogram(CLAIM_BUCKETS)
        self._claimed = 0
        self._consumers: weakref.WeakSet[OutboxConsumer] = weakref.WeakSet()
        self._queue: QueueGauges | None = None
        self._collectors = (
            _EventCollector(self),
            _ConsumerGauges(self._consumers),
            _QueueCollector(self),
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

    def unregister(self) -> None:
        """Remove every family from the registry (a test, or a second instance)."""
        for collector in self._collectors:
            with contextlib.suppress(KeyError):
                self.registry.unregister(collector)

    # -- Observer ------------------------------------------------------------------
    def attached(self, consumer: OutboxConsumer) -> None:
        self._consumers.add(consumer)

    def claimed(self, rows: int, seconds: float) -> None:
        self._claimed += rows
        self._claim.observe(seconds)

    def handler_finished(
        self, event: Event, token: Any, outcome: str, seconds: float, error: BaseException | None
    ) -> None:
        histogram = self._handler.get(event.topic)
        if histogram is None:
            histogram = self._handler[event.topic] = _Histogram(self._handler_bounds)
        histogram.observe(seconds)

    def settled(self, topic: str, outcome: str) -> None:
        key = (topic, outcome)
        self._outcomes[key] = self._outcomes.get(key, 0) + 1

    # -- the table's gauges ----------------------------------------------------------
    @contextlib.asynccontextmanager
    async def queue_gauges(
        self,
        pool: asyncpg.Pool,
        *,
        schema: str = DEFAULT_SCHEMA,
        table: str = DEFAULT_TABLE,
        interval: float = 15.0,
    ) -> AsyncIterator[QueueGauges]:
        """Refresh ``aiooutbox_queue_depth``/``_lag_seconds`` every ``interval`` seconds
        until the block exits. The first refresh runs before the block starts."""
        if self._queue is not None:
            raise RuntimeError("this OutboxMetrics already tracks a queue table")
        gauges = QueueGauges(pool, schema=schema, table=table, interval=interval)
        pause = await gauges.attempt()
        # a task of our own rather than a task group: the block's errors stay its own
        loop = asyncio.ensure_future(gauges.run(pause=pause))
        self._queue = gauges
        try:
            yield gauges
        finally:
            self._queue = None
            loop.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait([loop])
            if not loop.cancelled() and loop.exception() is not None:
                logger.error("queue gauges loop failed", exc_info=loop.exception())


class _Histogram:
    """Bucket counts (not cumulative), sum and count; cumulated at scrape time."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def buckets(self) -> list[tuple[str, float]]:
        counts = list(self.counts)
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip(self.bounds, counts, strict=False):
            running += n
            out.append((repr(bound), running))
        out.append(("+Inf", running + counts[-1]))
        return out


class _EventCollector(Collector):
    """The counters and histograms `OutboxMetrics` keeps, as Prometheus families."""

    def __init__(self, metrics: OutboxMetrics) -> None:
        self._m = metrics

    def describe(self) -> list[Metric]:
        return list(self._families())  # names only: lets the registry refuse duplicates

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(values=True))

    def _families(self, values: bool = False) -> list[Metric]:
        m = self._m
        events = CounterMetricFamily(
            "aiooutbox_events",
            "Outcomes recorded by this process: done, retry, dead, released.",
            labels=["topic", "outcome"],
        )
        handler = HistogramMetricFamily(
            "aiooutbox_handler_duration_seconds",
            "Wall time of one handler run, whatever its outcome.",
            labels=["topic"],
        )
        claim = HistogramMetricFamily(
            "aiooutbox_claim_duration_seconds",
            "Round trip of one claim statement, empty claims included.",
        )
        claimed = CounterMetricFamily("aiooutbox_claimed", "Events claimed by this process.")
        claims = CounterMetricFamily("aiooutbox_claims", "Claim statements run by this process.")
        if values:
            for (topic, outcome), n in sorted(m._outcomes.items()):
                events.add_metric([topic, outcome], n)
            for topic, h in sorted(m._handler.items()):
                handler.add_metric([topic], h.buckets(), h.sum)
            claim.add_metric([], m._claim.buckets(), m._claim.sum)
            claimed.add_metric([], m._claimed)
            claims.add_metric([], m._claim.count)
        return [events, handler, claim, claimed, claims]


class _ConsumerGauges(Collector):
    """Gauges read from the consumers at scrape time, never pushed."""

    def __init__(self, consumers: weakref.WeakSet[OutboxConsumer]) -> None:
        self._consumers = consumers

    def describe(self) -> list[Metric]:
        return []  # dynamic: keeps the registry from calling collect() at register time

    def collect(self) -> Iterator[Metric]:
        running = [c for c in list(self._consumers) if c.running]
        yield GaugeMetricFamily(
            "aiooutbox_in_flight",
            "Events claimed by this process's consumers and not yet settled.",
            value=sum(c.stats.in_flight for c in running),
        )
        yield GaugeMetricFamily(
            "aiooutbox_settle_backlog",
            "Outcomes recorded but not yet written to the database.",
            value=sum(c.settle_backlog for c in running),
        )
        listening = [c for c in running if c.options.listen]
        family = GaugeMetricFamily(
            "aiooutbox_listener_connected",
            "1 while every listening consumer's LISTEN connection is up, else 0.",
        )
        if listening:
            family.add_metric([], 1.0 if all(c.listening for c in listening) else 0.0)
        yield family


class _QueueCollector(Collector):
    def __init__(self, metrics: OutboxMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        queue = self._metrics._queue
        depth = GaugeMetricFamily(
            "aiooutbox_queue_depth",
            "Unfinished events by topic and status (pending, retry, processing, waiting).",
            labels=["topic", "status"],
        )
        lag = GaugeMetricFamily(
            "aiooutbox_queue_lag_seconds",
            "Age of the oldest claimable event of each topic since it became due (0: none).",
            labels=["topic"],
        )
        updated = GaugeMetricFamily(
            "aiooutbox_queue_stats_timestamp_seconds",
            "Unix time of the last successful refresh of the queue gauges.",
        )
        snapshot = queue.snapshot if queue is not None else None
        if snapshot is not None:
            for (topic, status), rows in sorted(snapshot.depth.items()):
                depth.add_metric([topic, status], rows)
            for topic, seconds in sorted(snapshot.lag.items()):
                lag.add_metric([topic], seconds)
            updated.add_metric([], snapshot.at)
        yield depth
        yield lag
        yield updated


class QueueSnapshot:
    """One refresh: rows per (topic, status), lag per topic, and its wall time."""

    __slots__ = ("at", "depth", "lag")

    def __init__(self, rows: list[Any], at: float) -> None:
        self.at = at
        self.depth: dict[tuple[str, str], float] = {}
        self.lag: dict[str, float] = {}
        for topic, status, count, age in rows:
            self.depth[(topic, status)] = float(count)
            oldest = self.lag.get(topic, 0.0)
            self.lag[topic] = max(oldest, float(age)) if age is not None else oldest


class QueueGauges:
    """The periodic query behind the table-level gauges, one loop per process.

    Refreshes every ``interval`` seconds (jittered ±10%), and less often when the query
    gets slow (it reads every unfinished row): never more than 5% of the wall time. A
    failed refresh is logged; gauges older than three intervals are no longer served,
    so a stale number never looks current.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        schema: str = DEFAULT_SCHEMA,
        table: str = DEFAULT_TABLE,
        interval: float = 15.0,
        timeout: float = 10.0,
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise TypeError(f"interval must be seconds, not {type(interval).__name__}")
        if not 0.05 <= interval <= 3600:
            raise InvalidArgument(f"interval must be between 0.05 and 3600 seconds, got {interval}")
        self._pool = pool
        self._sql = queries(schema, table).queue_gauges
        self.interval = float(interval)
        self._timeout = timeout
        self._snapshot: QueueSnapshot | None = None
        self._fresh_until = 0.0
        self.refreshes = 0

    @property
    def snapshot(self) -> QueueSnapshot | None:
        if self._snapshot is None or time.monotonic() > self._fresh_until:
            return None
        return self._snapshot

    async def refresh(self) -> float:
        """Run the query once; return how long it took. Raises on database errors."""
        started = time.monotonic()
        rows = await bounded(self._pool, "fetch", self._sql, timeout=self._timeout)
        took = time.monotonic() - started
        self._snapshot = QueueSnapshot(list(rows), time.time())
        self._fresh_until = time.monotonic() + 3 * max(self.interval, took / _QUEUE_QUERY_SHARE)
        self.refreshes += 1
        return took

    async def attempt(self) -> float:
        """Refresh once, logging a failure; return the pause before the next one."""
        took = 0.0
        try:
            took = await self.refresh()
        except TRANSIENT_ERRORS as exc:
            logger.warning("queue gauges not refreshed (%s: %s)", type(exc).__name__, exc)
        return max(self.interval, took / _QUEUE_QUERY_SHARE)

    async def run(
        self,
        *,
        pause: float | None = None,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Refresh until cancelled (``await task_group.start(gauges.run)`` returns after
        the first attempt, successful or not). ``pause``: wait that long first."""
        if pause is None:
            pause = await self.attempt()
        task_status.started()
        while True:
            await anyio.sleep(pause * random.uniform(0.9, 1.1))
            pause = await self.attempt()


class MetricsServer:
    """``GET /metrics`` (Prometheus text, or OpenMetrics if asked) and ``GET /healthz``.

    ``async with MetricsServer(registry, health, port=9464) as server:`` binds at once,
    so a port in use raises `OSError` before anything else starts; ``server.port`` is
    the bound port (useful with ``port=0``). Each connection answers one request and is
    closed; a client that sends nothing for 10 s is dropped. Without ``health``,
    ``/healthz`` answers 404.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        health: ConsumerHealth | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 9464,
    ) -> None:
        if isinstance(port, bool) or not isinstance(port, int):
            raise TypeError(f"port must be an int, not {type(port).__name__}")
        if not 0 <= port <= 65535:
            raise InvalidArgument(f"port must be between 0 and 65535, got {port}")
        self.registry = REGISTRY if registry is None else registry
        self.health = health
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> MetricsServer:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        sockets = self._server.sockets
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        logger.info(
            "serving /metrics and /healthz on http://%s:%d",
            self.host if ":" not in self.host else f"[{self.host}]",
            self.port,
            extra={"metrics_host": self.host, "metrics_port": self.port},
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._connections):
            task.cancel()
        with anyio.CancelScope(shield=True):
            if self._connections:
                await asyncio.wait(list(self._connections), timeout=5)
            with anyio.move_on_after(5):
                await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            with anyio.move_on_after(10):
                status, headers, body = await self._answer(reader)
                head = f"HTTP/1.1 {status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
                head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                writer.write(head.encode("latin-1") + body)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the client went away, or sent garbage
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception), anyio.CancelScope(shield=True):
                with anyio.move_on_after(1):
                    await writer.wait_closed()

    async def _answer(
        self, reader: asyncio.StreamReader
    ) -> tuple[str, list[tuple[str, str]], bytes]:
        request = await reader.readuntil(b"\r\n\r\n")
        lines = request.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        target = rest.partition(" ")[0].partition("?")[0]
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in lines[1:] if line)
        }
        text = [("Content-Type", "text/plain; charset=utf-8")]
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", [*text, ("Allow", "GET, HEAD")], b"GET only\n"
        if target == "/metrics":
            encode, content_type = choose_encoder(headers.get("accept", ""))
            body = encode(self.registry)
            return "200 OK", [("Content-Type", content_type)], b"" if method == "HEAD" else body
        if target == "/healthz" and self.health is not None:
            import json

            result = await self.health.check()
            status = "200 OK" if result.ok else "503 Service Unavailable"
            body = (json.dumps(result.as_dict(), default=str) + "\n").encode()
            content = [("Content-Type", "application/json")]
            return status, content, b"" if method == "HEAD" else body
        return "404 Not Found", text, b"not found: try /metrics or /healthz\n"
