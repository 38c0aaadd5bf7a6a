"""Fault injection with real processes and real PostgreSQL servers.

Each test asserts from the database (`check_outcome`): every committed event ends
``done`` (or ``dead`` where it must), nothing is left ``processing``, no attempt was
handled twice, and duplicates happen only where a lease was lost; they are counted and
printed (run with ``-s`` to see the numbers). Tests that stop, crash or cut PostgreSQL
use a private server (`tests.faults.private_pg`), never the shared one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

import aiooutbox
from tests.conftest import with_database
from tests.faults.private_pg import PrivatePostgres, private_postgres
from tests.faults.procs import (
    HANDLED_DDL,
    ConsumerProcess,
    all_finished,
    check_outcome,
    dump_tasks,
    wait_until,
)
from tests.faults.proxy import TCPProxy

pytestmark = pytest.mark.slow


def report(name: str, **numbers: Any) -> None:
    shown = ", ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in numbers.items()
    )
    print(f"\n[{name}] {shown}")


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
async def no_unhandled_errors_in_background() -> AsyncIterator[None]:
    """Fail a test whose event loop saw an unhandled error: a task that died unobserved,
    a callback that raised (asyncpg's test_adversity habit)."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        yield
        gc.collect()  # "Task exception was never retrieved" is reported on collection
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert not errors, "unhandled errors in the event loop:\n" + "\n".join(
        f"{e.get('message')}: {e.get('exception')!r}" for e in errors
    )


@pytest.fixture(scope="module")
def private_pg() -> Iterator[PrivatePostgres]:
    """A private server for this module; tests may stop, crash and restart it."""
    with private_postgres() as server:
        yield server


@pytest.fixture
async def private_dsn(private_pg: PrivatePostgres) -> AsyncIterator[str]:
    """A fresh migrated database on the private server (restarted first if a test left it down)."""
    if not private_pg.is_running():
        private_pg.start()
    name = f"faults_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(private_pg.dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = with_database(private_pg.dsn, name)
    conn = await asyncpg.connect(dsn)
    try:
        await aiooutbox.migrate(conn)
        await conn.execute(HANDLED_DDL)
    finally:
        await conn.close()
    try:
        yield dsn
    finally:
        if not private_pg.is_running():
            private_pg.start()
        admin = await asyncpg.connect(private_pg.dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


@pytest.fixture
async def db(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection to the shared test database, with the ``handled`` table created."""
    conn = await asyncpg.connect(dsn)
    await conn.execute(HANDLED_DDL)
    try:
        yield conn
    finally:
        await conn.close()


class Recorder:
    """Records in-process handler runs; `save` writes them to ``handled`` for the checks."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, str, int]] = []
        self.seen: dict[int, float] = {}
        self.max_n = -1  # the highest payload["n"] handled

    def __call__(self, worker: str, event: aiooutbox.Event) -> None:
        self.runs.append((event.id, worker, event.attempts))
        self.seen.setdefault(event.id, time.monotonic())
        if isinstance(event.payload, dict) and isinstance(event.payload.get("n"), int):
            self.max_n = max(self.max_n, event.payload["n"])

    async def save(self, conn: asyncpg.Connection) -> None:
        await conn.executemany(
            "INSERT INTO handled (event_id, worker_id, attempt) VALUES ($1, $2, $3)", self.runs
        )
        self.runs.clear()


@contextlib.asynccontextmanager
async def running(
    consumer: aiooutbox.OutboxConsumer, handlers: Any, *, stop_timeout: float = 30.0
) -> AsyncIterator[asyncio.Future[None]]:
    """Run ``consumer`` in a task; stop it on exit and fail if it does not return in time."""
    async with consumer:
        task = asyncio.ensure_future(consumer.run(handlers))
        await wait_until(lambda: _ready(consumer, task), 10, "the consumer to start", interval=0.01)
        try:
            yield task
        finally:
            consumer.stop()
            done, _ = await asyncio.wait({task}, timeout=stop_timeout)
            if not done:
                task.cancel()
                raise AssertionError(f"consumer did not stop within {stop_timeout}s")
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]


async def _ready(consumer: aiooutbox.OutboxConsumer, task: asyncio.Future[None]) -> bool:
    if task.done():
        task.result()
        raise AssertionError("consumer.run() returned at once")
    return consumer.running and (consumer.listening or not consumer.options.listen)


# -- a consumer process SIGKILLed mid-batch -------------------------------------------------


async def test_sigkill_mid_batch_leases_come_back(dsn: str, db: asyncpg.Connection) -> None:
    lease, concurrency, total = 2.0, 10, 600
    base = {"dsn": dsn, "concurrency": concurrency, "lease_timeout": lease, "sleep": 0.05}
    victim = ConsumerProcess({**base, "worker_id": "victim"})
    survivor = ConsumerProcess({**base, "worker_id": "survivor"})
    try:
        await asyncio.gather(victim.ready(), survivor.ready())
        await aiooutbox.enqueue_many(db, [aiooutbox.NewEvent("t", {"n": i}) for i in range(total)])

        async def victim_busy() -> bool:
            n = await db.fetchval("SELECT count(*) FROM handled WHERE worker_id = 'victim'")
            return bool(n >= 100)

        await wait_until(victim_busy, 30, "the victim to handle 100 events")
        victim.kill()
        killed_at = time.monotonic()
        # the victim is dead: what it holds now is frozen until its leases expire
        held = {
            r[0]
            for r in await db.fetch(
                "SELECT id FROM outbox_events WHERE status = 'processing' AND locked_by = 'victim'"
            )
        }
        survivor_before = await db.fetchval(
            "SELECT count(*) FROM handled WHERE worker_id = 'survivor'"
        )

        async def recovered() -> bool:
            n = await db.fetchval(
                "SELECT count(*) FROM outbox_events_all WHERE status = 'processing'"
                " AND locked_by = 'victim'"
            )
            return bool(n == 0)

        await wait_until(recovered, lease + 10, "the victim's leases to come back")
        recovery = time.monotonic() - killed_at
        await wait_until(lambda: all_finished(db, total), 60, "every event to finish")
        survivor_during = (
            await db.fetchval("SELECT count(*) FROM handled WHERE worker_id = 'survivor'")
            - survivor_before
        )
        await survivor.stop()
    finally:
        victim.close()
        survivor.close()

    outcome = await check_outcome(db)
    duplicated = {
        r[0] for r in await db.fetch("SELECT event_id FROM handled GROUP BY 1 HAVING count(*) > 1")
    }
    report(
        "sigkill",
        held_at_kill=len(held),
        recovery_s=recovery,
        survivor_runs_meanwhile=survivor_during,
        **outcome,
    )
    assert outcome["done"] == total and outcome["dead"] == 0
    # only what the victim held can run twice, and only once more
    assert duplicated <= held
    assert outcome["extra_runs"] <= len(held)
    # bounded work: concurrency in handlers plus a few settled-but-unflushed outcomes
    assert len(held) <= 5 * concurrency
    # leases come back after lease_timeout (plus a maintenance interval), not later
    assert recovery < lease + 6
    assert survivor_during > 0


# -- PostgreSQL restarted mid-run ---------------------------------------------------------


class Producer:
    """Enqueues numbered events steadily, riding out outages; remembers what committed."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.committed: set[int] = set()
        self.failures = 0
        self.sent = 0
        self._stop = asyncio.Event()

    async def run(self, interval: float = 0.02, batch: int = 5) -> None:
        conn: asyncpg.Connection | None = None
        while not self._stop.is_set():
            try:
                if conn is None or conn.is_closed():
                    conn = await asyncpg.connect(self.dsn, timeout=2)
                events = [aiooutbox.NewEvent("t", {"n": self.sent + i}) for i in range(batch)]
                ids = await aiooutbox.enqueue_many(conn, events)
                self.sent += batch
                self.committed.update(i for i in ids if i is not None)
            except Exception:  # asyncpg raises InternalClientError too on a dying link
                self.failures += 1
                if conn is not None:
                    conn.terminate()
                    conn = None
            await asyncio.sleep(interval)
        if conn is not None:
            await conn.close()

    def stop(self) -> None:
        self._stop.set()


async def listen_latency(
    consumer: aiooutbox.OutboxConsumer, recorder: Recorder, conn: asyncpg.Connection
) -> float:
    """Seconds from enqueue to handler for one event sent to an idle, listening consumer."""
    await wait_until(lambda: _idle(consumer, conn), 15, "the consumer to listen and go idle")
    event_id = await aiooutbox.enqueue(conn, "t", {"probe": True})
    assert event_id is not None
    sent = time.monotonic()

    async def handled() -> bool:
        return event_id in recorder.seen

    await wait_until(handled, 35, "the probe event", interval=0.01)
    return recorder.seen[event_id] - sent


async def _idle(consumer: aiooutbox.OutboxConsumer, db: asyncpg.Connection | asyncpg.Pool) -> bool:
    # listening, nothing in flight, past the linger of its last empty claim, and
    # advertised as idle (a consumer sleeping off a failed claim's backoff also stops
    # claiming for a while, but nothing wakes it early: it is not idle)
    if not consumer.listening or consumer.stats.in_flight:
        return False
    claims = consumer.stats.claims
    await asyncio.sleep(0.3)
    if consumer.stats.claims != claims or not consumer.listening:
        return False
    try:
        advertised = await db.fetchval(
            "SELECT count(*) FROM outbox_events_idle WHERE worker_id = $1", consumer.worker_id
        )
    except (OSError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError):
        return False  # a pooled connection the last crash broke: ask again
    return bool(advertised)


async def test_postgres_restart_and_outage(private_pg: PrivatePostgres, private_dsn: str) -> None:
    """A quick restart and a crash with 5 s of downtime under steady production, then a
    crash while the consumer idles.

    poll_interval=30 proves that wake-ups come from LISTEN, re-established after each
    reconnect, and not from polling. The outage is 5 s rather than 10 s to keep the
    suite short: it already drives the reconnect backoffs to their caps' neighbourhood.
    """
    outage = 5.0
    recorder = Recorder()

    async def handler(event: aiooutbox.Event) -> None:
        recorder("c", event)

    producer = Producer(private_dsn)
    conn = await asyncpg.connect(private_dsn)
    async with asyncpg.create_pool(private_dsn, min_size=1, max_size=5) as pool:
        consumer = aiooutbox.OutboxConsumer(
            pool, concurrency=16, poll_interval=30, lease_timeout=15, statement_timeout=2
        )
        async with running(consumer, {"t": handler}) as task:
            before = await listen_latency(consumer, recorder, conn)
            await conn.close()
            produce = asyncio.ensure_future(producer.run())
            await asyncio.sleep(1)

            # 1. quick restart (clean shutdown, start again)
            await asyncio.to_thread(private_pg.restart, "fast")
            mark = producer.sent
            resumed_quick = await wait_until(
                lambda: _handled_after(recorder, mark), 20, "work to resume after the restart"
            )
            reconnected_quick = await wait_until(
                _async(lambda: consumer.listening), 20, "the listener to reconnect"
            )

            # 2. crash, 5 s outage, start again
            await asyncio.to_thread(private_pg.stop, "immediate")
            await asyncio.sleep(outage)
            assert not task.done(), "the consumer exited during the outage"
            await asyncio.to_thread(private_pg.start)
            mark = producer.sent
            resumed_outage = await wait_until(
                lambda: _handled_after(recorder, mark), 20, "work to resume after the outage"
            )
            producer.stop()
            await produce
            conn = await asyncpg.connect(private_dsn)
            after = await listen_latency(consumer, recorder, conn)
            await wait_until(lambda: all_finished(conn), 30, "every event to finish")
            await conn.close()

            # 3. crash while the consumer idles on LISTEN: the crash empties the unlogged
            # idle table its wake-up depends on
            await wait_until(lambda: _idle(consumer, pool), 15, "the consumer to go idle")
            assert consumer._listener is not None
            seen = consumer._listener.reconnects
            await asyncio.to_thread(private_pg.restart, "immediate")
            restarted = time.monotonic()
            await wait_until(
                _async(lambda: consumer.listening and consumer._listener.reconnects > seen),
                20,
                "the listener to reconnect",
                interval=0.01,
            )
            listener_back_idle = time.monotonic() - restarted
            conn = await asyncpg.connect(private_dsn)
            after_idle_crash = await listen_latency(consumer, recorder, conn)
            reconnects = consumer._listener.reconnects if consumer._listener else -1
        await recorder.save(conn)
        outcome = await check_outcome(conn)
        ids = {r[0] for r in await conn.fetch("SELECT id FROM outbox_events_all")}
        await conn.close()
    report(
        "pg restart",
        listen_latency_before_s=before,
        resumed_after_quick_restart_s=resumed_quick,
        listener_back_after_quick_restart_s=reconnected_quick,
        resumed_after_outage_s=resumed_outage,
        listen_latency_after_outage_s=after,
        listener_back_after_idle_crash_s=listener_back_idle,
        listen_latency_after_idle_crash_s=after_idle_crash,
        listener_reconnects=reconnects,
        producer_failures=producer.failures,
        committed=len(producer.committed),
        **outcome,
    )
    assert producer.committed <= ids, "a committed event is missing"
    assert outcome["dead"] == 0
    assert outcome["extra_runs"] == 0  # leases (15 s) outlived the outage: no duplicate
    assert reconnects >= 3
    assert resumed_quick < 10 and resumed_outage < 10
    assert after < 3.0, "LISTEN was not re-established: the probe waited for a poll"
    assert after_idle_crash < 3.0, (
        "no wake-up after a crash while idle: the probe waited for a poll"
    )


async def _handled_after(recorder: Recorder, mark: int) -> bool:
    """True once an event produced after ``mark`` events has been handled."""
    return recorder.max_n >= mark


def _async(predicate: Any) -> Any:
    async def wrapped() -> bool:
        return bool(predicate())

    return wrapped


async def test_leases_behind_the_mark_are_recovered_on_a_server_that_started_since(
    private_pg: PrivatePostgres, private_dsn: str
) -> None:
    """Lease recovery walks from a mark it keeps between runs; a row whose lease lies
    behind the mark cannot appear on one server, but a promoted standby (a heartbeat that
    never replicated) or a restored backup can hold one. After the server's start time
    changes, the next run walks from the start and recovers it."""

    async def handler(event: aiooutbox.Event) -> None:
        pass

    conn = await asyncpg.connect(private_dsn)
    try:
        async with asyncpg.create_pool(private_dsn, min_size=1, max_size=4) as pool:
            consumer = aiooutbox.OutboxConsumer(
                pool, concurrency=4, lease_timeout=2, statement_timeout=2, poll_interval=1
            )
            async with running(consumer, {"t": handler}) as task:
                await asyncio.sleep(3)  # recovery runs (each ~1 s) have moved the mark
                [event_id] = await aiooutbox.enqueue_many(
                    conn, [aiooutbox.NewEvent("t", {"n": 1}, delay=3600)]
                )
                await conn.execute(
                    "UPDATE outbox_events SET status = 'processing', locked_by = 'gone',"
                    " attempts = 1, locked_at = now() - interval '1 hour',"
                    " lease_expires_at = now() - interval '1 hour' WHERE id = $1",
                    event_id,
                )
                await asyncio.sleep(3)
                status = "SELECT status::text FROM outbox_events_all WHERE id = $1"
                # the precondition: the mark has passed the row, so only the restart's
                # walk from the start can find it
                assert await conn.fetchval(status, event_id) == "processing"
                await conn.close()
                private_pg.restart()
                restarted = time.monotonic()
                conn = await asyncpg.connect(private_dsn)

                async def recovered() -> bool:
                    return bool(await conn.fetchval(status, event_id) != "processing")

                await wait_until(recovered, 30, "the lease behind the mark to be recovered")
                report("lease_behind_mark", recovered_after_restart_s=time.monotonic() - restarted)
                assert not task.done()
    finally:
        await conn.close()


async def test_rows_behind_the_marks_are_claimed_on_a_server_that_started_since(
    private_pg: PrivatePostgres, private_dsn: str
) -> None:
    """A claim starts at each topic's low mark, a position no claimable row can appear
    behind on one server. A promoted standby can hold one: a claim the old primary
    committed and never replicated leaves its rows pending there. After the server's
    start time changes, the consumer drops its marks and claims from the start."""
    handled: list[int] = []

    async def handler(event: aiooutbox.Event) -> None:
        handled.append(event.payload["n"])

    conn = await asyncpg.connect(private_dsn)
    try:
        async with asyncpg.create_pool(private_dsn, min_size=1, max_size=4) as pool:
            consumer = aiooutbox.OutboxConsumer(
                pool, concurrency=4, statement_timeout=2, poll_interval=0.2
            )
            async with running(consumer, {"t": handler}) as task:
                [late] = await aiooutbox.enqueue_many(
                    conn, [aiooutbox.NewEvent("t", {"n": -1}, delay=3600)]
                )
                await aiooutbox.enqueue_many(
                    conn, [aiooutbox.NewEvent("t", {"n": i}) for i in range(50)]
                )
                await wait_until(_async(lambda: len(handled) >= 50), 20, "the first events")
                await asyncio.sleep(1)  # idle claims (a poll each 0.2 s) read the marks
                # the standby's row: pending, behind every mark the consumer holds
                await conn.execute(
                    "UPDATE outbox_events SET available_at = now() - interval '1 minute'"
                    " WHERE id = $1",
                    late,
                )
                await asyncio.sleep(2)
                # the precondition: on this server the marks hide the row
                assert -1 not in handled
                await conn.close()
                private_pg.restart()
                restarted = time.monotonic()
                conn = await asyncpg.connect(private_dsn)
                await wait_until(
                    _async(lambda: -1 in handled), 30, "the row behind the marks to be claimed"
                )
                report("row_behind_marks", claimed_after_restart_s=time.monotonic() - restarted)
                assert not task.done()
    finally:
        await conn.close()


async def test_after_a_restart_the_listener_is_back_before_the_consumer_idles(
    private_pg: PrivatePostgres, private_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server stops while the consumer idles and starts again 6 s later. The
    listener has been reconnecting since the stop, its backoff doubling; the claims
    begin failing later (here at the poll, 4 s in), so their backoff is short and they
    work again first. The consumer must not go idle before the listener is back: an event
    committed then notifies a listener that is not there and waits for the poll (seen:
    2.4 s where 40 ms is usual). Three restarts; the probe event after each must be
    handled through the listener, well within the poll."""
    poll = 4.0
    recorder = Recorder()

    async def handler(event: aiooutbox.Event) -> None:
        recorder("c", event)

    caplog.set_level(logging.INFO, logger="aiooutbox.listener")
    cycles: list[dict[str, Any]] = []
    async with asyncpg.create_pool(private_dsn, min_size=1, max_size=5) as pool:
        consumer = aiooutbox.OutboxConsumer(
            pool, concurrency=16, poll_interval=poll, lease_timeout=15, statement_timeout=2
        )
        async with running(consumer, {"t": handler}):
            for cycle in range(3):
                await wait_until(lambda: _idle(consumer, pool), 30, "the consumer to go idle")
                stopped = time.time()
                await asyncio.to_thread(private_pg.stop, "fast")
                await asyncio.sleep(6)
                await asyncio.to_thread(private_pg.start)
                up = time.time()
                conn = await asyncpg.connect(private_dsn)
                marker = await aiooutbox.enqueue(conn, "t", {"after_restart": cycle})
                assert marker is not None
                resumed = await wait_until(
                    _seen(recorder, marker), 30, "work to resume after the restart", interval=0.01
                )
                await wait_until(
                    lambda: _quiet(consumer), 30, "the consumer to go idle", interval=0.01
                )
                listening = consumer.listening
                sent, sent_at = time.monotonic(), time.time()
                probe = await aiooutbox.enqueue(conn, "t", {"probe": cycle})
                assert probe is not None
                await wait_until(_seen(recorder, probe), 40, "the probe event", interval=0.01)
                await conn.close()
                # seconds after the server was up that the listener said it was back
                said = [
                    r.created - up
                    for r in caplog.records
                    if r.getMessage().startswith("listener reconnected")
                    and stopped < r.created < sent_at
                ]
                cycles.append(
                    {
                        "resumed_s": round(resumed, 2),
                        "listening_when_idle": listening,
                        "listener_said_back_at_s": round(said[-1], 2) if said else None,
                        "probe_latency_s": round(recorder.seen[probe] - sent, 3),
                    }
                )
                caplog.clear()
    report("listener back before idle", **{f"restart_{i + 1}": c for i, c in enumerate(cycles)})
    for c in cycles:
        assert c["listening_when_idle"], f"went idle with the listener down: {cycles}"
        assert c["listener_said_back_at_s"] is not None, f"no 'listener reconnected': {cycles}"
        assert c["probe_latency_s"] < 1.0, f"the probe waited for a poll ({poll}s): {cycles}"


def _seen(recorder: Recorder, event_id: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return event_id in recorder.seen

    return check


async def _quiet(consumer: aiooutbox.OutboxConsumer) -> bool:
    """Nothing in flight and no claim for 0.3 s: the consumer waits for a wake-up (or for
    its poll), whether or not its listener is there."""
    if consumer.stats.in_flight:
        return False
    claims = consumer.stats.claims
    await asyncio.sleep(0.3)
    return consumer.stats.claims == claims and not consumer.stats.in_flight


# -- backend connections killed repeatedly ----------------------------------------------


async def test_backends_terminated_repeatedly(dsn: str, db: asyncpg.Connection) -> None:
    """pg_terminate_backend of every other backend of the test database, 5x a second for 4 s.

    That includes the pool's connections, the listener's and the producer's, at any
    point of a claim, a settlement or a heartbeat.
    """
    recorder = Recorder()

    async def handler(event: aiooutbox.Event) -> None:
        recorder("c", event)
        await asyncio.sleep(0.01)

    kills = 0

    async def killer(seconds: float) -> None:
        nonlocal kills
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            kills += await db.fetchval(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()) AS t"
            )
            await asyncio.sleep(0.2)

    producer = Producer(dsn)
    async with asyncpg.create_pool(dsn, min_size=2, max_size=5) as pool:
        consumers = [
            aiooutbox.OutboxConsumer(
                pool,
                worker_id=f"c{i}",
                concurrency=16,
                poll_interval=30,
                lease_timeout=5,
                statement_timeout=2,
            )
            for i in range(2)
        ]
        async with (
            running(consumers[0], {"t": handler}) as first,
            running(consumers[1], {"t": handler}) as second,
        ):
            produce = asyncio.ensure_future(producer.run(interval=0.005, batch=10))
            await killer(4.0)
            producer.stop()
            await produce
            assert not first.done() and not second.done(), "a consumer exited"
            finished = await wait_until(lambda: all_finished(db), 30, "every event to finish")
            latency = await listen_latency(consumers[0], recorder, db)
            reconnects = sum(c._listener.reconnects for c in consumers if c._listener)
            fenced = sum(c._settler.fenced for c in consumers if c._settler)
    await recorder.save(db)
    outcome = await check_outcome(db)
    ids = {r[0] for r in await db.fetch("SELECT id FROM outbox_events_all")}
    report(
        "terminate backends",
        kills=kills,
        listener_reconnects=reconnects,
        producer_failures=producer.failures,
        committed=len(producer.committed),
        finished_after_kills_s=finished,
        listen_latency_after_s=latency,
        fenced_outcomes=fenced,
        **outcome,
    )
    assert producer.committed <= ids
    assert outcome["dead"] == 0
    assert kills >= 20 and reconnects >= 5
    assert latency < 3.0


# -- network cut and network stall --------------------------------------------------------


async def test_a_release_cancelled_during_a_stall_leaves_no_unread_error(
    private_dsn: str,
) -> None:
    """The watchdog's deadline or a stop may cancel a release whose reset is stalled.

    asyncpg's release runs shielded and, once its caller is cancelled, nobody reads its
    TimeoutError (Python 3.11's shield drops the callback): "Task exception was never
    retrieved", once in CI. `pooled` reads it; the connection is closed either way.
    """
    from aiooutbox._sql.db import pooled

    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        with TCPProxy.for_dsn(private_dsn) as proxy:
            via_proxy = proxy.proxied(private_dsn)
            async with asyncpg.create_pool(via_proxy, min_size=1, max_size=1) as pool:

                async def use_then_release() -> None:
                    async with pooled(pool, 0.3) as conn:
                        await conn.fetchval("SELECT 1")
                        proxy.stall()  # the release's reset now waits for its timeout

                task = asyncio.create_task(use_then_release())
                await asyncio.sleep(0.1)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await asyncio.sleep(0.6)  # past the reset's timeout
                gc.collect()
                await asyncio.sleep(0)
                proxy.restore()
                # the pool recovers: the stalled connection was terminated, not reused
                assert await pool.fetchval("SELECT 2", timeout=5) == 2
    finally:
        loop.set_exception_handler(previous)
    assert not errors, [f"{e.get('message')}: {e.get('exception')!r}" for e in errors]


async def test_network_stall_and_cut(private_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """Consumer <-> server through a TCP proxy that blackholes, then resets, the path.

    statement_timeout=1.5 s must fire instead of hanging; work resumes when the path
    returns; a stop() during a stall returns in bounded time.
    """
    caplog.set_level(logging.WARNING, logger="aiooutbox")
    recorder = Recorder()

    async def handler(event: aiooutbox.Event) -> None:
        recorder("c", event)
        await asyncio.sleep(0.01)

    conn = await asyncpg.connect(private_dsn)
    numbers: dict[str, Any] = {}
    with TCPProxy.for_dsn(private_dsn) as proxy:
        via_proxy = proxy.proxied(private_dsn)
        async with asyncpg.create_pool(via_proxy, min_size=1, max_size=4) as pool:
            consumer = aiooutbox.OutboxConsumer(
                pool,
                concurrency=8,
                poll_interval=30,
                lease_timeout=5,
                statement_timeout=1.5,
                shutdown_grace=1,
            )
            async with running(consumer, {"t": handler}) as task:
                await aiooutbox.enqueue_many(
                    conn, [aiooutbox.NewEvent("t", {"n": i}) for i in range(200)]
                )
                await wait_until(lambda: all_finished(conn), 20, "the first batch")

                # 1. stall: bytes stop flowing both ways, connections stay open
                proxy.stall()
                stalled = time.monotonic()
                await aiooutbox.enqueue_many(
                    conn, [aiooutbox.NewEvent("t", {"n": 1000 + i}) for i in range(200)]
                )
                await wait_until(
                    _async(lambda: "TimeoutError" in caplog.text), 15, "a statement timeout"
                )
                numbers["first_timeout_after_stall_s"] = time.monotonic() - stalled
                await asyncio.sleep(3)
                assert not task.done(), "the consumer exited during the stall"
                proxy.restore()
                numbers["drained_after_stall_s"] = await wait_until(
                    lambda: all_finished(conn), 30, "work to resume after the stall"
                )

                # 2. cut: every connection reset, new ones refused
                assert consumer._listener is not None
                seen = consumer._listener.reconnects
                proxy.cut()
                await aiooutbox.enqueue_many(
                    conn, [aiooutbox.NewEvent("t", {"n": 2000 + i}) for i in range(200)]
                )
                await asyncio.sleep(3)
                assert not task.done(), "the consumer exited during the cut"
                proxy.restore()
                numbers["drained_after_cut_s"] = await wait_until(
                    lambda: all_finished(conn), 30, "work to resume after the cut"
                )
                await wait_until(
                    _async(lambda: consumer._listener.reconnects > seen),
                    20,
                    "the listener to reconnect",
                )
                numbers["listen_latency_after_cut_s"] = await listen_latency(
                    consumer, recorder, conn
                )

                # 3. stop() while the path is stalled with work in flight: bounded
                slow = asyncio.Event()

                async def slow_handler(event: aiooutbox.Event) -> None:
                    recorder("c", event)
                    await slow.wait()

                consumer._handlers["t"] = aiooutbox.Handler(slow_handler)
                await aiooutbox.enqueue_many(
                    conn, [aiooutbox.NewEvent("t", {"n": 3000 + i}) for i in range(4)]
                )
                await wait_until(
                    _async(lambda: consumer.stats.in_flight == 4), 10, "four handlers to start"
                )
                proxy.stall()
                stop_started = time.monotonic()
                consumer.stop()
                done, _ = await asyncio.wait({task}, timeout=30)
                numbers["stop_during_stall_s"] = time.monotonic() - stop_started
                if not done:
                    dump_tasks()
                assert done, "stop() hung while the network was stalled"
                proxy.restore()
    # what the stalled stop could not settle comes back after the lease: finish it here
    # by expiring the leases, as time would
    await conn.execute(
        "UPDATE outbox_events SET lease_expires_at = now() - interval '1 s'"
        " WHERE status = 'processing'"
    )
    async with asyncpg.create_pool(private_dsn, min_size=1, max_size=4) as pool:
        consumer = aiooutbox.OutboxConsumer(
            pool, concurrency=8, poll_interval=0.2, lease_timeout=20
        )

        async def finish(event: aiooutbox.Event) -> None:
            recorder("c2", event)

        async with running(consumer, {"t": finish}):
            await wait_until(lambda: all_finished(conn), 30, "the rest to finish")
    await recorder.save(conn)
    outcome = await check_outcome(conn)
    await conn.close()
    timeouts = caplog.text.count("TimeoutError")
    report("network", statement_timeouts_logged=timeouts, **numbers, **outcome)
    assert outcome["dead"] == 0
    # the stop's own bounds: the grace (1 s), the final flush (max(5 s, statement_timeout)
    # plus two statement timeouts: 8 s), then four clean-up statements of at most a
    # statement timeout each (6 s): 15 s, and some slack for a busy machine (it measured
    # 15.04 s under a full suite; the guarantees table's run 10.7 s)
    bound = 1 + (5 + 2 * 1.5) + 4 * 1.5 + 5
    assert numbers["stop_during_stall_s"] < bound, (numbers["stop_during_stall_s"], bound)
    assert numbers["listen_latency_after_cut_s"] < 3


# -- long transactions elsewhere ----------------------------------------------------------


async def test_idle_in_transaction_producer_and_long_reader(
    dsn: str, db: asyncpg.Connection
) -> None:
    """A producer idles in its transaction and a REPEATABLE READ reader pins xmin meanwhile.

    Claims skip the uncommitted row (it does not exist yet) instead of waiting on it;
    dead tuples pile up behind the pinned horizon, but consumers keep draining.
    """
    recorder = Recorder()

    async def handler(event: aiooutbox.Event) -> None:
        recorder("c", event)

    idle_producer = await asyncpg.connect(dsn)
    reader = await asyncpg.connect(dsn)
    try:
        idle_tx = idle_producer.transaction()
        await idle_tx.start()
        held_id = await aiooutbox.enqueue(idle_producer, "t", {"held": True})
        read_tx = reader.transaction(isolation="repeatable_read")
        await read_tx.start()
        await reader.fetchval("SELECT count(*) FROM outbox_events_all")  # takes the snapshot
        async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
            consumer = aiooutbox.OutboxConsumer(
                pool, concurrency=32, poll_interval=0.5, statement_timeout=2
            )
            async with running(consumer, {"t": handler}):
                started = time.monotonic()
                for chunk in range(10):
                    events = [aiooutbox.NewEvent("t", {"n": chunk * 300 + i}) for i in range(300)]
                    await aiooutbox.enqueue_many(db, events)
                    await asyncio.sleep(0.05)

                async def drained() -> bool:
                    n = await db.fetchval(
                        "SELECT count(*) FROM outbox_events_all WHERE status <> 'done'"
                    )
                    return bool(n == 0)

                await wait_until(drained, 60, "3000 events to drain beside the long transactions")
                drained_s = time.monotonic() - started
                # these two sessions (the consumer's own multi-statement transactions, the
                # watchdog's and a flush's, are briefly idle in transaction too)
                horizon = await db.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY ($1::int[])"
                    " AND state = 'idle in transaction'",
                    [idle_producer.get_server_pid(), reader.get_server_pid()],
                )
                assert horizon == 2, "both long transactions should still be open"
                assert held_id not in recorder.seen
                await idle_tx.commit()
                await wait_until(
                    _async(lambda: held_id in recorder.seen), 10, "the held event after commit"
                )
                await read_tx.rollback()
    finally:
        await idle_producer.close()
        await reader.close()
    await recorder.save(db)
    outcome = await check_outcome(db)
    report("long transactions", drained_3000_s=drained_s, **outcome)
    assert outcome["done"] == 3001 and outcome["extra_runs"] == 0


# -- handler faults -----------------------------------------------------------------------

FAST = aiooutbox.RetryPolicy(base=0.02, max_delay=0.1)


async def _topic_outcomes(db: asyncpg.Connection) -> dict[str, list[tuple[str, int]]]:
    rows = await db.fetch(
        "SELECT topic, status::text, attempts FROM outbox_events_all ORDER BY topic, id"
    )
    result: dict[str, list[tuple[str, int]]] = {}
    for r in rows:
        result.setdefault(r[0], []).append((r[1], r[2]))
    return result


async def test_handler_faults_side_by_side(dsn: str, db: asyncpg.Connection) -> None:
    """Exceptions, timeouts, CancelledError, Retry and Dead, concurrently with good events.

    Each failure costs exactly its own event an attempt; the consumer keeps running and
    the good events are handled once.
    """
    recorder = Recorder()
    attempts_seen: dict[int, int] = {}

    async def handler(event: aiooutbox.Event) -> None:
        recorder("c", event)
        attempts_seen[event.id] = event.attempts
        kind = event.topic
        if kind == "raise":
            raise ValueError("boom")
        if kind == "timeout":
            await asyncio.sleep(30)
        if kind == "cancel":
            raise asyncio.CancelledError
        if kind == "retry":
            raise aiooutbox.Retry(0, "again")
        if kind == "dead":
            raise aiooutbox.Dead("hopeless")
        if kind == "flaky" and event.attempts == 1:
            raise RuntimeError("first time fails")

    plan = {"ok": 40, "raise": 4, "timeout": 3, "cancel": 3, "retry": 3, "dead": 2, "flaky": 4}
    events = [
        aiooutbox.NewEvent(topic, {"i": i}, max_attempts=2)
        for topic, n in plan.items()
        for i in range(n)
    ]
    await aiooutbox.enqueue_many(db, events)
    async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
        consumer = aiooutbox.OutboxConsumer(
            pool, concurrency=8, handler_timeout=0.3, retry=FAST, poll_interval=0.2
        )
        async with running(consumer, dict.fromkeys(plan, handler)) as task:
            await wait_until(lambda: all_finished(db, len(events)), 30, "every event to finish")
            assert not task.done(), "a handler fault stopped the consumer"
    outcomes = await _topic_outcomes(db)
    assert outcomes["ok"] == [("done", 1)] * 40
    assert outcomes["flaky"] == [("done", 2)] * 4
    for topic in ("raise", "timeout", "cancel", "retry"):
        assert outcomes[topic] == [("dead", 2)] * plan[topic], topic
    assert outcomes["dead"] == [("dead", 1)] * 2
    errors = {
        r[0]: r[1]
        for r in await db.fetch(
            "SELECT DISTINCT ON (topic) topic, last_error FROM outbox_events_all"
            " WHERE status = 'dead' ORDER BY topic"
        )
    }
    assert "ValueError: boom" in errors["raise"]
    assert "TimeoutError" in errors["timeout"]
    assert "CancelledError" in errors["cancel"]
    assert "again" in errors["retry"]
    assert "hopeless" in errors["dead"]
    await recorder.save(db)
    outcome = await check_outcome(db)
    report("handler faults", **outcome)
    assert outcome["runs"] == 40 + 4 * 2 + 2 + 2 * (4 + 3 + 3 + 3)


async def test_handlers_hanging_past_shutdown_grace(dsn: str, db: asyncpg.Connection) -> None:
    """stop() waits ``shutdown_grace`` for running handlers, then cancels and releases."""
    await aiooutbox.enqueue_many(
        db,
        [aiooutbox.NewEvent("hang", {}) for _ in range(3)]
        + [aiooutbox.NewEvent("quick", {}) for _ in range(3)],
    )
    started = asyncio.Event()
    running_now = 0

    async def hang(event: aiooutbox.Event) -> None:
        nonlocal running_now
        running_now += 1
        if running_now == 6:
            started.set()
        await asyncio.sleep(3600)

    async def quick(event: aiooutbox.Event) -> None:
        nonlocal running_now
        running_now += 1
        if running_now == 6:
            started.set()
        await asyncio.sleep(0.3)

    async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
        consumer = aiooutbox.OutboxConsumer(pool, concurrency=8, shutdown_grace=1.0)
        async with consumer:
            task = asyncio.ensure_future(consumer.run({"hang": hang, "quick": quick}))
            await asyncio.wait_for(started.wait(), 10)
            stop_at = time.monotonic()
            consumer.stop()
            await asyncio.wait_for(task, 15)
            stopped_in = time.monotonic() - stop_at
    outcomes = await _topic_outcomes(db)
    assert outcomes["quick"] == [("done", 1)] * 3  # finished within the grace
    assert outcomes["hang"] == [("retry", 1)] * 3  # released: available again at once
    late = await db.fetchval(
        "SELECT count(*) FROM outbox_events_all WHERE topic = 'hang'"
        " AND (available_at > now() OR last_error NOT LIKE 'released%')"
    )
    assert late == 0
    report("hang past grace", grace_s=1.0, stop_returned_after_s=stopped_in)
    assert 0.9 < stopped_in < 5


class Fatal(BaseException):
    pass


def _exit(event: aiooutbox.Event) -> None:
    import sys

    sys.exit(3)


def _fatal(event: aiooutbox.Event) -> None:
    raise Fatal("stop the world")


def _interrupt(event: aiooutbox.Event) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("raiser", "expected"),
    [(_exit, SystemExit), (_fatal, Fatal), (_interrupt, KeyboardInterrupt)],
    ids=["sys.exit", "BaseException", "KeyboardInterrupt"],
)
async def test_base_exception_in_handler_settles_then_stops(
    dsn: str, db: asyncpg.Connection, raiser: Any, expected: type[BaseException]
) -> None:
    """The failing event is settled as failed, handlers in flight finish, run() re-raises."""
    await aiooutbox.enqueue_many(db, [aiooutbox.NewEvent("slow", {}) for _ in range(3)])
    slow_started = asyncio.Event()
    started = 0

    async def slow(event: aiooutbox.Event) -> None:
        nonlocal started
        started += 1
        if started == 3:
            slow_started.set()
        await asyncio.sleep(0.5)

    async def fatal(event: aiooutbox.Event) -> None:
        raiser(event)

    async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
        consumer = aiooutbox.OutboxConsumer(pool, concurrency=8, retry=FAST, poll_interval=0.2)

        async def trigger() -> None:
            await asyncio.wait_for(slow_started.wait(), 10)
            await aiooutbox.enqueue(db, "fatal", {})

        # run() is awaited here, not in a task of its own: asyncio re-raises SystemExit and
        # KeyboardInterrupt escaping a task out of the event loop, as it should
        helper = asyncio.ensure_future(trigger())
        async with consumer:
            with pytest.raises(expected):
                await consumer.run({"slow": slow, "fatal": fatal})
        await helper
    outcomes = await _topic_outcomes(db)
    assert outcomes["slow"] == [("done", 1)] * 3
    assert outcomes["fatal"] == [("retry", 1)]
    error = await db.fetchval("SELECT last_error FROM outbox_events_all WHERE topic = 'fatal'")
    assert expected.__name__ in error


# -- poison events ------------------------------------------------------------------------


async def test_poison_that_always_fails_dies_without_blocking(
    dsn: str, db: asyncpg.Connection
) -> None:
    """Oldest first: the poison is claimed first every time, and still blocks nothing."""
    recorder = Recorder()

    async def handler(event: aiooutbox.Event) -> None:
        recorder("c", event)
        if event.payload.get("poison"):
            raise RuntimeError("poison")
        await asyncio.sleep(0.005)

    await aiooutbox.enqueue_many(db, [aiooutbox.NewEvent("t", {"poison": True}, max_attempts=3)])
    await aiooutbox.enqueue_many(db, [aiooutbox.NewEvent("t", {"n": i}) for i in range(300)])
    async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
        consumer = aiooutbox.OutboxConsumer(
            pool, concurrency=4, poll_interval=0.2, retry=aiooutbox.RetryPolicy(base=0.3, jitter=0)
        )
        async with running(consumer, {"t": handler}):
            await wait_until(lambda: all_finished(db, 301), 30, "everything to finish")
    poison = await db.fetchrow(
        "SELECT status::text, attempts, last_error, finished_at FROM outbox_events_all"
        " WHERE payload ? 'poison'"
    )
    last_good = await db.fetchval(
        "SELECT max(finished_at) FROM outbox_events_all WHERE NOT payload ? 'poison'"
    )
    await recorder.save(db)
    outcome = await check_outcome(db)
    report("poison (failing)", **outcome)
    assert (poison["status"], poison["attempts"]) == ("dead", 3)
    assert "RuntimeError: poison" in poison["last_error"]
    assert outcome["done"] == 300 and outcome["extra_runs"] == 2
    # the 300 good events did not wait for the poison's three attempts (0.3 s + 0.6 s)
    assert last_good < poison["finished_at"]


async def test_poison_that_crashes_its_process_reaches_dead(
    dsn: str, db: asyncpg.Connection
) -> None:
    """A handler that kills its process (os._exit) on one event, restarted each time.

    attempts grows at claim, so after ``max_attempts`` crashes lease recovery moves the
    row to dead instead of handing it out again; the other events complete.
    """
    await aiooutbox.enqueue(db, "crash", {}, max_attempts=3)
    await aiooutbox.enqueue_many(db, [aiooutbox.NewEvent("t", {"n": i}) for i in range(200)])
    config = {
        "dsn": dsn,
        "concurrency": 4,
        "lease_timeout": 1.0,
        "sleep": 0.01,
        "topics": ["t", "crash"],
        "crash_topics": ["crash"],
    }
    crashes = 0
    started = time.monotonic()
    proc = ConsumerProcess({**config, "worker_id": "w0"})
    try:
        while True:
            if await all_finished(db, 201):
                break
            if proc.exited():
                assert proc.proc.returncode == 3, proc.stderr()
                crashes += 1
                assert crashes <= 3, "the poison was handed out after max_attempts"
                proc.close()
                proc = ConsumerProcess({**config, "worker_id": f"w{crashes}"})
            assert time.monotonic() - started < 60, "poison run did not finish"
            await asyncio.sleep(0.05)
        await proc.stop()
    finally:
        proc.close()
    elapsed = time.monotonic() - started
    poison = await db.fetchrow(
        "SELECT status::text, attempts, last_error FROM outbox_events_all WHERE topic = 'crash'"
    )
    outcome = await check_outcome(db)
    report("poison (crashing)", crashes=crashes, elapsed_s=elapsed, **outcome)
    assert crashes == 3
    assert (poison["status"], poison["attempts"]) == ("dead", 3)
    assert "lease expired" in poison["last_error"]
    assert outcome["done"] == 200
    # a crash loses at most what the process held besides the poison
    assert outcome["extra_runs"] <= crashes * 4


# -- a burst of 100k events ---------------------------------------------------------------


async def test_burst_of_100k_events_while_consumers_run(dsn: str, db: asyncpg.Connection) -> None:
    """100k events enqueued in chunks of 5000 into two running consumer processes."""
    total, chunk = 100_000, 5_000
    base = {"dsn": dsn, "concurrency": 64, "record": "batch", "lease_timeout": 30}
    procs = [ConsumerProcess({**base, "worker_id": f"burst{i}"}) for i in range(2)]
    try:
        await asyncio.gather(*(p.ready() for p in procs))
        started = time.monotonic()
        for start in range(0, total, chunk):
            await aiooutbox.enqueue_many(
                db, [aiooutbox.NewEvent("t", {"n": n}) for n in range(start, start + chunk)]
            )
        enqueued = time.monotonic() - started

        async def drained() -> bool:
            n = await db.fetchval("SELECT count(*) FROM outbox_events_all WHERE status <> 'done'")
            return bool(n == 0)

        await wait_until(drained, 120, "100k events to drain", interval=0.25)
        elapsed = time.monotonic() - started
        stats = [await p.stop() for p in procs]
    finally:
        for p in procs:
            p.close()
    outcome = await check_outcome(db)
    per_worker = {s["worker_id"]: s["done"] for s in stats}
    report(
        "burst",
        enqueue_s=enqueued,
        drain_s=elapsed,
        events_per_s=total / elapsed,
        per_worker=per_worker,
        **outcome,
    )
    assert outcome["events"] == outcome["done"] == outcome["runs"] == total
    assert outcome["extra_runs"] == 0


# -- bad input to the consumer --------------------------------------------------------------

NAN, INF = float("nan"), float("inf")


async def _async_decoder(text: str) -> Any:
    """A decoder must return the payload: this one would return a coroutine."""
    return text


# (id, keyword arguments, expected exception, message fragment)
BAD_OPTIONS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("concurrency-0", {"concurrency": 0}, ValueError, "concurrency"),
    ("concurrency-negative", {"concurrency": -1}, ValueError, "concurrency"),
    ("concurrency-huge", {"concurrency": 10**9}, ValueError, "concurrency"),
    ("concurrency-str", {"concurrency": "8"}, TypeError, "concurrency"),
    ("concurrency-float", {"concurrency": 8.0}, TypeError, "concurrency"),
    ("concurrency-bool", {"concurrency": True}, TypeError, "concurrency"),
    ("concurrency-none", {"concurrency": None}, TypeError, "concurrency"),
    ("batch-0", {"batch_size": 0}, ValueError, "batch_size"),
    ("batch-over-concurrency", {"concurrency": 4, "batch_size": 5}, ValueError, "batch_size"),
    ("batch-str", {"batch_size": "4"}, TypeError, "batch_size"),
    ("poll-negative", {"poll_interval": -1}, ValueError, "poll_interval"),
    ("poll-zero", {"poll_interval": 0}, ValueError, "poll_interval"),
    ("poll-nan", {"poll_interval": NAN}, ValueError, "poll_interval"),
    ("poll-inf", {"poll_interval": INF}, ValueError, "poll_interval"),
    ("poll-str", {"poll_interval": "5"}, TypeError, "poll_interval"),
    ("poll-none", {"poll_interval": None}, TypeError, "poll_interval"),
    ("poll-negative-timedelta", {"poll_interval": timedelta(seconds=-1)}, ValueError, "poll"),
    ("lease-too-short", {"lease_timeout": 0.5}, ValueError, "lease_timeout"),
    ("lease-nan", {"lease_timeout": NAN}, ValueError, "lease_timeout"),
    ("lease-str", {"lease_timeout": "30"}, TypeError, "lease_timeout"),
    ("grace-negative", {"shutdown_grace": -1}, ValueError, "shutdown_grace"),
    ("grace-nan", {"shutdown_grace": NAN}, ValueError, "shutdown_grace"),
    ("handler-timeout-0", {"handler_timeout": 0}, ValueError, "handler_timeout"),
    ("handler-timeout-inf", {"handler_timeout": INF}, ValueError, "handler_timeout"),
    ("handler-timeout-str", {"handler_timeout": "1"}, TypeError, "handler_timeout"),
    ("statement-timeout-0", {"statement_timeout": 0}, ValueError, "statement_timeout"),
    ("statement-timeout-nan", {"statement_timeout": NAN}, ValueError, "statement_timeout"),
    ("retention-0", {"retention": 0}, ValueError, "retention"),
    ("retention-str", {"retention": "7d"}, TypeError, "retention"),
    ("retry-dict", {"retry": {"base": 1}}, TypeError, "RetryPolicy"),
    ("worker-empty", {"worker_id": ""}, ValueError, "worker_id"),
    ("worker-blank", {"worker_id": "   "}, ValueError, "worker_id"),
    ("worker-int", {"worker_id": 5}, TypeError, "worker_id"),
    ("worker-nul", {"worker_id": "a\x00b"}, ValueError, "worker_id"),
    ("worker-10k", {"worker_id": "w" * 10_000}, ValueError, "worker_id"),
    ("topics-str", {"topics": "orders"}, TypeError, "topics"),
    ("topics-int", {"topics": 5}, TypeError, "topics"),
    ("topics-empty", {"topics": []}, ValueError, "topics"),
    ("topics-non-str", {"topics": [1]}, TypeError, "topic"),
    ("topics-star", {"topics": ["t", "*"]}, ValueError, "leave topics unset"),
    ("listen-str", {"listen": "no"}, TypeError, "listen"),
    ("listen-none", {"listen": None}, TypeError, "listen"),
    ("listen-dsn-int", {"listen_dsn": 5432}, TypeError, "listen_dsn"),
    ("listen-dsn-empty", {"listen_dsn": ""}, ValueError, "listen_dsn"),
    ("decoder-str", {"decoder": "json"}, TypeError, "decoder"),
    ("decoder-async", {"decoder": _async_decoder}, TypeError, "not async"),
    ("topics-iterator", {"topics": iter(["t"])}, TypeError, "list_iterator"),
    ("typo", {"concurency": 4}, TypeError, "concurency"),
]


async def _snapshot(conn: asyncpg.Connection) -> tuple[Any, ...]:
    return (
        await conn.fetchval("SELECT count(*) FROM outbox_events_all"),
        await conn.fetchval("SELECT count(*) FROM outbox_events_all WHERE status <> 'pending'"),
        await conn.fetchval("SELECT count(*) FROM outbox_events_idle"),
        await conn.fetchval("SELECT max(updated_at) FROM outbox_events_all"),
    )


@pytest.fixture
async def seeded(db: asyncpg.Connection) -> asyncpg.Connection:
    await aiooutbox.enqueue(db, "t", {"n": 1})
    return db


@pytest.fixture
async def small_pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    async with asyncpg.create_pool(dsn, min_size=1, max_size=2) as pool:
        yield pool


async def test_consumer_rejects_bad_options_before_writing(
    seeded: asyncpg.Connection, small_pool: asyncpg.Pool
) -> None:
    before = await _snapshot(seeded)
    failures = []
    for case, options, exc, fragment in BAD_OPTIONS:
        try:
            aiooutbox.OutboxConsumer(small_pool, **options)
        except exc as error:
            if fragment not in str(error):
                failures.append(f"{case}: message {str(error)!r} lacks {fragment!r}")
        except Exception as error:
            failures.append(f"{case}: {type(error).__name__}: {error} (wanted {exc.__name__})")
        else:
            failures.append(f"{case}: accepted")
    assert not failures, "\n".join(failures)
    assert await _snapshot(seeded) == before


async def test_consumer_rejects_a_non_pool(seeded: asyncpg.Connection) -> None:
    for thing in (None, "postgresql://localhost/db", seeded, object()):
        with pytest.raises(TypeError, match=r"asyncpg\.Pool"):
            aiooutbox.OutboxConsumer(thing)


async def test_consumer_accepts_timedeltas(small_pool: asyncpg.Pool) -> None:
    consumer = aiooutbox.OutboxConsumer(
        small_pool,
        poll_interval=timedelta(seconds=1),
        lease_timeout=timedelta(minutes=1),
        shutdown_grace=timedelta(0),
        handler_timeout=timedelta(seconds=3),
        retention=timedelta(days=1),
        statement_timeout=timedelta(seconds=5),
    )
    assert not consumer.running


async def _sync_handler(event: aiooutbox.Event) -> None:
    return None


def _plain(event: aiooutbox.Event) -> None:
    return None


async def _agen(event: aiooutbox.Event) -> Any:
    yield None


class _AsyncCall:
    """Its instances are handlers; the class itself is not (calling it makes one)."""

    async def __call__(self, event: aiooutbox.Event) -> None:
        return None


class _HoldsAnAsyncFunc:
    """A plain callable that happens to hold an async function as ``.func``."""

    func = staticmethod(_sync_handler)

    def __call__(self, event: aiooutbox.Event) -> None:
        return None


BAD_HANDLERS: list[tuple[str, Any, dict[str, Any], type[Exception], str]] = [
    ("not-a-mapping", [("t", _sync_handler)], {}, TypeError, "mapping"),
    ("empty", {}, {}, ValueError, "empty"),
    ("sync-function", {"t": _plain}, {}, TypeError, "async"),
    ("lambda", {"t": lambda e: _sync_handler(e)}, {}, TypeError, "async"),
    ("async-generator", {"t": _agen}, {}, TypeError, "async"),
    ("coroutine-object", {"t": "placeholder"}, {}, TypeError, "async"),
    ("none", {"t": None}, {}, TypeError, "async"),
    ("class-with-async-call", {"t": _AsyncCall}, {}, TypeError, "async"),
    ("sync-callable-with-func", {"t": _HoldsAnAsyncFunc()}, {}, TypeError, "async"),
    ("topic-int", {1: _sync_handler}, {}, TypeError, "topic"),
    ("topic-empty", {"": _sync_handler}, {}, ValueError, "topic"),
    ("topic-long", {"t" * 256: _sync_handler}, {}, ValueError, "topic"),
    ("topic-nul", {"a\x00b": _sync_handler}, {}, ValueError, "topic"),
    ("topics-without-handler", {"t": _sync_handler}, {"topics": ["t", "u"]}, ValueError, "'u'"),
]


async def test_run_rejects_bad_handlers_before_writing(
    seeded: asyncpg.Connection, small_pool: asyncpg.Pool
) -> None:
    before = await _snapshot(seeded)
    failures = []
    for case, handlers, options, exc, fragment in BAD_HANDLERS:
        coroutine = None
        if handlers == {"t": "placeholder"}:
            coroutine = _sync_handler(None)  # type: ignore[arg-type]
            handlers = {"t": coroutine}
        consumer = aiooutbox.OutboxConsumer(small_pool, **options)
        try:
            await asyncio.wait_for(consumer.run(handlers), 5)
        except exc as error:
            if fragment not in str(error):
                failures.append(f"{case}: message {str(error)!r} lacks {fragment!r}")
        except BaseException as error:
            failures.append(f"{case}: {type(error).__name__}: {error} (wanted {exc.__name__})")
        else:
            failures.append(f"{case}: accepted")
        finally:
            if coroutine is not None:
                coroutine.close()
        assert not consumer.running
    assert not failures, "\n".join(failures)
    assert await _snapshot(seeded) == before


async def test_a_partial_and_an_instance_with_async_call_are_handlers(
    db: asyncpg.Connection, small_pool: asyncpg.Pool
) -> None:
    seen: list[tuple[str, str]] = []

    async def note(how: str, event: aiooutbox.Event) -> None:
        seen.append((how, event.topic))

    class Note:
        async def __call__(self, event: aiooutbox.Event) -> None:
            seen.append(("instance", event.topic))

    await aiooutbox.enqueue(db, "a", {})
    await aiooutbox.enqueue(db, "b", {})
    handlers: dict[str, aiooutbox.HandlerFunc] = {
        "a": functools.partial(note, "partial"),
        "b": Note(),
    }
    async with aiooutbox.OutboxConsumer(small_pool, poll_interval=0.05) as consumer:
        run = asyncio.create_task(consumer.run(handlers))
        deadline = time.monotonic() + 30
        while len(seen) < 2 and not run.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        consumer.stop()
        await asyncio.wait_for(run, 30)
    assert sorted(seen) == [("instance", "b"), ("partial", "a")]


@pytest.mark.parametrize(
    ("options", "error", "says"),
    [
        ({"timeout": NAN}, ValueError, "timeout must be a finite number"),
        ({"retry": 3}, TypeError, "retry must be a RetryPolicy, got 3"),
        ({"on_dead": "drop"}, ValueError, "on_dead must be 'skip' or 'block'"),
    ],
)
def test_a_handler_with_a_bad_option_is_refused_when_made(
    options: dict[str, Any], error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=says):
        aiooutbox.Handler(_sync_handler, **options)


async def test_consumer_start_during_a_stall_fails_in_bounded_time(private_dsn: str) -> None:
    """Entering a consumer checks the schema: on a stalled path that check must time out."""
    with TCPProxy.for_dsn(private_dsn) as proxy:
        async with asyncpg.create_pool(proxy.proxied(private_dsn), min_size=1, max_size=2) as pool:
            consumer = aiooutbox.OutboxConsumer(pool, statement_timeout=1.0)
            proxy.stall()
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="schema"):
                async with consumer:
                    pass
            elapsed = time.monotonic() - started
            proxy.restore()
    report("start during stall", failed_after_s=elapsed)
    assert elapsed < 10
