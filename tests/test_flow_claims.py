"""What one claim may take when topics are limited: never more rows than the consumer
has free slots plus its prefetch, served in turn across the limited topics, and never
more stored payload bytes than ``max_claim_bytes`` across limited and open topics
together (the row that crosses the cap is the claim's last; a row larger than the cap is
claimed alone).

Behaviour only: rows claimed are read from the database, claims from the consumer's
``Observer.claimed`` hook, the order of runs from the handlers. The three-process
version (and a SIGKILL) is in ``test_flow_processes.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

import aiooutbox
from aiooutbox import admin
from aiooutbox.observe import Observer
from tests.helpers import running, wait_until

TOPICS = [f"lim{i:02d}" for i in range(60)]

# the rows a consumer holds that no handler has finished with: claimed and waiting for
# a worker, or running (a finished one only waits for its outcome's write)
HELD_UNFINISHED = (
    "SELECT coalesce(array_agg(id), '{}') FROM outbox_events_all"
    " WHERE status = 'processing' AND locked_by = $1"
)


async def limit_each(conn: asyncpg.Connection, topics: list[str], **limits: Any) -> None:
    for topic in topics:
        await admin.limit_topic(conn, topic, **limits)


async def enqueue_each(conn: asyncpg.Connection, topics: list[str], n: int) -> None:
    await aiooutbox.enqueue_many(
        conn, [aiooutbox.NewEvent(t, {"n": i}) for i in range(n) for t in topics]
    )


class Runs:
    """Which events ran, in the order they started; which have finished."""

    def __init__(self, sleep: float) -> None:
        self.sleep = sleep
        self.started: list[tuple[str, int]] = []
        self.finished: set[int] = set()

    async def __call__(self, event: aiooutbox.Event) -> None:
        self.started.append((event.topic, event.id))
        await asyncio.sleep(self.sleep)
        self.finished.add(event.id)


@contextlib.asynccontextmanager
async def unfinished(pool: asyncpg.Pool, worker: str, runs: Runs) -> AsyncIterator[list[int]]:
    """Sample, every few ms, how many rows the worker holds that no handler has finished
    (the database's own list of its claimed rows, less those the handlers finished)."""
    seen: list[int] = []
    conn = await pool.acquire()

    async def sample() -> None:
        while True:
            ids = await conn.fetchval(HELD_UNFINISHED, worker)
            # read after the query: a row finished meanwhile only lowers the count
            seen.append(sum(1 for i in ids if i not in runs.finished))
            await asyncio.sleep(0.003)

    task = asyncio.ensure_future(sample())
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await pool.release(conn)


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_a_claim_of_sixty_limited_topics_takes_no_more_than_the_free_slots(
    pool: asyncpg.Pool, conn: asyncpg.Connection, concurrency: int
) -> None:
    """60 topics at max_running=1, each with a backlog, one consumer without prefetch:
    it holds at most ``concurrency`` rows, and serves the topics in turn."""
    await limit_each(conn, TOPICS, max_running=1)
    await enqueue_each(conn, TOPICS, 3)
    runs = Runs(sleep=0.01)
    c = aiooutbox.OutboxConsumer(
        pool, concurrency=concurrency, prefetch=0, worker_id="one", poll_interval=1.0
    )
    rounds = 2 * len(TOPICS)
    async with unfinished(pool, "one", runs) as seen, running(c, dict.fromkeys(TOPICS, runs)):
        await wait_until(lambda: _at_least(runs.started, rounds), timeout=60)
    held = max(seen)
    topics = [t for t, _ in runs.started]
    print(f"concurrency {concurrency}: held at most {held}; {len(seen)} samples")
    assert held <= concurrency, f"held {held} claimed rows with {concurrency} slots"
    # in turn: every topic's first event ran before any topic's third, and the first
    # round (a run per topic) took at most a few more runs than there are topics
    first_round = _first_round(topics)
    assert first_round <= len(TOPICS) + 2 * concurrency, (first_round, topics)
    assert max(topics[:first_round].count(t) for t in TOPICS) <= 2


async def test_prefetch_counts_against_the_claim_of_limited_topics(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    """With prefetch, the rows claimed ahead are bounded by it, limited topics included
    (a busy consumer claims ahead about 0.1 s of work, at most ``prefetch``)."""
    await limit_each(conn, TOPICS, max_running=2)
    await enqueue_each(conn, TOPICS, 20)
    runs = Runs(sleep=0.005)
    c = aiooutbox.OutboxConsumer(pool, concurrency=2, prefetch=3, worker_id="one")
    async with unfinished(pool, "one", runs) as seen, running(c, dict.fromkeys(TOPICS, runs)):
        await wait_until(lambda: _at_least(runs.started, 600), timeout=60)
    print(f"held at most {max(seen)} rows; {len(seen)} samples")
    assert max(seen) <= 2 + 3


def _first_round(topics: list[str]) -> int:
    """How many runs it took until every topic had run once."""
    seen: set[str] = set()
    for n, topic in enumerate(topics, 1):
        seen.add(topic)
        if len(seen) == len(TOPICS):
            return n
    raise AssertionError(f"only {len(seen)} of {len(TOPICS)} topics ran: {topics}")


async def _at_least(items: list[Any] | set[Any], n: int) -> bool:
    return len(items) >= n


class Claims(Observer):
    """The rows each claim took."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def claimed(self, rows: int, seconds: float) -> None:
        if rows:
            self.sizes.append(rows)


def blob(n: int) -> str:
    """``n`` characters that TOAST cannot compress (stored as about ``n`` bytes)."""
    return os.urandom(n // 2).hex()


@pytest.mark.parametrize("cap_rows", [3, 0])
async def test_max_claim_bytes_bounds_the_whole_claim_across_limited_and_open_topics(
    pool: asyncpg.Pool, conn: asyncpg.Connection, cap_rows: int
) -> None:
    """Four limited topics and an open one, rows of ~100 kB, handlers that hold on to
    them: each claim stops once its stored payloads reach the cap, whatever topics they
    come from (the row that crosses the cap is its last), and the claims take turns,
    so every topic gets rows. A cap below one row: each claim takes one row."""
    limited = ["l0", "l1", "l2", "l3"]
    topics = [*limited, "open"]
    await limit_each(conn, limited[:2], max_running=100)
    await limit_each(conn, limited[2:], rate="1000/s")
    for topic in topics:
        await aiooutbox.enqueue_many(
            conn, [aiooutbox.NewEvent(topic, {"b": blob(100_000)}) for _ in range(8)]
        )
    size = await conn.fetchval("SELECT max(pg_column_size(payload)) FROM outbox_events_all")
    assert 100_000 <= size < 101_000
    cap = int((cap_rows + 0.5) * size) if cap_rows else size // 2
    claims = Claims()
    gate = asyncio.Event()

    async def hold(event: aiooutbox.Event) -> None:
        await gate.wait()

    c = aiooutbox.OutboxConsumer(
        pool, concurrency=40, prefetch=0, max_claim_bytes=cap, observers=[claims]
    )
    async with running(c, dict.fromkeys(topics, hold)):
        # the claims go on while a quarter of the slots are free (see `Dispatcher`)
        await wait_until(lambda: _processing(conn, 24), timeout=30)
        by_topic = dict(
            await conn.fetch(
                "SELECT topic, count(*) FROM outbox_events_all WHERE status = 'processing'"
                " GROUP BY topic"
            )
        )
        gate.set()
    print(f"cap {cap} bytes, rows of {size}: claims of {claims.sizes}; {by_topic}")
    # the rows before the last one of a claim are below the cap
    most = cap // size + 1 if cap >= size else 1
    assert max(claims.sizes) == most, claims.sizes
    assert set(by_topic) == set(topics), by_topic


async def _processing(conn: asyncpg.Connection, n: int) -> bool:
    count = await conn.fetchval(
        "SELECT count(*) FROM outbox_events_all WHERE status = 'processing'"
    )
    return bool(count >= n)


# -- a consumer of every topic beside many held topics ------------------------------------

HELD = [f"held{i:04d}" for i in range(1000)]

# index scans of the outbox table since the statistics were reset (every descent of the
# skip scan that finds the topics with events is one)
INDEX_SCANS = (
    "SELECT coalesce(sum(idx_scan), 0) FROM pg_stat_user_indexes WHERE relname = 'outbox_events'"
)


async def _scans(conn: asyncpg.Connection, pids: set[int]) -> int:
    """The outbox's index scans, once the backends ``pids`` have exited (a backend's
    statistics are written when it exits)."""

    async def gone() -> bool:
        left = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY ($1::int[])", list(pids)
        )
        return bool(left == 0)

    await wait_until(gone, timeout=10)
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    return int(await conn.fetchval(INDEX_SCANS))


async def _pause_many(conn: asyncpg.Connection, topics: list[str]) -> None:
    """Pause ``topics`` at once (the operator's functions do one topic a statement)."""
    await conn.execute(
        "INSERT INTO outbox_events_flow (topic, paused, updated_by)"
        " SELECT unnest($1::text[]), true, 'test'",
        topics,
    )


async def test_a_consumer_of_every_topic_does_not_walk_the_held_topics_at_each_claim(
    dsn: str, conn: asyncpg.Connection
) -> None:
    """A thousand paused topics with events: a consumer of every topic finds the topics
    to claim without looking at each of them at every claim (it did: one descent of the
    claimable index per held topic per claim). Counted from the database's statistics
    of index scans: at most a look at every topic four times a second, plus a few scans
    a claim; the claims themselves read only the topic that runs."""
    await _pause_many(conn, HELD)
    await conn.execute(
        "INSERT INTO outbox_events (topic, payload)"
        " SELECT 'held' || lpad((g % 1000)::text, 4, '0'), '{}' FROM generate_series(1, 5000) g"
    )
    n = 3000
    await aiooutbox.enqueue_many(conn, [aiooutbox.NewEvent("live", {"n": i}) for i in range(n)])
    await conn.execute("VACUUM ANALYZE outbox_events")
    handled = asyncio.Event()
    count = 0

    async def handle(event: aiooutbox.Event) -> None:
        nonlocal count
        assert event.topic == "live"
        count += 1
        if count == n:
            handled.set()

    claims = Claims()
    pids: set[int] = set()

    async def init(c: asyncpg.Connection) -> None:
        pids.add(c.get_server_pid())

    async with asyncpg.create_pool(dsn, min_size=4, max_size=4, init=init) as pool:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        before = int(await conn.fetchval(INDEX_SCANS))
        c = aiooutbox.OutboxConsumer(pool, concurrency=32, observers=[claims], listen=False)
        started = time.monotonic()
        async with running(c, {"*": handle}):
            await asyncio.wait_for(handled.wait(), 60)
            seconds = time.monotonic() - started
    scans = await _scans(conn, pids) - before
    print(f"{n} events in {seconds:.2f}s, {len(claims.sizes)} claims: {scans} index scans")
    # claiming and settling an event: a scan of the primary key each (an array of ids
    # is a scan per id), upkeep a few; looking for the topics with events: a scan per
    # topic, at most every 0.25 s, after the start and after an idle wait
    looks = (scans - 4 * n) / (len(HELD) + 2)
    assert looks <= seconds / 0.25 + 3, (looks, seconds, len(claims.sizes))


async def test_a_busy_consumer_of_every_topic_finds_new_and_resumed_topics(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    """Beside paused topics a consumer of every topic claims the topics it found with
    events; a topic that gets its first events while it is busy, and one resumed, are
    still claimed within a fraction of a second (the claims take the oldest events
    first: the busy topic's events come due one a millisecond, more than it handles)."""
    await _pause_many(conn, HELD[:10])
    for topic in HELD[:10]:
        await aiooutbox.enqueue_many(conn, [aiooutbox.NewEvent(topic, {}) for _ in range(5)])
    await aiooutbox.enqueue_many(
        conn, [aiooutbox.NewEvent("busy", {}, delay=i / 1000) for i in range(4000)]
    )
    first: dict[str, float] = {}

    async def handle(event: aiooutbox.Event) -> None:
        first.setdefault(event.topic, time.monotonic())
        await asyncio.sleep(0.01)

    c = aiooutbox.OutboxConsumer(pool, concurrency=8, prefetch=0)
    async with running(c, {"*": handle}):
        await wait_until(lambda: _at_least(list(first), 1), timeout=10)
        await asyncio.sleep(0.3)
        await aiooutbox.enqueue_many(conn, [aiooutbox.NewEvent("newcomer", {}) for _ in range(5)])
        sent = time.monotonic()
        await wait_until(lambda: _at_least(list(first), 2), timeout=10)
        await admin.resume_topic(conn, HELD[3])
        resumed = time.monotonic()
        await wait_until(lambda: _at_least(list(first), 3), timeout=10)
        pending = await conn.fetchval(
            "SELECT count(*) FROM outbox_events_all WHERE topic = 'busy' AND status = 'pending'"
        )
    new, back = first["newcomer"] - sent, first[HELD[3]] - resumed
    print(f"a new topic claimed after {new:.3f}s, a resumed one after {back:.3f}s")
    assert pending > 0, "the consumer was not busy all along"
    assert set(first) == {"busy", "newcomer", HELD[3]}
    # the list is looked up every 0.25 s on a quiet machine (longer while looking costs
    # more than 3% of the time); bounded generously for a loaded CI machine
    assert new < 5.0 and back < 5.0, (new, back)
