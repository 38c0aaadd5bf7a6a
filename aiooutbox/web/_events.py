"""What the event pages show: the filtered list (keyset-paged, counted within bounds),
one event with its attempt history, the blocked ordering keys, and the audit log in
words."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import asyncpg

from .._admin.counts import SAMPLE_PAGES
from ._counts import BOUND, Count, bounded, estimate_rows, estimated, exact
from ._filters import PAGE, WINDOW, EventFilter
from ._sql import EVENT_TIMES, WebQueries
from ._times import Stored, later, stored

__all__ = [
    "EventDetail",
    "EventPage",
    "Failure",
    "audit_entries",
    "blocked_keys",
    "count_matching",
    "event_page",
    "load_event",
]

# how long a page may spend counting its matches exactly before it estimates
COUNT_TIME = 0.1


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
    newest = await conn.fetchval(f"SELECT max(id) FROM {w.events}")
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
    listed = [dict(zip(keys, r, strict=True)) for r in rows]
    for row in listed:
        for name in ("created_at", "available_at", "finished_at"):
            row[name] = stored(row[name])
    return EventPage(
        rows=listed,
        count=await count_matching(conn, w, f),
        next_before=next_before,
        window=window,
        newest=newest,
    )


@dataclass(frozen=True)
class Failure:
    """One failed attempt, as the failure's settlement (or lease recovery) kept it."""

    attempt: int | None
    at: Stored  # text: a time no datetime holds, as the entry has it
    worker: str
    seconds: float | None
    error: str
    outcome: str


@dataclass
class EventDetail:
    fields: dict[str, Any]
    payload: str
    headers: str
    trace_id: str | None
    due_later: bool = False  # its due time is still ahead
    ahead: Count | None = None  # unfinished events of its key before it
    head: int | None = None
    failures: list[Failure] = field(default_factory=list)
    # failed attempts the history no longer holds (it keeps the last ten)
    failures_dropped: int = 0


def failures_of(text: str | None) -> list[Failure]:
    """The history column read defensively: any entry, any value, never an error."""
    try:
        entries = json.loads(text) if text else []
    except (ValueError, RecursionError):
        return []
    if not isinstance(entries, list):
        return []
    out = []
    for e in entries:
        if not isinstance(e, dict):
            continue
        out.append(
            Failure(
                attempt=int(n) if (n := _number(e.get("attempt"))) is not None else None,
                at=_moment(_number(e.get("at"))),
                worker=str(e.get("worker") or "?"),
                seconds=_number(e.get("seconds")),
                error=str(e.get("error") or ""),
                outcome=str(e.get("outcome") or ""),
            )
        )
    return out


def _moment(seconds: float | None) -> Stored:
    """Epoch seconds as a UTC datetime, or as text outside the years 1-9999."""
    if seconds is None:
        return None
    try:
        return datetime.fromtimestamp(seconds, timezone.utc)
    except (OverflowError, ValueError, OSError):
        return f"{seconds:.0f} s from 1970 (outside the years 1-9999)"


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) and abs(number) < 1e11 else None


def pretty(text: str) -> str:
    """JSON indented, keys sorted; as stored when it is too deep to indent (a legal
    payload may nest thousands of levels, past what Python's JSON module recurses)."""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False, sort_keys=True)
    except (ValueError, RecursionError):
        return text


def trace_id_of(headers: str) -> str | None:
    """The trace id of a W3C ``traceparent`` header, if well formed."""
    try:
        parent = json.loads(headers).get("traceparent")
    except (ValueError, AttributeError, RecursionError):
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
    names = ["id", "topic", "status", "ordering_key", "dedupe_key", "attempts"]
    names += ["max_attempts", "locked_by", "last_error", "message_id"]
    times = {n: stored(r[n]) for n in EVENT_TIMES}
    detail = EventDetail(
        fields={n: r[n] for n in names} | times,
        due_later=later(times["available_at"]),
        payload=pretty(r["payload"]),
        headers=pretty(r["headers"]),
        trace_id=trace_id_of(r["headers"]),
        failures=failures_of(r["failures"]),
    )
    attempts = [f.attempt for f in detail.failures if f.attempt is not None]
    if detail.failures and attempts:
        # attempts before the oldest kept failure that are not in the history
        detail.failures_dropped = max(min(attempts) - 1, 0) if len(detail.failures) >= 10 else 0
    key = r["ordering_key"]
    if key is not None and (
        r["status"] in ("pending", "scheduled", "retry", "processing", "waiting")
    ):
        n, head = await conn.fetchrow(w.key_position, key, event_id, BOUND)
        detail.ahead = Count(int(n), n < BOUND)
        detail.head = head
    return detail


async def blocked_keys(
    conn: Any, w: WebQueries, limit: int = 200, topic: str | None = None
) -> list[dict[str, Any]]:
    sql = w.blocked_heads if topic is None else w.blocked_heads_of_topic
    heads = [dict(r.items()) for r in await conn.fetch(sql, limit, topic)]
    if heads:
        keys = [h["ordering_key"] for h in heads]
        waiting = {k: int(n) for k, n in await conn.fetch(w.waiting_of_keys, keys, BOUND)}
        for h in heads:
            h["available_at"] = stored(h["available_at"])
            n = waiting.get(h["ordering_key"], 0)
            h["waiting"] = Count(n, n < BOUND)
    return heads


async def audit_entries(
    conn: Any, w: WebQueries, before: int | None, limit: int = 100
) -> list[dict[str, Any]]:
    return [dict(r.items()) for r in await conn.fetch(w.audit_list, before, limit)]
