"""What consumers keep for the dashboard, with real consumers on a real server: each
failed attempt in the event's history (appended by the failure's settlement and by lease
recovery only, bounded), and the per-topic, per-minute counts (done, retried, dead, lag
at claim) written from memory, one upsert per flush; a role without the grant gets one
warning and the consumer runs on; minutes past the retention are deleted."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

import asyncpg
import pytest

import aiooutbox
from aiooutbox._engine import rollups as rollups_module
from tests.helpers import running, status_counts, wait_until
from tests.test_roles import as_user, documented_grants

pytestmark = pytest.mark.slow

HOSTILE_TOPIC = "<script>alert('t')</script>.orders"


async def minutes(pool: asyncpg.Pool) -> dict[str, dict[str, float]]:
    rows = await pool.fetch(
        "SELECT topic, sum(done) AS done, sum(retried) AS retried, sum(dead) AS dead,"
        " sum(claimed) AS claimed, max(lag_max) AS lag_max, sum(lag_sum) AS lag_sum,"
        " count(*) AS minutes FROM outbox_events_rollups GROUP BY topic"
    )
    return {r["topic"]: {k: float(v) for k, v in r.items() if k != "topic"} for r in rows}


async def test_failures_are_kept_with_the_event_and_counted_per_minute(dsn: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=6)
    tries: dict[int, int] = {}

    async def flaky(event: aiooutbox.Event) -> None:
        tries[event.id] = tries.get(event.id, 0) + 1
        if event.payload["fail"] >= tries[event.id]:
            raise RuntimeError(f"try {tries[event.id]} of {event.id}: <b>no</b> \u2603")

    async def hopeless(event: aiooutbox.Event) -> None:
        raise aiooutbox.Dead("the mail server said no")

    try:
        ok = [await aiooutbox.enqueue(pool, "emails.send", {"fail": 0}) for _ in range(5)]
        twice = await aiooutbox.enqueue(pool, "emails.send", {"fail": 2})
        dead = await aiooutbox.enqueue(pool, HOSTILE_TOPIC, {})
        # an event due for two minutes already: its lag at claim is at least that
        late = await aiooutbox.enqueue(pool, "late", {"fail": 0})
        await pool.execute(
            "UPDATE outbox_events SET available_at = now() - interval '2 minutes' WHERE id = $1",
            late,
        )
        consumer = aiooutbox.OutboxConsumer(
            pool,
            concurrency=4,
            poll_interval=0.2,
            retry=aiooutbox.RetryPolicy(base=0.05, max_delay=0.05, jitter=0.0),
        )
        handlers: dict[str, Any] = {"emails.send": flaky, HOSTILE_TOPIC: hopeless, "late": flaky}
        async with running(consumer, handlers):
            await wait_until(lambda: _statuses(pool, {"done": 7, "dead": 1}), timeout=60)
        # the last flush at the stop wrote what was counted
        counted = await minutes(pool)
        assert counted["emails.send"]["done"] == 6
        assert counted["emails.send"]["retried"] == 2
        assert counted["emails.send"]["dead"] == 0
        assert counted[HOSTILE_TOPIC]["dead"] == 1 and counted[HOSTILE_TOPIC]["done"] == 0
        assert counted["emails.send"]["claimed"] == 8  # 5 + 3 attempts
        assert 120 <= counted["late"]["lag_max"] < 600
        assert counted["late"]["claimed"] == 1
        history: dict[int | None, tuple[Any, str]] = {
            r["id"]: (json.loads(r["failures"]) if r["failures"] else None, r["status"])
            for r in await pool.fetch(
                "SELECT id, failures::text AS failures, status::text AS status"
                " FROM outbox_events_all"
            )
        }
        # the success path wrote no history
        assert all(history[i] == (None, "done") for i in [*ok, late])
        entries, status = history[twice]
        assert status == "done"
        assert [e["attempt"] for e in entries] == [1, 2]
        assert [e["outcome"] for e in entries] == ["retry", "retry"]
        assert entries[0]["error"].startswith(f"RuntimeError: try 1 of {twice}: <b>no</b> \u2603")
        assert all(e["worker"] == consumer.worker_id for e in entries)
        assert all(0 <= e["seconds"] < 30 for e in entries)
        assert entries[0]["at"] <= entries[1]["at"]
        [died], status = history[dead]
        assert status == "dead" and died["outcome"] == "dead"
        assert "the mail server said no" in died["error"]
    finally:
        await pool.close()


async def _statuses(pool: asyncpg.Pool, expected: dict[str, int]) -> bool:
    return await status_counts(pool) == expected


async def test_lease_recovery_adds_the_attempt_cut_short_and_the_history_is_bounded(
    dsn: str,
) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=6)
    try:
        # a claim of a consumer that vanished (its lease long expired), twelve times over
        event_id = await aiooutbox.enqueue(pool, "crashy", {}, max_attempts=20)
        for attempt in range(1, 13):
            await pool.execute(
                "UPDATE outbox_events SET status = 'processing', attempts = $2,"
                " locked_by = 'gone-worker', locked_at = now() - interval '1 minute',"
                " lease_expires_at = now() - interval '1 second' WHERE id = $1",
                event_id,
                attempt,
            )
            await pool.fetch("SELECT * FROM outbox_events_requeue_v5(NULL, '{}', 10, 'gone')")
        entries = json.loads(
            await pool.fetchval(
                "SELECT failures::text FROM outbox_events_all WHERE id = $1", event_id
            )
        )
        assert [e["attempt"] for e in entries] == list(range(3, 13))  # the last ten
        assert {e["worker"] for e in entries} == {"gone-worker"}
        assert all(59 <= e["seconds"] < 120 for e in entries)
        # a running consumer recovers one more: counted as retried in its topic's minute
        await pool.execute(
            "UPDATE outbox_events SET status = 'processing', attempts = 13,"
            " locked_by = 'gone-worker', locked_at = now(),"
            " lease_expires_at = now() - interval '1 second' WHERE id = $1",
            event_id,
        )
        seen = asyncio.Event()

        async def handle(event: aiooutbox.Event) -> None:
            seen.set()

        consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.2, lease_timeout=2.0)
        async with running(consumer, {"crashy": handle}):
            await asyncio.wait_for(seen.wait(), 30)
        counted = await minutes(pool)
        assert counted["crashy"]["retried"] == 1 and counted["crashy"]["done"] == 1
        entries = json.loads(
            await pool.fetchval(
                "SELECT failures::text FROM outbox_events_all WHERE id = $1", event_id
            )
        )
        assert len(entries) == 10 and entries[-1]["attempt"] == 13
        assert entries[-1]["error"].startswith("lease expired")
    finally:
        await pool.close()


async def test_counts_are_flushed_while_running_on_the_quarter_minute(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rollups_module, "FLUSH_EVERY", 1.0)
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=6)

    async def handle(event: aiooutbox.Event) -> None:
        pass

    try:
        consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.2)
        async with running(consumer, {"t": handle}):
            for i in range(20):
                await aiooutbox.enqueue(pool, "t", {"i": i})

            async def flushed() -> bool:
                found = await minutes(pool)
                return found.get("t", {}).get("done") == 20

            await wait_until(flushed, timeout=30)
            # one row per topic and minute, whatever the number of events
            assert (await minutes(pool))["t"]["minutes"] <= 2
    finally:
        await pool.close()


async def test_minutes_past_the_retention_are_deleted(dsn: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    try:
        await pool.execute(
            "INSERT INTO outbox_events_rollups (minute, topic, done) VALUES"
            " (date_trunc('minute', now() - interval '9 days'), 'old', 5),"
            " (date_trunc('minute', now() - interval '7 days'), 'kept', 5)"
        )
        options = aiooutbox.OutboxConsumer(pool).options
        writer = rollups_module.Rollups(pool, options, rollups_module.Tallies())
        writer._next_purge = 0.0
        await writer.flush()
        assert set(await minutes(pool)) == {"kept"}
    finally:
        await pool.close()


async def test_a_role_without_the_grant_warns_once_and_consumes(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    role = f"aiooutbox_consumer_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(f'CREATE ROLE "{role}" LOGIN')
        for statement in documented_grants("consumer", role):
            if "outbox_events_rollups" not in statement:
                await admin.execute(statement)
        for i in range(3):
            await aiooutbox.enqueue(admin, "t", {"i": i})
        caplog.set_level(logging.WARNING, logger="aiooutbox")

        async def handle(event: aiooutbox.Event) -> None:
            pass

        async with asyncpg.create_pool(as_user(dsn, role), min_size=1, max_size=4) as pool:
            consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.2)
            async with running(consumer, {"t": handle}):
                await wait_until(lambda: _statuses(pool, {"done": 3}), timeout=30)
            # and its stop (the last flush) did not warn again
        warned = [r.getMessage() for r in caplog.records if "per-minute counts" in r.getMessage()]
        table = '"public"."outbox_events_rollups"'
        grant = f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {role}"
        assert len(warned) == 1 and grant in warned[0] and "\n" not in warned[0], warned
        assert await admin.fetchval("SELECT count(*) FROM outbox_events_rollups") == 0
    finally:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role
        )
        await admin.execute(f'DROP OWNED BY "{role}"')
        await admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        await admin.close()


async def test_a_relays_events_are_counted(dsn: str) -> None:
    from tests.relay.brokers import REDIS_URL
    from tests.relay.common import RelayProcess

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=3)
    relay = None
    try:
        stream = f"dash-rollups-{uuid.uuid4().hex[:10]}"
        for i in range(5):
            await aiooutbox.enqueue(pool, "relayed", {"i": i})
        relay = RelayProcess(dsn, REDIS_URL, "--destination", stream)
        await wait_until(lambda: _statuses(pool, {"done": 5}), timeout=60)
        assert await relay.stop() == 0, relay.stderr()
        relay = None
        # the relay's last flush at its stop wrote them
        counted = await minutes(pool)
        assert counted["relayed"]["done"] == 5 and counted["relayed"]["claimed"] == 5
    finally:
        if relay is not None:
            relay.kill()
        await pool.close()
