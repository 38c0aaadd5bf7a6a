"""Per-group limits (`admin.limit_groups`, ``topics limit --group-max-running``): exact
across claims and processes, overrides for named groups, hostile input."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import pytest

import aiooutbox
from aiooutbox import NewEvent, admin
from aiooutbox._sql.flow import flow_queries
from aiooutbox.errors import InvalidArgument
from tests.clirunner import cli
from tests.faults.procs import wait_until
from tests.test_flow_processes import CONFIG, clock, prepare, processes

MAX_BYTES = 1 << 40
FQ = flow_queries()

# the most handler runs of the group overlapping at any instant; a run cut short by a
# SIGKILL ends when its process died ($2)
GROUP_OVERLAP = """
WITH r AS (SELECT r.* FROM runs r JOIN outbox_events_all e ON e.id = r.event_id WHERE e.grp = $1),
e AS (SELECT started AS at, 1 AS d FROM r UNION ALL SELECT coalesce(ended, $2), -1 FROM r)
SELECT coalesce(max(n), 0) FROM (SELECT sum(d) OVER (ORDER BY at, d) AS n FROM e) AS s
"""


async def _claim(conn: asyncpg.Connection, want: int, worker: str = "w") -> list[asyncpg.Record]:
    rows: list[asyncpg.Record] = await conn.fetch(
        FQ.claim_limited_in_turn, worker, 30.0, ["t"], [want], MAX_BYTES, [], None, 32
    )
    return rows


def _by_group(rows: list[asyncpg.Record]) -> dict[str | None, int]:
    counts: dict[str | None, int] = {}
    for r in rows:
        if r["id"] is not None:
            counts[r["grp"]] = counts.get(r["grp"], 0) + 1
    return counts


async def test_each_group_runs_at_most_its_limit_and_overrides_win(
    conn: asyncpg.Connection,
) -> None:
    await admin.limit_groups(conn, "t", max_running=2)
    await admin.limit_groups(conn, "t", group="vip", max_running=5)
    await aiooutbox.enqueue_many(
        conn,
        [NewEvent("t", i, group=g) for g in ("a", "b", "vip") for i in range(10)]
        + [NewEvent("t", i) for i in range(3)],
    )
    first = await _claim(conn, 100)
    assert _by_group(first) == {"a": 2, "b": 2, "vip": 5, None: 3}
    # at their limits: nothing more, and the claim says why
    again = await _claim(conn, 100, "w2")
    assert _by_group(again) == {}
    assert [r["held"] for r in again] == ["running"]
    # a slot freed (the row settled) is used again, by its own group only
    a_row = next(r["id"] for r in first if r["grp"] == "a")
    await conn.execute("UPDATE outbox_events SET status = 'done' WHERE id = $1", a_row)
    assert _by_group(await _claim(conn, 100, "w3")) == {"a": 1}


async def test_a_limit_on_a_group_that_has_no_events_yet(conn: asyncpg.Connection) -> None:
    limit = await admin.limit_groups(conn, "t", group="future", max_running=1)
    assert (limit.group, limit.max_running) == ("future", 1)
    assert [g.group for g in await admin.group_limits(conn, "t")] == ["future"]
    await aiooutbox.enqueue_many(conn, [NewEvent("t", i, group="future") for i in range(3)])
    await aiooutbox.enqueue_many(conn, [NewEvent("t", i, group="other") for i in range(3)])
    assert _by_group(await _claim(conn, 10)) == {"future": 1, "other": 3}


async def test_removing_every_group_limit_opens_the_topic_again(pool: asyncpg.Pool) -> None:
    await admin.limit_groups(pool, "t", max_running=1)
    assert {c.topic for c in await admin.topic_controls(pool)} == {"t"}
    await admin.limit_groups(pool, "t", max_running=None)
    assert await admin.group_limits(pool, "t") == []
    assert await admin.topic_controls(pool) == []
    await aiooutbox.enqueue_many(pool, [NewEvent("t", i, group="g") for i in range(5)])
    handled = []

    async def handle(event: aiooutbox.Event) -> None:
        handled.append(event.id)

    consumer = aiooutbox.OutboxConsumer(pool)
    task = asyncio.ensure_future(consumer.run({"t": handle}))
    try:
        await wait_until(lambda: asyncio.sleep(0, len(handled) == 5), 20, "the events")
    finally:
        consumer.stop()
        await task


async def test_a_group_rate_lets_its_burst_through_then_says_when(
    conn: asyncpg.Connection,
) -> None:
    limit = await admin.limit_groups(conn, "t", rate="2/min")
    assert (limit.rate_text, limit.burst) == ("2/min", 1.0)
    await aiooutbox.enqueue_many(conn, [NewEvent("t", i, group=g) for g in "ab" for i in range(5)])
    assert _by_group(await _claim(conn, 10)) == {"a": 1, "b": 1}
    held = await _claim(conn, 10)
    assert _by_group(held) == {}
    assert [r["held"] for r in held] == ["rate"] and 20 < held[0]["retry_in"] <= 30


async def test_two_operators_setting_the_same_limit_at_once(dsn: str) -> None:
    conns = [await asyncpg.connect(dsn) for _ in range(2)]
    try:
        results = await asyncio.gather(
            *(
                admin.limit_groups(c, "t", group="tenant-7", max_running=3, actor=f"op{i}")
                for i, c in enumerate(conns)
            )
        )
        assert {r.max_running for r in results} == {3}
        rows = await conns[0].fetch("SELECT grp, max_running FROM outbox_events_group_limits")
        assert [tuple(r) for r in rows] == [("tenant-7", 3)]
        # the second saw the first's change: one change logged
        log = await conns[0].fetchval(
            "SELECT count(*) FROM outbox_events_flow_log WHERE action = 'limit groups'"
        )
        assert log == 1
    finally:
        for c in conns:
            await c.close()


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"group": "", "max_running": 1}, InvalidArgument, "group must not be empty"),
        ({"group": "a\x00b", "max_running": 1}, InvalidArgument, "without NUL"),
        ({"group": "g" * 1_000_000, "max_running": 1}, InvalidArgument, "at most 512 bytes"),
        ({"group": "\ud800", "max_running": 1}, InvalidArgument, "not valid Unicode"),
        ({"group": 7, "max_running": 1}, TypeError, "group must be a str"),
        ({"max_running": 0}, InvalidArgument, "max_running must be at least 1"),
        ({"rate": "0/s"}, InvalidArgument, "lets nothing through"),
        ({"burst": 5}, InvalidArgument, "a burst needs a rate"),
        ({}, InvalidArgument, "say which limit to change"),
    ],
)
async def test_bad_group_limits_are_refused_before_anything_is_written(
    conn: asyncpg.Connection, kwargs: dict[str, object], exc: type[Exception], message: str
) -> None:
    with pytest.raises(exc, match=message):
        await admin.limit_groups(conn, "t", **kwargs)  # type: ignore[arg-type]
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_group_limits") == 0
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_flow") == 0


async def test_the_cli_sets_group_limits(dsn: str, conn: asyncpg.Connection) -> None:
    d = ["--dsn", dsn]
    ok = await cli("topics", "limit", "t", "--group-max-running", "4", "--group-rate", "10/s", *d)
    assert ok.rc == 0, ok.err
    assert "every group: at most 4 running, rate 10/s (burst 1)" in ok.out
    one = await cli("topics", "limit", "t", "--group", "vip", "--group-max-running", "9", *d)
    assert one.rc == 0 and "group 'vip': at most 9 running" in one.out, one.err
    rows = await conn.fetch("SELECT grp, max_running FROM outbox_events_group_limits ORDER BY grp")
    assert [tuple(r) for r in rows] == [("", 4), ("vip", 9)]
    bad = await cli("topics", "limit", "t", "--group", "vip", "--max-running", "3", *d)
    assert bad.rc == 2 and "--group takes only" in bad.err, bad.err


@pytest.mark.slow
async def test_group_max_running_across_three_processes_with_a_sigkill(
    dsn: str, conn: asyncpg.Connection
) -> None:
    """Three processes, two groups limited to 2 running each; the process holding the
    most is SIGKILLed; per group, the runs overlapping at any instant (from the recorded
    intervals, in SQL) never exceed 2, and the slots come back with the leases."""
    limit, lease = 2, 2.0
    await prepare(conn, "lim", 0)
    await aiooutbox.enqueue_many(
        conn, [NewEvent("lim", {"n": i}, group=g) for i in range(150) for g in ("ga", "gb")]
    )
    await admin.limit_groups(conn, "lim", max_running=limit)
    config = CONFIG | {"dsn": dsn, "lease_timeout": lease}
    async with processes(3, config) as procs:
        await admin.resume_topic(conn, "lim")
        victims: list[str] = []

        async def one_holds_some() -> bool:
            victims[:] = [
                r[0]
                for r in await conn.fetch(
                    "SELECT locked_by FROM outbox_events_all WHERE topic = 'lim'"
                    " AND status = 'processing' GROUP BY locked_by ORDER BY count(*) DESC"
                )
            ]
            return bool(victims)

        await wait_until(one_holds_some, 20, "a process to hold a limited event")
        by_name = {f"p{i}": p for i, p in enumerate(procs)}
        by_name.pop(victims[0]).kill()
        killed = await clock(conn)
        started = time.monotonic()

        async def recovered() -> bool:
            n = await conn.fetchval(
                "SELECT count(*) FROM outbox_events WHERE status = 'processing' AND locked_by = $1",
                victims[0],
            )
            return bool(n == 0)

        await wait_until(recovered, lease + 15, "the victim's leases to come back")
        back = time.monotonic() - started
        resumed = await clock(conn)
        await asyncio.sleep(4.0)
        end = await clock(conn)
        for p in by_name.values():
            await p.stop()
    overlaps = {g: await conn.fetchval(GROUP_OVERLAP, g, killed) for g in ("ga", "gb")}
    after = await conn.fetchval(
        "SELECT count(*) FROM runs r JOIN outbox_events_all e ON e.id = r.event_id"
        " WHERE e.topic = 'lim' AND r.started > $1 AND r.started < $2",
        resumed,
        end,
    )
    print(f"per group at most {overlaps} ran at once; leases back after {back:.1f}s; {after} runs")
    assert all(n <= limit for n in overlaps.values()), overlaps
    # the dead process's slots came back: 2 groups x 2 slots of 1 s handlers for 4 s
    assert after >= 8


async def test_topics_show_lists_the_busiest_and_most_waiting_groups(
    dsn: str, conn: asyncpg.Connection
) -> None:
    await aiooutbox.enqueue_many(
        conn,
        [NewEvent("t", i, group="big") for i in range(30)]
        + [NewEvent("t", i, group="small") for i in range(2)]
        + [NewEvent("t", i) for i in range(5)],
    )
    await admin.limit_groups(conn, "t", max_running=3)
    await _claim(conn, 100)  # big 3, small 2, ungrouped 5 now running
    stats = await admin.group_stats(conn, "t", top=2)
    assert stats.busiest == [(None, 5), ("big", 3)]
    assert [(g, n) for g, n, _ in stats.waiting] == [("big", 27)]
    shown = await cli("topics", "show", "t", "--dsn", dsn)
    assert shown.rc == 0, shown.err
    assert "every group: at most 3 running" in shown.out
    assert "busiest groups (running): (ungrouped) 5, 'big' 3, 'small' 2" in shown.out
    assert "most waiting groups (due, oldest): 'big' 27" in shown.out
    with pytest.raises(InvalidArgument):
        await admin.group_stats(conn, "t", top=0)


@pytest.mark.slow
async def test_a_group_rate_across_three_processes_over_thirty_seconds(
    dsn: str, conn: asyncpg.Connection
) -> None:
    """Two groups at 50/s each, three processes, 30 s: each group's claims within ±5% of
    its rate, whatever the other group's backlog."""
    rate, seconds = 50, 30.0
    await prepare(conn, "rated", 0, free=0)
    await aiooutbox.enqueue_many(
        conn, [NewEvent("rated", {"n": i}, group=g) for i in range(1700) for g in ("ga", "gb")]
    )
    limit = await admin.limit_groups(conn, "rated", rate=f"{rate}/s")
    assert limit.burst == 5
    config = {"dsn": dsn, "topics": ["rated", "free"], "concurrency": 8}
    async with processes(3, config) as procs:
        await admin.resume_topic(conn, "rated")
        start = await clock(conn)
        await asyncio.sleep(seconds + 0.5)
        for p in procs:
            await p.stop()
    claimed = dict(
        await conn.fetch(
            "SELECT grp, count(*) FROM outbox_events_all WHERE topic = 'rated' AND locked_at >= $1"
            " AND locked_at < $1 + make_interval(secs => $2) GROUP BY grp",
            start,
            seconds,
        )
    )
    expected = rate * seconds
    print(f"group rate {rate}/s for {seconds:.0f}s: {claimed} (expected {expected:.0f} each)")
    for group in ("ga", "gb"):
        assert abs(claimed[group] - expected) <= 0.05 * expected, claimed
