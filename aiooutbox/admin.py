"""Operator tools as plain async functions: statistics, dead letters, purging, flow control.

``python -m aiooutbox stats``, ``dead ...`` and ``purge`` print what these return;
applications and scripts can call them on an asyncpg connection or pool::

    from aiooutbox import admin

    report = await admin.stats(pool)
    if report.lag and report.lag > 60:
        alert(f"outbox lag {report.lag:.0f}s, {report.dead} dead")
    await admin.dead_retry(pool, topic="emails.send")
    await admin.pause_topic(pool, "payments.charge")
    await admin.limit_topic(pool, "payments.charge", max_running=5, rate="50/s")

`stats` counts the unfinished and dead rows exactly, each status through its partial
index, and the ``done`` rows exactly up to 50,000; past that it estimates them
(`OutboxStats.done_estimated`), so it stays fast beside millions of rows of history.
Nothing here runs inside a consumer.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Collection
from datetime import timedelta
from typing import Any

import asyncpg

from ._admin.counts import BOUND, estimate_rows, sample_percent
from ._admin.flow import (
    KEEP,
    flow_history,
    limit_topic,
    parse_rate,
    pause_all,
    pause_topic,
    resume_all,
    resume_topic,
    topic_controls,
    topic_info,
    topics,
)
from ._admin.groups import GroupLimit, GroupStats, group_limits, group_stats, limit_groups
from ._admin.records import (
    STATUSES,
    BlockedKey,
    DeadEvent,
    FlowChange,
    OutboxStats,
    TopicControl,
    TopicInfo,
    TopicStats,
    UnconsumedTopic,
    WorkerStats,
    dead_event,
)
from ._engine.watchdog import inspect_mvcc
from ._sql.admin import AdminQueries, admin_queries
from ._sql.statements import DEFAULT_SCHEMA, DEFAULT_TABLE, queries
from ._values.limits import check_count, check_seconds, check_topic_name
from .errors import InvalidArgument

__all__ = [
    "KEEP",
    "STATUSES",
    "BlockedKey",
    "DeadEvent",
    "FlowChange",
    "GroupLimit",
    "GroupStats",
    "OutboxStats",
    "TopicControl",
    "TopicInfo",
    "TopicStats",
    "UnconsumedTopic",
    "WorkerStats",
    "dead_list",
    "dead_purge",
    "dead_retry",
    "delete_dead",
    "event_statuses",
    "flow_history",
    "group_limits",
    "group_stats",
    "limit_groups",
    "limit_topic",
    "parse_duration",
    "parse_rate",
    "pause_all",
    "pause_topic",
    "purge",
    "requeue_dead",
    "resume_all",
    "resume_topic",
    "stats",
    "topic_controls",
    "topic_info",
    "topics",
    "unconsumed_topics",
]

logger = logging.getLogger("aiooutbox.admin")

PURGEABLE = ("done", "dead")
MAX_LIST = 100_000  # the most dead events `dead_list` returns at once
_DEAD_BATCH = 1000  # dead events `dead_purge` deletes per transaction
_BLOCKED_SHOWN = 20  # blocked ordered keys `stats` lists
# `stats` names a topic as unconsumed once its oldest claimable event waited this long
# with no consumer in sight (a poll-only consumer advertises nothing while idle)
UNCONSUMED_AFTER = 60.0

# ages clamp to this: now() less 6,700 years leaves a timestamp's range; no row is older
_MAX_AGE = 1000 * 366 * 86400.0
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_PART = re.compile(rf"({_NUMBER})(ms|s|m|h|d|w)")
_DURATION = re.compile(rf"(?:{_NUMBER}(?:ms|s|m|h|d|w))+")


def parse_duration(text: str) -> float:
    """Seconds in ``"30s"``, ``"15m"``, ``"12h"``, ``"7d"``, ``"1w"``, ``"1h30m"``, ``"500ms"``.

    A bare number is seconds (``"90"``). Raises `InvalidArgument` for anything else,
    saying so when the only fault is a minus sign.
    """
    spec = text.strip().lower().replace(" ", "")
    if re.fullmatch(_NUMBER, spec):
        return float(spec)
    if _DURATION.fullmatch(spec):
        return sum(float(number) * _UNITS[unit] for number, unit in _PART.findall(spec))
    if spec.startswith("-") and (re.fullmatch(_NUMBER, spec[1:]) or _DURATION.fullmatch(spec[1:])):
        raise InvalidArgument(f"invalid duration {text!r}: must not be negative")
    raise InvalidArgument(
        f"invalid duration {text!r}: use seconds (90) or a number with a unit: "
        "500ms, 30s, 15m, 12h, 7d, 1w or 1h30m"
    )


def _seconds(name: str, value: float | timedelta) -> float:
    return check_seconds(name, value, maximum=math.inf)  # any age or wait, however long


def _age(value: float | timedelta) -> float:
    return min(_seconds("older_than", value), _MAX_AGE)  # matches the same rows


def _ids(ids: Collection[int] | None) -> list[int] | None:
    if ids is None:
        return None
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Collection):
        raise TypeError("ids must be a collection of event ids")
    checked = []
    for event_id in ids:
        if isinstance(event_id, bool) or not isinstance(event_id, int):
            raise TypeError(f"event ids are ints, got {event_id!r}")
        if not -(2**63) <= event_id < 2**63:
            raise InvalidArgument(f"event id {event_id} is out of range (ids are 64-bit)")
        checked.append(event_id)
    if not checked:
        raise InvalidArgument("ids is empty: pass at least one event id")
    return checked


def _chosen(
    ids: Collection[int] | None, topic: str | None, everything: bool, verb: str
) -> tuple[list[int] | None, str | None]:
    """The checked ids and topic; exactly one of them or ``everything``."""
    checked, name = _ids(ids), None if topic is None else check_topic_name(topic)
    if sum((checked is not None, name is not None, bool(everything))) != 1:
        raise InvalidArgument(
            f"say which dead events to {verb}: ids=[...], topic=... or everything=True "
            "(exactly one)"
        )
    return checked, name


@contextlib.asynccontextmanager
async def _connection(db: asyncpg.Connection | asyncpg.Pool) -> AsyncIterator[Any]:
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn:
            yield conn
    else:
        yield db


async def stats(
    db: asyncpg.Connection | asyncpg.Pool,
    *,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> OutboxStats:
    """Count rows by topic and status; measure lag; list the rows each consumer holds.

    Every status but ``done`` is counted exactly (an index reaches each); ``done`` is
    exact below `BOUND` rows (50,000), else estimated: the planner's count of the
    table's rows less the exact others, shared among topics as a random sample of the
    table's pages shares it (``done_estimated`` is then true)."""
    q = queries(schema, table)
    a = admin_queries(schema, table)
    async with _connection(db) as conn:
        counts = list(await conn.fetch(a.unfinished_by_topic))
        found = await conn.fetch(a.done_by_topic_bounded, BOUND)
        kept = {r[0]: int(r[1]) for r in found if r[1]}
        ring = {r[0]: int(r[2]) for r in found if r[2]}
        estimated = sum(kept.values()) >= BOUND or sum(ring.values()) >= BOUND
        if sum(kept.values()) >= BOUND:
            kept = await _estimated_done(conn, a, False, sum(int(r[2]) for r in counts))
        if sum(ring.values()) >= BOUND:
            ring = await _estimated_done(conn, a, True, 0)
        done = {t: kept.get(t, 0) + ring.get(t, 0) for t in kept.keys() | ring.keys()}
        counts += [(t, "done", n) for t, n in done.items()]
        lags = {r[0]: r[1] for r in await conn.fetch(a.oldest_claimable)}
        workers = await conn.fetch(a.in_flight_by_worker)
        unconsumed = await unconsumed_topics(conn, schema=schema, table=table)
        mvcc = await inspect_mvcc(conn, q)
        blocked = [BlockedKey(*r) for r in await conn.fetch(a.blocked_keys, _BLOCKED_SHOWN)]
        controls = await topic_controls(conn, schema=schema, table=table)
    held = {c.topic for c in controls if c.paused}
    # a paused topic waits by design ("": every topic is paused)
    unconsumed = [] if "" in held else [u for u in unconsumed if u.topic not in held]
    by_topic: dict[str, dict[str, int]] = {}
    for topic, status, count in counts:
        by_topic.setdefault(topic, dict.fromkeys(STATUSES, 0))[status] = count
    return OutboxStats(
        outbox=f"{q.schema}.{q.table}",
        topics=[TopicStats(t, c, lags.get(t)) for t, c in sorted(by_topic.items())],
        in_flight=[WorkerStats(w or "?", n, age or 0.0) for w, n, age in workers],
        unconsumed=unconsumed,
        mvcc=mvcc,
        blocked_keys=blocked,
        controls=controls,
        done_estimated=estimated,
    )


async def _estimated_done(
    conn: Any, a: AdminQueries, ring: bool, unfinished: int
) -> dict[str, int]:
    """``done`` rows by topic, of the outbox or of its ring, estimated: the planner's
    rows less the ``unfinished`` (at least `BOUND`: that many were found), shared as a
    sample of pages shares them."""
    total = max(round(await estimate_rows(conn, a.explain_rows(ring))) - unfinished, BOUND)
    source = a.outbox.done_table if ring else a.qualified
    percent = sample_percent(await conn.fetchval(a.table_pages, source))
    # one seed for ten minutes: the same pages, and numbers that do not jitter
    seed = float(int(time.time() // 600))
    sample_sql = a.done_sample_by_topic(ring)
    sample = {r[0]: int(r[1]) for r in await conn.fetch(sample_sql, percent, seed)}
    seen = sum(sample.values())
    return {t: round(total * n / seen) for t, n in sample.items()} if seen else {}


async def unconsumed_topics(
    db: asyncpg.Connection | asyncpg.Pool,
    *,
    handled: Collection[str] | None = None,
    waited: float = UNCONSUMED_AFTER,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> list[UnconsumedTopic]:
    """Topics, other than ``handled``, whose oldest claimable event has waited at least
    ``waited`` seconds with no consumer in sight (see `UnconsumedTopic`)."""
    a = admin_queries(schema, table)
    topics = None if handled is None else sorted(handled)
    async with _connection(db) as conn:
        rows = await conn.fetch(a.unconsumed_topics, topics, _seconds("waited", waited))
    return [UnconsumedTopic(r[0], r[1], r[2]) for r in rows]


async def event_statuses(
    db: asyncpg.Connection | asyncpg.Pool,
    ids: Collection[int],
    *,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> dict[int, str]:
    """The status of each of ``ids`` that exists."""
    checked = _ids(ids) or []
    a = admin_queries(schema, table)
    async with _connection(db) as conn:
        return {r[0]: r[1] for r in await conn.fetch(a.event_statuses, checked)}


async def dead_list(
    db: asyncpg.Connection | asyncpg.Pool,
    *,
    topic: str | None = None,
    limit: int = 50,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> list[DeadEvent]:
    """Dead events, oldest id first, optionally of one topic; at most ``limit``.

    A payload that cannot be decoded is listed as its stored text (`DeadEvent`)."""
    check_count("limit", limit, 1, MAX_LIST)
    a, name = admin_queries(schema, table), None if topic is None else check_topic_name(topic)
    async with _connection(db) as conn:
        rows = await conn.fetch(a.dead_list, name, limit)
    return [dead_event(r) for r in rows]


async def dead_retry(
    db: asyncpg.Connection | asyncpg.Pool,
    *,
    ids: Collection[int] | None = None,
    topic: str | None = None,
    everything: bool = False,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> dict[str, int]:
    """Send dead events back to ``pending`` with attempts reset; return counts by topic.

    Choose exactly one of ``ids``, ``topic`` or ``everything=True``. Idle consumers of
    the affected topics are woken by one notification per topic when this commits (it
    joins the caller's transaction on a connection).
    """
    rows = await requeue_dead(
        db, ids=ids, topic=topic, everything=everything, schema=schema, table=table
    )
    return dict(sorted(Counter(topic for _, topic in rows).items()))


async def requeue_dead(
    db: asyncpg.Connection | asyncpg.Pool,
    *,
    ids: Collection[int] | None = None,
    topic: str | None = None,
    everything: bool = False,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> list[tuple[int, str]]:
    """`dead_retry`, returning ``(id, topic)`` of each requeued event, so a caller can
    tell which of the ids it named were not dead."""
    checked, topic = _chosen(ids, topic, everything, "retry")
    q = queries(schema, table)
    a = admin_queries(schema, table)
    async with _connection(db) as conn, conn.transaction():
        requeued = await conn.fetch(a.dead_retry, checked, topic)
        rows = [(r["id"], r["topic"]) for r in requeued]
        if rows:
            await conn.execute(q.notify, q.channel, sorted({t for _, t in rows}))
        ordered = [r["id"] for r in requeued if r["ordering_key"] is not None]
        if ordered:
            for event_id, later in await conn.fetch(a.later_done_of_keys, ordered):
                logger.warning(
                    "event %d re-runs after %d later event(s) of its ordering key were "
                    "handled: out of their order",
                    event_id,
                    later,
                    extra={"event_id": event_id},
                )
    return sorted(rows)


async def dead_purge(
    db: asyncpg.Connection | asyncpg.Pool,
    *,
    ids: Collection[int] | None = None,
    topic: str | None = None,
    everything: bool = False,
    older_than: float | timedelta | None = None,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> int:
    """Delete dead events for good; return how many.

    Choose exactly one of ``ids``, ``topic`` or ``everything=True``; ``older_than`` keeps
    those that died more recently.
    """
    deleted = await delete_dead(
        db,
        ids=ids,
        topic=topic,
        everything=everything,
        older_than=older_than,
        schema=schema,
        table=table,
    )
    return len(deleted)


async def delete_dead(
    db: asyncpg.Connection | asyncpg.Pool,
    *,
    ids: Collection[int] | None = None,
    topic: str | None = None,
    everything: bool = False,
    older_than: float | timedelta | None = None,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> list[int]:
    """`dead_purge`, returning the ids it deleted.

    Deletes in batches of 1000, each one statement. An ordered key that a
    deleted event kept blocked (``on_dead="block"``) moves on to its next event in the
    same transaction; if a producer is inserting into that key at that moment, the
    purge waits for the producer's transaction to end (as a row lock would).
    """
    checked, topic = _chosen(ids, topic, everything, "purge")
    age = None if older_than is None else _age(older_than)
    a = admin_queries(schema, table)
    deleted: list[int] = []
    async with _connection(db) as conn:
        while True:
            batch = await _delete_dead(conn, a, checked, topic, age, _DEAD_BATCH)
            deleted += batch
            if len(batch) < _DEAD_BATCH:
                return sorted(deleted)


async def _delete_dead(
    conn: Any,
    a: AdminQueries,
    ids: list[int] | None,
    topic: str | None,
    age: float | None,
    limit: int,
) -> list[int]:
    """One batch of dead events deleted, and the keys they blocked moved on."""
    row = await conn.fetchrow(a.delete_dead, ids, topic, age, limit)  # one statement
    if row["skipped"]:
        # only an event that died blocking its key between the purge's two statements
        logger.warning(
            "%d ordered key(s) could not move on after their dead head was purged (a "
            "producer held the key); a running consumer promotes them within its "
            "orphan_sweep_interval: %s",
            len(row["skipped"]),
            ", ".join(row["skipped"][:20]),
        )
    return list(row["deleted"])


async def purge(
    db: asyncpg.Connection | asyncpg.Pool,
    *,
    older_than: float | timedelta,
    status: str = "done",
    batch_size: int = 1000,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> int:
    """Delete ``done`` (or ``dead``) events finished more than ``older_than`` ago.

    Deletes in batches of ``batch_size``, each its own statement, so that a large purge
    never holds locks for long; returns how many rows went. ``done`` events are deleted
    from the outbox and from its ring of finished events, row by row (consumers'
    retention empties the ring's slots whole instead, by ``TRUNCATE``). Unfinished events can never
    be purged. Purging ``dead`` events moves the ordered keys they blocked on, as
    `dead_purge` does.
    """
    if status not in PURGEABLE:
        raise InvalidArgument(
            f"cannot purge {status!r} events: only finished ones ({' or '.join(PURGEABLE)})"
        )
    age = _age(older_than)
    check_count("batch_size", batch_size, 1, 2**31 - 1)  # LIMIT's range
    q = queries(schema, table)
    a = admin_queries(schema, table)
    deleted = 0
    async with _connection(db) as conn:
        while True:
            if status == "done":
                counts = []
                for sql in (q.purge_done, a.purge_ring):
                    result: str = await conn.execute(sql, age, batch_size)
                    counts.append(int(result.rsplit(" ", 1)[-1]))
                deleted += sum(counts)
                full = max(counts) >= batch_size  # another batch while either was full
            else:  # the keys a purged dead event blocked move on (see `delete_dead`)
                count = len(await _delete_dead(conn, a, None, None, age, batch_size))
                deleted += count
                full = count >= batch_size
            if not full:
                return deleted
