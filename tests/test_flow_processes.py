"""Flow control across three consumer processes, on a real server.

Each handler run is recorded with its start and end in ``runs`` (``tests/faults/
flow_proc.py``): how many ran at once is computed in SQL from those intervals, and a
sampler reads the database's own count of claimed rows every few milliseconds. The
SIGKILL and the 30-second rate test are marked ``slow``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import asyncpg
import pytest

import aiooutbox
from aiooutbox import admin
from tests.faults.flow_proc import RUNS_DDL
from tests.faults.procs import ConsumerProcess, wait_until

MODULE = "tests.faults.flow_proc"
# Three processes of eight workers claiming ahead (prefetch) of a limited topic whose
# handlers take a second (a slow downstream call) and of a topic of quick events. A
# slot is busy from its claim to its outcome's write, a handler's run is less: the
# hand-out, the write and the next claim take a few round trips per run (tens of
# milliseconds each on a loaded two-core machine).
CONFIG = {
    "topics": ["lim", "free"],
    "sleep_topics": ["lim"],
    "sleep": 1.0,
    "concurrency": 8,
    "prefetch": 64,
}

# the most handler runs of the topic overlapping at any instant; a run cut short by a
# SIGKILL ends when its process died ($2)
OVERLAP = """
WITH e AS (
    SELECT started AS at, 1 AS d FROM runs WHERE topic = $1
    UNION ALL
    SELECT coalesce(ended, $2), -1 FROM runs WHERE topic = $1)
SELECT coalesce(max(n), 0) FROM (SELECT sum(d) OVER (ORDER BY at, d) AS n FROM e) AS s
"""

# the average number of runs of the topic under way over [$2, $3]: the runs' time
# inside the window, divided by the window (a run cut short by SIGKILL ended at $4)
AVERAGE = """
SELECT sum(extract(epoch FROM least(coalesce(ended, $4), $3) - greatest(started, $2)))
       / extract(epoch FROM $3::timestamptz - $2::timestamptz)
FROM runs WHERE topic = $1 AND started < $3 AND coalesce(ended, $4) > $2
"""


@contextlib.asynccontextmanager
async def processes(n: int, config: dict[str, Any]) -> AsyncIterator[list[ConsumerProcess]]:
    procs = [ConsumerProcess({**config, "worker_id": f"p{i}"}, MODULE) for i in range(n)]
    try:
        await asyncio.gather(*(p.ready() for p in procs))
        yield procs
    finally:
        for p in procs:
            p.close()


@contextlib.asynccontextmanager
async def sampler(dsn: str, topic: str) -> AsyncIterator[list[int]]:
    """The database's count of the topic's claimed rows, every 10 ms."""
    seen: list[int] = []
    conn = await asyncpg.connect(dsn)

    async def sample() -> None:
        while True:
            seen.append(
                await conn.fetchval(
                    "SELECT count(*) FROM outbox_events WHERE topic = $1 AND status = 'processing'",
                    topic,
                )
            )
            await asyncio.sleep(0.01)

    task = asyncio.ensure_future(sample())
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await conn.close()


async def clock(conn: asyncpg.Connection) -> datetime:
    value: datetime = await conn.fetchval("SELECT clock_timestamp()")
    return value


async def prepare(conn: asyncpg.Connection, topic: str, backlog: int, free: int = 3000) -> None:
    await conn.execute(RUNS_DDL)
    await admin.pause_topic(conn, topic)  # the backlog waits until every process runs
    await aiooutbox.enqueue_many(
        conn, [aiooutbox.NewEvent(topic, {"n": i}) for i in range(backlog)]
    )
    # another topic keeps the consumers' prefetch busy beside the limited one
    await aiooutbox.enqueue_many(conn, [aiooutbox.NewEvent("free", {"n": i}) for i in range(free)])


async def test_max_running_holds_across_three_processes_and_is_used(
    dsn: str, conn: asyncpg.Connection
) -> None:
    limit = 4
    await prepare(conn, "lim", 300)
    await admin.limit_topic(conn, "lim", max_running=limit)
    # three workers a process and nothing claimed ahead: no process can hold all four
    # slots, so using the limit takes two processes, and together they could run nine
    config = CONFIG | {"dsn": dsn, "concurrency": 3, "prefetch": 0}
    async with processes(3, config) as procs, sampler(dsn, "lim") as seen:
        await admin.resume_topic(conn, "lim")
        await asyncio.sleep(1.5)
        start = await clock(conn)
        await asyncio.sleep(6.0)
        end = await clock(conn)
        for p in procs:
            await p.stop()
    overlap = await conn.fetchval(OVERLAP, "lim", end)
    average = await conn.fetchval(AVERAGE, "lim", start, end, end)
    workers = await conn.fetchval("SELECT count(DISTINCT worker_id) FROM runs WHERE topic = 'lim'")
    print(
        f"max_running={limit}: at most {overlap} ran at once, {max(seen)} claimed at once; "
        f"{average:.2f} running on average; {workers} processes ran them"
    )
    assert overlap <= limit
    assert max(seen) <= limit
    # the limit is used, not just never exceeded (one process alone would be at most 3)
    assert average >= 0.6 * limit
    # the slots are shared across processes. Which process gets a freed slot is not
    # promised (the one that just wrote an outcome claims again at once: with eight
    # workers each, one process sometimes held all four for the whole 6 s), but one that
    # cannot take the fourth leaves it to the others
    assert workers >= 2


@pytest.mark.slow
async def test_max_running_holds_when_a_process_is_sigkilled_and_slots_come_back(
    dsn: str, conn: asyncpg.Connection
) -> None:
    limit, lease = 4, 2.0
    await prepare(conn, "lim", 400)
    await admin.limit_topic(conn, "lim", max_running=limit)
    config = CONFIG | {"dsn": dsn, "lease_timeout": lease}
    async with processes(3, config) as procs, sampler(dsn, "lim") as seen:
        await admin.resume_topic(conn, "lim")

        # the victim is whichever process holds the most limited events: which process
        # gets the slots is not promised (one process of eight workers sometimes holds
        # all four for many seconds)
        victims: list[str] = []

        async def one_holds_some() -> bool:
            victims[:] = [
                r["locked_by"]
                for r in await conn.fetch(
                    "SELECT locked_by FROM outbox_events_all WHERE topic = 'lim'"
                    " AND status = 'processing' GROUP BY locked_by ORDER BY count(*) DESC"
                )
            ]
            return bool(victims)

        await wait_until(one_holds_some, 20, "a process to hold a limited event")
        victim = victims[0]
        by_name = {f"p{i}": p for i, p in enumerate(procs)}
        by_name.pop(victim).kill()
        killed = await clock(conn)
        held = await conn.fetchval(
            "SELECT count(*) FROM outbox_events_all WHERE topic = 'lim' AND status = 'processing'"
            " AND locked_by = $1",
            victim,
        )
        killed_mono = time.monotonic()

        async def recovered() -> bool:
            n = await conn.fetchval(
                "SELECT count(*) FROM outbox_events WHERE status = 'processing' AND locked_by = $1",
                victim,
            )
            return bool(n == 0)

        await wait_until(recovered, lease + 15, "the victim's leases to come back")
        recovery = time.monotonic() - killed_mono
        back = await clock(conn)
        await asyncio.sleep(5.0)
        end = await clock(conn)
        for p in by_name.values():
            await p.stop()
    overlap = await conn.fetchval(OVERLAP, "lim", killed)
    after = await conn.fetchval(AVERAGE, "lim", back, end, killed)
    print(
        f"victim {victim} held {held} of {limit} slots when killed;"
        f" leases back after {recovery:.1f}s;"
        f" at most {overlap} ran at once, {max(seen)} claimed at once;"
        f" {after:.2f} running on average after recovery"
    )
    assert held >= 1
    assert overlap <= limit
    assert max(seen) <= limit
    # the dead process's slots came back with its leases: the survivors use all of them
    assert after >= 0.8 * limit


@pytest.mark.slow
async def test_rate_limit_across_three_processes_over_thirty_seconds(
    dsn: str, conn: asyncpg.Connection
) -> None:
    rate, seconds = 50, 30.0
    await prepare(conn, "rated", 2500, free=0)
    control = await admin.limit_topic(conn, "rated", rate=f"{rate}/s")
    burst = control.burst
    assert burst == 5
    config = {"dsn": dsn, "topics": ["rated", "free"], "concurrency": 8}
    async with processes(3, config) as procs:
        await admin.resume_topic(conn, "rated")
        start = await clock(conn)
        await asyncio.sleep(seconds + 0.5)
        for p in procs:
            await p.stop()
    handled = await conn.fetchval(
        "SELECT count(*) FROM runs WHERE topic = 'rated'"
        " AND started >= $1 AND started < $1 + make_interval(secs => $2)",
        start,
        seconds,
    )
    # claims per second of the window, by the time the claim took its tokens
    per_second = [
        r[0]
        for r in await conn.fetch(
            "SELECT count(*) FROM outbox_events_all WHERE topic = 'rated' AND locked_at >= $1"
            " AND locked_at < $1 + make_interval(secs => $2)"
            " GROUP BY floor(extract(epoch FROM locked_at - $1)) ORDER BY 1 DESC",
            start,
            seconds,
        )
    ]
    # the same over every window of one second that starts at a claim
    worst = await conn.fetchval(
        "SELECT max(n) FROM (SELECT count(*) OVER (ORDER BY locked_at"
        "  RANGE BETWEEN CURRENT ROW AND '999999 microseconds' FOLLOWING) AS n"
        " FROM outbox_events_all WHERE topic = 'rated' AND locked_at IS NOT NULL) AS w"
    )
    workers = await conn.fetchval(
        "SELECT count(DISTINCT worker_id) FROM runs WHERE topic = 'rated'"
    )
    expected = rate * seconds
    print(
        f"rate {rate}/s for {seconds:.0f}s: {handled} handled (expected {expected:.0f},"
        f" {handled / expected - 1:+.1%}); busiest second {per_second[0]},"
        f" busiest sliding second {worst} (bound {rate + burst:.0f}); {workers} processes"
    )
    assert abs(handled - expected) <= 0.05 * expected
    assert worst <= rate + burst
    assert workers == 3


async def test_a_relay_of_every_topic_honours_a_pause_and_a_limit(
    dsn: str, conn: asyncpg.Connection
) -> None:
    """``python -m aiooutbox relay`` runs on the consumer engine: a paused topic is not
    published until resumed, a limited one never has more claimed than its limit."""
    import nats

    from tests.relay.brokers import NATS_URL
    from tests.relay.common import RelayProcess, nats_stream, unique

    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    stream, prefix = unique("FLOW"), unique("flow.relay.") + "."
    await nats_stream(js, stream, [prefix + ">"], "memory")
    held, narrow, free = prefix + "held", prefix + "narrow", prefix + "free"
    try:
        await admin.pause_topic(conn, held)
        await admin.limit_topic(conn, narrow, max_running=2)
        for topic in (held, narrow, free):
            await aiooutbox.enqueue_many(
                conn, [aiooutbox.NewEvent(topic, {"n": i}) for i in range(100)]
            )
        async with sampler(dsn, narrow) as seen:
            relay = RelayProcess(dsn, NATS_URL, "--concurrency", "64")
            try:

                async def others_done() -> bool:
                    n = await conn.fetchval(
                        "SELECT count(*) FROM outbox_events_all WHERE status = 'done'"
                        " AND topic = ANY ($1::text[])",
                        [narrow, free],
                    )
                    return bool(n == 200)

                await wait_until(others_done, 60, "the relay to publish the open topics")
                pending = await conn.fetchval(
                    "SELECT count(*) FROM outbox_events WHERE topic = $1 AND status = 'pending'",
                    held,
                )
                assert pending == 100, "the relay published a paused topic"
                await admin.resume_topic(conn, held)

                async def all_done() -> bool:
                    n = await conn.fetchval(
                        "SELECT count(*) FROM outbox_events_all WHERE status = 'done'"
                    )
                    return bool(n == 300)

                await wait_until(all_done, 60, "the relay to publish the resumed topic")
            finally:
                assert await relay.stop() == 0
        assert (await js.stream_info(stream)).state.messages == 300
        assert 0 < max(seen) <= 2, max(seen)
    finally:
        await js.delete_stream(stream)
        await nc.close()


# the rows each process holds that its handlers have not finished: claimed and waiting
# for a worker, or running (a run's end is committed before its handler returns, so
# before the process can claim again: a snapshot that shows a later claim shows it)
UNFINISHED = """
SELECT e.locked_by, count(*) FILTER (WHERE NOT EXISTS (
           SELECT 1 FROM runs r WHERE r.event_id = e.id AND r.worker_id = e.locked_by
             AND r.ended IS NOT NULL)) AS unfinished,
       count(*) AS claimed
FROM outbox_events_all e WHERE e.status = 'processing' GROUP BY e.locked_by
"""

SIXTY = [f"lim{i:02d}" for i in range(60)]


@contextlib.asynccontextmanager
async def held_by_process(dsn: str) -> AsyncIterator[dict[str, list[int]]]:
    """Every 10 ms, the rows each process holds unfinished (the database's count)."""
    seen: dict[str, list[int]] = {}
    conn = await asyncpg.connect(dsn)

    async def sample() -> None:
        while True:
            for r in await conn.fetch(UNFINISHED):
                seen.setdefault(r["locked_by"], []).append(r["unfinished"])
            await asyncio.sleep(0.01)

    task = asyncio.ensure_future(sample())
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await conn.close()


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [1, 4])
async def test_sixty_limited_topics_a_sigkill_strands_no_more_than_the_slots(
    dsn: str, conn: asyncpg.Connection, concurrency: int
) -> None:
    """Two processes without prefetch, sixty topics at max_running=1 with a backlog:
    neither ever holds more unfinished rows than it has workers, so the SIGKILL of one
    mid-run strands at most that many topics' slots; the other serves the rest."""
    lease = 3.0
    await conn.execute(RUNS_DDL)
    for topic in SIXTY:
        await admin.limit_topic(conn, topic, max_running=1)
    await aiooutbox.enqueue_many(
        conn, [aiooutbox.NewEvent(t, {"n": i}) for i in range(10) for t in SIXTY]
    )
    config = {
        "dsn": dsn,
        "topics": SIXTY,
        "sleep": 0.2,
        "concurrency": concurrency,
        "prefetch": 0,
        "lease_timeout": lease,
    }
    async with processes(2, config) as procs, held_by_process(dsn) as seen:

        async def both_run() -> bool:
            n = await conn.fetchval("SELECT count(DISTINCT worker_id) FROM runs")
            return bool(n == 2)

        await wait_until(both_run, 20, "both processes to run handlers")
        await asyncio.sleep(1.0)
        procs[0].kill()
        killed = await clock(conn)
        stranded = {
            r["locked_by"]: (r["unfinished"], r["claimed"]) for r in await conn.fetch(UNFINISHED)
        }.get("p0", (0, 0))
        await asyncio.sleep(lease / 2)  # the dead process's leases still run
        served = await conn.fetch(
            "SELECT DISTINCT topic FROM runs WHERE worker_id = 'p1' AND started > $1", killed
        )

        async def recovered() -> bool:
            n = await conn.fetchval(
                "SELECT count(*) FROM outbox_events_all WHERE status = 'processing'"
                " AND locked_by = 'p0'"
            )
            return bool(n == 0)

        await wait_until(recovered, lease + 15, "the dead process's leases to come back")
        await procs[1].stop()
    most = {worker: max(counts) for worker, counts in seen.items()}
    print(
        f"concurrency {concurrency}: held unfinished at most {most}; the SIGKILL stranded"
        f" {stranded[1]} claimed rows ({stranded[0]} unfinished); the survivor served"
        f" {len(served)} topics before the leases ran out"
    )
    assert set(most) >= {"p0", "p1"}, most
    assert max(most.values()) <= concurrency, most
    assert stranded[0] <= concurrency and stranded[1] <= 2 * concurrency, stranded
    # the topics whose slots the dead process holds wait for its leases; the others run
    # (a handler takes 0.2 s: a worker runs about seven in the 1.5 s)
    assert len(served) >= 3 * concurrency, served
