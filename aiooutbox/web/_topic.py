"""A page per topic (``/topics/NAME``): its counts, per-minute charts of done, failed
and lag over the last hour and day (from the consumers' per-minute counts), its flow
controls, the consumers that handle it and its blocked ordering keys."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote, urlencode

import asyncpg

from .._admin.flow import burst_for
from .._admin.groups import GroupLimit, GroupStats, group_limits, read_group_stats
from .._sql.flow import ALL_TOPICS, flow_queries
from ..errors import InvalidArgument
from ._backlog import Backlog
from ._charts import Chart, minute_chart
from ._counts import BOUND, estimated, exact
from ._data import DAY, TopicRow, age, handles
from ._events import blocked_keys
from ._sql import WebQueries
from ._workers import Worker, read_workers

__all__ = ["TopicPage", "load_topic", "topic_path"]


def topic_path(topic: str) -> str:
    """The topic page's path, the name percent-encoded (slashes included). A name that
    is a dot segment ("." or "..", which browsers resolve away) goes in the query."""
    if topic in (".", ".."):
        return "/topics/?" + urlencode({"name": topic})
    return "/topics/" + quote(topic, safe="")


@dataclass(frozen=True)
class GroupRow:
    """A group limit as the page shows it and its forms start from: ``burst`` empty
    when it is the rate's default."""

    group: str | None  # None: the topic's default for every group
    max_running: str
    rate: str
    burst: str
    shown_burst: str
    updated_by: str
    updated_at: Any

    @classmethod
    def of(cls, g: GroupLimit) -> GroupRow:
        burst = "" if g.burst is None else f"{g.burst:g}"
        default = g.rate is not None and g.burst == burst_for(g.rate)
        return cls(
            g.group,
            "" if g.max_running is None else str(g.max_running),
            g.rate_text or "",
            "" if default else burst,
            burst,
            g.updated_by or "",
            g.updated_at,
        )


@dataclass
class TopicPage:
    row: TopicRow
    backlog: Backlog | None = None  # `with_backlog` adds it
    charts: dict[str, Chart] = field(default_factory=dict)
    totals: dict[str, dict[str, int]] = field(default_factory=dict)  # hour/day sums
    lag_seen: dict[str, float | None] = field(default_factory=dict)  # hour/day max
    workers: list[Worker] = field(default_factory=list)
    keys: list[dict[str, Any]] = field(default_factory=list)
    groups: GroupStats | None = None  # the busiest and most-waiting groups
    group_limits: list[GroupRow] = field(default_factory=list)  # the default first
    more_group_limits: int = 0  # overrides not listed
    group_limits_unreadable: str | None = None
    all_paused: bool = False
    flow_unreadable: str | None = None
    rollups_unreadable: str | None = None
    known: bool = True  # anything of it but its backlog (`with_backlog` adds that)

    def with_backlog(self, backlog: Backlog) -> TopicPage:
        """This page with the backlog's counts of its topic."""
        b = backlog.of(self.row.topic)
        row = replace(
            self.row,
            pending=b.pending,
            scheduled=b.scheduled,
            retry=b.retry,
            due=b.due,
            dead=b.dead,
        )
        known = self.known or self.row.topic in backlog.topics
        return replace(self, row=row, backlog=backlog, known=known)


async def load_topic(conn: Any, w: WebQueries, topic: str) -> TopicPage:
    """Everything but the backlog (see `TopicPage.with_backlog`)."""
    row = TopicRow(topic)
    page = TopicPage(row)
    for status, sql in (("processing", w.processing_by_topic), ("waiting", w.waiting_by_topic)):
        found = {t: int(n) for t, n in await conn.fetch(sql, BOUND)}
        n = found.get(topic, 0)
        setattr(row, status, exact(n) if sum(found.values()) < BOUND else estimated(n))
    lag, oldest = await conn.fetchrow(w.topic_lag, topic)
    if lag is not None and lag >= 0:
        row.lag, row.oldest = lag, oldest
    counted = False
    try:
        minutes = await conn.fetch(w.topic_minutes, topic, DAY)
        counted = bool(minutes) or bool(await conn.fetchval(w.topic_counted, topic))
        _charts(page, minutes)
    except (asyncpg.InsufficientPrivilegeError, asyncpg.UndefinedTableError):
        page.rollups_unreadable = (
            f"this dashboard's database role may not read {w.outbox.table}_rollups (or the"
            " outbox is not migrated): GRANT SELECT on it to show the charts"
        )
    controlled = False
    try:
        for c in await conn.fetch(flow_queries(w.outbox.schema, w.outbox.table).all_controls):
            if c["topic"] == ALL_TOPICS:
                page.all_paused = bool(c["paused"])
            elif c["topic"] == topic:
                controlled = True
                row.extra["flow"] = "paused" if c["paused"] else ""
                row.extra["max_running"] = "" if c["max_running"] is None else str(c["max_running"])
                row.extra["rate"] = c["rate_text"] or ""
        row.extra.setdefault("flow", "")
        if page.all_paused and not row.extra["flow"]:
            row.extra["flow"] = "paused (every topic)"
    except asyncpg.InsufficientPrivilegeError:
        page.flow_unreadable = (
            f"this dashboard's database role may not read {w.outbox.table}_flow: GRANT SELECT"
            " on it to show the topic's pause and limits"
        )
    workers, _ = await read_workers(conn, w)
    page.workers = [x for x in workers if handles(x, topic) or topic in x.topics]
    row.consumed = any(handles(x, topic) for x in workers)
    page.keys = await blocked_keys(conn, w, topic=topic)
    page.groups = await _group_stats(conn, w, topic)
    await _group_limits(conn, w, page)
    page.known = (
        counted
        or controlled
        or bool(row.processing)
        or bool(row.waiting)
        or bool(page.keys)
        or bool(page.group_limits)
    )
    return page


_TOP_GROUPS = 10  # the groups the page lists, of each kind
_GROUP_LIMITS = 200  # the group limits the page lists (the default, then overrides)


async def _group_stats(conn: Any, w: WebQueries, topic: str) -> GroupStats:
    """`admin.group_stats`' reads, for any name stored: that checks a name as a producer
    must write it, and a raw SQL producer may have stored a blank one."""
    return await read_group_stats(conn, w.outbox.qualified, topic, _TOP_GROUPS, BOUND)


async def _group_limits(conn: Any, w: WebQueries, page: TopicPage) -> None:
    try:
        limits = await group_limits(
            conn, page.row.topic, schema=w.outbox.schema, table=w.outbox.table
        )
    except InvalidArgument:  # a name no limit can be set for (blank): it has none
        return
    except (asyncpg.InsufficientPrivilegeError, asyncpg.UndefinedTableError):
        page.group_limits_unreadable = (
            f"this dashboard's database role may not read {w.outbox.table}_group_limits (or"
            " the outbox is not migrated): GRANT SELECT on it to show the group limits"
        )
        return
    page.group_limits = [GroupRow.of(g) for g in limits[:_GROUP_LIMITS]]
    page.more_group_limits = max(0, len(limits) - _GROUP_LIMITS)


def lag_text(seconds: float) -> str:
    """A lag: milliseconds under a second (a healthy topic's), else as `age` says it."""
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else age(seconds)


def _charts(page: TopicPage, minutes: list[Any]) -> None:
    """Per-minute series of the last hour and day (a minute with no count is 0)."""
    now = math.floor(time.time() / 60) * 60  # the current minute's start
    start = now - 1439 * 60
    done: list[float | None] = [None] * 1440
    failed: list[float | None] = [None] * 1440
    lag: list[float | None] = [None] * 1440
    for at, d, retried, dead, claimed, _, lag_max in minutes:
        i = round((at - start) / 60)
        if 0 <= i < 1440:
            done[i] = float(d)
            failed[i] = float(retried + dead)
            lag[i] = float(lag_max) if claimed else None
    hour_ticks = [(0, "60m ago"), (15, "45m"), (30, "30m"), (45, "15m"), (59, "now")]
    day_ticks = [(0, "24h ago"), (360, "18h"), (720, "12h"), (1080, "6h"), (1439, "now")]
    for span, series_slice, ticks in (
        ("hour", slice(1380, 1440), hour_ticks),
        ("day", slice(0, 1440), day_ticks),
    ):
        hover = 1 if span == "hour" else 15
        d, f, g = done[series_slice], failed[series_slice], lag[series_slice]
        shape: dict[str, Any] = {"ticks": ticks, "hover": hover, "width": 390, "height": 100}
        page.charts[f"done_{span}"] = minute_chart(d, what="done", **shape)
        page.charts[f"failed_{span}"] = minute_chart(f, what="failed", kind="failed", **shape)
        page.charts[f"lag_{span}"] = minute_chart(
            g, what="lag at claim (the longest)", fmt=lag_text, kind="lag", **shape
        )
        page.totals[span] = {
            "done": int(sum(x or 0 for x in d)),
            "failed": int(sum(x or 0 for x in f)),
        }
        seen = [x for x in g if x is not None]
        page.lag_seen[span] = max(seen) if seen else None
