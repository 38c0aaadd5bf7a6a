"""`aiooutbox.admin`: the operator functions behind the CLI, called from Python."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import asyncpg
import pytest

import aiooutbox
from aiooutbox import admin
from aiooutbox._sql.statements import queries
from aiooutbox.cli.output import age, duration
from tests.helpers import backdate, status_counts, wait_until


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30),
        ("15m", 900),
        ("12h", 43200),
        ("7d", 604800),
        ("1w", 604800),
        ("1h30m", 5400),
        ("500ms", 0.5),
        ("1.5h", 5400),
        (" 10 ", 10),
        ("0", 0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert admin.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "s", "-5s", "5y", "inf", "nan", "1e3", "5 x", "1h-5m"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(aiooutbox.InvalidArgument, match="invalid duration"):
        admin.parse_duration(text)


def test_text_formats() -> None:
    assert [age(s) for s in (None, 0.42, 5, 42, 192, 7500, 273600)] == [
        "-",
        "0.42s",
        "5.0s",
        "42s",
        "3m12s",
        "2h05m",
        "3d04h",
    ]
    assert [duration(s) for s in (604800, 43200, 90, 0.5, 0)] == ["7d", "12h", "90s", "0.5s", "0s"]


async def _make_dead(pool: asyncpg.Pool, topic: str, n: int, age: str = "0 seconds") -> list[int]:
    ids = await aiooutbox.enqueue_many(
        pool, [aiooutbox.NewEvent(topic, {"n": i}) for i in range(n)]
    )
    await pool.execute(
        "UPDATE outbox_events SET status = 'dead', attempts = max_attempts, last_error = 'boom',"
        " finished_at = now() - $2::text::interval WHERE id = ANY($1)",
        ids,
        age,
    )
    return [i for i in ids if i is not None]


async def test_stats_counts_lag_and_workers(pool: asyncpg.Pool) -> None:
    empty = await admin.stats(pool)
    assert (empty.topics, empty.in_flight, empty.lag, empty.dead) == ([], [], None, 0)

    await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("a", {}) for _ in range(3)])
    await aiooutbox.enqueue(pool, "b", {}, delay=3600)
    await _make_dead(pool, "b", 2)
    await backdate(
        pool, "UPDATE outbox_events SET available_at = now() - interval '1 min' WHERE topic = 'a'"
    )
    await pool.execute(
        # held as a claim holds it: with a lease (stats counts processing rows by it)
        "UPDATE outbox_events SET status = 'processing', locked_by = 'w1',"
        " locked_at = now() - interval '5 seconds', lease_expires_at = now() + interval '25 s'"
        " WHERE id = (SELECT min(id) FROM outbox_events_all)"
    )
    report = await admin.stats(pool)
    assert report.outbox == "public.outbox_events"
    a, b = report.topics
    assert (a.topic, a.counts["pending"], a.counts["processing"]) == ("a", 2, 1)
    assert a.lag is not None and 59 < a.lag < 90
    # the delayed event is scheduled, not pending (due now)
    assert (b.counts["pending"], b.counts["scheduled"], b.counts["dead"], b.lag) == (0, 1, 2, None)
    assert report.totals == {
        "pending": 2,
        "scheduled": 1,
        "retry": 0,
        "processing": 1,
        "waiting": 0,
        "done": 0,
        "dead": 2,
    }
    assert report.dead == 2 and report.lag == a.lag
    [worker] = report.in_flight
    assert (worker.worker, worker.rows) == ("w1", 1) and 4 < worker.oldest_claim_age < 60
    data = report.as_dict()
    assert data["topics"]["b"]["dead"] == 2 and data["in_flight"][0]["worker"] == "w1"


async def test_dead_list_filters_and_decodes(pool: asyncpg.Pool) -> None:
    first = await _make_dead(pool, "a", 3)
    await _make_dead(pool, "b", 1)
    everything = await admin.dead_list(pool)
    assert [e.id for e in everything][:3] == first and len(everything) == 4
    only_a = await admin.dead_list(pool, topic="a", limit=2)
    assert [e.payload for e in only_a] == [{"n": 0}, {"n": 1}]
    assert only_a[0].last_error == "boom" and only_a[0].as_dict()["topic"] == "a"
    with pytest.raises(aiooutbox.InvalidArgument):
        await admin.dead_list(pool, limit=0)


async def test_dead_retry_requeues_and_wakes_consumers(pool: asyncpg.Pool) -> None:
    a = await _make_dead(pool, "a", 2)
    await _make_dead(pool, "b", 2)
    for wrong in ({}, {"ids": a, "topic": "a"}, {"topic": "a", "everything": True}):
        with pytest.raises(aiooutbox.InvalidArgument, match="exactly one"):
            await admin.dead_retry(pool, **wrong)
    with pytest.raises(TypeError):
        await admin.dead_retry(pool, ids=["1"])  # type: ignore[list-item,unused-ignore]

    woken: asyncio.Queue[str] = asyncio.Queue()

    def notified(*args: object) -> None:
        woken.put_nowait(str(args[3]))

    async with pool.acquire() as listener:
        await listener.add_listener(queries().channel, notified)
        try:
            assert await admin.dead_retry(pool, ids=a[:1]) == {"a": 1}
            assert await asyncio.wait_for(woken.get(), 10) == "a"
            assert await admin.dead_retry(pool, everything=True) == {"a": 1, "b": 2}
            assert {await asyncio.wait_for(woken.get(), 10) for _ in range(2)} == {"a", "b"}
            assert await admin.dead_retry(pool, topic="a") == {}
        finally:  # a pooled connection must not go back with a listener on it
            await listener.remove_listener(queries().channel, notified)
    rows = await pool.fetch("SELECT DISTINCT status::text, attempts FROM outbox_events_all")
    assert [tuple(r) for r in rows] == [("pending", 0)]


async def test_retried_events_reach_a_running_consumer(pool: asyncpg.Pool) -> None:
    await _make_dead(pool, "a", 3)
    seen: list[int] = []
    done = asyncio.Event()

    async def handle(event: aiooutbox.Event) -> None:
        seen.append(event.attempts)
        if len(seen) == 3:
            done.set()

    consumer = aiooutbox.OutboxConsumer(pool, poll_interval=30)
    task = asyncio.ensure_future(consumer.run({"a": handle}))
    try:

        async def idle() -> bool:  # advertised as idle: only a notification wakes it now
            return bool(await pool.fetchval("SELECT count(*) FROM outbox_events_idle"))

        await wait_until(idle, timeout=20)
        await admin.dead_retry(pool, topic="a")
        await asyncio.wait_for(done.wait(), 20)
    finally:
        consumer.stop()
        await asyncio.wait_for(task, 10)
    assert seen == [1, 1, 1]


async def test_dead_purge_and_purge(pool: asyncpg.Pool) -> None:
    old = await _make_dead(pool, "a", 2, age="40 days")
    await _make_dead(pool, "a", 1)
    assert await admin.dead_purge(pool, topic="a", older_than=timedelta(days=30)) == 2
    assert await admin.dead_purge(pool, ids=old) == 0
    assert await admin.dead_purge(pool, everything=True) == 1

    ids = await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", {}) for _ in range(7)])
    await pool.execute(
        "UPDATE outbox_events SET status = 'done', finished_at = now() - interval '2 hours'"
        " WHERE id = ANY($1)",
        ids[:5],
    )
    with pytest.raises(aiooutbox.InvalidArgument, match="only finished"):
        await admin.purge(pool, status="pending", older_than=0)
    assert await admin.purge(pool, older_than=3 * 3600) == 0
    assert await admin.purge(pool, older_than=3600, batch_size=2) == 5
    assert await status_counts(pool) == {"pending": 2}
