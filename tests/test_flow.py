"""Flow control in one process: pause and resume, max_running, rate, their composition
with ordering keys, prefetch and consumers of every topic, the operator's functions
and their refusals. The three-process tests are in ``test_flow_processes.py``."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

import aiooutbox
from aiooutbox import admin
from aiooutbox._engine.flow import REFRESH
from aiooutbox._sql.db import PermanentDatabaseError
from aiooutbox._sql.flow import flow_queries
from aiooutbox._sql.statements import queries
from tests.helpers import running, wait_until

Q = queries()
FQ = flow_queries()


def consumer(pool: asyncpg.Pool, **options: Any) -> aiooutbox.OutboxConsumer:
    return aiooutbox.OutboxConsumer(
        pool, **{"concurrency": 16, "poll_interval": 1.0, "lease_timeout": 5.0, **options}
    )


async def enqueue(conn: asyncpg.Connection, topic: str, n: int, **kw: Any) -> None:
    await aiooutbox.enqueue_many(
        conn, [aiooutbox.NewEvent(topic, {"n": i}, **kw) for i in range(n)]
    )


async def statuses(conn: asyncpg.Connection, topic: str) -> dict[str, int]:
    rows = await conn.fetch(
        "SELECT status::text, count(*) FROM outbox_events_all WHERE topic = $1 GROUP BY 1", topic
    )
    return {r[0]: r[1] for r in rows}


class Tracker:
    """What ran, when, and how many of each topic ran at once."""

    def __init__(self, sleep: float = 0.0) -> None:
        self.sleep = sleep
        self.now: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)
        self.done: dict[str, int] = defaultdict(int)
        self.first: dict[str, float] = {}
        self.order: dict[str | None, list[int]] = defaultdict(list)

    async def __call__(self, event: aiooutbox.Event) -> None:
        t = event.topic
        self.first.setdefault(t, time.monotonic())
        self.now[t] += 1
        self.peak[t] = max(self.peak[t], self.now[t])
        self.order[event.ordering_key].append(event.payload["n"])
        try:
            if self.sleep:
                await asyncio.sleep(self.sleep)
        finally:
            self.now[t] -= 1
            self.done[t] += 1


@contextlib.asynccontextmanager
async def sampled(pool: asyncpg.Pool, topic: str) -> AsyncIterator[list[int]]:
    """Sample the topic's claimed rows (the database's own count) every few ms, on a
    connection of its own."""
    seen: list[int] = []
    conn = await pool.acquire()

    async def sample() -> None:
        while True:
            seen.append(
                await conn.fetchval(
                    "SELECT count(*) FROM outbox_events WHERE topic = $1 AND status = 'processing'",
                    topic,
                )
            )
            await asyncio.sleep(0.005)

    task = asyncio.ensure_future(sample())
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await pool.release(conn)


# -- pause and resume ------------------------------------------------------------------------


async def test_a_paused_topic_waits_while_another_drains_and_resume_wakes_at_once(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    track = Tracker(sleep=0.001)
    handlers = {"held": track, "other": track}
    # one consumer hears the change at once; the other polls and listens to nothing, so
    # only the database's own refusal keeps it off the paused topic
    deaf = consumer(pool, listen=False, poll_interval=0.05)
    async with running(consumer(pool), handlers), running(deaf, handlers):
        await asyncio.sleep(0.3)  # both read the controls before the pause
        await admin.pause_topic(pool, "held")
        await enqueue(conn, "held", 50)
        await enqueue(conn, "other", 3000)
        started = time.monotonic()
        while time.monotonic() - started < 5.0:
            assert await statuses(conn, "held") == {"pending": 50}, "a paused topic was claimed"
            await asyncio.sleep(0.05)
        assert track.done["other"] > 100, track.done  # the other topic drained meanwhile
        resumed = time.monotonic()
        await admin.resume_topic(pool, "held")
        await wait_until(lambda: _gt(track.first, "held"), timeout=10)
        first = track.first["held"] - resumed
        print(f"first event of the resumed topic handled {first * 1000:.0f} ms after resume")
        assert first < 1.0, f"first handled {first:.2f}s after resume"
        await wait_until(lambda: _eq(track.done, "held", 50), timeout=30)


async def _gt(d: dict[str, float], key: str) -> bool:
    return key in d


async def _eq(d: dict[str, int], key: str, n: int) -> bool:
    return d[key] == n


async def test_a_pause_waits_for_the_claims_under_way_and_no_claim_after_it_sees_the_topic(
    dsn: str, conn: asyncpg.Connection
) -> None:
    await enqueue(conn, "t", 10)
    claimer = await asyncpg.connect(dsn)
    try:
        in_flight = claimer.transaction()
        await in_flight.start()
        # a claim under way (its transaction still open): it holds the flow lock shared
        taken = await claimer.fetch(Q.claim, "w1", 30.0, ["t"], 2, 1 << 30, 0, 0)
        assert len(taken) == 2
        pause = asyncio.ensure_future(admin.pause_topic(conn, "t"))
        await asyncio.sleep(0.3)
        assert not pause.done(), "the pause did not wait for the claim under way"
        await in_flight.commit()
        await asyncio.wait_for(pause, 10)
        # the pause has returned: the open claim and the limited claim both refuse it
        assert await claimer.fetch(Q.claim, "w1", 30.0, ["t"], 10, 1 << 30, 10, 10) == []
        assert await claimer.fetch(Q.claim, "w1", 30.0, None, 10, 1 << 30, 10, 10) == []
        held = await claimer.fetch(FQ.claim_limited, "w1", 30.0, ["t"], [10], 1 << 30, [])
        assert [(r["id"], r["held"]) for r in held] == [(None, "paused")]
        await admin.pause_all(conn)
        await admin.resume_topic(conn, "t")
        assert await claimer.fetch(Q.claim, "w1", 30.0, ["t"], 10, 1 << 30, 10, 10) == []
        await admin.resume_all(conn)
        assert len(await claimer.fetch(Q.claim, "w1", 30.0, None, 10, 1 << 30, 10, 10)) == 8
    finally:
        await claimer.close()


async def test_a_pause_made_while_no_consumer_runs_holds_across_restarts(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    await admin.pause_topic(pool, "t")
    await enqueue(conn, "t", 20)
    await enqueue(conn, "u", 20)
    track = Tracker()
    for _ in range(2):  # a consumer started after the pause, then a restarted one
        async with running(consumer(pool), {"t": track, "u": track}):
            await asyncio.sleep(1.0)
        assert track.done["t"] == 0 and await statuses(conn, "t") == {"pending": 20}
    assert track.done["u"] == 20
    async with running(consumer(pool), {"t": track}):
        await admin.resume_topic(pool, "t")
        await wait_until(lambda: _eq(track.done, "t", 20), timeout=10)


async def test_a_consumer_of_every_topic_honours_pauses_and_limits(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    """Relays consume every topic through the same engine."""
    await admin.pause_topic(pool, "paused")
    await admin.limit_topic(pool, "narrow", max_running=2)
    for topic in ("paused", "narrow", "free"):
        await enqueue(conn, topic, 30)
    track = Tracker(sleep=0.02)
    async with sampled(pool, "narrow") as seen, running(consumer(pool, prefetch=50), {"*": track}):
        await wait_until(lambda: _eq(track.done, "narrow", 30), timeout=30)
    assert track.done["free"] == 30 and track.done["paused"] == 0
    assert track.peak["narrow"] == 2, track.peak
    assert max(seen) <= 2, max(seen)


# -- max_running -----------------------------------------------------------------------------


async def test_max_running_holds_in_one_process_with_prefetch_and_is_used(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    await admin.limit_topic(pool, "narrow", max_running=3)
    await enqueue(conn, "narrow", 40)
    await enqueue(conn, "wide", 400)
    track = Tracker(sleep=0.05)
    handlers = {"narrow": track, "wide": track}
    async with (
        sampled(pool, "narrow") as seen,
        running(consumer(pool, concurrency=32, prefetch=200), handlers),
        running(consumer(pool, concurrency=32, prefetch=200), handlers),
    ):
        await wait_until(lambda: _eq(track.done, "narrow", 40), timeout=60)
    print(f"peak running narrow={track.peak['narrow']} wide={track.peak['wide']}")
    assert track.peak["narrow"] == 3
    assert max(seen) <= 3, f"the database saw {max(seen)} claimed at once"
    assert track.peak["wide"] > 3  # the limit is the topic's alone


async def test_rows_running_when_a_limit_is_set_count_against_it(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    gate = asyncio.Event()
    track = Tracker(sleep=0.02)

    async def first_ten_block(event: aiooutbox.Event) -> None:
        if event.payload["n"] < 10:
            await gate.wait()
        else:
            await track(event)

    await aiooutbox.enqueue_many(conn, [aiooutbox.NewEvent("t", {"n": i}) for i in range(10)])
    handlers = {"t": first_ten_block}
    async with running(consumer(pool, concurrency=10, prefetch=0), handlers):
        await wait_until(lambda: _processing(conn, "t", 10), timeout=10)
        await admin.limit_topic(pool, "t", max_running=3)
        await aiooutbox.enqueue_many(
            conn, [aiooutbox.NewEvent("t", {"n": i}) for i in range(10, 40)]
        )
        # another consumer with free slots: the ten claimed before the limit count
        async with sampled(pool, "t") as seen, running(consumer(pool), handlers):
            await asyncio.sleep(1.0)
            assert await statuses(conn, "t") == {"processing": 10, "pending": 30}
            gate.set()
            await wait_until(lambda: _processed(conn, "t", 40), timeout=30)
    after = seen[next(i for i, n in enumerate(seen) if n < 10) :]
    assert max(after) <= 3, seen
    assert track.peak["t"] == 3


async def _processing(conn: asyncpg.Connection, topic: str, n: int) -> bool:
    return (await statuses(conn, topic)).get("processing", 0) == n


async def _len(items: list[Any], n: int) -> bool:
    return len(items) >= n


async def _processed(conn: asyncpg.Connection, topic: str, n: int) -> bool:
    return (await statuses(conn, topic)).get("done", 0) == n


async def test_ordered_keys_keep_their_order_under_max_running(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    await admin.limit_topic(pool, "k", max_running=2)
    events = [aiooutbox.NewEvent("k", {"n": i}, ordering_key=f"key-{i % 4}") for i in range(40)]
    await aiooutbox.enqueue_many(conn, events)
    track = Tracker(sleep=0.01)
    async with sampled(pool, "k") as seen, running(consumer(pool, prefetch=100), {"k": track}):
        await wait_until(lambda: _eq(track.done, "k", 40), timeout=60)
    for key in range(4):
        assert track.order[f"key-{key}"] == list(range(key, 40, 4))
    assert track.peak["k"] <= 2 and max(seen) <= 2


# -- rate ------------------------------------------------------------------------------------


async def test_rate_limit_bounds_claims_in_every_second(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    control = await admin.limit_topic(pool, "r", rate="40/s")
    assert control.burst == 4
    await enqueue(conn, "r", 400)
    track = Tracker()
    async with running(consumer(pool), {"r": track}), running(consumer(pool), {"r": track}):
        await asyncio.sleep(3.0)
    claims = [
        r[0]
        for r in await conn.fetch(
            "SELECT extract(epoch FROM locked_at)::float8 FROM outbox_events_all"
            " WHERE topic = 'r' AND locked_at IS NOT NULL ORDER BY locked_at"
        )
    ]
    # any window of one second holds at most rate + burst claims (the token bucket's bound)
    worst = max(sum(1 for t in claims[i:] if t < start + 1.0) for i, start in enumerate(claims))
    span = claims[-1] - claims[0]
    print(f"{len(claims)} claims in {span:.2f}s, at most {worst} in one second")
    assert worst <= 40 + 4
    assert len(claims) <= 4 + 40 * span + 1
    assert len(claims) >= 40 * span * 0.5  # and the limit is not starved


# -- operators ---------------------------------------------------------------------------------


async def test_two_operators_changing_one_limit_at_once_are_both_logged(dsn: str) -> None:
    conns = [await asyncpg.connect(dsn) for _ in range(6)]
    try:
        results = await asyncio.gather(
            *(
                admin.limit_topic(c, "t", max_running=n + 1, actor=f"op{n}")
                for n, c in enumerate(conns)
            )
        )
        final = await admin.topic_controls(conns[0])
        history = list(reversed(await admin.flow_history(conns[0], "t")))
    finally:
        for c in conns:
            await c.close()
    assert {r.max_running for r in results} == {1, 2, 3, 4, 5, 6}
    assert len(history) == 6 and {h.actor for h in history} == {f"op{n}" for n in range(6)}
    # serialised: each change starts from the one before it, and the last one stands
    for before, after in itertools.pairwise(history):
        assert after.before == before.after
    assert [c.max_running for c in final] == [history[-1].after["max_running"]]  # type: ignore[index]


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"max_running": 0}, "at least 1"),
        ({"max_running": -5}, "at least 1"),
        ({"max_running": 10**7}, "between 1 and 1000000"),
        ({"max_running": 2.5}, "must be an int"),
        ({"rate": "0/s"}, "lets nothing through"),
        ({"rate": "1e12/s"}, "above the highest limit"),
        ({"rate": "-3/s"}, "invalid rate"),
        ({"rate": "50/day"}, "invalid rate"),
        ({"rate": "nan/s"}, "invalid rate"),
        ({"rate": 0}, "lets nothing through"),
        ({"rate": float("inf")}, "above the highest limit"),
        ({"rate": "0.5/h"}, "below the lowest limit"),
        ({"burst": 5}, "has no rate limit"),
        ({"rate": "5/s", "burst": 0}, "burst must be between"),
        ({}, "say which limit"),
    ],
)
async def test_bad_limits_are_refused_before_anything_is_written(
    conn: asyncpg.Connection, changes: dict[str, Any], error: str
) -> None:
    with pytest.raises((aiooutbox.InvalidArgument, TypeError), match=error):
        await admin.limit_topic(conn, "t", **changes)
    assert await admin.topic_controls(conn) == []
    assert await admin.flow_history(conn) == []


async def test_bad_topics_are_refused(conn: asyncpg.Connection) -> None:
    for bad in ("", " ", "x" * 256, "a\x00b"):
        with pytest.raises(aiooutbox.InvalidArgument):
            await admin.pause_topic(conn, bad)
    with pytest.raises(TypeError):
        await admin.pause_topic(conn, 42)  # type: ignore[arg-type]
    assert await admin.topic_controls(conn) == []


async def test_topics_lists_depth_lag_pause_and_limits(conn: asyncpg.Connection) -> None:
    await enqueue(conn, "a", 3)
    await enqueue(conn, "b", 2, delay=3600)
    await admin.pause_topic(conn, "a", actor="alice")
    await admin.limit_topic(conn, "c", max_running=4, rate="10/min", actor="bob")
    listed = {t.topic: t for t in await admin.topics(conn)}
    assert set(listed) == {"a", "b", "c"}
    a, b, c = listed["a"], listed["b"], listed["c"]
    assert (a.queued, a.due, a.paused, a.control.updated_by) == (3, 3, True, "alice")
    assert a.lag is not None and a.lag >= 0
    assert (b.queued, b.due, b.lag, b.paused) == (2, 0, None, False)
    assert (c.queued, c.control.max_running, c.control.rate_text, c.control.burst) == (
        0,
        4,
        "10/min",
        1.0,
    )
    assert await admin.topic_info(conn, "nothing") is None
    await admin.pause_all(conn)
    assert all(t.paused for t in await admin.topics(conn))
    report = await admin.stats(conn)
    assert report.paused == ["*"] and report.as_dict()["limits"]["c"]["max_running"] == 4
    await admin.resume_all(conn)
    report = await admin.stats(conn)
    assert report.paused == [] and not report.unconsumed
    changes = await admin.flow_history(conn)
    assert [(h.topic, h.action) for h in changes] == [
        ("a", "resume"),
        ("", "resume"),
        ("", "pause"),
        ("c", "limit"),
        ("a", "pause"),
    ]


async def test_refresh_interval_bounds_a_missed_notification(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    """A change whose notification is lost is still seen within `REFRESH` seconds."""
    await enqueue(conn, "t", 5)
    track = Tracker()
    c = consumer(pool, listen=False, poll_interval=0.05)
    await admin.pause_topic(pool, "t")
    async with running(c, {"t": track}):
        await asyncio.sleep(0.5)
        # resumed behind the consumers' back: no notification at all
        await conn.execute("DELETE FROM outbox_events_flow")
        started = time.monotonic()
        await wait_until(lambda: _eq(track.done, "t", 5), timeout=10)
    assert time.monotonic() - started < REFRESH + 1.0


async def test_a_consumer_without_the_flow_grant_stops_at_start_with_the_fix(dsn: str) -> None:
    role = f"aiooutbox_f_{uuid.uuid4().hex[:8]}"
    owner = await asyncpg.connect(dsn)
    try:
        await owner.execute(
            f'CREATE ROLE "{role}" LOGIN; GRANT USAGE ON SCHEMA public TO "{role}";'
            f' GRANT SELECT, UPDATE, DELETE ON outbox_events TO "{role}";'
            f' GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_events_idle TO "{role}";'
            " GRANT SELECT ON outbox_events_migrations, outbox_events_migrations_compat"
            f' TO "{role}"'
        )
        parts = urlsplit(dsn)
        user_dsn = urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.rpartition('@')[2]}"))
        async with asyncpg.create_pool(user_dsn, min_size=1, max_size=4) as pool:
            with pytest.raises(
                PermanentDatabaseError, match=r"topic controls.*GRANT SELECT, UPDATE ON"
            ):
                await asyncio.wait_for(consumer(pool).run({"t": Tracker()}), 30)
            # an older consumer's claim (schema 6 to 8) reads the controls without it
            await admin.pause_topic(owner, "t")
            assert await pool.fetch(Q.claim, "old", 30.0, ["t"], 10, 1 << 30, 0, 0) == []
    finally:
        await owner.execute(f'DROP OWNED BY "{role}"; DROP ROLE IF EXISTS "{role}"')
        await owner.close()


@pytest.mark.parametrize("control", ["max_running", "rate"])
async def test_racing_limited_claims_never_exceed_the_limit(
    dsn: str, conn: asyncpg.Connection, control: str
) -> None:
    """Twenty claimers start at the same instant, each asking for ten rows."""
    if control == "max_running":
        await admin.limit_topic(conn, "t", max_running=5)
    else:
        await admin.limit_topic(conn, "t", rate="1/h", burst=5)  # five tokens, then none
    await enqueue(conn, "t", 300)
    claimers = [await asyncpg.connect(dsn) for _ in range(20)]
    try:
        for c in claimers:  # prepared, so that the race is in the claims themselves
            await c.fetch(FQ.claim_limited, "warm", 30.0, ["none"], [1], 1 << 30, [])
        go = asyncio.Event()

        async def claim(c: asyncpg.Connection, n: int) -> int:
            await go.wait()
            rows = await c.fetch(FQ.claim_limited, f"w{n}", 30.0, ["t"], [10], 1 << 30, [])
            return sum(1 for r in rows if r["id"] is not None)

        tasks = [asyncio.ensure_future(claim(c, n)) for n, c in enumerate(claimers)]
        await asyncio.sleep(0.1)
        go.set()
        taken = await asyncio.gather(*tasks)
    finally:
        for c in claimers:
            await c.close()
    assert sum(taken) == 5, taken
    assert await statuses(conn, "t") == {"processing": 5, "pending": 295}


async def test_metrics_show_paused_topics_and_limits(pool: asyncpg.Pool) -> None:
    from prometheus_client import CollectorRegistry

    from aiooutbox.metrics import MetricsServer, OutboxMetrics
    from tests.test_metrics import http_get, samples, value

    registry = CollectorRegistry()
    metrics = OutboxMetrics(registry)
    await admin.pause_topic(pool, "held")
    await admin.limit_topic(pool, "narrow", max_running=3, rate="2/min")
    async with (
        MetricsServer(registry, port=0) as server,
        metrics.queue_gauges(pool, interval=0.05) as gauges,
    ):
        found = samples((await http_get(server.port, "/metrics"))[1])
        assert value(found, "aiooutbox_topic_paused", topic="held") == 1
        assert value(found, "aiooutbox_topic_paused", topic="narrow") is None
        assert value(found, "aiooutbox_topic_max_running", topic="narrow") == 3
        assert value(found, "aiooutbox_topic_rate_limit", topic="narrow") == pytest.approx(1 / 30)
        await admin.pause_all(pool)
        refreshes = gauges.refreshes

        async def everything_paused() -> bool:
            now = samples((await http_get(server.port, "/metrics"))[1])
            return (
                gauges.refreshes > refreshes
                and value(now, "aiooutbox_topic_paused", topic="*") == 1
            )

        await wait_until(everything_paused, timeout=10)
