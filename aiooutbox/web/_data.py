"""What each page shows, read from PostgreSQL with the dashboard's bounded statements."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from .._admin.counts import SAMPLE_PAGES, sample_percent
from .._admin.records import STATUSES
from .._engine.watchdog import MvccReport, inspect_mvcc
from .._sql.flow import ALL_TOPICS, flow_queries
from ._counts import BOUND, Count, bounded, estimate_rows, estimated, exact
from ._filters import PAGE, WINDOW, EventFilter
from ._sql import WebQueries
from ._workers import Worker, read_workers

__all__ = ["Overview", "TopicRow", "event_page", "load_event", "overview"]

HOUR = 3600.0
DAY = 86400.0
# how long a page may spend counting its matches exactly before it estimates
COUNT_TIME = 0.1


@dataclass
class TopicRow:
    """One topic of the overview. ``extra`` holds columns other features add (shown
    after the built-in ones, in `Overview.extra_columns` order)."""

    topic: str
    pending: Count = field(default_factory=lambda: exact(0))
    retry: Count = field(default_factory=lambda: exact(0))
    due: Count = field(default_factory=lambda: exact(0))
    processing: Count = field(default_factory=lambda: exact(0))
    waiting: Count = field(default_factory=lambda: exact(0))
    dead: Count = field(default_factory=lambda: exact(0))
    done: Count = field(default_factory=lambda: exact(0))
    lag: float | None = None
    done_hour: Count = field(default_factory=lambda: exact(0))
    done_day: Count = field(default_factory=lambda: exact(0))
    died_day: Count = field(default_factory=lambda: exact(0))
    extra: dict[str, str] = field(default_factory=dict)


@dataclass
class Overview:
    topics: list[TopicRow]
    totals: dict[str, Count]
    done_hour: Count
    done_day: Count
    hourly: list[Count]  # done per hour, oldest first, the last 24 hours
    workers: list[Worker]
    listeners: list[dict[str, Any]]
    hidden_sessions: int
    mvcc: MvccReport
    table_rows: Count
    extra_columns: list[tuple[str, str]] = field(default_factory=list)
    all_paused: bool = False  # `aiooutbox.admin.pause_all` holds every topic
    flow_unreadable: str | None = None  # why the flow columns are missing
    registry_unreadable: str | None = None  # why concurrency, host and heartbeat are missing


async def _sample(conn: Any, w: WebQueries) -> tuple[float, bool, list[Any]]:
    """Rows by topic and status in a random sample of about `SAMPLE_PAGES` pages
    (every page of a small table: then the numbers are exact)."""
    pages = await conn.fetchval(w.pages, w.outbox.qualified)
    percent = sample_percent(pages)
    sample = await conn.fetch(w.sample, percent, float(int(time.time() // 600)))
    return 100.0 / percent, percent >= 100.0, sample


async def overview(conn: Any, w: WebQueries) -> Overview:
    q = w.outbox
    topics: dict[str, TopicRow] = {}

    def row(name: str) -> TopicRow:
        return topics.setdefault(name, TopicRow(name))

    # 1. every number from a sample of the table (exact when the sample is the table)
    scale, whole, sample = await _sample(conn, w)

    def counted(n: float) -> Count:
        return exact(int(n)) if whole else estimated(n * scale)

    hourly = [0] * 24
    for topic, status, hour, n, died, due in sample:
        r = row(topic)
        if status in STATUSES:
            setattr(r, status, getattr(r, status) + counted(n))
        if hour is not None:
            r.done_day += counted(n)
            if hour == 0:
                r.done_hour += counted(n)
            hourly[min(max(hour, 0), 23)] += n
        r.died_day += counted(died)
        r.due += counted(due)
    hourly_counts = [counted(hourly[h]) for h in range(23, -1, -1)]

    # 2. exact counts wherever an index reaches the rows within the bound
    # (skipped when the sample already shows far more than the bound)
    def few(*names: str) -> bool:
        total: int = sum(getattr(r, n).value for r in topics.values() for n in names)
        return total < 2 * BOUND

    if not whole:
        if few("pending", "retry") and await conn.fetchval(w.claimable_count, BOUND) < BOUND:
            for r in topics.values():
                r.pending = r.retry = r.due = exact(0)
            for topic, pending, retry, due in await conn.fetch(w.claimable_by_topic):
                r = row(topic)
                r.pending, r.retry, r.due = exact(pending), exact(retry), exact(due)
        for status, sql in (
            ("processing", w.processing_by_topic),
            ("waiting", w.waiting_by_topic),
        ):
            found = {t: int(n) for t, n in await conn.fetch(sql, BOUND)}
            if sum(found.values()) < BOUND:
                for r in topics.values():
                    setattr(r, status, exact(found.pop(r.topic, 0)))
                for topic, n in found.items():
                    setattr(row(topic), status, exact(n))
        dead = {t: (int(n), int(d)) for t, n, d in await conn.fetch(w.dead_by_topic, BOUND)}
        if sum(n for n, _ in dead.values()) < BOUND:
            for r in topics.values():
                r.dead, r.died_day = (exact(x) for x in dead.pop(r.topic, (0, 0)))
            for topic, (n, d) in dead.items():
                row(topic).dead, row(topic).died_day = exact(n), exact(d)
        if few("done_day") and await conn.fetchval(w.finished_since, DAY, BOUND) < BOUND:
            for r in topics.values():
                r.done_hour = r.done_day = exact(0)
            by_hour = [0] * 24
            for topic, h, n in await conn.fetch(w.finished_by_topic, DAY):
                r = row(topic)
                r.done_day = exact(r.done_day.value + n)
                if h == 0:
                    r.done_hour = exact(r.done_hour.value + n)
                by_hour[min(max(h, 0), 23)] += n
            hourly_counts = [exact(by_hour[h]) for h in range(23, -1, -1)]
    # 3. the lag of every topic with claimable events, exact (a skip scan)
    for topic, lag in await conn.fetch(w.topic_lags):
        row(topic).lag = lag if lag is not None and lag >= 0 else None

    # 4. flow control: the controls table holds a row per paused or limited topic
    try:
        all_paused, flow_unreadable = await _flow_controls(conn, w, topics, row), None
    except asyncpg.InsufficientPrivilegeError:
        all_paused = False
        flow_unreadable = (
            f"this dashboard's database role may not read {w.outbox.table}_flow: GRANT SELECT"
            " on it to show each topic's pause and limits"
        )

    workers, listeners, hidden = await _consumers(conn, w)
    mvcc = await inspect_mvcc(conn, q)
    rows = sorted(topics.values(), key=lambda r: r.topic)
    o = _overview(rows, hourly_counts, workers, listeners, hidden, mvcc)
    if flow_unreadable is None:
        o.extra_columns = list(FLOW_COLUMNS)
    o.all_paused, o.flow_unreadable = all_paused, flow_unreadable
    return o


FLOW_COLUMNS = (("flow", "flow"), ("max_running", "max running"), ("rate", "rate"))


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
    topics = [TopicRow(topic, lag=lag) for topic, lag in await conn.fetch(w.topic_lags)]
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
    hourly_counts: list[Count],
    workers: tuple[list[Worker], str | None],
    listeners: list[dict[str, Any]],
    hidden: int,
    mvcc: MvccReport,
) -> Overview:
    totals = {
        name: sum((getattr(r, name) for r in rows), exact(0))
        for name in (
            "pending",
            "retry",
            "due",
            "processing",
            "waiting",
            "dead",
            "died_day",
            "done",
            "done_hour",
            "done_day",
        )
    }
    return Overview(
        topics=rows,
        totals=totals,
        done_hour=totals["done_hour"],
        done_day=totals["done_day"],
        hourly=hourly_counts,
        workers=workers[0],
        registry_unreadable=workers[1],
        listeners=listeners,
        hidden_sessions=hidden,
        mvcc=mvcc,
        table_rows=sum((getattr(r, s) for r in rows for s in STATUSES), exact(0)),
    )


# -- events ---------------------------------------------------------------------------
@dataclass
class EventPage:
    rows: list[dict[str, Any]]
    count: Count
    next_before: int | None  # the cursor of the next (older) page, if any
    window: tuple[int, int] | None  # ids searched, when the filter needs a window
    newest: int | None


def _where(w: WebQueries, f: EventFilter, **kwargs: Any) -> tuple[str, list[Any]]:
    return f.where(**kwargs)


async def count_matching(conn: Any, w: WebQueries, f: EventFilter) -> Count:
    """How many events match: counted exactly when an index (or a table of at most
    `SAMPLE_PAGES` pages) finds fewer than `BOUND` within `COUNT_TIME`, else the
    planner's estimate."""
    where, args = _where(w, f, cursor=False)
    if not f.indexed and await conn.fetchval(w.pages, w.outbox.qualified) > SAMPLE_PAGES:
        # no index to follow and too many rows to read: the planner's word
        return estimated(await estimate_rows(conn, w.explain_count(where), *args))
    try:
        async with conn.transaction():
            await conn.execute(f"SET LOCAL statement_timeout = {int(COUNT_TIME * 1000)}")
            n = int(await conn.fetchval(w.event_count(where, len(args) + 1), *args, BOUND))
    except asyncpg.QueryCanceledError:
        n = BOUND
    if n < BOUND:
        return exact(n)
    return bounded(BOUND, BOUND, await estimate_rows(conn, w.explain_count(where), *args))


async def event_page(conn: Any, w: WebQueries, f: EventFilter, *, size: int = PAGE) -> EventPage:
    newest = await conn.fetchval(f"SELECT max(id) FROM {w.t}")
    window = None
    floor = None
    if not f.indexed and newest is not None:
        top = f.before if f.before is not None else newest + 1
        floor = max(top - WINDOW, 0)
        window = (floor, top)
    where, args = _where(w, f, floor=floor)
    rows = await conn.fetch(w.event_list(where, len(args) + 1), *args, size + 1)
    more = len(rows) > size
    rows = rows[:size]
    if more:
        next_before = rows[-1][0]
    elif window is not None and window[0] > 0:
        next_before = window[0]  # nothing more in this window: search the older one
    else:
        next_before = None
    keys = [
        "id",
        "topic",
        "status",
        "ordering_key",
        "dedupe_key",
        "attempts",
        "max_attempts",
        "created_at",
        "available_at",
        "finished_at",
        "last_error",
        "locked_by",
    ]
    return EventPage(
        rows=[dict(zip(keys, r, strict=True)) for r in rows],
        count=await count_matching(conn, w, f),
        next_before=next_before,
        window=window,
        newest=newest,
    )


@dataclass
class EventDetail:
    fields: dict[str, Any]
    payload: str
    headers: str
    trace_id: str | None
    ahead: Count | None = None  # unfinished events of its key before it
    head: int | None = None


def pretty(text: str) -> str:
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False, sort_keys=True)
    except ValueError:
        return text


def trace_id_of(headers: str) -> str | None:
    """The trace id of a W3C ``traceparent`` header, if well formed."""
    try:
        parent = json.loads(headers).get("traceparent")
    except (ValueError, AttributeError):
        return None
    if not isinstance(parent, str):
        return None
    parts = parent.split("-")
    trace = parts[1] if len(parts) >= 4 else ""
    if len(trace) == 32 and all(c in "0123456789abcdef" for c in trace) and trace != "0" * 32:
        return trace
    return None


async def load_event(conn: Any, w: WebQueries, event_id: int) -> EventDetail | None:
    r = await conn.fetchrow(w.event, event_id)
    if r is None:
        return None
    names = [
        "id",
        "topic",
        "status",
        "ordering_key",
        "dedupe_key",
        "attempts",
        "max_attempts",
        "created_at",
        "available_at",
        "updated_at",
        "finished_at",
        "locked_by",
        "locked_at",
        "lease_expires_at",
        "last_error",
    ]
    detail = EventDetail(
        fields={n: r[n] for n in names} | {"message_id": r["message_id"]},
        payload=pretty(r["payload"]),
        headers=pretty(r["headers"]),
        trace_id=trace_id_of(r["headers"]),
    )
    key = r["ordering_key"]
    if key is not None and (r["status"] in ("pending", "retry", "processing", "waiting")):
        n, head = await conn.fetchrow(w.key_position, key, event_id, BOUND)
        detail.ahead = Count(int(n), n < BOUND)
        detail.head = head
    return detail


async def blocked_keys(conn: Any, w: WebQueries, limit: int = 200) -> list[dict[str, Any]]:
    heads = [dict(r.items()) for r in await conn.fetch(w.blocked_heads, limit)]
    if heads:
        keys = [h["ordering_key"] for h in heads]
        waiting = {k: int(n) for k, n in await conn.fetch(w.waiting_of_keys, keys, BOUND)}
        for h in heads:
            n = waiting.get(h["ordering_key"], 0)
            h["waiting"] = Count(n, n < BOUND)
    return heads


async def audit_entries(
    conn: Any, w: WebQueries, before: int | None, limit: int = 100
) -> list[dict[str, Any]]:
    return [dict(r.items()) for r in await conn.fetch(w.audit_list, before, limit)]


def age(seconds: float | None) -> str:
    """``3s``, ``4m 05s``, ``2h 10m``, ``3d 4h``."""
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


def when(value: datetime | None) -> str:
    return "\N{EN DASH}" if value is None else value.strftime("%Y-%m-%d %H:%M:%S UTC")
