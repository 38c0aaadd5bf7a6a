"""What each page shows, read from PostgreSQL with the dashboard's bounded statements."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .._watchdog import MvccReport, inspect_mvcc
from ._counts import BOUND, Count, bounded, estimate_rows, estimated, exact
from ._filters import PAGE, WINDOW, EventFilter
from ._sql import WebQueries

__all__ = ["Overview", "TopicRow", "event_page", "load_event", "overview"]

HOUR = 3600.0
DAY = 86400.0
SAMPLE = 20_000  # newest done events read to split a window's total by topic
WINDOW_BOUND = 2_000_000  # done events a window count may visit (index-only)


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
class Worker:
    worker_id: str
    held: int = 0
    oldest_claim: float | None = None
    lease_left: float | None = None  # seconds until its latest lease expires
    topics: list[str] = field(default_factory=list)
    idle_topics: list[str] | None = None
    idle_left: float | None = None

    @property
    def relay(self) -> bool:
        return self.worker_id.startswith("relay ")


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


def _by_topic(rows: list[Any]) -> dict[str, int]:
    return {r[0]: int(r[1]) for r in rows}


async def _bounded_by_topic(
    conn: Any, sql: str, *args: object, bound: int = BOUND
) -> tuple[dict[str, int], bool]:
    rows = _by_topic(await conn.fetch(sql, *args, bound))
    return rows, sum(rows.values()) < bound


async def _status_estimates(conn: Any, w: WebQueries) -> tuple[float, dict[str, float]]:
    """reltuples and each status's share as ANALYZE saw it."""
    q = w.outbox
    row = await conn.fetchrow(w.table_estimate, q.schema, q.table, q.qualified)
    total = max(float(row[0] or 0.0), 0.0)
    shares: dict[str, float] = {}
    if row[1]:
        names = row[1].strip("{}").split(",")
        shares = dict(zip(names, row[2] or [], strict=False))
    return total, shares


async def overview(conn: Any, w: WebQueries) -> Overview:
    q = w.outbox
    topics: dict[str, TopicRow] = {}

    def row(name: str) -> TopicRow:
        return topics.setdefault(name, TopicRow(name))

    for record in await conn.fetch(w.claimable_by_topic):
        r = row(record[0])
        r.pending, r.due, r.lag = exact(record[1]), exact(record[2]), record[3]
    retry, retry_exact = await _bounded_by_topic(conn, w.retry_by_topic)
    for topic, n in retry.items():
        r = row(topic)
        r.retry = Count(n, retry_exact)
        r.pending = Count(max(r.pending.value - n, 0), retry_exact)
    for topic, n in await conn.fetch(w.processing_by_topic):
        row(topic).processing = exact(n)
    waiting, waiting_exact = await _bounded_by_topic(conn, w.waiting_by_topic)
    for topic, n in waiting.items():
        row(topic).waiting = Count(n, waiting_exact)
    dead, dead_exact = await _bounded_by_topic(conn, w.dead_by_topic)
    for topic, n in dead.items():
        row(topic).dead = Count(n, dead_exact)
    died, died_exact = await _bounded_by_topic(conn, w.failed_since, DAY)
    for topic, n in died.items():
        row(topic).died_day = Count(n, died_exact)

    reltuples, shares = await _status_estimates(conn, w)
    done_total = reltuples * shares.get("done", 0.0)
    hour, hour_topics = await _window(conn, w, HOUR)
    day, day_topics = await _window(conn, w, DAY)
    for name, in_hour in hour_topics.items():
        row(name).done_hour = in_hour
    for name, in_day in day_topics.items():
        row(name).done_day = in_day
    # done per topic: the table's done estimate split like the last day's throughput
    day_sum = sum(c.value for c in day_topics.values())
    for r in topics.values():
        share = r.done_day.value / day_sum if day_sum else 1 / max(len(topics), 1)
        r.done = estimated(done_total * share)

    workers = await _workers(conn, w)
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
    mvcc = await inspect_mvcc(conn, q)
    rows = sorted(topics.values(), key=lambda r: r.topic)
    totals = {
        name: sum((getattr(r, name) for r in rows), exact(0))
        for name in ("pending", "retry", "due", "processing", "waiting", "dead", "died_day")
    }
    totals["done"] = estimated(done_total)
    return Overview(
        topics=rows,
        totals=totals,
        done_hour=hour,
        done_day=day,
        hourly=await _hourly(conn, w, day),
        workers=workers,
        listeners=listeners,
        hidden_sessions=hidden,
        mvcc=mvcc,
        table_rows=estimated(reltuples),
    )


async def _window(conn: Any, w: WebQueries, seconds: float) -> tuple[Count, dict[str, Count]]:
    """Done events finished in the last ``seconds``: the total (exact up to a bound) and
    by topic (exact when the newest `SAMPLE` cover the window, else a proportional
    estimate from them)."""
    total = int(await conn.fetchval(w.finished_since, seconds, WINDOW_BOUND))
    if total >= WINDOW_BOUND:
        explain = (
            f"EXPLAIN (FORMAT JSON) SELECT 1 FROM {w.t} WHERE status = 'done'"
            " AND finished_at > now() - make_interval(secs => $1::float8)"
        )
        count = estimated(max(await estimate_rows(conn, explain, seconds), total))
    else:
        count = exact(total)
    sample = await conn.fetch(w.finished_sample, seconds, SAMPLE)
    by_topic = Counter(r[0] for r in sample)
    if len(sample) >= total:
        return count, {t: exact(n) for t, n in by_topic.items()}
    scale = count.value / max(len(sample), 1)
    return count, {t: estimated(n * scale) for t, n in by_topic.items()}


async def _hourly(conn: Any, w: WebQueries, day: Count) -> list[Count]:
    """Done per hour over the last day, oldest first: exact when the day was counted
    exactly, else the planner's estimate for each hour."""
    sql = (
        f"SELECT floor(extract(epoch FROM (now() - finished_at)) / 3600)::int, count(*)"
        f" FROM {w.t} WHERE status = 'done'"
        " AND finished_at > now() - interval '1 day' GROUP BY 1"
    )
    if day.exact and day.value <= WINDOW_BOUND // 4:
        counts = {int(h): int(n) for h, n in await conn.fetch(sql)}
        return [exact(counts.get(h, 0)) for h in range(23, -1, -1)]
    explain = (
        f"EXPLAIN (FORMAT JSON) SELECT 1 FROM {w.t} WHERE status = 'done'"
        " AND finished_at > now() - make_interval(secs => $1::float8)"
        " AND finished_at <= now() - make_interval(secs => $2::float8)"
    )
    out = []
    for h in range(23, -1, -1):
        out.append(estimated(await estimate_rows(conn, explain, (h + 1) * HOUR, h * HOUR)))
    return out


async def _workers(conn: Any, w: WebQueries) -> list[Worker]:
    found: dict[str, Worker] = {}
    for worker_id, held, oldest, left, topics in await conn.fetch(w.workers):
        found[worker_id or "?"] = Worker(worker_id or "?", held, oldest, left, list(topics))
    for worker_id, topics, left in await conn.fetch(w.idle_workers):
        if left is not None and left < -60:
            continue  # an advert long expired: its consumer is gone
        worker = found.setdefault(worker_id, Worker(worker_id))
        worker.idle_topics, worker.idle_left = list(topics), left
    return sorted(found.values(), key=lambda x: x.worker_id)


# -- events ---------------------------------------------------------------------------
@dataclass
class EventPage:
    rows: list[dict[str, Any]]
    count: Count
    next_before: int | None  # the cursor of the next (older) page, if any
    window: tuple[int, int] | None  # ids searched, when the filter needs a window
    newest: int | None


def _where(w: WebQueries, f: EventFilter, **kwargs: Any) -> tuple[str, list[Any]]:
    where, args = f.where(**kwargs)
    return where.replace("{status_type}", w.outbox.status_type), args


async def count_matching(conn: Any, w: WebQueries, f: EventFilter) -> Count:
    """How many events match: counted up to `BOUND` through an index, else estimated."""
    where, args = _where(w, f, cursor=False)
    if f.indexed:
        n = int(await conn.fetchval(w.event_count(where, len(args) + 1), *args, BOUND))
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
    heads = [dict(r) for r in await conn.fetch(w.blocked_heads, limit)]
    if heads:
        keys = [h["ordering_key",] for h in heads]
        waiting = {k: int(n) for k, n in await conn.fetch(w.waiting_of_keys, keys, BOUND)}
        for h in heads:
            n = waiting.get(h["ordering_key"], 0)
            h["waiting"] = Count(n, n < BOUND)
    return heads


async def audit_entries(
    conn: Any, w: WebQueries, before: int | None, limit: int = 100
) -> list[dict[str, Any]]:
    return [dict(r) for r in await conn.fetch(w.audit_list, before, limit)]


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
