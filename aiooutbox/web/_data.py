"""What the overview and the consumers page show, read with the dashboard's bounded
statements; the backlog comes exact from `_backlog` (cached with the pulse), the
numbers over time from the consumers' per-minute counts (``<table>_rollups``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import asyncpg

from .._admin.counts import sample_percent
from .._engine.watchdog import MvccReport, inspect_mvcc
from .._sql.flow import ALL_TOPICS, flow_queries
from ._backlog import Backlog
from ._counts import BOUND, Count, estimated, exact
from ._sql import WebQueries
from ._workers import Worker, read_workers

__all__ = [
    "STATES",
    "Overview",
    "TopicRow",
    "age",
    "consumers",
    "overview",
    "when",
    "with_backlog",
    "PastHours",
]

# the states the dashboard counts: `pending` is due now, `scheduled` is pending and
# not due yet, `retry` failed and waits for its next attempt (due or not)
STATES = ("pending", "scheduled", "retry", "processing", "waiting", "done", "dead")
HOUR = 3600.0
DAY = 86400.0


@dataclass
class TopicRow:
    """One topic of the overview. ``extra`` holds columns other features add (shown
    after the built-in ones, in `Overview.extra_columns` order)."""

    topic: str
    pending: Count = field(default_factory=lambda: exact(0))
    scheduled: Count = field(default_factory=lambda: exact(0))
    retry: Count = field(default_factory=lambda: exact(0))
    due: Count = field(default_factory=lambda: exact(0))
    processing: Count = field(default_factory=lambda: exact(0))
    waiting: Count = field(default_factory=lambda: exact(0))
    dead: Count = field(default_factory=lambda: exact(0))
    done: Count = field(default_factory=lambda: exact(0))
    lag: float | None = None
    oldest: float | None = None  # epoch seconds the oldest due event became due
    done_hour: Count = field(default_factory=lambda: exact(0))
    done_day: Count = field(default_factory=lambda: exact(0))
    failed_hour: Count = field(default_factory=lambda: exact(0))
    died_day: Count = field(default_factory=lambda: exact(0))
    extra: dict[str, str] = field(default_factory=dict)
    consumed: bool = True  # False: due events and no consumer in sight

    @property
    def paused(self) -> bool:
        return self.extra.get("flow", "").startswith("paused")

    @property
    def unconsumed(self) -> bool:
        """Due events that nothing consumes (a paused topic waits by design)."""
        return bool(self.due) and not self.consumed and not self.paused


@dataclass
class Overview:
    topics: list[TopicRow]
    totals: dict[str, Count]
    hourly: list[tuple[int, int]]  # (done, failed) per hour, oldest first, the last 24
    workers: list[Worker]
    listeners: list[dict[str, Any]]
    hidden_sessions: int
    mvcc: MvccReport
    table_rows: Count
    backlog: Backlog | None = None
    extra_columns: list[tuple[str, str]] = field(default_factory=list)
    all_paused: bool = False  # `aiooutbox.admin.pause_all` holds every topic
    flow_unreadable: str | None = None  # why the flow columns are missing
    registry_unreadable: str | None = None  # why concurrency, host and heartbeat are missing
    rollups_unreadable: str | None = None  # why the numbers over time are missing
    ring_unreadable: str | None = None  # why `done` leaves out the ring's events

    @property
    def unconsumed(self) -> list[TopicRow]:
        return [t for t in self.topics if t.unconsumed]

    @property
    def hourly_done(self) -> list[Count]:
        return [exact(d) for d, _ in self.hourly]

    @property
    def hourly_failed(self) -> list[int]:
        return [f for _, f in self.hourly]


async def done_sample(conn: Any, w: WebQueries) -> tuple[dict[str, Count], str | None]:
    """``done`` rows by topic from a random sample of about `SAMPLE_PAGES` pages of the
    outbox and of its ring (every page of a small table: then the numbers are exact),
    and why the ring's are left out, if they are (a role without the grant)."""
    found: dict[str, Count] = {}
    unreadable = None
    for table, sql in ((w.outbox.qualified, w.sample), (w.outbox.done_table, w.ring_sample)):
        try:
            async with conn.transaction():  # a refusal must not abort the caller's
                percent = sample_percent(await conn.fetchval(w.pages, table))
                rows = await conn.fetch(sql, percent, float(int(time.time() // 600)))
        except asyncpg.InsufficientPrivilegeError:
            unreadable = (
                f"this dashboard's database role may not read {w.outbox.table}_done, where"
                " finished events go: GRANT SELECT on it to count them"
            )
            continue
        scale = 100.0 / percent
        for t, n in rows:
            part = exact(n) if percent >= 100.0 else estimated(n * scale)
            found[t] = found[t] + part if t in found else part
    return found, unreadable


class PastHours:
    """The per-minute counts of the day's past hours, by topic and hour: they no longer
    change once an hour is over (and its last flush, within a quarter-minute, is in), so
    they are read once an hour; the current hour is read with every overview."""

    GRACE = 60.0  # seconds into an hour before the one that ended is read for good

    def __init__(self) -> None:
        self._hour = -1.0
        self._rows: list[Any] = []

    async def read(self, conn: Any, w: WebQueries) -> list[Any]:
        now = time.time()
        hour = (now - self.GRACE) // 3600
        if hour != self._hour or now % 3600 < self.GRACE:
            self._rows = list(await conn.fetch(w.rollups_past_hours))
            self._hour = hour
        return self._rows


async def overview(conn: Any, w: WebQueries, past: PastHours | None = None) -> Overview:
    """Everything but the backlog, which `with_backlog` adds (each has a cache of its
    own: a page may show a view with the latest count of the backlog)."""
    topics: dict[str, TopicRow] = {}

    def row(name: str) -> TopicRow:
        return topics.setdefault(name, TopicRow(name))

    # 1. `done` from the page sample
    done, ring_unreadable = await done_sample(conn, w)
    for topic, n in done.items():
        row(topic).done = n
    # 2. running and waiting: exact below the bound (processing rows are few; waiting
    # ones are read through the key index)
    for status, sql in (("processing", w.processing_by_topic), ("waiting", w.waiting_by_topic)):
        found = {t: int(c) for t, c in await conn.fetch(sql, BOUND)}
        whole = sum(found.values()) < BOUND
        for topic, c in found.items():
            setattr(row(topic), status, exact(c) if whole else estimated(c))
    # 3. the lag of every topic with claimable events, exact (a skip scan)
    for topic, lag, oldest in await conn.fetch(w.topic_lags):
        if lag is not None and lag >= 0:
            row(topic).lag, row(topic).oldest = lag, oldest
    # 4. over time: what the consumers counted, per minute (survives retention, purges)
    hourly: list[tuple[int, int]] = [(0, 0)] * 24
    rollups_unreadable = None
    try:
        per_hour = [[0, 0] for _ in range(24)]
        days: dict[str, list[int]] = {}
        for topic, hours_ago, done, failed, dead in await (past or PastHours()).read(conn, w):
            day = days.setdefault(topic, [0, 0, 0, 0])
            day[0] += done
            day[1] += dead
            if 0 < hours_ago < 24:
                per_hour[23 - hours_ago][0] += done
                per_hour[23 - hours_ago][1] += failed
        for topic, this_hour, done, failed, dead in await conn.fetch(w.rollups_last_hour):
            day = days.setdefault(topic, [0, 0, 0, 0])
            day[2] += done
            day[3] += failed
            if this_hour:
                day[0] += done
                day[1] += dead
                per_hour[23][0] += done
                per_hour[23][1] += failed
        for topic, (done_day, died_day, done_hour, failed_hour) in days.items():
            r = row(topic)
            r.done_day, r.died_day = exact(done_day), exact(died_day)
            r.done_hour, r.failed_hour = exact(done_hour), exact(failed_hour)
        hourly = [(d, f) for d, f in per_hour]
    except (asyncpg.InsufficientPrivilegeError, asyncpg.UndefinedTableError):
        rollups_unreadable = (
            f"this dashboard's database role may not read {w.outbox.table}_rollups (or the"
            " outbox is not migrated): GRANT SELECT on it to show the numbers over time"
        )
    # 5. flow control: the controls table holds a row per paused or limited topic
    try:
        all_paused, flow_unreadable = await _flow_controls(conn, w, topics, row), None
    except asyncpg.InsufficientPrivilegeError:
        all_paused = False
        flow_unreadable = (
            f"this dashboard's database role may not read {w.outbox.table}_flow: GRANT SELECT"
            " on it to show each topic's pause and limits"
        )
    workers, listeners, hidden = await _consumers(conn, w)
    mvcc = await inspect_mvcc(conn, w.outbox)
    rows = sorted(topics.values(), key=lambda r: r.topic)
    mark_consumed(rows, workers[0])
    o = _overview(rows, hourly, workers, listeners, hidden, mvcc)
    if flow_unreadable is None:
        o.extra_columns = list(FLOW_COLUMNS)
    o.all_paused, o.flow_unreadable = all_paused, flow_unreadable
    o.rollups_unreadable = rollups_unreadable
    o.ring_unreadable = ring_unreadable
    return o


def with_backlog(o: Overview, backlog: Backlog) -> Overview:
    """``o`` with the backlog's counts (pending, scheduled, retrying, due, dead), the
    topics only the backlog knows added."""
    rows = {r.topic: replace(r, extra=dict(r.extra)) for r in o.topics}
    for topic in backlog.topics:
        if topic not in rows:
            rows[topic] = TopicRow(topic, consumed=any(handles(x, topic) for x in o.workers))
            if o.extra_columns:
                flow = "paused (every topic)" if o.all_paused else ""
                rows[topic].extra = {"flow": flow}
    for r in rows.values():
        b = backlog.of(r.topic)
        r.pending, r.scheduled, r.retry, r.due, r.dead = (
            b.pending,
            b.scheduled,
            b.retry,
            b.due,
            b.dead,
        )
    ordered = sorted(rows.values(), key=lambda r: r.topic)
    merged = _overview(
        ordered,
        o.hourly,
        (o.workers, o.registry_unreadable),
        o.listeners,
        o.hidden_sessions,
        o.mvcc,
    )
    merged.backlog = backlog
    merged.extra_columns, merged.all_paused = o.extra_columns, o.all_paused
    merged.flow_unreadable, merged.rollups_unreadable = o.flow_unreadable, o.rollups_unreadable
    merged.ring_unreadable = o.ring_unreadable
    return merged


FLOW_COLUMNS = (("flow", "flow"), ("max_running", "max running"), ("rate", "rate"))


def handles(worker: Worker, topic: str) -> bool:
    """Whether ``worker`` (alive, or seen through its leases or idle advert) consumes
    ``topic``; a consumer with a ``*`` handler consumes every topic."""
    if worker.state == "gone":
        return False
    shown = worker.shown_topics
    return "*" in shown or topic in shown or topic in worker.topics


def mark_consumed(rows: list[TopicRow], workers: list[Worker]) -> None:
    for r in rows:
        r.consumed = any(handles(w, r.topic) for w in workers)


async def _flow_controls(conn: Any, w: WebQueries, topics: dict[str, TopicRow], row: Any) -> bool:
    """Fill the flow columns of every controlled topic (adding the topics that have
    no events yet); whether every topic is paused. One read of the small controls table."""
    everything = False
    for c in await conn.fetch(flow_queries(w.outbox.schema, w.outbox.table).all_controls):
        if c["topic"] == ALL_TOPICS:
            everything = bool(c["paused"])
            continue
        extra = row(c["topic"]).extra
        extra["flow"] = "paused" if c["paused"] else ""
        extra["max_running"] = "" if c["max_running"] is None else str(c["max_running"])
        extra["rate"] = c["rate_text"] or ""
    for r in topics.values():
        r.extra.setdefault("flow", "")
        if everything and not r.extra["flow"]:
            r.extra["flow"] = "paused (every topic)"
    return everything


async def consumers(conn: Any, w: WebQueries) -> Overview:
    """What the consumers page shows: the overview's consumers, listeners and lags."""
    topics = [
        TopicRow(topic, lag=lag, oldest=oldest)
        for topic, lag, oldest in await conn.fetch(w.topic_lags)
    ]
    workers, listeners, hidden = await _consumers(conn, w)
    return _overview(topics, [], workers, listeners, hidden, MvccReport())


async def _consumers(
    conn: Any, w: WebQueries
) -> tuple[tuple[list[Worker], str | None], list[dict[str, Any]], int]:
    q = w.outbox
    workers = await read_workers(conn, w)
    listeners = [
        {
            "pid": r[0],
            "application_name": r[1],
            "user": r[2],
            "state": r[3],
            "age": r[4],
            "client": r[5],
        }
        for r in await conn.fetch(w.listeners, f'LISTEN "{q.channel}"')
    ]
    hidden = int(await conn.fetchval(w.hidden_sessions))
    return workers, listeners, hidden


def _overview(
    rows: list[TopicRow],
    hourly: list[tuple[int, int]],
    workers: tuple[list[Worker], str | None],
    listeners: list[dict[str, Any]],
    hidden: int,
    mvcc: MvccReport,
) -> Overview:
    totals = {
        name: sum((getattr(r, name) for r in rows), exact(0))
        for name in (*STATES, "due", "died_day", "done_hour", "done_day", "failed_hour")
    }
    return Overview(
        topics=rows,
        totals=totals,
        hourly=hourly,
        workers=workers[0],
        registry_unreadable=workers[1],
        listeners=listeners,
        hidden_sessions=hidden,
        mvcc=mvcc,
        table_rows=sum((totals[s] for s in STATES), exact(0)),
    )


def age(seconds: float | None) -> str:
    """``3s``, ``4m 05s``, ``2h 10m``, ``3d 4h`` (`static/dashboard.js` ticks the same)."""
    if seconds is None:
        return "\N{EN DASH}"
    s = int(seconds)
    if s < 0:
        return f"in {age(-seconds)}"
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def when(value: datetime | str | None) -> str:
    """A time in UTC; a str is one no datetime holds, shown as stored (`_times`)."""
    if value is None:
        return "\N{EN DASH}"
    return value if isinstance(value, str) else value.strftime("%Y-%m-%d %H:%M:%S UTC")
