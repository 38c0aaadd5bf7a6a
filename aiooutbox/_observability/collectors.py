"""What ``/metrics`` reads at scrape time: `OutboxMetrics`' counts as Prometheus families.

Counts are plain Python numbers updated on the event loop (`PlainHistogram`); the
collectors turn them, the consumers' gauges and the queue table's last snapshot into
metric families only when a scrape asks.

A process relaying several databases names each one (`OutboxMetrics.database`): then,
and only then, every family carries a ``database`` label first; a process with one
unnamed database serves the families exactly as before. Counts kept without a name
(``None``) are served with ``database=""`` beside named ones.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ..observe import ObservedConsumer
from .queue_gauges import QueueGauges

if TYPE_CHECKING:
    from .._engine.watchdog import MvccReport

__all__ = [
    "BATCH_BUCKETS",
    "CLAIM_BUCKETS",
    "ConsumerGauges",
    "EventCollector",
    "EventCounts",
    "MvccCollector",
    "PlainHistogram",
    "QueueCollector",
]

#: events per call of a batch handler
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 100000)
CLAIM_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

# the watchdog's holder kinds as label values; a fixed set, so the label stays bounded
_HOLDER_KINDS = {
    "backend": "backend",
    "prepared transaction": "prepared_transaction",
    "replication slot": "replication_slot",
}
_TIMED_KINDS = ("backend", "prepared_transaction")  # a slot has no start time

#: a database's name, as `OutboxMetrics.database` was given it; None: not named
Name = str | None


def _named(names: Iterable[Name]) -> bool:
    """Whether the families carry the ``database`` label: once any database is named."""
    return any(n is not None for n in names)


def _labels(named: bool, labels: list[str]) -> list[str]:
    return ["database", *labels] if named else labels


def _values(named: bool, name: Name, values: list[str]) -> list[str]:
    return [name or "", *values] if named else values


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


@dataclass
class EventCounts:
    """What `OutboxMetrics` counts on the event loop, read at scrape time."""

    handler_bounds: tuple[float, ...]
    outcomes: dict[tuple[str, str], int] = field(default_factory=dict)
    handler: dict[str, PlainHistogram] = field(default_factory=dict)
    claim: PlainHistogram = field(default_factory=lambda: PlainHistogram(CLAIM_BUCKETS))
    claimed: int = 0
    batch_sizes: dict[str, PlainHistogram] = field(default_factory=dict)

    @property
    def used(self) -> bool:
        """Whether anything was counted here."""
        return bool(self.outcomes or self.handler or self.claim.count or self.batch_sizes)


class EventCollector(Collector):
    """The counters and histograms `OutboxMetrics` keeps, as Prometheus families: one
    `EventCounts` per database name (``None``: the unnamed one)."""

    def __init__(self, counts: Mapping[Name, EventCounts]) -> None:
        self._counts = counts

    def describe(self) -> list[Metric]:
        return list(self._families())  # names only: lets the registry refuse duplicates

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(values=True))

    def _families(self, values: bool = False) -> list[Metric]:
        every = dict(self._counts)
        named = _named(every)
        if named and every.get(None) is not None and not every[None].used:
            del every[None]  # the unnamed counts of a process that names its databases
        events = CounterMetricFamily(
            "aiooutbox_events",
            "Outcomes recorded by this process: done, retry, dead, released.",
            labels=_labels(named, ["topic", "outcome"]),
        )
        handler = HistogramMetricFamily(
            "aiooutbox_handler_duration_seconds",
            "Wall time of one handler run, whatever its outcome.",
            labels=_labels(named, ["topic"]),
        )
        claim = HistogramMetricFamily(
            "aiooutbox_claim_duration_seconds",
            "Round trip of one claim statement, empty claims included.",
            labels=_labels(named, []),
        )
        claimed = CounterMetricFamily(
            "aiooutbox_claimed", "Events claimed by this process.", labels=_labels(named, [])
        )
        claims = CounterMetricFamily(
            "aiooutbox_claims", "Claim statements run by this process.", labels=_labels(named, [])
        )
        batches = HistogramMetricFamily(
            "aiooutbox_batch_size",
            "Events per call of a batch handler.",
            labels=_labels(named, ["topic"]),
        )
        if values:
            for name, m in sorted(every.items(), key=lambda item: item[0] or ""):
                for (topic, outcome), n in sorted(m.outcomes.items()):
                    events.add_metric(_values(named, name, [topic, outcome]), n)
                for topic, h in sorted(m.handler.items()):
                    handler.add_metric(_values(named, name, [topic]), h.buckets(), h.sum)
                claim.add_metric(_values(named, name, []), m.claim.buckets(), m.claim.sum)
                claimed.add_metric(_values(named, name, []), m.claimed)
                claims.add_metric(_values(named, name, []), m.claim.count)
                for topic, h in sorted(m.batch_sizes.items()):
                    batches.add_metric(_values(named, name, [topic]), h.buckets(), h.sum)
        return [events, handler, claim, claimed, claims, batches]


#: the consumers an `OutboxMetrics` observes, each with the name of its database
Consumers = weakref.WeakKeyDictionary[ObservedConsumer, Name]


def _by_database(consumers: Consumers) -> dict[Name, list[ObservedConsumer]]:
    grouped: dict[Name, list[ObservedConsumer]] = {}
    for consumer, name in list(consumers.items()):
        grouped.setdefault(name, []).append(consumer)
    return grouped


class ConsumerGauges(Collector):
    """Gauges read from the consumers at scrape time, never pushed."""

    def __init__(self, consumers: Consumers) -> None:
        self._consumers = consumers

    def describe(self) -> list[Metric]:
        return []  # dynamic: keeps the registry from calling collect() at register time

    def collect(self) -> Iterator[Metric]:
        grouped = _by_database(self._consumers)
        named = _named(grouped)
        in_flight = GaugeMetricFamily(
            "aiooutbox_in_flight",
            "Events claimed by this process's consumers and not yet settled.",
            labels=_labels(named, []),
        )
        backlog = GaugeMetricFamily(
            "aiooutbox_settle_backlog",
            "Outcomes recorded but not yet written to the database.",
            labels=_labels(named, []),
        )
        connected = GaugeMetricFamily(
            "aiooutbox_listener_connected",
            "1 while every listening consumer's LISTEN connection is up, else 0.",
            labels=_labels(named, []),
        )
        if not grouped:
            grouped = {None: []}
        for name, consumers in sorted(grouped.items(), key=lambda item: item[0] or ""):
            running = [c for c in consumers if c.running]
            key = _values(named, name, [])
            in_flight.add_metric(key, sum(c.stats.in_flight for c in running))
            backlog.add_metric(key, sum(c.settle_backlog for c in running))
            listening = [c for c in running if c.options.listen]
            if listening:
                connected.add_metric(key, 1.0 if all(c.listening for c in listening) else 0.0)
        yield in_flight
        yield backlog
        yield connected


class MvccCollector(Collector):
    """The MVCC watchdog's last readings, taken from the running consumers at scrape time.

    No query of its own: each consumer's watchdog reads the catalogs every
    ``watchdog_interval`` (`_watchdog.Watchdog.latest`). Per outbox table the newest
    reading is served; the horizon is the database's, so its gauges take the highest
    value over those readings. Kinds with no holder among the oldest the watchdog
    reads are 0; with no fresh reading (watchdog off, not checked yet, checks failing
    for three intervals) the families are empty.
    """

    def __init__(self, consumers: Consumers) -> None:
        self._consumers = consumers

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        grouped = _by_database(self._consumers)
        named = _named(grouped)
        newest: dict[tuple[str, str], MvccReport] = {}
        for name, consumers in grouped.items():
            for consumer in consumers:
                report = consumer.mvcc if consumer.running else None
                if report is None:
                    continue
                q = consumer.options.queries
                key = (name or "", f"{q.schema}.{q.table}")
                if key not in newest or report.checked_at > newest[key].checked_at:
                    newest[key] = report
        age = GaugeMetricFamily(
            "aiooutbox_xmin_horizon_age_seconds",
            "Seconds the oldest backend or prepared transaction holding the xmin horizon"
            " had been open at the last watchdog check, by kind (0: none).",
            labels=_labels(named, ["holder"]),
        )
        xid_age = GaugeMetricFamily(
            "aiooutbox_xmin_horizon_xid_age",
            "Transaction ids between the horizon held by the oldest holder of each kind"
            " and now, at the last watchdog check (0: none).",
            labels=_labels(named, ["holder"]),
        )
        dead = GaugeMetricFamily(
            "aiooutbox_dead_tuples",
            "Dead tuples of the outbox table (pg_stat_user_tables.n_dead_tup).",
            labels=_labels(named, ["table"]),
        )
        live = GaugeMetricFamily(
            "aiooutbox_live_tuples",
            "Live tuples of the outbox table (pg_stat_user_tables.n_live_tup).",
            labels=_labels(named, ["table"]),
        )
        checked = GaugeMetricFamily(
            "aiooutbox_mvcc_check_timestamp_seconds",
            "Unix time of the watchdog reading the MVCC gauges come from.",
            labels=_labels(named, ["table"]),
        )
        # the horizon is one database's (each its own server, as far as we know)
        for database in sorted({d for d, _ in newest}):
            ages = dict.fromkeys(_TIMED_KINDS, 0.0)
            xids = dict.fromkeys(_HOLDER_KINDS.values(), 0.0)
            for (d, _), report in newest.items():
                if d != database:
                    continue
                for holder in report.holders:
                    kind = _HOLDER_KINDS.get(holder.kind)
                    if kind is None:
                        continue
                    if holder.age is not None and kind in ages:
                        ages[kind] = max(ages[kind], holder.age)
                    if holder.xid_age is not None:
                        xids[kind] = max(xids[kind], float(holder.xid_age))
            for kind, seconds in ages.items():
                age.add_metric(_values(named, database, [kind]), seconds)
            for kind, count in xids.items():
                xid_age.add_metric(_values(named, database, [kind]), count)
        for (database, table), report in sorted(newest.items()):
            labelled = _values(named, database, [table])
            if report.dead_tuples is not None:
                dead.add_metric(labelled, float(report.dead_tuples))
            if report.live_tuples is not None:
                live.add_metric(labelled, float(report.live_tuples))
            checked.add_metric(labelled, report.checked_at)
        yield age
        yield xid_age
        yield dead
        yield live
        yield checked


class QueueCollector(Collector):
    """The queue tables' gauges, from the last snapshot of each loop ``current`` returns
    (one per database name; ``None``: the unnamed one)."""

    def __init__(self, current: Callable[[], Mapping[Name, QueueGauges]]) -> None:
        self._current = current

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        queues = dict(self._current())
        named = _named(queues)
        depth = GaugeMetricFamily(
            "aiooutbox_queue_depth",
            "Unfinished events by topic and status (pending: due now; scheduled: pending,"
            " not due yet; retry, processing, waiting).",
            labels=_labels(named, ["topic", "status"]),
        )
        lag = GaugeMetricFamily(
            "aiooutbox_queue_lag_seconds",
            "Age of the oldest claimable event of each topic since it became due (0: none).",
            labels=_labels(named, ["topic"]),
        )
        updated = GaugeMetricFamily(
            "aiooutbox_queue_stats_timestamp_seconds",
            "Unix time of the last successful refresh of the queue gauges.",
            labels=_labels(named, []),
        )
        paused = GaugeMetricFamily(
            "aiooutbox_topic_paused",
            '1 for each paused topic (topic="*": every topic is paused).',
            labels=_labels(named, ["topic"]),
        )
        max_running = GaugeMetricFamily(
            "aiooutbox_topic_max_running",
            "The limit on events of the topic claimed at once, across all consumers.",
            labels=_labels(named, ["topic"]),
        )
        grouped = GaugeMetricFamily(
            "aiooutbox_group_events",
            "Events of the busiest groups (state running: claimed now) and of the most waiting"
            " (state due), the top 10 of each over every topic.",
            labels=_labels(named, ["topic", "group", "state"]),
        )
        rate = GaugeMetricFamily(
            "aiooutbox_topic_rate_limit",
            "The limit on claims of the topic, in events per second.",
            labels=_labels(named, ["topic"]),
        )
        for name, queue in sorted(queues.items(), key=lambda item: item[0] or ""):
            snapshot = queue.snapshot
            if snapshot is None:
                continue
            for (topic, status), rows in sorted(snapshot.depth.items()):
                depth.add_metric(_values(named, name, [topic, status]), rows)
            for topic, seconds in sorted(snapshot.lag.items()):
                lag.add_metric(_values(named, name, [topic]), seconds)
            updated.add_metric(_values(named, name, []), snapshot.at)
            for (topic, group, state), events in sorted(snapshot.groups.items()):
                grouped.add_metric(_values(named, name, [topic, group, state]), events)
            for topic, (is_paused, most, per_second) in sorted(snapshot.controls.items()):
                if is_paused:
                    paused.add_metric(_values(named, name, [topic]), 1.0)
                if most is not None:
                    max_running.add_metric(_values(named, name, [topic]), float(most))
                if per_second is not None:
                    rate.add_metric(_values(named, name, [topic]), per_second)
        yield depth
        yield lag
        yield updated
        yield paused
        yield max_running
        yield rate
        yield grouped
