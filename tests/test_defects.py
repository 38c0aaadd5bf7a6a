"""Regression tests for the defects of issue 19 (and the error split of issue 11).

Each test failed on ``ab0edab`` and describes the defect it pins. Real PostgreSQL only;
the outage test runs its own private server.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

import aiooutbox
from aiooutbox._engine.claim_window import ClaimWindow
from aiooutbox._engine.listener import Listener
from aiooutbox._engine.rows import Outcome, Settlement
from aiooutbox._engine.settler import Settler
from aiooutbox._sql.db import PermanentDatabaseError
from aiooutbox._sql.statements import queries
from aiooutbox._values.text import safe_text
from tests.faults.private_pg import PrivatePostgres, private_postgres
from tests.helpers import all_in, running, status_counts, truthy, wait_until

FAST_RETRY = aiooutbox.RetryPolicy(base=0.05, factor=2.0, max_delay=0.1)

# exception messages a handler may produce from what it received
HOSTILE_MESSAGES = [
    "upstream said: \x00\x01binary",
    "lone surrogate \udcff from a bad decode",
    "\x00" * 50,
    "x" * 1_000_000,
    "mixed \x00 and \ud800 and emoji \U0001f600",
    "",
]


# -- 1. a handler's error text can never poison settlement ---------------------------------


@pytest.mark.parametrize("message", HOSTILE_MESSAGES, ids=lambda m: repr(m[:12]))
async def test_hostile_error_text_settles_and_nothing_runs_twice(
    pool: asyncpg.Pool, message: str
) -> None:
    bad = await aiooutbox.enqueue(pool, "t", {"bad": True}, max_attempts=2)
    good = await aiooutbox.enqueue_many(
        pool, [aiooutbox.NewEvent("t", {"n": i}) for i in range(20)]
    )
    assert bad is not None and None not in good
    runs: Counter[int | None] = Counter()

    async def handle(event: aiooutbox.Event) -> None:
        runs[event.id] += 1
        if event.payload.get("bad"):
            raise RuntimeError(message)

    consumer = aiooutbox.OutboxConsumer(pool, concurrency=8, lease_timeout=2, retry=FAST_RETRY)
    async with running(consumer, {"t": handle}):
        await wait_until(lambda: status_counts_are(pool, {"done": 20, "dead": 1}), timeout=20)
    assert all(runs[i] == 1 for i in good), runs  # lease never lost: nothing ran twice
    assert runs[bad] == 2
    error = await pool.fetchval("SELECT last_error FROM outbox_events_all WHERE id = $1", bad)
    assert "RuntimeError" in error and "\x00" not in error and len(error) <= 4000


async def status_counts_are(pool: asyncpg.Pool, expected: dict[str, int]) -> bool:
    return await status_counts(pool) == expected


def test_safe_text_removes_what_postgres_refuses() -> None:
    for message in HOSTILE_MESSAGES:
        text = safe_text(message, 4000)
        assert "\x00" not in text and len(text) <= 4000
        text.encode("utf-8")  # never raises


async def test_a_refused_value_is_written_apart_with_a_placeholder(pool: asyncpg.Pool) -> None:
    """The settler's own defence, below safe_text: a row whose error text PostgreSQL
    refuses is split from the batch; the others are written, it gets a placeholder."""
    ids = [
        i
        for i in await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", i) for i in range(5)])
        if i is not None
    ]
    assert len(ids) == 5
    q = queries()
    await pool.fetch(q.claim, "w", 30.0, ["t"], 10, 1 << 30, 0, 0)
    settler = Settler(pool, q, "w", flush_interval=0.001, flush_size=100, statement_timeout=5)
    for i in ids[:4]:
        settler.record(Settlement(i, 1, Outcome.RETRY, 60.0, f"fine {i}"))
    settler.record(Settlement(ids[4], 1, Outcome.RETRY, 60.0, "raw NUL \x00 here"))
    await settler.close(timeout=5)
    rows = {r["id"]: r for r in await pool.fetch("SELECT * FROM outbox_events_all")}
    assert all(rows[i]["status"] == "retry" for i in ids)
    assert [rows[i]["last_error"] for i in ids[:4]] == [f"fine {i}" for i in ids[:4]]
    assert "could not be stored" in rows[ids[4]]["last_error"]
    assert settler.abandoned == 0


async def test_the_settle_backlog_counts_the_write_under_way(pool: asyncpg.Pool) -> None:
    """The dispatcher stops claiming on `backlog`: outcomes in a write that is under way
    are not written yet either, so a crash may still repeat their events (the relay's
    duplicate bound, docs/relay.md, counts on it)."""
    ids = [
        i
        for i in await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", i) for i in range(3)])
        if i is not None
    ]
    q = queries()
    await pool.fetch(q.claim, "w", 30.0, ["t"], 10, 1 << 30, 0, 0)
    settler = Settler(pool, q, "w", flush_interval=0.001, flush_size=100, statement_timeout=5)
    async with pool.acquire() as blocker, blocker.transaction():
        # the settlement's UPDATE waits for this row lock: the write stays under way
        await blocker.execute("SELECT 1 FROM outbox_events WHERE id = $1 FOR UPDATE", ids[0])
        for i in ids:
            settler.done(i, 1)
        flushing = asyncio.ensure_future(settler.close(timeout=10))
        waiting = (
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        await wait_until(lambda: truthy_value(pool.fetchval(waiting)), 10)
        assert settler.backlog == 3  # all three are in the write the lock holds up
    await flushing
    assert settler.backlog == 0
    assert await status_counts(pool) == {"done": 3}


async def test_a_listener_cancelled_between_connect_and_listen_closes_its_connection(
    pool: asyncpg.Pool,
) -> None:
    """A stop at start-up may land after the listener connected and before its LISTEN
    returned: the connection was left open for the garbage collector (a ResourceWarning
    in a later test, once in CI)."""
    opened: list[asyncpg.Connection] = []

    class CancelledAfterConnect(Listener):
        async def _connect(self) -> asyncpg.Connection:
            conn = await super()._connect()
            opened.append(conn)
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # delivered at the next await: the LISTEN
            return conn

    listener = CancelledAfterConnect(
        pool, queries().channel, None, lambda: None, dsn=None, keepalive=60, timeout=5
    )
    with pytest.raises(asyncio.CancelledError):
        await listener.run()
    assert len(opened) == 1 and opened[0].is_closed()


async def truthy_value(value: Awaitable[object]) -> bool:
    return bool(await value)


# -- 2. odd times stored by a raw SQL producer never stop a consumer ------------------------


async def test_infinite_and_extreme_times_do_not_stop_the_consumer(pool: asyncpg.Pool) -> None:
    for at in ("-infinity", "0001-01-01 00:00+00", "4713-01-01 00:00+00 BC"):
        await pool.execute(
            "INSERT INTO outbox_events (topic, payload, available_at, created_at)"
            " VALUES ('t', '{}', $1::text::timestamptz, $1::text::timestamptz)",
            at,
        )
    for at in ("infinity", "9999-12-31 00:00+00"):  # never due: they wait, harmlessly
        await pool.execute(
            "INSERT INTO outbox_events (topic, payload, available_at)"
            " VALUES ('t', '{\"later\": true}', $1::text::timestamptz)",
            at,
        )
    seen: list[aiooutbox.Event] = []

    async def handle(event: aiooutbox.Event) -> None:
        seen.append(event)

    consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.2)
    async with running(consumer, {"t": handle}) as task:
        await wait_until(lambda: status_counts_are(pool, {"done": 3, "pending": 2}), timeout=20)
        await aiooutbox.enqueue(pool, "t", {"after": True})
        await wait_until(lambda: status_counts_are(pool, {"done": 4, "pending": 2}), timeout=20)
        await asyncio.sleep(0.5)  # several idle polls over the infinite rows
        assert not task.done()
    assert all(e.created_at is not None and e.created_at.tzinfo is not None for e in seen)


# -- 4. run() is guarded before its first await ---------------------------------------------


async def test_two_concurrent_runs_are_refused(pool: asyncpg.Pool) -> None:
    consumer = aiooutbox.OutboxConsumer(pool, concurrency=4)

    async def handle(event: aiooutbox.Event) -> None:
        await asyncio.sleep(0.01)

    first = asyncio.ensure_future(consumer.run({"t": handle}))
    second = asyncio.ensure_future(consumer.run({"t": handle}))
    with pytest.raises(RuntimeError, match="already running"):
        await second
    consumer.stop()
    await asyncio.wait_for(first, 20)


# -- 5. a closed pool ends run() at once ----------------------------------------------------


async def test_closing_the_pool_under_a_consumer_ends_run_promptly(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", i) for i in range(4)])
    started = asyncio.Event()

    async def handle(event: aiooutbox.Event) -> None:
        started.set()
        await asyncio.sleep(3600)

    consumer = aiooutbox.OutboxConsumer(pool, shutdown_grace=0.5)
    task = asyncio.ensure_future(consumer.run({"t": handle}))
    await asyncio.wait_for(started.wait(), 20)
    closing = asyncio.ensure_future(pool.close())
    began = time.monotonic()
    with pytest.raises(aiooutbox.OutboxError, match="pool was closed"):
        await asyncio.wait_for(task, 30)
    took = time.monotonic() - began
    await asyncio.wait_for(closing, 30)
    assert took < 8, f"run() took {took:.1f}s to raise after pool.close()"


# -- 6. a graceful stop while the database is down returns within its bound -----------------


@pytest.fixture
async def outage_dsn() -> AsyncIterator[tuple[PrivatePostgres, str]]:
    with private_postgres() as server:
        admin = await asyncpg.connect(server.dsn)
        try:
            await aiooutbox.migrate(admin)
        finally:
            await admin.close()
        yield server, server.dsn


@pytest.mark.slow
async def test_stop_while_the_database_is_down_is_bounded(
    outage_dsn: tuple[PrivatePostgres, str], caplog: pytest.LogCaptureFixture
) -> None:
    server, dsn = outage_dsn
    grace, timeout = 3.0, 2.0
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=8)
    try:
        await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", i) for i in range(200)])
        running_now = asyncio.Event()

        async def handle(event: aiooutbox.Event) -> None:
            running_now.set()
            await asyncio.sleep(2)

        consumer = aiooutbox.OutboxConsumer(
            pool, concurrency=64, shutdown_grace=grace, statement_timeout=timeout
        )
        task = asyncio.ensure_future(consumer.run({"t": handle}))
        await asyncio.wait_for(running_now.wait(), 20)
        await asyncio.sleep(2.5)  # outcomes pile up and flush while the server is up
        server.stop("immediate")
        consumer.stop()
        began = time.monotonic()
        await asyncio.wait_for(asyncio.wait({task}), 60)
        took = time.monotonic() - began
        documented = grace + max(5.0, timeout) + 3 * timeout
        assert took <= documented + 5, f"stop took {took:.1f}s (documented {documented:.0f}s)"
        assert any("gave up writing" in r.message for r in caplog.records), caplog.text
    finally:
        pool.terminate()


# -- 7. claims make progress when they are slower than the statement timeout ----------------


@pytest.mark.slow  # waits out statement timeouts
async def test_claims_shrink_after_a_timeout_and_make_progress(
    pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    # every claimed row costs 0.2 s in a trigger: a claim of 16 rows (3.2 s) cannot
    # finish within the 2 s statement timeout, one of 4 rows can
    await pool.execute(
        "CREATE FUNCTION slow_claim() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN IF NEW.status = 'processing' THEN PERFORM pg_sleep(0.2); END IF;"
        " RETURN NEW; END $$;"
        " CREATE TRIGGER slow_claim BEFORE UPDATE ON outbox_events"
        " FOR EACH ROW EXECUTE FUNCTION slow_claim()"
    )
    await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", i) for i in range(24)])

    async def handle(event: aiooutbox.Event) -> None:
        pass

    caplog.set_level(logging.WARNING, "aiooutbox")
    consumer = aiooutbox.OutboxConsumer(pool, concurrency=16, statement_timeout=2.0)
    async with running(consumer, {"t": handle}):
        await wait_until(all_in(pool, "done", 24), timeout=90)
    assert any("got no answer within statement_timeout" in r.message for r in caplog.records)


def test_claim_window_shrinks_then_grows_back() -> None:
    window = ClaimWindow(64)
    assert [window.timed_out() for _ in range(4)] == [16, 4, 1, 1]
    sizes = []
    for _ in range(8):
        window.claimed([], full=True, started=0.0, ended=0.001)
        sizes.append(window.size)
    assert sizes == [2, 4, 8, 16, 32, 64, 64, 64]


def test_lingering_only_while_traffic_is_dense() -> None:
    from aiooutbox._engine.claim_window import Arrivals

    arrivals = Arrivals()
    assert not arrivals.dense(0.0)
    for i in range(50):  # 50 events/s: advertise idle at once, be woken by NOTIFY
        arrivals.add(i * 0.02, 1)
    assert not arrivals.dense(1.0)
    for i in range(100):  # a burst of 1000 in 0.1 s: linger, spare producers NOTIFY
        arrivals.add(1.0 + i * 0.001, 10)
    assert arrivals.dense(1.1)
    assert not arrivals.dense(2.2)  # and it forgets after a second


async def test_claims_are_capped_by_bytes(pool: asyncpg.Pool) -> None:
    big = "x" * 300_000  # incompressible enough with the digits below
    await aiooutbox.enqueue_many(
        pool,
        [aiooutbox.NewEvent("t", {"blob": big, "n": str(uuid.uuid4()) * 1000}) for _ in range(12)],
    )
    sizes = await pool.fetch("SELECT pg_column_size(payload) AS s FROM outbox_events_all")
    one = max(r["s"] for r in sizes)
    seen: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        seen.append(len(event.payload["blob"]))

    consumer = aiooutbox.OutboxConsumer(pool, concurrency=12, max_claim_bytes=2 * one)
    async with running(consumer, {"t": handle}):
        await wait_until(all_in(pool, "done", 12), timeout=30)
    assert seen == [300_000] * 12
    # never more than three rows a claim (two full ones, then the one that crosses)
    assert consumer.stats.claims >= 4, consumer.stats


# -- 9. no row claimed by a consumer that returned from run() stays processing -------------


async def test_two_quick_stops_during_a_claim_strand_nothing(pool: asyncpg.Pool) -> None:
    await pool.execute(
        "CREATE FUNCTION slow_claim() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN IF NEW.status = 'processing' THEN PERFORM pg_sleep(0.02); END IF;"
        " RETURN NEW; END $$;"
        " CREATE TRIGGER slow_claim BEFORE UPDATE ON outbox_events"
        " FOR EACH ROW EXECUTE FUNCTION slow_claim()"
    )
    await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", i) for i in range(64)])

    async def handle(event: aiooutbox.Event) -> None:
        await asyncio.sleep(3600)

    consumer = aiooutbox.OutboxConsumer(pool, concurrency=64, shutdown_grace=30)
    task = asyncio.ensure_future(consumer.run({"t": handle}))

    async def claim_in_flight() -> bool:
        return bool(
            await pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE state = 'active' AND query ~ 'claim_v[0-9]+' AND pid <> pg_backend_pid()"
            )
        )

    await wait_until(claim_in_flight, timeout=20, interval=0.002)
    consumer.stop()
    consumer.stop()
    await asyncio.wait_for(task, 30)
    left = await pool.fetchval(
        "SELECT count(*) FROM outbox_events_all WHERE status = 'processing' AND locked_by = $1",
        consumer.worker_id,
    )
    assert left == 0
    assert await status_counts(pool) in ({"retry": 64}, {"pending": 64})


async def test_a_lost_claim_reply_is_taken_back_at_once(pool: asyncpg.Pool) -> None:
    """Rows claimed under our id that we do not hold (the claim committed, the reply
    was lost) are released when the consumer next claims after a failure."""
    consumer = aiooutbox.OutboxConsumer(pool, worker_id="me", lease_timeout=3600)
    await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", i) for i in range(3)])
    q = queries()
    # a claim of ours whose reply "never arrived", and one of another consumer
    await pool.fetch(q.claim, "me", 3600.0, ["t"], 2, 1 << 30, 0, 0)
    await pool.fetch(q.claim, "someone-else", 3600.0, ["t"], 1, 1 << 30, 0, 0)
    seen: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        seen.append(event.id)

    async with running(consumer, {"t": handle}):
        await wait_until(truthy(lambda: len(seen) >= 2), timeout=20)
    # our two rows came back within seconds although their lease was an hour; the
    # other consumer's row is untouched
    counts = await status_counts(pool)
    assert counts == {"done": 2, "processing": 1}, counts


# -- 11.4 errors that retrying cannot fix stop the consumer ---------------------------------


async def test_a_revoked_grant_stops_the_consumer_with_the_fix(dsn: str) -> None:
    role = f"aiooutbox_c_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(f'CREATE ROLE "{role}" LOGIN')
        await admin.execute(
            f'GRANT USAGE ON SCHEMA public TO "{role}";'
            f' GRANT SELECT, UPDATE, DELETE ON outbox_events TO "{role}";'
            f' GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_events_idle TO "{role}";'
            f" GRANT SELECT ON outbox_events_migrations, outbox_events_migrations_compat"
            f' TO "{role}"; GRANT SELECT, UPDATE ON outbox_events_flow TO "{role}"'
        )
        parts = urlsplit(dsn)
        user_dsn = urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.rpartition('@')[2]}"))
        async with asyncpg.create_pool(user_dsn, min_size=1, max_size=4) as pool:
            consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.1)

            async def handle(event: aiooutbox.Event) -> None:
                pass

            task = asyncio.ensure_future(consumer.run({"t": handle}))
            await consumer.wait_started()
            await admin.execute(f'REVOKE UPDATE ON outbox_events FROM "{role}"')
            await aiooutbox.enqueue(admin, "t", {})
            with pytest.raises(PermanentDatabaseError, match="grant the consumer's role"):
                await asyncio.wait_for(task, 30)
    finally:
        await admin.execute(f'DROP OWNED BY "{role}"; DROP ROLE IF EXISTS "{role}"')
        await admin.close()


async def test_a_dropped_claim_function_stops_the_consumer(pool: asyncpg.Pool) -> None:
    consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.1)

    async def handle(event: aiooutbox.Event) -> None:
        pass

    task = asyncio.ensure_future(consumer.run({"t": handle}))
    await consumer.wait_started()
    await pool.execute("DROP FUNCTION outbox_events_claim_v10 CASCADE")  # claim_v11 runs it
    await aiooutbox.enqueue(pool, "t", {})
    with pytest.raises(PermanentDatabaseError, match="aiooutbox migrate"):
        await asyncio.wait_for(task, 30)


async def test_passing_trouble_is_still_retried(dsn: str) -> None:
    """Backends terminated under the consumer are transient: it keeps going."""
    seen: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        seen.append(event.id)

    admin = await asyncpg.connect(dsn)
    try:
        async with asyncpg.create_pool(dsn, min_size=2, max_size=4) as consumer_pool:
            consumer = aiooutbox.OutboxConsumer(consumer_pool, poll_interval=0.2)
            async with running(consumer, {"t": handle}) as task:
                await consumer.wait_started()
                await admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
                await aiooutbox.enqueue(admin, "t", {})
                await wait_until(truthy(lambda: seen), timeout=30)
                assert not task.done()
    finally:
        await admin.close()


async def test_wait_started_raises_when_run_fails(pool: asyncpg.Pool) -> None:
    consumer = aiooutbox.OutboxConsumer(pool, listen_dsn="postgresql://nobody@127.0.0.1:1/x")

    async def handle(event: aiooutbox.Event) -> None:
        pass

    task = asyncio.ensure_future(consumer.run({"t": handle}))
    with pytest.raises(RuntimeError, match="ended before it started"):
        await asyncio.wait_for(consumer.wait_started(), 30)
    with pytest.raises(OSError):
        await task


async def test_task_group_start_is_the_readiness_idiom(pool: asyncpg.Pool) -> None:
    import anyio

    seen: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        seen.append(event.id)

    consumer = aiooutbox.OutboxConsumer(pool)
    async with anyio.create_task_group() as tg:
        await tg.start(consumer.run, {"t": handle})
        assert consumer.running and consumer.listening
        event_id = await aiooutbox.enqueue(pool, "t", {})
        await wait_until(truthy(lambda: seen == [event_id]), timeout=20)
        consumer.stop()


async def test_catch_all_handler_claims_every_topic(pool: asyncpg.Pool) -> None:
    ids = await aiooutbox.enqueue_many(
        pool, [aiooutbox.NewEvent(f"topic.{i % 5}", i) for i in range(20)]
    )
    seen: dict[int, tuple[str, str | None]] = {}

    async def handle(event: aiooutbox.Event) -> None:
        seen[event.id] = (event.topic, event.message_id)

    consumer = aiooutbox.OutboxConsumer(pool)
    async with running(consumer, {"*": handle}):
        await wait_until(all_in(pool, "done", 20), timeout=20)
        # an idle relay is woken by any topic
        late = await aiooutbox.enqueue(pool, "brand.new", {})
        await wait_until(truthy(lambda: late in seen), timeout=10)
    assert set(seen) == {*ids, late}
    message_ids = {m for _, m in seen.values()}
    assert len(message_ids) == 21 and all(uuid.UUID(str(m)) for m in message_ids)


# -- 8. large payloads are decoded off the event loop --------------------------------------


async def test_large_payloads_are_decoded_in_a_thread_small_ones_inline(pool: asyncpg.Pool) -> None:
    import json
    import threading

    threads: dict[int, str] = {}

    def decode(text: str | bytes) -> object:
        value = json.loads(text)
        threads[len(text)] = threading.current_thread().name
        return value

    big = {"blob": "x" * 3_000_000}
    await aiooutbox.enqueue_many(
        pool, [aiooutbox.NewEvent("t", big), aiooutbox.NewEvent("t", {"small": 1})]
    )
    seen: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        seen.append(len(event.payload.get("blob", "")))

    loop_thread = threading.current_thread().name
    async with running(aiooutbox.OutboxConsumer(pool, decoder=decode), {"t": handle}):
        await wait_until(all_in(pool, "done", 2), timeout=30)
    assert sorted(seen) == [0, 3_000_000]
    by_size = sorted(threads.items())
    assert by_size[0][1] == loop_thread  # a small payload: decoded where it runs
    assert by_size[-1][1] != loop_thread  # a 3 MB one: in a worker thread


# -- issue 18: failure log lines say what happens next -------------------------------------


async def test_failure_logs_say_whether_the_event_retries_or_is_dead(
    pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    flaky = await aiooutbox.enqueue(pool, "t", {"kind": "flaky"}, max_attempts=2)
    doomed = await aiooutbox.enqueue(pool, "t", {"kind": "doomed"})

    async def handle(event: aiooutbox.Event) -> None:
        if event.payload["kind"] == "doomed":
            raise aiooutbox.Dead("no such customer")
        raise RuntimeError("boom")

    caplog.set_level(logging.INFO, "aiooutbox")
    async with running(aiooutbox.OutboxConsumer(pool, retry=FAST_RETRY), {"t": handle}):
        await wait_until(lambda: status_counts_are(pool, {"dead": 2}), timeout=20)
    lines = {
        (r.levelname, r.getMessage()) for r in caplog.records if r.name == "aiooutbox.consumer"
    }
    retry = [m for level, m in lines if level == "WARNING" and f"event {flaky} " in m]
    assert any(
        re.search(r"attempt 1/2 failed: RuntimeError: boom; retry in \d+\.\ds$", m) for m in retry
    ), retry
    assert any(
        m.endswith("attempt 2/2 failed: RuntimeError: boom; dead after 2/2 attempts") for m in retry
    ), retry
    dead = [m for level, m in lines if level == "WARNING" and f"event {doomed} " in m]
    assert any("Dead: no such customer; dead after 1/5 attempts" in m for m in dead), dead
    record = next(r for r in caplog.records if getattr(r, "event_id", None) == doomed)
    assert (record.outcome, record.attempt, record.max_attempts) == ("dead", 1, 5)  # type: ignore[attr-defined]
