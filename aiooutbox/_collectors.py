"""What ``/metrics`` reads at scrape time: `OutboxMetrics`' counts as Prometheus families.

Counts are plain Python numbers updated on the event loop (`PlainHistogram`); the
collectors turn them, the consumers' gauges and the queue table's last snapshot into
metric families only when a scrape asks.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ._watchdog import MvccReport
    from .consumer import OutboxConsumer
    from .metrics import OutboxMetrics

__all__ = ["ConsumerGauges", "EventCollector", "MvccCollector", "PlainHistogram", "QueueCollector"]

# the watchdog's holder kinds as label values; a fixed set, so the label stays bounded
_HOLDER_KINDS = {
    "backend": "backend",
    "prepared transaction": "prepared_transaction",
    "replication slot": "replication_slot",
}
_TIMED_KINDS = ("backend", "prepared_transaction")  # a slot has no start time


class PlainHistogram:
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


class EventCollector(Collector):
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


class ConsumerGauges(Collector):
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


class MvccCollector(Collector):
    """The MVCC watchdog's last readings, taken from the running consumers at scrape time.

    No query of its own: each consumer's watchdog reads the catalogs every
    ``watchdog_interval`` (`_watchdog.Watchdog.latest`). Per outbox table the newest
    reading is served; the horizon is the database's, so its gauges take the highest
    value over those readings. Kinds with no holder among the oldest the watchdog
    reads are 0; with no fresh reading (watchdog off, not checked yet, checks failing
    for three intervals) the families are empty.
    """

    def __init__(self, consumers: weakref.WeakSet[OutboxConsumer]) -> None:
        self._consumers = consumers

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        newest: dict[str, MvccReport] = {}
        for consumer in list(self._consumers):
            report = consumer.mvcc if consumer.running else None
            if report is None:
                continue
            q = consumer.options.queries
            table = f"{q.schema}.{q.table}"
            if table not in newest or report.checked_at > newest[table].checked_at:
                newest[table] = report
        age = GaugeMetricFamily(
            "aiooutbox_xmin_horizon_age_seconds",
            "Seconds the oldest backend or prepared transaction holding the xmin horizon"
            " had been open at the last watchdog check, by kind (0: none).",
            labels=["holder"],
        )
        xid_age = GaugeMetricFamily(
            "aiooutbox_xmin_horizon_xid_age",
            "Transaction ids between the horizon held by the oldest holder of each kind"
            " and now, at the last watchdog check (0: none).",
            labels=["holder"],
        )
        dead = GaugeMetricFamily(
            "aiooutbox_dead_tuples",
            "Dead tuples of the outbox table (pg_stat_user_tables.n_dead_tup).",
            labels=["table"],
        )
        live = GaugeMetricFamily(
            "aiooutbox_live_tuples",
            "Live tuples of the outbox table (pg_stat_user_tables.n_live_tup).",
            labels=["table"],
        )
        checked = GaugeMetricFamily(
            "aiooutbox_mvcc_check_timestamp_seconds",
            "Unix time of the watchdog reading the MVCC gauges come from.",
            labels=["table"],
        )
        if newest:
            ages = dict.fromkeys(_TIMED_KINDS, 0.0)
            xids = dict.fromkeys(_HOLDER_KINDS.values(), 0.0)
            for report in newest.values():
                for holder in report.holders:
                    kind = _HOLDER_KINDS.get(holder.kind)
                    if kind is None:
                        continue
                    if holder.age is not None and kind in ages:
                        ages[kind] = max(ages[kind], holder.age)
                    if holder.xid_age is not None:
                        xids[kind] = max(xids[kind], float(holder.xid_age))
            for kind, seconds in ages.items():
                age.add_metric([kind], seconds)
            for kind, count in xids.items():
                xid_age.add_metric([kind], count)
            for table, report in sorted(newest.items()):
                if report.dead_tuples is not None:
                    dead.add_metric([table], float(report.dead_tuples))
                if report.live_tuples is not None:
                    live.add_metric([table], float(report.live_tuples))
                checked.add_metric([table], report.checked_at)
        yield age
        yield xid_age
        yield dead
        yield live
        yield checked


class QueueCollector(Collector):
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
        paused = GaugeMetricFamily(
            "aiooutbox_topic_paused",
            '1 for each paused topic (topic="*": every topic is paused).',
            labels=["topic"],
        )
        max_running = GaugeMetricFamily(
            "aiooutbox_topic_max_running",
            "The limit on events of the topic claimed at once, across all consumers.",
            labels=["topic"],
        )
        rate = GaugeMetricFamily(
            "aiooutbox_topic_rate_limit",
            "The limit on claims of the topic, in events per second.",
            labels=["topic"],
        )
        snapshot = queue.snapshot if queue is not None else None
        if snapshot is not None:
            for (topic, status), rows in sorted(snapshot.depth.items()):
                depth.add_metric([topic, status], rows)
            for topic, seconds in sorted(snapshot.lag.items()):
                lag.add_metric([topic], seconds)
            updated.add_metric([], snapshot.at)
            for topic, (is_paused, most, per_second) in sorted(snapshot.controls.items()):
                if is_paused:
                    paused.add_metric([topic], 1.0)
                if most is not None:
                    max_running.add_metric([topic], float(most))
                if per_second is not None:
                    rate.add_metric([topic], per_second)
        yield depth
        yield lag
        yield updated
        yield paused
        yield max_running
        yield rate
