"""Per-group limits for operators: at most N running, at most R a second, for each group
of a topic (`limit_groups`), with overrides for named groups; `group_limits` lists them.

Re-exported by `aiooutbox.admin`. A change runs as flow control's do (`_admin.flow`):
in one transaction holding the outbox's flow lock exclusively, logged, announced. The
limits are enforced by the claim of limited topics (migration 0018).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import asyncpg

from .._sql.flow import FLOW_NOTICE, FlowQueries, flow_queries
from .._sql.groups import GroupQueries, busiest_groups, waiting_groups
from .._sql.statements import DEFAULT_SCHEMA, DEFAULT_TABLE
from .._values.limits import check_count, check_topic_name
from ..errors import InvalidArgument
from .flow import KEEP, Db, _actor, _burst, _changing, _Keep, _max_running, _rate, burst_for

__all__ = [
    "GroupLimit",
    "GroupStats",
    "check_group",
    "group_limits",
    "group_stats",
    "limit_groups",
    "read_group_stats",
]

MAX_GROUP_LENGTH = 512  # UTF-8 bytes, as the producers' (migration 0018's check)


@dataclass(frozen=True, slots=True)
class GroupLimit:
    """A topic's limits per group: ``group`` None for every named group (the topic's
    default), else one group's override (a None field takes the default)."""

    topic: str
    group: str | None
    max_running: int | None = None
    rate: float | None = None
    rate_text: str | None = None
    burst: float | None = None
    updated_at: datetime | None = None
    updated_by: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["updated_at"] = None if self.updated_at is None else self.updated_at.isoformat()
        return d


def check_group(group: object) -> str:
    """A group name as producers may write it: 1-512 UTF-8 bytes, no NUL."""
    if not isinstance(group, str):
        raise TypeError(f"group must be a str, not {type(group).__name__}")
    if not group:
        raise InvalidArgument("group must not be empty")
    try:
        size = len(group.encode())
    except UnicodeEncodeError:
        raise InvalidArgument("group is not valid Unicode") from None
    if "\x00" in group or size > MAX_GROUP_LENGTH:
        raise InvalidArgument(f"group must be at most {MAX_GROUP_LENGTH} bytes (UTF-8) without NUL")
    return group


def _queries(fq: FlowQueries) -> GroupQueries:
    return GroupQueries(fq.outbox.schema, fq.outbox.table)


def _limit(topic: str, row: Any) -> GroupLimit:
    return GroupLimit(
        topic,
        row["grp"] or None,
        row["max_running"],
        row["rate"],
        row["rate_text"],
        row["burst"],
        row["updated_at"],
        row["updated_by"],
    )


def _state(g: GroupLimit) -> dict[str, Any]:
    return {
        "group": g.group,
        "group_max_running": g.max_running,
        "group_rate": g.rate_text,
        "group_burst": g.burst,
    }


async def limit_groups(
    db: Db,
    topic: str,
    *,
    group: str | None = None,
    max_running: int | _Keep | None = KEEP,
    rate: str | float | _Keep | None = KEEP,
    burst: float | _Keep | None = KEEP,
    actor: str | None = None,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> GroupLimit:
    """Set or remove (``None``) the limits of each group of ``topic``; a limit not named
    stays as it is.

    ``max_running``: at most this many events of one group claimed at once, across every
    consumer; ``rate``: ``"5/s"`` (``"10/min"``, ``"3/h"``, a number per second) per
    group, in bursts of at most ``burst``. With ``group``, the limits of that group only
    (overriding the topic's for it); it need not have events yet. Ungrouped events are
    held by the topic's own limits (`limit_topic`) only. Bad values raise
    `InvalidArgument` before anything is written.
    """
    name, who, fq = check_topic_name(topic), _actor(actor), flow_queries(schema, table)
    grp = "" if group is None else check_group(group)
    changes: dict[str, Any] = {}
    if not isinstance(max_running, _Keep):
        changes["max_running"] = _max_running(max_running)
    if not isinstance(rate, _Keep):
        parsed = _rate(rate)
        changes["rate"], changes["rate_text"] = parsed if parsed else (None, None)
        changes["burst"] = None
    if not isinstance(burst, _Keep):
        changes["burst"] = _burst(burst)
    if not changes:
        raise InvalidArgument("say which limit to change: max_running=..., rate=... or burst=...")

    async def change(conn: asyncpg.Connection) -> GroupLimit:
        gq = _queries(fq)
        row = await conn.fetchrow(gq.limit_for_update, name, grp)
        before = _limit(name, row) if row is not None else GroupLimit(name, group)
        values = {**asdict(before), **changes}
        if values["rate"] is None and changes.get("burst") is not None:
            raise InvalidArgument("a burst needs a rate: give rate=... too")
        if values["rate"] is None:
            values.update(rate_text=None, burst=None)
        elif values["burst"] is None:
            values["burst"] = burst_for(values["rate"])
        after = GroupLimit(**values)
        if _state(after) == _state(before):
            return before
        if after.max_running is None and after.rate is None:
            await conn.execute(gq.delete_limit, name, grp)
            result = GroupLimit(name, group)
        else:
            result = _limit(
                name,
                await conn.fetchrow(
                    gq.upsert_limit,
                    name, grp, after.max_running, after.rate, after.rate_text, after.burst, who,
                ),
            )  # fmt: skip
        if (after.rate, after.burst) != (before.rate, before.burst):  # buckets start full
            await conn.execute(gq.refill, name, grp)
        # the topic's control row says it has group limits: its claims lock that row
        grouped = bool(await conn.fetchval(gq.has_limits, name))
        await conn.execute(gq.mark_grouped, name, who, grouped)
        await conn.execute(gq.drop_empty_control, name)
        if grouped:
            await conn.execute(fq.count_running, name)  # rows in flight count from now on
        await conn.execute(
            fq.log_change,
            who,
            name,
            "limit groups",
            None if row is None else json.dumps(_state(before)),
            json.dumps(_state(result)) if result.max_running or result.rate else None,
        )
        await conn.execute(fq.outbox.notify, fq.outbox.channel, [FLOW_NOTICE])
        return result

    return await _changing(db, fq, change)  # type: ignore[no-any-return]


async def group_limits(
    db: Db, topic: str, *, schema: str = DEFAULT_SCHEMA, table: str = DEFAULT_TABLE
) -> list[GroupLimit]:
    """``topic``'s group limits: its default for every group first (if any), then each
    group's override, by name."""
    name, fq = check_topic_name(topic), flow_queries(schema, table)
    rows = await db.fetch(_queries(fq).topic_limits, name)
    return [_limit(name, r) for r in rows]


@dataclass(frozen=True, slots=True)
class GroupStats:
    """A topic's busiest groups (``(group, running)``, most claimed now first) and its
    most-waiting ones (``(group, due, seconds the oldest has waited)``); ``None`` is
    the ungrouped events."""

    topic: str
    busiest: list[tuple[str | None, int]]
    waiting: list[tuple[str | None, int, float | None]]

    def as_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "busiest": [{"group": g, "running": n} for g, n in self.busiest],
            "waiting": [{"group": g, "due": n, "lag": lag} for g, n, lag in self.waiting],
        }


async def group_stats(
    db: Db,
    topic: str,
    *,
    top: int = 10,
    read: int = 1_000_000,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> GroupStats:
    """The ``top`` busiest and most-waiting groups of ``topic`` (`GroupStats`); the
    waiting ones among the first ``read`` due events (a bound on what it reads)."""
    name, fq = check_topic_name(topic), flow_queries(schema, table)
    check_count("top", top, 1, 1000)
    return await read_group_stats(db, fq.outbox.qualified, name, top, read)


async def read_group_stats(db: Any, outbox: str, topic: str, top: int, read: int) -> GroupStats:
    """`group_stats`' reads, for a topic name as stored (checked or not)."""
    busy = await db.fetch(busiest_groups(outbox), topic, top)
    waiting = await db.fetch(waiting_groups(outbox), topic, top, read)
    return GroupStats(
        topic,
        [(r["g"] or None, r["running"]) for r in busy],
        [(r["g"] or None, r["due"], r["lag"]) for r in waiting],
    )
