"""OutboxConsumer against a real PostgreSQL: delivery, retries, leases, wake-up, stop."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import asyncpg
import pytest

import aiooutbox
from aiooutbox._engine.options import DEFAULT_MAX_CLAIM_BYTES as MAX_CLAIM_BYTES
from aiooutbox._engine.options import ConsumerOptions
from aiooutbox._sql.plans import hot_path_plans, nested_plans
from aiooutbox._sql.statements import queries
from aiooutbox.errors import InvalidArgument
from tests.helpers import all_in, running, status_counts, table_scans, truthy, wait_until

FAST_RETRY = aiooutbox.RetryPolicy(base=0.05, factor=2.0, max_delay=0.2)


async def _invocations_table(pool: asyncpg.Pool) -> None:
    await pool.execute(
        "CREATE TABLE invocations (event_id BIGINT, attempt INT, worker TEXT,"
        " PRIMARY KEY (event_id, attempt))"
    )


async def test_several_consumers_handle_each_event_exactly_once(pool: asyncpg.Pool) -> None:
    total = 3000
    await _invocations_table(pool)
    await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("jobs", {"n": i}) for i in range(total)])
    concurrency = 16
    peaks: list[int] = []

    def make_handler(name: str, counter: dict[str, int]) -> aiooutbox.HandlerFunc:
        async def handle(event: aiooutbox.Event) -> None:
            counter["now"] += 1
            peaks.append(counter["now"])
            try:
                # the primary key turns a second invocation into an error
                await pool.execute(
                    "INSERT INTO invocations VALUES ($1, $2, $3)", event.id, event.attempts, name
                )
                await asyncio.sleep(0)
            finally:
                counter["now"] -= 1

        return handle

    consumers = [
        aiooutbox.OutboxConsumer(pool, concurrency=concurrency, poll_interval=0.5) for _ in range(3)
    ]
    async with (
        running(consumers[0], {"jobs": make_handler("a", {"now": 0})}),
        running(consumers[1], {"jobs": make_handler("b", {"now": 0})}),
        running(consumers[2], {"jobs": make_handler("c", {"now": 0})}),
    ):
        await wait_until(all_in(pool, "done", total), timeout=60)

    assert await status_counts(pool) == {"done": total}
    assert await pool.fetchval("SELECT count(*) FROM invocations") == total
    assert await pool.fetchval("SELECT count(*) FROM invocations WHERE attempt <> 1") == 0
    workers = await pool.fetch("SELECT worker, count(*) FROM invocations GROUP BY 1")
    assert len(workers) >= 2, "work should spread over several consumers"
    assert max(peaks) <= concurrency
    assert sum(c.stats.done for c in consumers) == total


@pytest.mark.parametrize(("prefetch", "bound"), [(None, 8 + 504), (20, 8 + 20), (0, 8)])
async def test_prefetch_claims_ahead_of_fast_handlers_within_its_bound(
    pool: asyncpg.Pool, prefetch: int | None, bound: int
) -> None:
    total = 3000
    await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", {}) for _ in range(total)])
    held: list[int] = []
    consumer = aiooutbox.OutboxConsumer(pool, concurrency=8, prefetch=prefetch)

    async def handle(event: aiooutbox.Event) -> None:
        held.append(consumer.stats.in_flight)  # claimed rows not finished yet

    async with running(consumer, {"t": handle}):
        await wait_until(all_in(pool, "done", total), timeout=60)
    assert len(held) == total
    assert max(held) <= bound, (max(held), bound)
    if prefetch != 0:
        assert max(held) > 8, max(held)  # it did claim ahead


@pytest.mark.parametrize(("prefetch", "bound"), [(None, 4 * 300), (0, 600)])
async def test_batch_handlers_claim_ahead_until_four_batches_are_held(
    pool: asyncpg.Pool, prefetch: int | None, bound: int
) -> None:
    """A batch frees its slots at once: with room for two batches only, a claim would
    wait for one to end; by default the consumer claims ahead to hold four."""
    total = 6000
    await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", {}) for _ in range(total)])
    held: list[int] = []
    consumer = aiooutbox.OutboxConsumer(pool, concurrency=600, prefetch=prefetch)

    async def handle(events: list[aiooutbox.Event]) -> None:
        held.append(consumer.stats.in_flight)  # claimed rows not finished yet

    async with running(consumer, {"t": aiooutbox.Handler(handle, batch=300)}):
        await wait_until(all_in(pool, "done", total), timeout=60)
    assert max(held) <= bound, (max(held), bound)
    if prefetch is None:
        assert max(held) > 600, held  # it did claim ahead


def test_the_default_prefetch_with_batch_handlers() -> None:
    def ahead(largest: int, **options: Any) -> int:
        return ConsumerOptions.build(**options).for_batches(largest).ahead

    assert ahead(500, concurrency=1000) == 1000  # four batches held
    assert ahead(256, concurrency=2048) == 0  # eight batches run already
    assert ahead(10) == 512 - 64  # the per-event default is larger
    assert ahead(500, concurrency=1000, prefetch=0) == 0  # given: kept
    assert ahead(500, concurrency=1000, prefetch=7) == 7
    # a batch larger than concurrency is capped at it: four of the capped batch, not
    # 4 x 100,000 rows claimed ahead
    assert ahead(100_000, concurrency=1000) == 3000
    assert ahead(100_000, concurrency=64) == 512 - 64


async def test_slow_handlers_get_no_prefetch(pool: asyncpg.Pool) -> None:
    await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", {}) for _ in range(10)])
    held: list[int] = []
    consumer = aiooutbox.OutboxConsumer(pool, concurrency=2)

    async def handle(event: aiooutbox.Event) -> None:
        held.append(consumer.stats.in_flight)
        await asyncio.sleep(0.25)  # 8 events/s: under 0.1 s of work is less than a row

    async with running(consumer, {"t": handle}):
        await wait_until(all_in(pool, "done", 10), timeout=30)
    assert max(held) <= 2, held


def test_prefetch_must_be_a_whole_number() -> None:
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises((TypeError, InvalidArgument), match="prefetch"):
            ConsumerOptions.build(prefetch=bad)


async def test_unknown_topics_stay_pending(pool: asyncpg.Pool) -> None:
    await aiooutbox.enqueue(pool, "handled", {})
    other = await aiooutbox.enqueue(pool, "nobody.handles.this", {})
    seen: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        seen.append(event.id)

    async with running(aiooutbox.OutboxConsumer(pool, poll_interval=0.2), {"handled": handle}):
        await wait_until(all_in(pool, "done", 1))
        await asyncio.sleep(0.5)  # several claim rounds; the other row must stay untouched
    row = await pool.fetchrow(
        "SELECT status::text, attempts, locked_by FROM outbox_events_all WHERE id = $1", other
    )
    assert tuple(row) == ("pending", 0, None)
    assert other not in seen


async def test_event_fields_reach_the_handler(pool: asyncpg.Pool) -> None:
    event_id = await aiooutbox.enqueue(
        pool,
        "orders.created",
        {"order_id": 42, "items": [1, 2]},
        dedupe_key="order-42-created",
        headers={"traceparent": "00-abc-def-01"},
        max_attempts=7,
    )
    got: list[aiooutbox.Event] = []

    async def handle(event: aiooutbox.Event) -> None:
        got.append(event)

    async with running(aiooutbox.OutboxConsumer(pool), {"orders.created": handle}):
        await wait_until(lambda: _truthy(got))
    (event,) = got
    assert event.id == event_id
    assert event.topic == "orders.created"
    assert event.payload == {"order_id": 42, "items": [1, 2]}
    assert event.dedupe_key == "order-42-created"
    assert event.headers == {"traceparent": "00-abc-def-01"}
    assert (event.attempts, event.max_attempts) == (1, 7)
    assert event.created_at is not None and event.created_at.tzinfo is not None


async def _truthy(value: object) -> bool:
    return bool(value)


async def test_failures_retry_with_backoff_then_die_with_last_error(pool: asyncpg.Pool) -> None:
    event_id = await aiooutbox.enqueue(pool, "flaky", {}, max_attempts=3)
    seen: list[float] = []

    async def handle(event: aiooutbox.Event) -> None:
        seen.append(time.monotonic())
        raise ValueError(f"broken on attempt {event.attempts}")

    policy = aiooutbox.RetryPolicy(base=0.3, factor=2.0, max_delay=0.5, jitter=0.0)
    consumer = aiooutbox.OutboxConsumer(pool, retry=policy, poll_interval=0.1)
    async with running(consumer, {"flaky": handle}):
        await wait_until(all_in(pool, "dead", 1), timeout=20)
    row = await pool.fetchrow("SELECT * FROM outbox_events_all WHERE id = $1", event_id)
    assert row["attempts"] == 3
    assert "ValueError: broken on attempt 3" in row["last_error"]
    assert "Traceback" in row["last_error"]
    assert row["finished_at"] is not None
    assert len(seen) == 3
    gaps = [b - a for a, b in itertools.pairwise(seen)]
    # exact exponential delays (no jitter): 0.3 s then 0.5 s (capped)
    assert 0.28 <= gaps[0] < 1.5
    assert 0.48 <= gaps[1] < 1.7
    assert consumer.stats.dead == 1 and consumer.stats.retried == 2


def test_retry_policy_bounds() -> None:
    policy = aiooutbox.RetryPolicy(base=1.0, factor=2.0, max_delay=10.0)
    for attempts in range(1, 30):
        ceiling = min(10.0, 2.0 ** (attempts - 1))
        delays = [policy.delay(attempts) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in delays)
        # full jitter spreads the delays across the range
        assert max(delays) - min(delays) > ceiling * 0.5
    half = aiooutbox.RetryPolicy(base=2.0, jitter=0.5)
    assert all(1.0 <= half.delay(1) <= 2.0 for _ in range(200))
    assert aiooutbox.RetryPolicy(max_delay=5).delay(10_000) <= 5


async def test_retry_exception_delay_is_honoured(pool: asyncpg.Pool) -> None:
    event_id = await aiooutbox.enqueue(pool, "later", {})
    attempts: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        attempts.append(event.attempts)
        if event.attempts == 1:
            raise aiooutbox.Retry(delay=30, reason="rate limited")

    async with running(aiooutbox.OutboxConsumer(pool, poll_interval=0.1), {"later": handle}):
        await wait_until(all_in(pool, "retry", 1))
        row = await pool.fetchrow(
            "SELECT extract(epoch FROM available_at - updated_at) AS delay, last_error"
            " FROM outbox_events_all WHERE id = $1",
            event_id,
        )
        assert 29.9 <= row["delay"] <= 30.1
        assert row["last_error"] == "Retry: rate limited"
        await asyncio.sleep(0.3)
        assert attempts == [1]
        # make it due now: the consumer picks it up (its next-due timer or poll)
        await pool.execute("UPDATE outbox_events SET available_at = now() WHERE id = $1", event_id)
        await wait_until(all_in(pool, "done", 1))
    assert attempts == [1, 2]


async def test_dead_goes_straight_to_dead(pool: asyncpg.Pool) -> None:
    event_id = await aiooutbox.enqueue(pool, "bad", {}, max_attempts=10)

    async def handle(event: aiooutbox.Event) -> None:
        raise aiooutbox.Dead("malformed order")

    async with running(aiooutbox.OutboxConsumer(pool), {"bad": handle}):
        await wait_until(all_in(pool, "dead", 1))
    row = await pool.fetchrow(
        "SELECT attempts, last_error FROM outbox_events_all WHERE id=$1", event_id
    )
    assert tuple(row) == (1, "Dead: malformed order")


async def test_handler_timeout_is_a_failure(pool: asyncpg.Pool) -> None:
    await aiooutbox.enqueue(pool, "slow", {}, max_attempts=1)

    async def handle(event: aiooutbox.Event) -> None:
        await asyncio.sleep(30)

    consumer = aiooutbox.OutboxConsumer(pool, handler_timeout=0.2)
    async with running(consumer, {"slow": handle}):
        await wait_until(all_in(pool, "dead", 1))
    assert "TimeoutError" in await pool.fetchval("SELECT last_error FROM outbox_events_all")


async def test_abandoned_claim_is_recovered_after_lease_timeout(pool: asyncpg.Pool) -> None:
    event_id = await aiooutbox.enqueue(pool, "jobs", {})
    q = queries()
    # a worker that claims and then "crashes": it never settles nor heartbeats
    rows = await pool.fetch(q.claim, "crashed-worker", 1.0, ["jobs"], 10, MAX_CLAIM_BYTES, 0, 0)
    assert [r[0] for r in rows] == [event_id]
    handled: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        handled.append(event.attempts)

    started = time.monotonic()
    consumer = aiooutbox.OutboxConsumer(pool, lease_timeout=2.0, poll_interval=0.2)
    async with running(consumer, {"jobs": handle}):
        await wait_until(all_in(pool, "done", 1), timeout=20)
    assert time.monotonic() - started < 10
    assert handled == [2]  # the crashed claim counted as attempt 1
    assert consumer.stats.recovered == 1


async def test_recovery_of_an_exhausted_row_makes_it_dead(pool: asyncpg.Pool) -> None:
    event_id = await aiooutbox.enqueue(pool, "jobs", {}, max_attempts=1)
    await pool.fetch(queries().claim, "crashed-worker", 1.0, ["jobs"], 10, MAX_CLAIM_BYTES, 0, 0)
    await asyncio.sleep(1.1)
    recovered = await pool.fetch(queries().recover_expired, 100)
    assert [(r[0], r[2]) for r in recovered] == [(event_id, "dead")]
    error = await pool.fetchval("SELECT last_error FROM outbox_events_all")
    assert "lease expired" in error and "crashed-worker" in error


async def test_long_handler_keeps_its_lease_through_heartbeats(pool: asyncpg.Pool) -> None:
    await aiooutbox.enqueue(pool, "long", {})
    runs: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        runs.append(event.attempts)
        await asyncio.sleep(4.0)  # twice the lease

    slow = aiooutbox.OutboxConsumer(pool, lease_timeout=2.0, poll_interval=0.2)
    thief = aiooutbox.OutboxConsumer(pool, lease_timeout=2.0, poll_interval=0.2)
    async with running(slow, {"long": handle}):
        await wait_until(lambda: _truthy(runs))
        async with running(thief, {"long": handle}):
            await wait_until(all_in(pool, "done", 1), timeout=20)
    assert runs == [1]
    assert slow.stats.recovered + thief.stats.recovered == 0


async def test_stale_settlement_is_fenced_out(pool: asyncpg.Pool) -> None:
    event_id = await aiooutbox.enqueue(pool, "jobs", {})
    q = queries()
    await pool.fetch(q.claim, "stale", 0.5, ["jobs"], 1, MAX_CLAIM_BYTES, 0, 0)
    await asyncio.sleep(0.6)
    assert len(await pool.fetch(q.recover_expired, 100)) == 1
    await pool.fetch(q.claim, "fresh", 30.0, ["jobs"], 1, MAX_CLAIM_BYTES, 0, 0)
    # the stale worker (attempt 1) tries to settle: nothing changes
    assert await pool.fetchval(q.settle_done, [event_id], "stale", 1) == 0
    assert (
        await pool.fetchval(q.settle_failed, [event_id], [0.0], ["late"], ["dead"], "stale", 1) == 0
    )
    # the same worker id on an older attempt is fenced too
    assert await pool.fetchval(q.settle_done, [event_id], "fresh", 1) == 0
    row = await pool.fetchrow("SELECT status::text, locked_by, attempts FROM outbox_events_all")
    assert tuple(row) == ("processing", "fresh", 2)
    assert await pool.fetchval(q.settle_done, [event_id], "fresh", 2) == 1


async def _listener_pids(pool: asyncpg.Pool) -> list[int]:
    rows = await pool.fetch(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND query ILIKE 'LISTEN%' AND pid <> pg_backend_pid()"
    )
    return [r[0] for r in rows]


async def test_idle_consumer_wakes_on_notify_long_before_its_poll(pool: asyncpg.Pool) -> None:
    started: dict[int, float] = {}

    async def handle(event: aiooutbox.Event) -> None:
        started[event.id] = time.monotonic()

    consumer = aiooutbox.OutboxConsumer(pool, poll_interval=60)
    async with running(consumer, {"ping": handle}):
        await wait_until(lambda: _is_idle(pool, consumer))
        latencies = []
        for _ in range(5):
            sent = time.monotonic()
            event_id = await aiooutbox.enqueue(pool, "ping", {})
            assert event_id is not None
            await wait_until(partial(_has, started, event_id), timeout=10, interval=0.001)
            latencies.append(started[event_id] - sent)
            await wait_until(lambda: _is_idle(pool, consumer))
        assert max(latencies) < 1.0, latencies  # the poll interval is 60 s

        # kill the listener's backend: it reconnects, re-listens and still wakes at once
        pids = await _listener_pids(pool)
        assert len(pids) == 1
        await pool.execute("SELECT pg_terminate_backend($1)", pids[0])
        await wait_until(lambda: _new_listener(pool, pids[0]), timeout=15)
        await wait_until(lambda: _is_idle(pool, consumer))
        sent = time.monotonic()
        event_id = await aiooutbox.enqueue(pool, "ping", {})
        assert event_id is not None
        await wait_until(lambda: _has(started, event_id), timeout=10, interval=0.001)
        assert started[event_id] - sent < 1.0
    assert await status_counts(pool) == {"done": 6}


async def test_sparse_wake_ups_keep_and_refresh_the_idle_advertisement(pool: asyncpg.Pool) -> None:
    """Below the dense rate a consumer stays advertised while it handles what woke it
    (no withdraw and re-advertise per event), and refreshes the advertisement before it
    expires even though notifications keep cutting its idle waits short."""
    started: dict[int, float] = {}

    async def handle(event: aiooutbox.Event) -> None:
        started[event.id] = time.monotonic()

    advert = "SELECT expires_at FROM outbox_events_idle WHERE worker_id = $1"
    consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.5)
    async with running(consumer, {"ping": handle}):
        await wait_until(lambda: _is_idle(pool, consumer))
        first = await pool.fetchval(advert, consumer.worker_id)
        missing = 0
        for _ in range(25):  # 10 events/s for 2.5 s: sparse, each wait cut short
            event_id = await aiooutbox.enqueue(pool, "ping", {})
            assert event_id is not None
            await wait_until(partial(_has, started, event_id), timeout=10, interval=0.001)
            if await pool.fetchval(advert, consumer.worker_id) is None:
                missing += 1
            await asyncio.sleep(0.1)
        last = await pool.fetchval(advert, consumer.worker_id)
    assert missing == 0, f"advertisement withdrawn {missing} time(s) between sparse events"
    assert last is not None and (last - first).total_seconds() >= 1.0, (first, last)
    assert await status_counts(pool) == {"done": 25}


async def test_an_insert_that_commits_after_the_consumer_went_idle_is_not_left_for_the_poll(
    pool: asyncpg.Pool,
) -> None:
    """The wake-up trigger looks for idle consumers when the INSERT runs: a producer that
    inserted before the consumer advertised itself, and commits after its last claim,
    notifies nobody. The consumer sees the open transaction's write lock and looks
    again soon instead of waiting for its 30 s poll."""
    started: dict[int, float] = {}

    async def handle(event: aiooutbox.Event) -> None:
        started[event.id] = time.monotonic()

    async with pool.acquire() as producer:
        tx = producer.transaction()
        await tx.start()
        event_id = await aiooutbox.enqueue(producer, "ping", {})  # nobody is idle yet
        assert event_id is not None
        consumer = aiooutbox.OutboxConsumer(pool, poll_interval=30)
        async with running(consumer, {"ping": handle}):
            await wait_until(lambda: _is_idle(pool, consumer))
            await asyncio.sleep(0.3)  # its claims after advertising have come and gone
            await tx.commit()
            committed = time.monotonic()
            try:
                await wait_until(partial(_has, started, event_id), timeout=10, interval=0.001)
            except AssertionError as exc:  # say what the database shows
                row = await pool.fetchrow(
                    "SELECT status, attempts, available_at, clock_timestamp() AS now"
                    " FROM outbox_events WHERE id = $1",
                    event_id,
                )
                locks = await pool.fetch(
                    "SELECT locktype, mode, pid, classid, objid FROM pg_locks"
                    " WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database"
                    " WHERE datname = current_database())"
                )
                idle = await _is_idle(pool, consumer)
                raise AssertionError(f"{exc}: row {row}, idle {idle}, locks {locks}") from exc
            waited = started[event_id] - committed
    assert waited < 5.0, f"handled {waited:.3f}s after its commit (the poll is 30 s)"


async def _has(mapping: dict[int, float], key: int) -> bool:
    return key in mapping


async def _is_idle(pool: asyncpg.Pool, consumer: aiooutbox.OutboxConsumer) -> bool:
    return (
        bool(
            await pool.fetchval(
                "SELECT count(*) FROM outbox_events_idle WHERE worker_id = $1", consumer.worker_id
            )
        )
        and consumer.listening
    )


async def _new_listener(pool: asyncpg.Pool, old_pid: int) -> bool:
    pids = await _listener_pids(pool)
    return bool(pids) and old_pid not in pids


async def test_poll_only_consumer_still_delivers(pool: asyncpg.Pool) -> None:
    async def handle(event: aiooutbox.Event) -> None:
        return None

    consumer = aiooutbox.OutboxConsumer(pool, listen=False, poll_interval=0.2)
    async with running(consumer, {"x": handle}):
        await asyncio.sleep(0.3)
        await aiooutbox.enqueue(pool, "x", {})
        await wait_until(all_in(pool, "done", 1), timeout=5)
        assert not consumer.listening
    assert await pool.fetchval("SELECT count(*) FROM outbox_events_idle") == 0


async def test_delayed_event_runs_when_due_not_at_next_poll(pool: asyncpg.Pool) -> None:
    ran: list[float] = []

    async def handle(event: aiooutbox.Event) -> None:
        ran.append(time.monotonic())

    consumer = aiooutbox.OutboxConsumer(pool, poll_interval=30)
    async with running(consumer, {"x": handle}):
        await wait_until(lambda: _is_idle(pool, consumer))
        sent = time.monotonic()
        await aiooutbox.enqueue(pool, "x", {}, delay=timedelta(seconds=1))
        await wait_until(lambda: _truthy(ran), timeout=10)
    assert 0.9 <= ran[0] - sent < 5


async def test_a_failed_idle_advertisement_is_retried_not_waited_out(
    pool: asyncpg.Pool, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Producers notify only consumers advertised idle. When the advertisement cannot
    be written (the database did not answer in time: here the idle table is locked), the
    consumer is not advertised, so it looks again after a short backoff: an event
    committed then runs within seconds, not after the 30 s poll."""
    ran: list[float] = []

    async def handle(event: aiooutbox.Event) -> None:
        ran.append(time.monotonic())

    locker = await asyncpg.connect(dsn)
    try:
        await locker.execute("BEGIN; LOCK TABLE outbox_events_idle IN ACCESS EXCLUSIVE MODE")
        consumer = aiooutbox.OutboxConsumer(pool, poll_interval=30, statement_timeout=1)
        with caplog.at_level(logging.DEBUG, logger="aiooutbox.consumer"):
            async with running(consumer, {"x": handle}):
                await wait_until(
                    lambda: _truthy("idle advertisement failed" in caplog.text), timeout=20
                )
                await locker.execute("COMMIT")
                sent = time.monotonic()
                await aiooutbox.enqueue(pool, "x", {})
                await wait_until(lambda: _truthy(ran), timeout=20)
    finally:
        await locker.close()
    assert ran[0] - sent < 10, ran[0] - sent  # the poll would be 24-36 s


async def test_graceful_stop_lets_running_handlers_finish(pool: asyncpg.Pool) -> None:
    await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("work", i) for i in range(4)])
    started = asyncio.Event()
    finished: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        started.set()
        await asyncio.sleep(0.5)
        finished.append(event.id)

    consumer = aiooutbox.OutboxConsumer(pool, concurrency=4, shutdown_grace=10)
    task = asyncio.ensure_future(consumer.run({"work": handle}))
    await asyncio.wait_for(started.wait(), 10)
    consumer.stop()
    await asyncio.wait_for(task, 20)
    assert len(finished) == 4
    assert await status_counts(pool) == {"done": 4}


async def test_stop_after_grace_releases_running_handlers(pool: asyncpg.Pool) -> None:
    await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("hang", i) for i in range(3)])
    started = asyncio.Event()

    async def handle(event: aiooutbox.Event) -> None:
        started.set()
        await asyncio.sleep(3600)

    consumer = aiooutbox.OutboxConsumer(pool, concurrency=3, shutdown_grace=0.3)
    task = asyncio.ensure_future(consumer.run({"hang": handle}))
    await asyncio.wait_for(started.wait(), 10)
    await wait_until(all_in(pool, "processing", 3))
    consumer.stop()
    await asyncio.wait_for(task, 20)
    rows = await pool.fetch("SELECT status::text, attempts, last_error FROM outbox_events_all")
    assert {r["status"] for r in rows} == {"retry"}
    assert all(r["attempts"] == 1 and r["last_error"].startswith("released") for r in rows)
    assert consumer.stats.released == 3


async def test_release_on_the_last_attempt_does_not_kill_the_event(pool: asyncpg.Pool) -> None:
    await aiooutbox.enqueue(pool, "hang", {}, max_attempts=1)
    hang = True
    attempts: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        attempts.append(event.attempts)
        if hang:
            await asyncio.sleep(3600)

    consumer = aiooutbox.OutboxConsumer(pool, shutdown_grace=0.1)
    task = asyncio.ensure_future(consumer.run({"hang": handle}))
    await wait_until(all_in(pool, "processing", 1))
    await wait_until(truthy(lambda: attempts))  # the handler is running, not just claimed
    consumer.stop()
    await asyncio.wait_for(task, 20)
    assert await status_counts(pool) == {"retry": 1}
    hang = False
    async with running(aiooutbox.OutboxConsumer(pool), {"hang": handle}):
        await wait_until(all_in(pool, "done", 1))
    assert attempts == [1, 2]


async def test_second_stop_is_fast(pool: asyncpg.Pool) -> None:
    await aiooutbox.enqueue(pool, "hang", {})

    async def handle(event: aiooutbox.Event) -> None:
        await asyncio.sleep(3600)

    consumer = aiooutbox.OutboxConsumer(pool, shutdown_grace=3600)
    task = asyncio.ensure_future(consumer.run({"hang": handle}))
    await wait_until(all_in(pool, "processing", 1))
    consumer.stop()
    await asyncio.sleep(0.2)
    assert not task.done()
    consumer.stop()
    await asyncio.wait_for(task, 10)
    assert await status_counts(pool) == {"retry": 1}


async def test_cancelling_run_stops_gracefully(pool: asyncpg.Pool) -> None:
    await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("work", i) for i in range(2)])
    started = asyncio.Event()

    async def handle(event: aiooutbox.Event) -> None:
        started.set()
        await asyncio.sleep(0.3)

    consumer = aiooutbox.OutboxConsumer(pool, concurrency=2)
    task = asyncio.ensure_future(consumer.run({"work": handle}))
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 20)
    assert await status_counts(pool) == {"done": 2}
    assert not consumer.running


async def test_handler_raising_cancelled_error_is_a_failure(pool: asyncpg.Pool) -> None:
    await aiooutbox.enqueue(pool, "odd", {}, max_attempts=1)
    await aiooutbox.enqueue(pool, "fine", {})

    async def odd(event: aiooutbox.Event) -> None:
        raise asyncio.CancelledError

    async def fine(event: aiooutbox.Event) -> None:
        return None

    async with running(aiooutbox.OutboxConsumer(pool), {"odd": odd, "fine": fine}):
        await wait_until(lambda: _statuses(pool, {"dead": 1, "done": 1}))
    assert "CancelledError" in await pool.fetchval(
        "SELECT last_error FROM outbox_events_all WHERE topic = 'odd'"
    )


async def _statuses(pool: asyncpg.Pool, expected: dict[str, int]) -> bool:
    return await status_counts(pool) == expected


class Shutdown(BaseException):
    pass


async def test_handler_raising_base_exception_stops_and_surfaces(pool: asyncpg.Pool) -> None:
    await aiooutbox.enqueue(pool, "fatal", {})

    async def handle(event: aiooutbox.Event) -> None:
        raise Shutdown("bye")

    consumer = aiooutbox.OutboxConsumer(pool, retry=FAST_RETRY)
    with pytest.raises(Shutdown):
        await asyncio.wait_for(consumer.run({"fatal": handle}), 20)
    row = await pool.fetchrow("SELECT status::text, last_error FROM outbox_events_all")
    assert row["status"] == "retry"
    assert "Shutdown: bye" in row["last_error"]


async def test_consumer_refuses_an_unmigrated_database(empty_dsn: str) -> None:
    async with asyncpg.create_pool(empty_dsn, min_size=1, max_size=2) as p:
        with pytest.raises(aiooutbox.SchemaNotReady, match="migrate"):
            async with aiooutbox.OutboxConsumer(p):
                pass
        with pytest.raises(aiooutbox.SchemaNotReady):
            await aiooutbox.OutboxConsumer(p).run({"x": _noop})


async def _noop(event: aiooutbox.Event) -> None:
    return None


async def test_listener_that_cannot_connect_fails_run(pool: asyncpg.Pool) -> None:
    consumer = aiooutbox.OutboxConsumer(
        pool, listen_dsn="postgresql://postgres@127.0.0.1:1/nope", statement_timeout=2
    )
    with pytest.raises(OSError):
        await asyncio.wait_for(consumer.run({"x": _noop}), 20)


async def test_consumer_cannot_run_twice(pool: asyncpg.Pool) -> None:
    consumer = aiooutbox.OutboxConsumer(pool)
    async with running(consumer, {"x": _noop}):
        await asyncio.sleep(0.05)
        with pytest.raises(RuntimeError, match="already running"):
            await consumer.run({"x": _noop})
    with pytest.raises(RuntimeError, match="again"):
        await consumer.run({"x": _noop})


async def test_router_per_topic_options(pool: asyncpg.Pool) -> None:
    router = aiooutbox.Router()
    calls: list[int] = []

    @router.handler("a", retry=aiooutbox.RetryPolicy(base=0.01, max_delay=0.01), timeout=5)
    async def a(event: aiooutbox.Event) -> None:
        calls.append(event.attempts)
        if event.attempts < 3:
            raise RuntimeError("not yet")

    # the consumer default would wait an hour; the topic's own policy retries at once
    slow = aiooutbox.RetryPolicy(base=3600, jitter=0)
    await aiooutbox.enqueue(pool, "a", {})
    async with running(aiooutbox.OutboxConsumer(pool, retry=slow, poll_interval=0.1), router):
        await wait_until(all_in(pool, "done", 1), timeout=15)
    assert calls == [1, 2, 3]
    with pytest.raises(aiooutbox.InvalidArgument):
        router.add("a", a)
    with pytest.raises(TypeError, match="async"):
        router.add("b", lambda e: None)  # type: ignore[arg-type, return-value]


async def test_done_rows_are_purged_after_retention(pool: asyncpg.Pool) -> None:
    ids = await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("x", i) for i in range(5)])
    await pool.execute(
        "UPDATE outbox_events SET status = 'done', finished_at = now() - interval '2 days'"
        " WHERE id = ANY($1::bigint[])",
        ids[:3],
    )
    consumer = aiooutbox.OutboxConsumer(pool, retention=timedelta(days=1))
    async with running(consumer, {"x": _noop}):
        await wait_until(lambda: _statuses(pool, {"done": 2}), timeout=20)
    left = {r[0] for r in await pool.fetch("SELECT id FROM outbox_events_all")}
    assert left == set(ids[3:])


def _assert_index_plans(plans: dict[str, str]) -> None:
    for name, plan in plans.items():
        assert "Seq Scan" not in plan, (name, plan)
        if name != "recover_after":  # it found no expired lease: nothing to update
            assert "outbox_events_pkey" in plan, (name, plan)
    for name in ("claim", "claim_after", "claim_marked"):
        assert "outbox_events_topic_claimable_idx" in plans[name], plans[name]
    # the watermark and the marks are index conditions, not filters over the dead prefix
    for name in ("claim_after", "claim_marked"):
        index_conds = [line for line in plans[name].splitlines() if "Index Cond" in line]
        assert any("ROW(available_at, id) >" in line for line in index_conds), plans[name]
    # lease recovery starts at its mark
    recover = plans["recover_after"]
    assert "outbox_events_lease_idx" in recover, recover
    assert "lease_expires_at >= " in recover, recover


async def test_claim_plan_uses_the_partial_index(pool: asyncpg.Pool) -> None:
    await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("x", i) for i in range(2000)])
    # 400 left claimable: the claims of `hot_path_plans` run in one transaction, 100 rows
    # each, and each must find rows to update (the update through the primary key)
    await pool.execute(
        "UPDATE outbox_events SET status = 'done', finished_at = now() WHERE id % 5 <> 0"
    )
    await pool.execute("ANALYZE outbox_events")
    async with pool.acquire() as conn:
        # the generic plans that a consumer's connection switches to after five calls
        _assert_index_plans(await hot_path_plans(conn, queries(), ["x"]))
        # nothing was claimed: the statements ran in a transaction that was rolled back
        held = await conn.fetchval(
            "SELECT count(*) FROM outbox_events_all WHERE locked_by IS NOT NULL"
        )
        assert held == 0
        q = queries()
        plans = await nested_plans(
            conn,
            q,
            [
                ("recover", q.recover_expired, (100,)),
                ("orphans", q.release_orphans, ("w", [1, 2])),
            ],
        )
        for name in ("recover", "orphans"):
            plan = plans[name]
            assert "outbox_events_lease_idx" in plan and "Seq Scan" not in plan, plan
        # the probes before idling read one topic's range of the index at a time
        for sql, args in ((q.idle_probe, (["x", "y"],)), (q.idle_probe_any, ())):
            async with conn.transaction():
                await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
                stmt = await conn.prepare("EXPLAIN " + sql)
                plan = "\n".join(r[0] for r in await stmt.fetch(*args))
            assert "outbox_events_topic_claimable_idx" in plan and not table_scans(plan), plan


async def test_reading_plans_needs_a_superuser(empty_dsn: str) -> None:
    role = f"aiooutbox_plans_{uuid.uuid4().hex[:8]}"  # roles are cluster-wide
    conn = await asyncpg.connect(empty_dsn)
    try:
        await aiooutbox.migrate(conn)
        await conn.execute(f"CREATE ROLE {role} NOLOGIN")
        await conn.execute(f"SET ROLE {role}")
        with pytest.raises(aiooutbox.OutboxError, match="needs a superuser"):
            await hot_path_plans(conn, queries(), ["x"])
    finally:
        await conn.execute("RESET ROLE")
        await conn.execute(f"DROP ROLE IF EXISTS {role}")
        await conn.close()


async def test_plans_made_on_an_empty_table_survive_a_backlog(empty_dsn: str) -> None:
    """Regression: a consumer's connection caches the plans it made while the table was
    empty; they used to be sequential scans, kept as the backlog grew (~26 ms per claim
    at 30k rows instead of ~2 ms)."""
    conn = await asyncpg.connect(empty_dsn)
    try:
        await aiooutbox.migrate(conn)
        await conn.execute("VACUUM ANALYZE outbox_events")  # statistics: really empty
        q = queries()
        for _ in range(8):  # past the five custom plans: the generic one is cached now
            assert await conn.fetch(q.claim, "w", 30.0, ["x"], 100, MAX_CLAIM_BYTES, 0, 0) == []
            assert (
                await conn.fetch(
                    q.claim_after,
                    "w",
                    30.0,
                    ["x"],
                    100,
                    MAX_CLAIM_BYTES,
                    0,
                    0,
                    datetime.now(UTC),
                    0,
                )
                == []
            )
            assert await conn.fetchval(q.settle_done, [1], "w", 1) == 0
            assert await conn.fetchval(q.settle_failed, [1], [0.0], ["e"], ["retry"], "w", 1) == 0
        await conn.execute(
            "INSERT INTO outbox_events (topic, payload)"
            " SELECT 'x', '{}' FROM generate_series(1, 5000)"
        )
        # the plans cached above, not new ones
        _assert_index_plans(await hot_path_plans(conn, q, ["x"], generic=False))
    finally:
        await conn.close()


async def test_stop_during_a_hanging_first_connect_returns_quickly(pool: asyncpg.Pool) -> None:
    # a local server that accepts connections and never answers
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        consumer = aiooutbox.OutboxConsumer(
            pool,
            listen_dsn=f"postgresql://postgres@127.0.0.1:{port}/x?sslmode=disable",
            statement_timeout=30,
        )
        task = asyncio.ensure_future(consumer.run({"x": _noop}))
        await asyncio.sleep(0.3)
        assert not task.done()
        started = time.monotonic()
        consumer.stop()
        await asyncio.wait_for(task, 10)
        assert time.monotonic() - started < 5
    finally:
        server.close()
        await server.wait_closed()


def test_retry_delays_are_bounded() -> None:
    with pytest.raises(aiooutbox.InvalidArgument, match="10 years"):
        aiooutbox.Retry(delay=1e300)
    with pytest.raises(aiooutbox.InvalidArgument):
        aiooutbox.Retry(delay=-1)
    with pytest.raises(TypeError):
        aiooutbox.Retry(delay="5")  # type: ignore[arg-type]
    with pytest.raises(aiooutbox.InvalidArgument):
        aiooutbox.RetryPolicy(max_delay=1e300)
    assert aiooutbox.Retry(delay=timedelta(minutes=1)).delay == 60.0


async def test_late_committed_row_behind_the_watermark_is_not_starved(pool: asyncpg.Pool) -> None:
    # a producer transaction that started before the backlog was enqueued: its row's
    # available_at (the transaction's now()) sorts before every backlog row
    late = await pool.acquire()
    try:
        tx = late.transaction()
        await tx.start()
        late_id = await aiooutbox.enqueue(late, "work", {"late": True})
        assert late_id is not None
        await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("work", i) for i in range(3000)])
        handled: dict[int, float] = {}

        async def handle(event: aiooutbox.Event) -> None:
            handled[event.id] = time.monotonic()
            await asyncio.sleep(0.05)  # the rest of the backlog takes >= 6.75 s

        consumer = aiooutbox.OutboxConsumer(pool, concurrency=20)
        async with running(consumer, {"work": handle}):
            await wait_until(lambda: _has_at_least(handled, 300))
            await tx.commit()
            committed = time.monotonic()
            await wait_until(lambda: _has(handled, late_id), timeout=30, interval=0.005)
            # found while the backlog is still draining, not after it (the claims start
            # from marks that went past its position: its key was awaited, and the claim
            # after its commit goes back to it)
            behind = len(handled)
            print(f"handled {handled[late_id] - committed:.3f}s after its commit, {behind} in")
            assert behind < 3000, f"handled only after the backlog ({behind} events before it)"
            await wait_until(all_in(pool, "done", 3001), timeout=60)
    finally:
        await pool.release(late)


async def _has_at_least(mapping: dict[int, float], count: int) -> bool:
    return len(mapping) >= count


async def test_the_idle_probe_counts_writers_in_its_own_database_only(
    databases: Any, dsn: str
) -> None:
    """pg_locks is cluster-wide, and a database copied from the same template has its
    outbox table under the same OID: a writer there is no writer here (it would keep
    every idle consumer here looking again each second instead of waiting to be woken)."""
    from tests.conftest import with_database

    other = await asyncio.wrap_future(databases.take())
    try:
        here = await asyncpg.connect(dsn)
        there = await asyncpg.connect(with_database(databases.admin_dsn, other))
        try:
            oid = "SELECT 'public.outbox_events'::regclass::oid"
            assert await here.fetchval(oid) == await there.fetchval(oid)  # the same table OID
            async with there.transaction():
                await there.execute("LOCK TABLE outbox_events IN ROW EXCLUSIVE MODE")
                assert await here.fetchval(queries().open_writers) == 0
            async with here.transaction():  # a writer in its own database still counts
                await here.execute("LOCK TABLE outbox_events IN ROW EXCLUSIVE MODE")
                assert await there.fetchval(queries().open_writers) == 0
                probe = await asyncpg.connect(dsn)
                try:
                    assert await probe.fetchval(queries().open_writers) == 1
                finally:
                    await probe.close()
        finally:
            await here.close()
            await there.close()
    finally:
        databases.drop_later(other)
