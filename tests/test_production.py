"""Production failure modes (issue 17): failover to a promoted standby, a read-only
standby, a listener that went deaf, a pinned xmin horizon, recovery racing a settle
at the lease boundary, and backend kills during claims.

Numbers are printed (run with ``-s``); bounds are generous, several times typical.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
import yaml

import aiooutbox
from aiooutbox import admin
from aiooutbox._engine.listener import Listener, is_probe
from aiooutbox._sql.db import PermanentDatabaseError
from aiooutbox._sql.statements import queries
from aiooutbox.cli import build_parser
from aiooutbox.cli.output import stats_view
from tests.conftest import with_database
from tests.faults.deaf_proxy import DeafProxy
from tests.faults.private_pg import private_postgres
from tests.faults.procs import HANDLED_DDL, all_finished, wait_until
from tests.faults.replica_pg import ReplicaPair, replica_pair

pytestmark = pytest.mark.slow

Q = queries()


def report(name: str, **numbers: Any) -> None:
    shown = ", ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in numbers.items()
    )
    print(f"\n[{name}] {shown}")


@contextlib.asynccontextmanager
async def running(
    consumer: aiooutbox.OutboxConsumer, handlers: Any, *, stop_timeout: float = 60.0
) -> AsyncIterator[asyncio.Future[None]]:
    """Run ``consumer`` until the block ends; re-raise what run() raised."""
    async with consumer:
        task = asyncio.ensure_future(consumer.run(handlers))
        await wait_until(
            lambda: _started(consumer, task), 20, "the consumer to start", interval=0.01
        )
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


async def _started(consumer: aiooutbox.OutboxConsumer, task: asyncio.Future[None]) -> bool:
    if task.done():
        task.result()
        raise AssertionError("consumer.run() returned at once")
    return consumer.running and (consumer.listening or not consumer.options.listen)


class Producer:
    """Enqueues numbered events steadily on its own connection, riding out outages."""

    def __init__(self, dsn: str, topic: str = "t") -> None:
        self.dsn = dsn
        self.topic = topic
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
                events = [
                    aiooutbox.NewEvent(self.topic, {"n": self.sent + i}) for i in range(batch)
                ]
                ids = await aiooutbox.enqueue_many(conn, events)
                self.sent += batch
                self.committed.update(i for i in ids if i is not None)
            except Exception:  # a dying link raises InternalClientError too
                self.failures += 1
                if conn is not None:
                    conn.terminate()
                    conn = None
            await asyncio.sleep(interval)
        if conn is not None:
            await conn.close()

    def stop(self) -> None:
        self._stop.set()


# -- 2. failover to a promoted standby -------------------------------------------------


@pytest.fixture(scope="module")
def pair() -> Iterator[ReplicaPair]:
    with replica_pair() as servers:
        yield servers


@pytest.fixture(scope="module")
def app_db(pair: ReplicaPair) -> str:
    """A migrated database on the primary, replicated to the standby."""

    async def create() -> None:
        admin_conn = await asyncpg.connect(pair.primary.dsn)
        try:
            await admin_conn.execute('CREATE DATABASE "app"')
        finally:
            await admin_conn.close()
        conn = await asyncpg.connect(with_database(pair.primary.dsn, "app"))
        try:
            await aiooutbox.migrate(conn)
            await conn.execute(HANDLED_DDL)
            lsn = await conn.fetchval("SELECT pg_current_wal_lsn()")
        finally:
            await conn.close()
        standby = await asyncpg.connect(pair.standby_dsn("postgres"))
        try:
            deadline = time.monotonic() + 30
            while not await standby.fetchval("SELECT pg_last_wal_replay_lsn() >= $1", lsn):
                assert time.monotonic() < deadline, "the standby never replayed the migration"
                await asyncio.sleep(0.05)
        finally:
            await standby.close()

    asyncio.run(create())
    return "app"


async def test_consumer_on_a_read_only_standby_stops_with_a_clear_message(
    pair: ReplicaPair, app_db: str
) -> None:
    conn = await asyncpg.connect(with_database(pair.primary.dsn, app_db))
    try:
        await aiooutbox.enqueue(conn, "t", {"n": -1})
    finally:
        await conn.close()
    handled: list[int] = []

    async def record(event: aiooutbox.Event) -> None:
        handled.append(event.id)

    async with asyncpg.create_pool(pair.standby_dsn(app_db), min_size=1, max_size=4) as pool:
        consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.05, statement_timeout=2)
        async with consumer:
            started = time.monotonic()
            with pytest.raises(PermanentDatabaseError) as caught:
                await asyncio.wait_for(consumer.run({"t": record}), 30)
            took = time.monotonic() - started
    message = str(caught.value)
    report("read-only standby", stopped_after_s=took, claims=consumer.stats.claims)
    print(message)
    assert "read-only" in message and "primary" in message
    assert "target_session_attrs=read-write" in message
    assert handled == [] and consumer.stats.claims == 0  # it never spun on claims
    assert took < 20


async def test_failover_to_a_promoted_standby(pair: ReplicaPair, app_db: str) -> None:
    dsn = pair.dsn(app_db)
    seen: dict[int, int] = {}

    async def handler(event: aiooutbox.Event) -> None:
        seen[event.id] = seen.get(event.id, 0) + 1
        # some events run long, so leases are held when the primary dies
        await asyncio.sleep(1.5 if event.payload["n"] % 7 == 0 else 0.02)

    producers = [Producer(dsn) for _ in range(2)]
    async with asyncpg.create_pool(dsn, min_size=1, max_size=6) as pool:
        consumer = aiooutbox.OutboxConsumer(
            pool,
            worker_id="failover",
            concurrency=16,
            lease_timeout=3,
            poll_interval=1,
            statement_timeout=2,
            shutdown_grace=5,
        )
        async with running(consumer, {"t": handler}) as task:
            tasks = [asyncio.ensure_future(p.run(interval=0.02, batch=3)) for p in producers]
            await wait_until(when(lambda: len(seen) > 100), 30, "events to flow")
            pair.kill_primary()
            killed = time.monotonic()
            standby = await asyncpg.connect(pair.standby_dsn(app_db))
            try:
                held = {
                    r[0]
                    for r in await standby.fetch(
                        "SELECT id FROM outbox_events_all WHERE status = 'processing'"
                    )
                }
            finally:
                await standby.close()
            await asyncio.sleep(1.0)  # the outage, before anyone promotes
            pair.standby.promote()
            promoted = time.monotonic()
            committed_before = sum(len(p.committed) for p in producers)
            before = len(seen)
            await wait_until(when(lambda: len(seen) > before + 50), 60, "handling to resume")
            resumed = time.monotonic() - promoted
            for p in producers:
                p.stop()
            await asyncio.gather(*tasks)
            new_primary = await asyncpg.connect(pair.standby_dsn(app_db))
            try:
                try:
                    drained = await wait_until(lambda: all_finished(new_primary), 60, "the drain")
                except AssertionError as exc:  # say what is left and what the consumer holds
                    left = await new_primary.fetch(
                        "SELECT id, status::text, locked_by, attempts, lease_expires_at - now(),"
                        " available_at - now() FROM outbox_events"
                        " WHERE status NOT IN ('done', 'dead') ORDER BY id LIMIT 20"
                    )
                    raise AssertionError(
                        f"{exc}: left {[tuple(r) for r in left]}; consumer {consumer.stats}"
                    ) from None
                rows = {
                    r[0]: r[1]
                    for r in await new_primary.fetch(
                        "SELECT id, status::text FROM outbox_events_all"
                    )
                }
                recovered = await new_primary.fetchval(
                    "SELECT count(*) FROM outbox_events_all WHERE id = ANY ($1::bigint[])"
                    " AND attempts > 1",
                    list(held),
                )
            finally:
                await new_primary.close()
            assert not task.done(), "the consumer exited during the failover"
    committed = set().union(*(p.committed for p in producers))
    lost = committed - set(rows)  # acknowledged by the dead primary, never replicated
    report(
        "failover",
        events_on_new_primary=len(rows),
        committed=len(committed),
        not_replicated=len(lost),
        held_at_crash=len(held),
        held_rerun=recovered,
        committed_after_promote=len(committed) - committed_before,
        producer_failures=sum(p.failures for p in producers),
        outage_s=promoted - killed,
        resumed_after_promote_s=resumed,
        drained_s=drained,
    )
    assert set(rows.values()) == {"done"}
    assert set(rows) <= set(seen), "an event that reached the standby was never handled"
    assert held and held <= set(rows), "no lease was held at the crash: the test proves nothing"
    assert all(rows[i] == "done" for i in held)
    assert len(committed) > committed_before, "no producer committed after the failover"


def when(check: Any) -> Any:
    """A `wait_until` predicate from a plain check, evaluated on every poll."""

    async def predicate() -> bool:
        return bool(check())

    return predicate


# -- 3. a listener that proves it hears ------------------------------------------------


async def test_probe_payload_can_never_be_a_topic(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    wakes: list[float] = []
    async with asyncpg.create_pool(dsn, min_size=1, max_size=2) as pool:
        quiet = Listener(
            pool, Q.channel, None, lambda: wakes.append(time.monotonic()),
            dsn=None, keepalive=60, timeout=5, worker_id="quiet", probe_interval=None,
        )  # fmt: skip
        prober = Listener(
            pool, Q.channel, None, lambda: None,
            dsn=None, keepalive=60, timeout=5, worker_id="prober", probe_interval=0.1,
        )  # fmt: skip
        async with asyncio.timeout(30):
            q_task = asyncio.ensure_future(quiet.run())
            p_task = asyncio.ensure_future(prober.run())
            try:
                await wait_until(when(lambda: prober.probes_sent >= 10), 20, "probes")
            finally:
                for t in (q_task, p_task):
                    t.cancel()
                await asyncio.gather(q_task, p_task, return_exceptions=True)
    payload = "\x01aiooutbox-probe:prober:1:".ljust(256, ".")
    try:
        with pytest.raises(asyncpg.CheckViolationError):
            await conn.execute(
                "INSERT INTO outbox_events (topic, payload) VALUES ($1, '{}')", payload
            )
    finally:
        await conn.close()
    report(
        "probes", sent=prober.probes_sent, missed=prober.probes_missed, rtt=prober.last_probe_rtt
    )
    assert is_probe(payload) and not is_probe("t") and not is_probe(payload[:255])
    assert prober.probes_missed == 0
    assert len(wakes) == 1, "a probe woke an every-topic consumer (only its connect may)"


@pytest.fixture
async def tcp_dsn(dsn: str) -> AsyncIterator[str]:
    """A migrated database reached over TCP: the proxy cannot front a Unix socket (the
    embedded server's), so then a private server is started for the test."""
    if urlsplit(dsn).hostname:
        yield dsn
        return
    with private_postgres() as server:
        conn = await asyncpg.connect(server.dsn)
        try:
            await aiooutbox.migrate(conn)
        finally:
            await conn.close()
        yield server.dsn


async def test_a_deaf_listener_reconnects_and_claims_without_waiting_for_the_poll(
    tcp_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    dsn = tcp_dsn
    handled: dict[int, float] = {}
    poll = 120.0

    async def handler(event: aiooutbox.Event) -> None:
        handled.setdefault(event.id, time.monotonic())

    with DeafProxy.for_dsn(dsn) as proxy:
        async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
            consumer = aiooutbox.OutboxConsumer(
                pool,
                poll_interval=poll,
                listen_dsn=proxy.proxied(dsn),
                listen_probe_interval=0.5,
                statement_timeout=2,
            )
            async with running(consumer, {"t": handler}):
                conn = await asyncpg.connect(dsn)
                try:
                    first = await _latency(conn, handled, consumer)
                    proxy.freeze()  # the listener's link stays up but hears nothing
                    frozen_at = time.monotonic()
                    deaf = await _latency(conn, handled, consumer)
                    assert consumer._listener is not None
                    listener = consumer._listener
                    await wait_until(when(lambda: listener.reconnects >= 1), 30, "a reconnect")
                    again = await _latency(conn, handled, consumer)
                finally:
                    await conn.close()
    detected = [r for r in caplog.records if "heard nothing" in r.getMessage()]
    report(
        "deaf listener",
        latency_before_s=first,
        latency_while_deaf_s=deaf,
        latency_after_reconnect_s=again,
        since_freeze_s=time.monotonic() - frozen_at,
        probes_sent=listener.probes_sent,
        probes_missed=listener.probes_missed,
        reconnects=listener.reconnects,
    )
    assert detected and listener.probes_missed >= 1 and listener.reconnects >= 1
    # the bound: a probe interval plus its timeout plus a claim, far below the poll
    assert deaf < poll / 4
    assert again < 3.0


async def _latency(
    conn: asyncpg.Connection,
    handled: dict[int, float],
    consumer: aiooutbox.OutboxConsumer,
    *,
    idle: bool = True,
) -> float:
    """Seconds from enqueue to handler for one event sent to an idle consumer."""
    if idle:
        worker = consumer.worker_id
        await wait_until(lambda: _idle_declared(conn, worker), 30, "the consumer to declare idle")
    event_id = await aiooutbox.enqueue(conn, "t", {})
    assert event_id is not None
    sent = time.monotonic()
    await wait_until(when(lambda: event_id in handled), 60, "the event", interval=0.01)
    return handled[event_id] - sent


async def _idle_declared(conn: asyncpg.Connection, worker: str) -> bool:
    return bool(
        await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM outbox_events_idle WHERE worker_id = $1)", worker
        )
    )


# -- 4. the MVCC watchdog ----------------------------------------------------------------


async def test_watchdog_names_the_transaction_that_pins_the_horizon(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A REPEATABLE READ transaction stays open while the consumer drains a backlog.

    The CI size is small; ``python -m benchmarks.mvcc_holder`` drains 200k events with
    and without the holder (docs/benchmarks.md).
    """
    total = 20_000
    caplog.set_level(logging.WARNING, logger="aiooutbox.watchdog")
    conn = await asyncpg.connect(dsn)
    holder = await asyncpg.connect(dsn, server_settings={"application_name": "long-report"})
    try:
        await conn.execute(
            "INSERT INTO outbox_events (topic, payload)"
            " SELECT 't', '{}' FROM generate_series(1, $1)",
            total,
        )
        tx = holder.transaction(isolation="repeatable_read")
        await tx.start()
        await holder.fetchval("SELECT count(*) FROM outbox_events_all")  # takes the snapshot
        holder_pid = holder.get_server_pid()
        handled = 0

        async def handler(event: aiooutbox.Event) -> None:
            nonlocal handled
            handled += 1

        async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
            consumer = aiooutbox.OutboxConsumer(
                pool, watchdog_interval=1.0, horizon_warning=2.0, dead_tuples_warning=5_000
            )
            started = time.monotonic()
            async with running(consumer, {"t": handler}):
                await wait_until(lambda: all_finished(conn), 120, "the drain")
                drained = time.monotonic() - started
                # both warnings: the dead tuples reach pg_stat_user_tables only when the
                # consumer's backends flush their statistics, a check or two after the
                # drain (it takes under a second now)
                await wait_until(
                    when(
                        lambda: (
                            any(_names(r, holder_pid) for r in caplog.records)
                            and any("dead tuples" in r.getMessage() for r in caplog.records)
                        )
                    ),
                    30,
                    "the watchdog's warnings",
                )
            report_ = await admin.stats(conn)
        await tx.rollback()
    finally:
        await holder.close()
        await conn.close()
    warning = next(r.getMessage() for r in caplog.records if _names(r, holder_pid))
    assert report_.mvcc is not None
    shown = stats_view(report_)
    report("watchdog", events=total, drained_s=drained, rate_per_s=total / drained)
    print(warning)
    print(shown)
    assert "long-report" in warning and "idle in transaction" in warning
    assert any(h.pid == holder_pid for h in report_.mvcc.holders)
    assert f"pid={holder_pid}" in shown and "long-report" in shown
    assert report_.as_dict()["mvcc"]["horizon_holders"]
    assert any("dead tuples" in r.getMessage() for r in caplog.records)


def _names(record: logging.LogRecord, pid: int) -> bool:
    return record.name == "aiooutbox.watchdog" and f"pid={pid} " in record.getMessage()


async def test_watchdog_options_are_checked(dsn: str) -> None:
    async with asyncpg.create_pool(dsn, min_size=1, max_size=1) as pool:
        for bad in ({"watchdog_interval": 0}, {"horizon_warning": -1}, {"dead_tuples_warning": 0}):
            with pytest.raises(aiooutbox.InvalidArgument):
                aiooutbox.OutboxConsumer(pool, **bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            aiooutbox.OutboxConsumer(pool, listen_probe_interval="5")  # type: ignore[arg-type]
        assert (
            aiooutbox.OutboxConsumer(pool, watchdog_interval=None).options.watchdog_interval is None
        )


# -- 5. lease recovery racing a settle at the lease boundary ---------------------------


async def test_recovery_racing_a_settle_at_the_lease_boundary(dsn: str) -> None:
    """Claim with a 50 ms lease, then settle and recover at about the moment it expires,
    and let another worker re-claim what recovery freed; many rounds.

    Either the settle wins (the row is ``done`` and recovery left it alone) or it is
    fenced (it changed nothing and the row went on to retry or to the second worker);
    a settled outcome is never overwritten and a fenced settle never lands.
    """
    rounds, lease = 300, 0.05
    worker_a, worker_b = "race-a", "race-b"
    settle_wins = fenced = reclaimed = late_settles_fenced = 0
    conns = [await asyncpg.connect(dsn) for _ in range(3)]
    setup, racer_settle, racer_recover = conns
    rng = random.Random(17)
    try:
        for _ in range(rounds):
            await aiooutbox.enqueue(setup, "t", {})
            (row,) = await setup.fetch(Q.claim, worker_a, lease, ["t"], 1, 1 << 20, 0, 0)
            await asyncio.sleep(lease + rng.uniform(-0.01, 0.01))

            async def settle(row: asyncpg.Record = row) -> int:
                await asyncio.sleep(rng.uniform(0, 0.004))
                return int(
                    await racer_settle.fetchval(
                        Q.settle_done, [row["id"]], worker_a, row["attempts"]
                    )
                )

            async def recover() -> list[asyncpg.Record]:
                await asyncio.sleep(rng.uniform(0, 0.004))
                rows: list[asyncpg.Record] = await racer_recover.fetch(Q.recover_expired, 100)
                return rows

            settled, recovered = await asyncio.gather(settle(), recover())
            status = await setup.fetchval(
                "SELECT status::text FROM outbox_events_all WHERE id = $1", row["id"]
            )
            if settled:
                settle_wins += 1
                assert status == "done" and not recovered, (settled, recovered, status)
            else:
                fenced += 1
                assert recovered and status == "retry", (settled, recovered, status)
                # another worker takes it; the first worker's late outcome stays fenced
                again = await setup.fetch(Q.claim, worker_b, 30.0, ["t"], 1, 1 << 20, 0, 0)
                assert [r["id"] for r in again] == [row["id"]]
                reclaimed += 1
                late = await racer_settle.fetchval(
                    Q.settle_done, [row["id"]], worker_a, row["attempts"]
                )
                assert late == 0
                late_settles_fenced += 1
                assert (
                    await racer_settle.fetchval(
                        Q.settle_done, [row["id"]], worker_b, again[0]["attempts"]
                    )
                    == 1
                )
            await setup.execute("DELETE FROM outbox_events")
    finally:
        for c in conns:
            await c.close()
    report(
        "settle vs recovery",
        rounds=rounds,
        settle_won=settle_wins,
        fenced=fenced,
        reclaimed=reclaimed,
        late_settles_fenced=late_settles_fenced,
    )
    assert settle_wins + fenced == rounds
    assert settle_wins > 0 and fenced > 0, "the race never went both ways: move the boundary"


# -- 6. a lost claim reply does not cost a lease -----------------------------------------


async def test_backend_kills_during_claims_cost_no_lease(dsn: str) -> None:
    """Terminate the consumer's connection while it runs a claim, many times: an event
    whose claim committed while the reply was lost is taken back at once by its own
    consumer (`release_orphans`), so no event waits for its 30 s lease to expire."""
    lease = 30.0
    latencies: dict[int, float] = {}

    async def handler(event: aiooutbox.Event) -> None:
        assert event.created_at is not None
        latencies.setdefault(
            event.id, (datetime.now(timezone.utc) - event.created_at).total_seconds()
        )

    killer_conn = await asyncpg.connect(dsn)
    kills = 0

    async def killer(seconds: float) -> None:
        nonlocal kills
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            hit = await killer_conn.fetchval(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = 'claims'"
                " AND state = 'active' AND query LIKE '%claim_v%') AS t"
            )
            kills += hit
            # after a hit, let a claim succeed: claim failures in a row back off (to 5 s)
            await asyncio.sleep(0.25 if hit else 0.001)

    producer = Producer(dsn)
    async with asyncpg.create_pool(
        dsn, min_size=2, max_size=4, server_settings={"application_name": "claims"}
    ) as pool:
        consumer = aiooutbox.OutboxConsumer(
            pool, worker_id="killed", concurrency=32, lease_timeout=lease, statement_timeout=2,
            poll_interval=1,
        )  # fmt: skip
        async with running(consumer, {"t": handler}) as task:
            produce = asyncio.ensure_future(producer.run(interval=0.002, batch=10))
            await killer(12.0)
            producer.stop()
            await produce
            await wait_until(lambda: all_finished(killer_conn), 60, "every event to finish")
            assert not task.done()
    released = await killer_conn.fetchval(
        "SELECT count(*) FROM outbox_events_all WHERE attempts > 1"
    )
    await killer_conn.close()
    ordered = sorted(latencies.values())
    p99 = ordered[int(0.99 * (len(ordered) - 1))]
    report(
        "backend kills during claims",
        kills=kills,
        events=len(ordered),
        taken_back_or_retried=released,
        p50_s=ordered[len(ordered) // 2],
        p99_s=p99,
        max_s=ordered[-1],
        lease_s=lease,
    )
    assert producer.committed <= set(latencies)
    assert kills >= 15, "too few claims were hit to prove anything"
    assert ordered[-1] < lease / 3, "an event waited for its lease to expire"


# -- 7. docs/deployment.md and the Kubernetes manifest -------------------------------

ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENT = ROOT / "docs" / "deployment.md"
MANIFEST = ROOT / "examples" / "k8s" / "worker.yaml"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DEPLOYMENT.read_text(), flags=re.S)


def test_deployment_doc_has_its_snippets() -> None:
    assert len(_blocks("python")) == 1 and len(_blocks("sql")) == 3 and len(_blocks("sh")) == 2
    text = DEPLOYMENT.read_text()
    for link in (
        "cli.md#behind-pgbouncer",
        "guarantees.md#least-privilege-roles",
        "k8s/worker.yaml",
    ):
        assert link in text


async def test_deployment_python_snippet_runs(dsn: str, tmp_path: Path) -> None:
    (code,) = _blocks("python")
    script = tmp_path / "deployment_snippet.py"
    script.write_text(code)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), env={**os.environ, "AIOOUTBOX_DSN": dsn},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert b"handled 1 event(s)" in out


async def test_deployment_sql_snippets_run(dsn: str) -> None:
    autovacuum, horizon, grant = _blocks("sql")
    role = f"outbox_consumer_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(autovacuum)
        options = await conn.fetchval(
            "SELECT reloptions FROM pg_class WHERE oid = 'public.outbox_events'::regclass"
        )
        assert "autovacuum_vacuum_scale_factor=0" in options
        holder = await asyncpg.connect(dsn, server_settings={"application_name": "doc-holder"})
        try:
            async with holder.transaction(isolation="repeatable_read"):
                await holder.fetchval("SELECT 1")
                rows = await conn.fetch(horizon)
        finally:
            await holder.close()
        assert "doc-holder" in [r["application_name"] for r in rows]
        await conn.execute(f'CREATE ROLE "{role}"')
        try:
            await conn.execute(grant.replace("outbox_consumer", f'"{role}"'))
            assert await conn.fetchval(
                "SELECT pg_has_role($1, 'pg_read_all_stats', 'MEMBER')", role
            )
        finally:
            await conn.execute(f'DROP ROLE "{role}"')
    finally:
        await conn.close()


def test_deployment_shell_commands_parse() -> None:
    """The commands point at hosts that do not exist here: the real parser checks them."""
    parser = build_parser()
    commands = [
        line
        for block in _blocks("sh")
        for line in block.replace("\\\n", " ").splitlines()
        if line.strip()
    ]
    assert len(commands) == 3
    for command in commands:
        words = shlex.split(command)
        assert words[:3] == ["python", "-m", "aiooutbox"], command
        args = parser.parse_args(words[3:])
        assert args.command == "run"


def _help(command: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "aiooutbox", command, "--help"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout  # fmt: skip


def test_k8s_manifest_parses_and_uses_real_flags() -> None:
    documents = list(yaml.safe_load_all(MANIFEST.read_text()))
    assert [d["kind"] for d in documents] == ["Job", "Deployment"]
    checked = 0
    for document in documents:
        pod = document["spec"]["template"]["spec"]
        for container in pod["containers"]:
            command = container["command"]
            assert command[:3] == ["python", "-m", "aiooutbox"]
            known = set(re.findall(r"--[a-z][a-z-]+", _help(command[3])))
            used = {word.split("=")[0] for word in command[4:] if word.startswith("--")}
            unknown = used - known
            assert not unknown, f"{command[3]}: no such flags {unknown}"
            checked += len(used)
            if command[3] == "run":
                grace = next(w for w in command if w.startswith("--shutdown-grace="))
                seconds = float(grace.split("=")[1].rstrip("s"))
                assert pod["terminationGracePeriodSeconds"] >= seconds + 2 * 10 + 5
                env = {e["name"]: e.get("value") for e in container["env"]}
                assert "target_session_attrs=read-write" in env["AIOOUTBOX_DSN"]
                probe = container["readinessProbe"]["httpGet"]
                assert probe["path"] == "/healthz"
    assert checked >= 5


async def test_mvcc_holder_benchmark_runs_at_a_tiny_size(pg_server: str) -> None:
    """`python -m benchmarks.mvcc_holder` cannot rot: both modes, and the watchdog's name."""
    from benchmarks.mvcc_holder import drain

    database = f"aiooutbox_mvcc_{uuid.uuid4().hex[:8]}"
    held = await drain(pg_server, 300, held=True, database=database)
    report("mvcc holder benchmark (tiny)", **held)
    assert held["events"] == 300 and held["watchdog_named_holder"]


async def test_watchdog_under_the_least_privilege_consumer_role(dsn: str) -> None:
    """With the consumer grants of docs/guarantees.md the watchdog's queries run and
    list another role's holder, but without its state and age (so it cannot be timed);
    `GRANT pg_read_all_stats` (docs/deployment.md) shows both."""
    role = f"outbox_consumer_{uuid.uuid4().hex[:8]}"
    grants = re.search(
        r"<!-- grants:consumer -->\n```sql\n(.*?)```",
        (ROOT / "docs" / "guarantees.md").read_text(),
        flags=re.S,
    )
    assert grants is not None
    parts = urlsplit(dsn)
    role_dsn = urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.rpartition('@')[2]}"))
    admin_conn = await asyncpg.connect(dsn)
    holder = await asyncpg.connect(dsn, server_settings={"application_name": "owner-report"})
    try:
        await admin_conn.execute(f'CREATE ROLE "{role}" LOGIN')
        await admin_conn.execute(grants.group(1).replace("outbox_consumer", f'"{role}"'))
        tx = holder.transaction(isolation="repeatable_read")
        await tx.start()
        await holder.fetchval("SELECT 1")
        pid = holder.get_server_pid()
        seen = []
        for grant in (False, True):
            if grant:
                (_, _, sql) = _blocks("sql")
                await admin_conn.execute(sql.replace("outbox_consumer", f'"{role}"'))
            conn = await asyncpg.connect(role_dsn)
            try:
                mvcc = (await admin.stats(conn)).mvcc
            finally:
                await conn.close()
            assert mvcc is not None and mvcc.dead_tuples is not None
            (found,) = [h for h in mvcc.holders if h.pid == pid]
            seen.append((found.name, found.state, found.age is not None))
        await tx.rollback()
    finally:
        await holder.close()
        await admin_conn.execute(f'DROP OWNED BY "{role}"')
        await admin_conn.execute(f'DROP ROLE "{role}"')
        await admin_conn.close()
    report("watchdog privileges", without_grant=seen[0], with_grant=seen[1])
    assert seen == [("owner-report", None, False), ("owner-report", "idle in transaction", True)]
