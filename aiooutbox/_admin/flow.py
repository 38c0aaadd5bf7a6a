"""Flow control for operators: pause, resume and limit topics; list them; the history.

Re-exported by `aiooutbox.admin`. Every change runs in one transaction that first
takes the outbox's flow lock exclusively (migration 0010): it waits for the claims
under way, holds new ones back until it commits, and is then seen by every claim
after it. The change and its log entry commit together, and a notification tells
running consumers to re-read the controls (a resume also wakes the topic's consumers).
"""

from __future__ import annotations

import asyncio
import getpass
import json
import math
import random
import re
import socket
import time
from dataclasses import replace
from typing import Any, Final, TypeAlias

import asyncpg

from .._sql.flow import ALL_TOPICS, FLOW_NOTICE, FlowQueries, flow_queries
from .._sql.statements import DEFAULT_SCHEMA, DEFAULT_TABLE
from .._values.limits import check_count, check_topic_name
from ..errors import InvalidArgument, OutboxError
from .records import FlowChange, TopicControl, TopicInfo

__all__ = [
    "KEEP",
    "MAX_RATE",
    "MAX_RUNNING",
    "MIN_RATE",
    "burst_for",
    "flow_history",
    "limit_topic",
    "parse_rate",
    "pause_all",
    "pause_topic",
    "resume_all",
    "resume_topic",
    "topic_controls",
    "topic_info",
    "topics",
]

Db: TypeAlias = asyncpg.Connection | asyncpg.Pool


class _Keep:
    def __repr__(self) -> str:
        return "KEEP"


KEEP: Final = _Keep()  # `limit_topic`: leave this control as it is

MAX_RUNNING = 1_000_000
MIN_RATE = 1 / 3600  # one event an hour
MAX_RATE = 1_000_000.0  # events a second
_UNITS = {"s": 1.0, "min": 60.0, "h": 3600.0}
_UNIT_NAMES = {
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), "s"),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), "min"),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), "h"),
}
_RATE = re.compile(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)/([a-z]+)\Z")
# a change waits at most this long for the claims under way, per try; between tries
# the claims it held back run on
_LOCK_TRY = "200ms"
_LOCK_PATIENCE = 10.0


def parse_rate(text: str) -> tuple[float, str]:
    """``"50/s"``, ``"10/min"``, ``"3/h"``: (events per second, the rate as written).

    Raises `InvalidArgument` for anything else, zero, or a rate outside 1/h-1000000/s.
    """
    if not isinstance(text, str):
        raise TypeError(f"rate must be a str such as '50/s', not {type(text).__name__}")
    spec = text.strip().lower().replace(" ", "")
    match = _RATE.fullmatch(spec)
    unit = _UNIT_NAMES.get(match[2]) if match else None
    if match is None or unit is None:
        raise InvalidArgument(
            f"invalid rate {text!r}: use N/s, N/min or N/h with N a positive number "
            "(e.g. 50/s), or none"
        )
    try:
        number = float(match[1])
    except (ValueError, OverflowError):
        number = math.inf
    return _rate_per_second(number / _UNITS[unit], f"{number:g}/{unit}"), f"{number:g}/{unit}"


def _rate_per_second(per_second: float, shown: str) -> float:
    if not per_second > 0:
        raise InvalidArgument(
            f"rate {shown} lets nothing through: to stop a topic, pause it "
            "(topics pause TOPIC); to remove the limit, use none"
        )
    if not math.isfinite(per_second) or per_second > MAX_RATE:
        raise InvalidArgument(
            f"rate {shown} is above the highest limit, {MAX_RATE:.0f}/s: to remove the "
            "limit, use none"
        )
    if per_second < MIN_RATE * (1 - 1e-9):
        raise InvalidArgument(f"rate {shown} is below the lowest limit, 1/h")
    return per_second


def burst_for(rate: float) -> float:
    """The default burst: a tenth of a second's worth of events, at least one."""
    return float(max(1, math.floor(rate / 10)))


def _rate(value: object) -> tuple[float, str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() == "none":
            return None
        return parse_rate(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"rate must be a str such as '50/s', a number per second or None, "
            f"not {type(value).__name__}"
        )
    per_second = float(value)
    shown = f"{per_second:g}/s"
    return _rate_per_second(per_second, shown), shown


def _max_running(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value < 1:
        raise InvalidArgument(
            f"max_running must be at least 1, got {value}: to stop a topic, pause it "
            "(topics pause TOPIC); to remove the limit, use none"
        )
    return check_count("max_running", value, 1, MAX_RUNNING)


def _burst(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"burst must be a number of events, not {type(value).__name__}")
    if not (math.isfinite(value) and 1 <= value <= MAX_RATE):
        raise InvalidArgument(f"burst must be between 1 and {MAX_RATE:.0f} events, got {value}")
    return float(value)


def _actor(actor: object) -> str:
    if actor is None:
        try:
            user = getpass.getuser()
        except (OSError, KeyError):
            user = "unknown"
        return f"{user}@{socket.gethostname()}"[:200]
    if not isinstance(actor, str):
        raise TypeError(f"actor must be a str, not {type(actor).__name__}")
    if not actor.strip() or len(actor) > 200 or "\x00" in actor:
        raise InvalidArgument("actor must be 1-200 characters without NUL")
    return actor


def _control(row: Any) -> TopicControl:
    return TopicControl(
        topic=row["topic"],
        paused=row["paused"],
        max_running=row["max_running"],
        rate=row["rate"],
        rate_text=row["rate_text"],
        burst=row["burst"],
        updated_at=row["updated_at"],
        updated_by=row["updated_by"],
    )


def _state(c: TopicControl) -> dict[str, Any]:
    return {"paused": c.paused, "max_running": c.max_running, "rate": c.rate_text, "burst": c.burst}


async def _changing(db: Db, fq: FlowQueries, change: Any) -> Any:
    """Run ``change(conn)`` in a transaction holding the flow lock exclusively."""
    deadline = time.monotonic() + _LOCK_PATIENCE
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn:
            return await _changing(conn, fq, change)
    while True:
        try:
            async with db.transaction():
                await db.execute(f"SET LOCAL lock_timeout = '{_LOCK_TRY}'")
                await db.execute(fq.lock_out_claims, fq.lock_key)
                return await change(db)
        except asyncpg.LockNotAvailableError:
            if time.monotonic() > deadline:
                raise OutboxError(
                    f"could not change the flow controls of {fq.outbox.qualified} within "
                    f"{_LOCK_PATIENCE:.0f}s: claims or other changes kept its lock busy; "
                    "nothing was changed, try again"
                ) from None
            await asyncio.sleep(0.02 + 0.05 * random.random())


async def _apply(
    conn: asyncpg.Connection, fq: FlowQueries, topic: str, action: str, actor: str, **changes: Any
) -> TopicControl:
    """Change one topic's controls (under the flow lock); log and announce the change."""
    row = await conn.fetchrow(fq.control_for_update, topic)
    before = _control(row) if row is not None else TopicControl(topic)
    after = replace(before, **changes)
    if after.rate is not None and after.burst is None:
        after = replace(after, burst=burst_for(after.rate))
    if after.rate is None:
        after = replace(after, rate_text=None, burst=None)
    if _state(after) == _state(before):
        return before
    if not after.paused and not after.limited:
        result = TopicControl(topic)
        deleted = await conn.execute(fq.delete_control, topic)
        if deleted == "DELETE 0" and row is not None:  # kept for its group limits: cleared
            await conn.fetchrow(
                fq.upsert_control, topic, False, None, None, None, None, actor, True
            )
    else:
        refill = (after.rate, after.burst) != (before.rate, before.burst)
        result = _control(
            await conn.fetchrow(
                fq.upsert_control,
                topic,
                after.paused,
                after.max_running,
                after.rate,
                after.rate_text,
                after.burst,
                actor,
                refill,
            )
        )
    if after.max_running is not None and before.max_running is None:
        # rows claimed before the limit count against it from now on
        await conn.execute(fq.count_running, topic)
    await conn.execute(
        fq.log_change,
        actor,
        topic,
        action,
        None if row is None else json.dumps(_state(before)),
        None if not (after.paused or after.limited) else json.dumps(_state(after)),
    )
    q = fq.outbox
    woken = [FLOW_NOTICE] + ([topic] if before.paused and not after.paused and topic else [])
    await conn.execute(q.notify, q.channel, woken)
    return result


def _names(schema: str, table: str) -> FlowQueries:
    return flow_queries(schema, table)


async def pause_topic(
    db: Db,
    topic: str,
    *,
    actor: str | None = None,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> TopicControl:
    """Stop every consumer from claiming ``topic`` until `resume_topic`.

    Once this returns, no claim of the topic starts or commits; handlers already
    running finish, producers keep enqueueing. The pause survives restarts. A topic
    with no events yet may be paused too (its events will wait).
    """
    name, who, fq = check_topic_name(topic), _actor(actor), _names(schema, table)
    return await _changing(db, fq, lambda c: _apply(c, fq, name, "pause", who, paused=True))  # type: ignore[no-any-return]


async def resume_topic(
    db: Db,
    topic: str,
    *,
    actor: str | None = None,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> TopicControl:
    """End ``topic``'s own pause and wake its consumers (a no-op if it was not paused;
    a pause of every topic, `pause_all`, still holds it)."""
    name, who, fq = check_topic_name(topic), _actor(actor), _names(schema, table)
    return await _changing(db, fq, lambda c: _apply(c, fq, name, "resume", who, paused=False))  # type: ignore[no-any-return]


async def pause_all(
    db: Db, *, actor: str | None = None, schema: str = DEFAULT_SCHEMA, table: str = DEFAULT_TABLE
) -> TopicControl:
    """Pause every topic, also those that have no events yet (see `pause_topic`)."""
    who, fq = _actor(actor), _names(schema, table)
    return await _changing(  # type: ignore[no-any-return]
        db, fq, lambda c: _apply(c, fq, ALL_TOPICS, "pause", who, paused=True)
    )


async def resume_all(
    db: Db, *, actor: str | None = None, schema: str = DEFAULT_SCHEMA, table: str = DEFAULT_TABLE
) -> list[TopicControl]:
    """End every pause, `pause_all`'s and each topic's own; limits stay. Returns the
    controls that changed."""
    who, fq = _actor(actor), _names(schema, table)

    async def change(conn: asyncpg.Connection) -> list[TopicControl]:
        changed = []
        for row in await conn.fetch(fq.paused_for_update):
            changed.append(await _apply(conn, fq, row["topic"], "resume", who, paused=False))
        topics = await conn.fetchval(fq.claimable_topics)
        if topics:
            await conn.execute(fq.outbox.notify, fq.outbox.channel, topics)
        return changed

    return await _changing(db, fq, change)  # type: ignore[no-any-return]


async def limit_topic(
    db: Db,
    topic: str,
    *,
    max_running: int | _Keep | None = KEEP,
    rate: str | float | _Keep | None = KEEP,
    burst: float | _Keep | None = KEEP,
    actor: str | None = None,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> TopicControl:
    """Set or remove (``None``) ``topic``'s limits; a limit not named stays as it is.

    ``max_running``: at most this many of its events claimed at once, across every
    consumer. ``rate``: ``"50/s"``, ``"10/min"``, ``"3/h"`` (or a number per second):
    claims average at most this rate, in bursts of at most ``burst`` events (default:
    a tenth of a second's worth, at least 1). Setting a rate or a burst refills the
    bucket. Bad values, and a burst without a rate (given or kept), raise
    `InvalidArgument` before anything is written.
    """
    name, who, fq = check_topic_name(topic), _actor(actor), _names(schema, table)
    changes: dict[str, Any] = {}
    if not isinstance(max_running, _Keep):
        changes["max_running"] = _max_running(max_running)
    if not isinstance(rate, _Keep):
        parsed = _rate(rate)
        changes["rate"], changes["rate_text"] = parsed if parsed else (None, None)
        changes["burst"] = None  # the default for the new rate, unless given below
    if not isinstance(burst, _Keep):
        changes["burst"] = _burst(burst)
    if not changes:
        raise InvalidArgument("say which limit to change: max_running=..., rate=... or burst=...")
    if "rate" in changes and changes["rate"] is None and changes["burst"] is not None:
        raise InvalidArgument("a burst needs a rate: give rate=... too (rate=None removes it)")

    async def change(conn: asyncpg.Connection) -> TopicControl:
        if changes.get("burst") is not None and "rate" not in changes:
            row = await conn.fetchrow(fq.control_for_update, name)
            if row is None or row["rate"] is None:
                raise InvalidArgument(f"topic {name!r} has no rate limit: a burst needs one")
        return await _apply(conn, fq, name, "limit", who, **changes)

    return await _changing(db, fq, change)  # type: ignore[no-any-return]


async def topic_controls(
    db: Db, *, schema: str = DEFAULT_SCHEMA, table: str = DEFAULT_TABLE
) -> list[TopicControl]:
    """Every topic's controls (the topic ``""`` is the pause of every topic)."""
    fq = _names(schema, table)
    return [_control(r) for r in await db.fetch(fq.all_controls)]


async def topics(
    db: Db, *, schema: str = DEFAULT_SCHEMA, table: str = DEFAULT_TABLE
) -> list[TopicInfo]:
    """Every topic with unfinished events or controls: depth, lag, paused, limits."""
    return await _overview(db, None, _names(schema, table))


async def topic_info(
    db: Db, name: str, *, schema: str = DEFAULT_SCHEMA, table: str = DEFAULT_TABLE
) -> TopicInfo | None:
    """One topic as `topics` lists it; ``None`` if it has no unfinished events and no
    controls."""
    found = await _overview(db, check_topic_name(name), _names(schema, table))
    return found[0] if found else None


async def _overview(db: Db, name: str | None, fq: FlowQueries) -> list[TopicInfo]:
    rows = await db.fetch(fq.overview, name)
    everything = bool(await db.fetchval(fq.everything_paused))
    return [
        TopicInfo(
            topic=r[0],
            queued=r[1],
            due=r[2],
            waiting=r[3],
            running=r[4],
            lag=r[5],
            paused=r[6] or everything,
            control=TopicControl(r[0], r[6], r[7], r[8], r[9], r[10], r[11], r[12]),
        )
        for r in rows
    ]


async def has_claimable(
    db: Db, name: str, *, schema: str = DEFAULT_SCHEMA, table: str = DEFAULT_TABLE
) -> bool:
    """Whether ``name`` has events pending or to retry (the command line's note)."""
    return bool(await db.fetchval(_names(schema, table).has_claimable, name))


async def flow_history(
    db: Db,
    topic: str | None = None,
    *,
    limit: int = 50,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> list[FlowChange]:
    """The latest changes of the flow controls (of one topic), newest first."""
    name = None if topic is None else (topic if topic == ALL_TOPICS else check_topic_name(topic))
    check_count("limit", limit, 1, 100_000)
    rows = await db.fetch(_names(schema, table).history, name, limit)
    return [
        FlowChange(
            r[0],
            r[1],
            r[2],
            r[3],
            r[4],
            None if r[5] is None else json.loads(r[5]),
            None if r[6] is None else json.loads(r[6]),
        )
        for r in rows
    ]
