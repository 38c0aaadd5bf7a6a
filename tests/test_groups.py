"""Groups: claims serve a topic's groups in turn, so one group's backlog cannot starve
another's events; a group is not an ordering key (docs/guarantees.md, "Fair groups")."""

from __future__ import annotations

import asyncio
import math
import time

import asyncpg
import pytest

import aiooutbox
from aiooutbox import NewEvent, admin
from aiooutbox._engine.groups import GROUPS_PER_CLAIM, GroupCursor
from aiooutbox._sql.flow import flow_queries
from aiooutbox._sql.statements import queries
from tests.clirunner import cli
from tests.helpers import running, wait_until

Q = queries()
MAX_BYTES = 1 << 40

# look-alikes that must stay distinct groups: Latin "a" and Cyrillic U+0430, a ligature and
# its letters, a precomposed "é" and "e" with a combining accent, a trailing space
CONFUSABLE = ["tenant-a", "tenant-\u0430", "\ufb01le", "file", "caf\u00e9", "cafe\u0301", "x ", "x"]


async def _claim(conn: asyncpg.Connection, limit: int, cursor: GroupCursor) -> list[asyncpg.Record]:
    rows: list[asyncpg.Record] = await conn.fetch(
        Q.claim_in_turn, "w", 30.0, ["t"], limit, MAX_BYTES, 0, 0, None, None,
        cursor.value, GROUPS_PER_CLAIM,
    )  # fmt: skip
    cursor.served([r["group"] for r in rows if r["is_head"]])
    return rows


def test_the_cursor_follows_the_claims_turn() -> None:
    cursor = GroupCursor()
    cursor.served([])
    assert cursor.value is None
    cursor.served([None])  # the ungrouped rows come first
    assert cursor.value == ""
    cursor.served(["b", None, "a"])  # after '': groups in order, then the ungrouped rows
    assert cursor.value == ""
    cursor.served(["a", "b"])
    assert cursor.value == "b"
    cursor.served(["c", None, "a"])  # past "b": "c", then wrapping: ungrouped, "a"
    assert cursor.value == "a"
    cursor.served(["b", "z"])
    assert cursor.value == "z"
    # code point order, as the claim's (COLLATE "C"): "Z" < "a" < "é"
    cursor.value = "a"
    cursor.served(["\u00e9", "Z"])
    assert cursor.value == "Z"


async def test_the_group_is_stored_and_handed_to_the_handler(pool: asyncpg.Pool) -> None:
    one = await aiooutbox.enqueue(pool, "t", {"n": 0}, group="tenant-42")
    many = await aiooutbox.enqueue_many(
        pool, [NewEvent("t", {"n": i}, group=g) for i, g in enumerate(CONFUSABLE, 1)]
    )
    plain = await aiooutbox.enqueue(pool, "t", {"n": 99})
    stored = dict(await pool.fetch("SELECT id, grp FROM outbox_events_all"))
    assert stored[one] == "tenant-42" and stored[plain] is None
    assert [stored[i] for i in many] == CONFUSABLE
    assert len(set(stored.values())) == len(CONFUSABLE) + 2
    seen: dict[int, str | None] = {}

    async def handle(event: aiooutbox.Event) -> None:
        seen[event.id] = event.group

    async with running(aiooutbox.OutboxConsumer(pool, concurrency=4), {"t": handle}):
        await wait_until(lambda: asyncio.sleep(0, len(seen) == len(stored)), timeout=20)
    assert seen == stored


async def test_raw_sql_producers_set_the_column_and_an_empty_group_is_refused(
    conn: asyncpg.Connection,
) -> None:
    await conn.execute("INSERT INTO outbox_events (topic, payload, grp) VALUES ('t', '{}', 'g1')")
    await conn.execute("INSERT INTO outbox_events (topic, payload) VALUES ('t', '{}')")
    with pytest.raises(asyncpg.CheckViolationError):
        await conn.execute("INSERT INTO outbox_events (topic, payload, grp) VALUES ('t', '{}', '')")
    with pytest.raises(asyncpg.CheckViolationError):
        await conn.execute(
            "INSERT INTO outbox_events (topic, payload, grp) VALUES ('t', '{}', repeat('g', 513))"
        )
    rows = await conn.fetch(Q.claim, "w", 30.0, ["t"], 10, MAX_BYTES, 0, 0)
    assert sorted(r["group"] or "" for r in rows) == ["", "g1"]


async def test_a_claim_serves_every_group_before_a_backlog_takes_a_second_turn(
    conn: asyncpg.Connection,
) -> None:
    await aiooutbox.enqueue_many(conn, [NewEvent("t", i, group="big") for i in range(500)])
    await aiooutbox.enqueue_many(conn, [NewEvent("t", "lone", group="small")])
    await aiooutbox.enqueue(conn, "t", "plain")
    cursor = GroupCursor()
    rows = await _claim(conn, 8, cursor)
    assert len(rows) == 8
    assert {r["payload"] for r in rows} >= {'"lone"', '"plain"'}
    # the backlog's oldest rows
    big = sorted(int(r["payload"]) for r in rows if r["group"] == "big")
    assert big == list(range(6))


async def test_every_group_is_served_within_its_turns(conn: asyncpg.Connection) -> None:
    """200 groups with work and claims of 10: each is served within ceil(201 / 10)
    claims, whatever the backlogs (one group has 2,000 events)."""
    groups = [f"g{i:03d}" for i in range(200)]
    await aiooutbox.enqueue_many(conn, [NewEvent("t", 0, group="g000") for _ in range(2000)])
    await aiooutbox.enqueue_many(conn, [NewEvent("t", 1, group=g) for g in groups[1:]])
    await aiooutbox.enqueue_many(conn, [NewEvent("t", 2) for _ in range(5)])
    cursor = GroupCursor()
    served: dict[str | None, int] = {}
    turns = math.ceil(201 / 10)
    for claim in range(turns):
        for r in await _claim(conn, 10, cursor):
            served.setdefault(r["group"], claim)
    assert set(served) == {*groups, None}, sorted(set(groups) - set(served), key=str)[:5]


async def test_a_claim_over_many_small_groups_takes_all_it_asks_for(
    conn: asyncpg.Connection,
) -> None:
    """Migration 0020: a claim visits groups a batch (`GROUPS_PER_CLAIM`) at a time, and
    more batches while it has fewer rows than it asked for. 1,000 groups of 2 events and
    a claim of 600: it takes 600 (0018's claim, 128 groups at most, took 256), every
    group's first event before any group's second, the groups in turn from the cursor,
    and the next claim goes on after them."""
    groups = [f"g{i:04d}" for i in range(1000)]
    await conn.execute(
        "INSERT INTO outbox_events (topic, payload, grp)"
        " SELECT 't', to_jsonb(r), g FROM unnest($1::text[]) AS g, generate_series(1, 2) AS r",
        groups,
    )
    cursor = GroupCursor()
    cursor.value = ""  # after the ungrouped rows: the groups from the first
    rows = await _claim(conn, 600, cursor)
    print(f"a claim of 600 over 1,000 groups of 2 took {len(rows)}")
    assert len(rows) == 600
    firsts = {r["group"] for r in rows if r["payload"] == "1"}
    seconds = {r["group"] for r in rows if r["payload"] == "2"}
    # every visited group's first event, and second events only of visited groups
    assert seconds <= firsts
    assert sorted(firsts) == groups[: len(firsts)]  # in turn, from the cursor
    assert len(firsts) + len(seconds) == 600
    assert cursor.value == max(firsts)
    # the next claim starts after them: the groups not visited yet come first
    rest = await _claim(conn, 2 * (1000 - len(firsts)), cursor)
    assert {r["group"] for r in rest} == set(groups[len(firsts) :])


async def test_groups_of_only_later_events_do_not_hide_the_groups_after_them(
    conn: asyncpg.Connection,
) -> None:
    """200 groups whose one event is due in an hour, then a group with a due event: a
    claim of 300 goes past the first batch of groups that gave nothing (0018's claim
    visited the same 128 groups again at every claim and never reached it)."""
    await conn.execute(
        "INSERT INTO outbox_events (topic, payload, grp, available_at)"
        " SELECT 't', '{}', 'a' || lpad(g::text, 3, '0'), now() + interval '1 hour'"
        " FROM generate_series(0, 199) AS g"
    )
    due = await aiooutbox.enqueue(conn, "t", "due", group="z")
    cursor = GroupCursor()
    cursor.value = ""
    rows = await _claim(conn, 300, cursor)
    assert [r["id"] for r in rows] == [due]
    assert cursor.value == "z"


async def test_topics_without_groups_claim_as_before(conn: asyncpg.Connection) -> None:
    await aiooutbox.enqueue_many(conn, [NewEvent("t", i) for i in range(30)])
    cursor = GroupCursor()
    got = [int(r["payload"]) for r in await _claim(conn, 10, cursor)]
    got += [int(r["payload"]) for r in await _claim(conn, 10, cursor)]
    assert got == list(range(20))  # oldest first, as ever
    assert cursor.value == ""


async def test_a_limited_topic_serves_its_groups_in_turn_too(conn: asyncpg.Connection) -> None:
    await admin.limit_topic(conn, "t", max_running=4)
    await aiooutbox.enqueue_many(conn, [NewEvent("t", i, group="big") for i in range(100)])
    await aiooutbox.enqueue(conn, "t", "lone", group="small")
    rows = await conn.fetch(
        flow_queries().claim_limited_in_turn, "w", 30.0, ["t"], [4], MAX_BYTES, [], None, 32
    )
    claimed = [r for r in rows if r["id"] is not None]
    assert len(claimed) == 4
    assert "small" in {r["grp"] for r in claimed}


async def test_ordering_keys_inside_groups_keep_their_order(pool: asyncpg.Pool) -> None:
    events = [
        NewEvent("t", {"k": k, "n": n}, ordering_key=f"{g}-{k}", group=g)
        for n in range(30)
        for g in ("ga", "gb", "gc")
        for k in range(3)
    ]
    events += [NewEvent("t", {"k": 9, "n": n}, group="ga") for n in range(100)]
    await aiooutbox.enqueue_many(pool, events)
    seen: dict[str, list[int]] = {}
    running_keys: set[str] = set()
    overlaps = 0

    async def handle(event: aiooutbox.Event) -> None:
        nonlocal overlaps
        key = event.ordering_key
        if key is not None:
            overlaps += key in running_keys
            running_keys.add(key)
        await asyncio.sleep(0.001)
        if key is not None:
            running_keys.discard(key)
            seen.setdefault(key, []).append(event.payload["n"])

    async with running(aiooutbox.OutboxConsumer(pool, concurrency=8), {"t": handle}):
        await wait_until(lambda: asyncio.sleep(0, sum(map(len, seen.values())) == 270), 30)
    assert overlaps == 0
    assert len(seen) == 9 and all(ns == list(range(30)) for ns in seen.values()), seen


async def test_a_lone_event_is_not_starved_by_another_groups_backlog(pool: asyncpg.Pool) -> None:
    """20,000 events of one group, then one of another; one consumer at concurrency 8
    with 5 ms handlers. Without groups the lone event waited for all 20,000 (13.8 s);
    here it starts within a claim or two (the 1 s figure is `python -m benchmarks
    fairness`'s; this asserts generously)."""
    await aiooutbox.enqueue_many(pool, [NewEvent("t", i, group="flood") for i in range(20_000)])
    await aiooutbox.enqueue(pool, "t", "lone", group="tenant-b")
    started: dict[str, float] = {}

    async def handle(event: aiooutbox.Event) -> None:
        started.setdefault(event.group or "", time.monotonic())
        await asyncio.sleep(0.005)

    async with running(aiooutbox.OutboxConsumer(pool, concurrency=8), {"t": handle}):
        await wait_until(lambda: asyncio.sleep(0, "tenant-b" in started), timeout=60)
    after = started["tenant-b"] - started["flood"]
    print(f"the lone event started {after:.3f}s after the first run")
    assert after < 5.0


async def test_an_idle_consumer_wakes_for_a_grouped_event_when_it_comes_due(
    pool: asyncpg.Pool,
) -> None:
    """The probe before an idle wait sees each group's first scheduled row, and a
    consumer with nothing due idles (it does not claim in a loop)."""
    handled: list[str | None] = []

    async def handle(event: aiooutbox.Event) -> None:
        handled.append(event.group)

    consumer = aiooutbox.OutboxConsumer(pool, poll_interval=60)
    async with running(consumer, {"t": handle}):
        await aiooutbox.enqueue(pool, "t", {}, group="later", delay=1.0)
        await asyncio.sleep(0.5)
        claims = consumer.stats.claims
        await asyncio.sleep(0.3)
        assert consumer.stats.claims - claims <= 1, "an idle consumer claims in a loop"
        await wait_until(lambda: asyncio.sleep(0, handled == ["later"]), timeout=10)


async def test_the_cli_enqueues_a_grouped_event(dsn: str, conn: asyncpg.Connection) -> None:
    result = await cli("enqueue", "t", "{}", "--group", "tenant-\u0430", "--dsn", dsn)
    assert result.rc == 0, result.err
    assert await conn.fetchval("SELECT grp FROM outbox_events_all") == "tenant-\u0430"
    bad = await cli("enqueue", "t", "{}", "--group", "", "--dsn", dsn)
    assert bad.rc == 2 and "group must not be empty" in bad.err, bad.err
