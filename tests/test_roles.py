"""Least privilege: a producer and a consumer role with exactly the documented grants.

The GRANT statements are read from ``docs/guarantees.md`` (the blocks after the
``<!-- grants:producer -->`` and ``<!-- grants:consumer -->`` markers) and executed
here, so the documentation cannot drift from what works. Roles are cluster-wide: each
test creates uniquely named ones and drops them at the end.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

import aiooutbox
import aiooutbox.admin
from tests.helpers import insert_unchecked

DOCS = Path(__file__).resolve().parents[1] / "docs" / "guarantees.md"


def documented_grants(kind: str, role: str) -> list[str]:
    """The SQL statements of the documented grant block for ``kind``, for ``role``."""
    text = DOCS.read_text(encoding="utf-8")
    match = re.search(rf"<!-- grants:{kind} -->\s*```sql\n(.*?)```", text, re.S)
    assert match, f"docs/guarantees.md has no grants:{kind} block"
    body = "\n".join(
        line for line in match.group(1).splitlines() if not line.lstrip().startswith("--")
    )
    statements = [s.strip() for s in body.split(";") if s.strip()]
    assert statements
    return [s.replace(f"outbox_{kind}", role) for s in statements]


def as_user(dsn: str, user: str) -> str:
    parts = urlsplit(dsn)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


class Roles:
    def __init__(self) -> None:
        suffix = uuid.uuid4().hex[:10]
        self.producer = f"aiooutbox_producer_{suffix}"
        self.consumer = f"aiooutbox_consumer_{suffix}"


@pytest.fixture
async def roles(dsn: str) -> AsyncIterator[Roles]:
    names = Roles()
    admin = await asyncpg.connect(dsn)
    try:
        for role in (names.producer, names.consumer):
            await admin.execute(f'CREATE ROLE "{role}" LOGIN')
        for statement in documented_grants("producer", names.producer):
            await admin.execute(statement)
        for statement in documented_grants("consumer", names.consumer):
            await admin.execute(statement)
        yield names
    finally:
        for role in (names.producer, names.consumer):
            # privileges in this database first, then the cluster-wide role itself
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role
            )
            await admin.execute(f'DROP OWNED BY "{role}"')
            await admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        await admin.close()


async def test_grant_blocks_are_documented() -> None:
    assert any("GRANT INSERT" in s for s in documented_grants("producer", "p"))
    assert any("GRANT SELECT, UPDATE, DELETE" in s for s in documented_grants("consumer", "c"))


async def test_producer_needs_insert_and_two_readable_columns(dsn: str, roles: Roles) -> None:
    conn = await asyncpg.connect(as_user(dsn, roles.producer))
    try:
        # enqueue joins the caller's transaction, as in the application
        async with conn.transaction():
            first = await aiooutbox.enqueue(conn, "orders.created", {"n": 1}, dedupe_key="k1")
        assert isinstance(first, int)
        assert await aiooutbox.enqueue(conn, "orders.created", {"n": 1}, dedupe_key="k1") is None
        ids = await aiooutbox.enqueue_many(
            conn, [aiooutbox.NewEvent("orders.created", {"n": i}) for i in range(5)]
        )
        assert all(isinstance(i, int) for i in ids)
        # the identity column needs no grant on its sequence
        sequence_usage = await conn.fetchval(
            "SELECT has_sequence_privilege(pg_get_serial_sequence('public.outbox_events', 'id'),"
            " 'USAGE')"
        )
        assert sequence_usage is False
        # ...and nothing else: no payloads, no state changes, no schema changes
        denied = [
            "SELECT payload FROM outbox_events",
            "SELECT count(*) FROM outbox_events_idle",
            "UPDATE outbox_events SET status = 'done'",
            "DELETE FROM outbox_events",
        ]
        for statement in denied:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(statement)
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await aiooutbox.migrate(conn, schema="public", table="other_outbox")
    finally:
        await conn.close()


async def test_insert_alone_is_not_enough_for_enqueue(dsn: str) -> None:
    """Why the producer grant reads ``id`` and ``dedupe_key``: RETURNING and ON CONFLICT."""
    role = f"aiooutbox_insert_only_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(f'CREATE ROLE "{role}" LOGIN')
        await admin.execute(f'GRANT USAGE ON SCHEMA public TO "{role}"')
        await admin.execute(f'GRANT INSERT ON public.outbox_events TO "{role}"')
        conn = await asyncpg.connect(as_user(dsn, role))
        try:
            await conn.execute("INSERT INTO outbox_events (topic, payload) VALUES ('t', '{}')")
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await aiooutbox.enqueue(conn, "t", {})
        finally:
            await conn.close()
    finally:
        await admin.execute(f'DROP OWNED BY "{role}"')
        await admin.execute(f'DROP ROLE "{role}"')
        await admin.close()


async def test_consumer_role_runs_a_real_consumer(dsn: str, roles: Roles) -> None:
    """Claims, retries, settles, heartbeats, recovers, purges and listens with its grants."""
    admin = await asyncpg.connect(dsn)
    producer = await asyncpg.connect(as_user(dsn, roles.producer))
    try:
        # an old done row for retention to delete, and an expired lease to recover
        await insert_unchecked(
            admin,
            "INSERT INTO outbox_events (topic, payload, status, finished_at)"
            " VALUES ('orders.created', '{}', 'done', now() - interval '2 days')",
        )
        await insert_unchecked(
            admin,
            "INSERT INTO outbox_events (topic, payload, status, attempts, locked_by,"
            " locked_at, lease_expires_at)"
            " VALUES ('orders.created', '{\"stale\": true}', 'processing', 1, 'gone',"
            " now() - interval '1 minute', now() - interval '1 second')",
        )
        await aiooutbox.enqueue_many(
            producer, [aiooutbox.NewEvent("orders.created", {"n": i}) for i in range(20)]
        )
        seen: dict[int, float] = {}

        async def handle(event: aiooutbox.Event) -> None:
            if event.payload.get("n") == 3 and event.attempts == 1:
                raise RuntimeError("first attempt fails")
            seen[event.id] = time.monotonic()

        async with asyncpg.create_pool(
            as_user(dsn, roles.consumer), min_size=1, max_size=4
        ) as pool:
            consumer = aiooutbox.OutboxConsumer(
                pool,
                poll_interval=30,
                lease_timeout=3,
                retention=86400,
                retry=aiooutbox.RetryPolicy(base=0.05, max_delay=0.1),
            )
            async with consumer:
                task = asyncio.ensure_future(consumer.run({"orders.created": handle}))

                async def settled() -> bool:
                    left = await admin.fetchval(
                        "SELECT count(*) FROM outbox_events WHERE status <> 'done'"
                    )
                    return bool(left == 0 and len(seen) == 21)

                await _wait(settled, 20, "the backlog")
                # the wake-up trigger runs as the table owner: an insert by the producer
                # role reaches a consumer that idles on LISTEN, long before its 30 s poll
                await _wait(_idle_probe(consumer), 10, "the consumer to idle")
                probe = await aiooutbox.enqueue(producer, "orders.created", {"probe": True})
                sent = time.monotonic()
                assert probe is not None
                await _wait(_async(lambda: probe in seen), 10, "the probe")
                latency = seen[probe] - sent
                consumer.stop()
                await asyncio.wait_for(task, 20)
            # a consumer role cannot produce or migrate unless granted more
            async with pool.acquire() as conn:
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await aiooutbox.enqueue(conn, "orders.created", {})
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await aiooutbox.migrate(conn, schema="public", table="other_outbox")
            counts = dict(
                await admin.fetch("SELECT status::text, count(*) FROM outbox_events_all GROUP BY 1")
            )
            # 20 + the recovered stale row + the probe; the old done row was purged
            assert counts == {"done": 22}
            assert consumer.stats.recovered == 1
            assert latency < 3.0

            # the operator's tools work with the consumer's grants
            dead = [
                (
                    await insert_unchecked(
                        admin,
                        "INSERT INTO outbox_events (topic, payload, status, attempts,"
                        " finished_at) VALUES ('orders.created', '{}', 'dead', 5,"
                        " now() - interval '40 days') RETURNING id",
                    )
                )[0]["id"]
                for _ in range(2)
            ]
            report = await aiooutbox.admin.stats(pool)
            assert report.dead == 2
            assert len(await aiooutbox.admin.dead_list(pool)) == 2
            assert await aiooutbox.admin.dead_retry(pool, ids=[dead[0]]) == {"orders.created": 1}
            assert await aiooutbox.admin.dead_purge(pool, ids=[dead[1]]) == 1
            assert await aiooutbox.admin.purge(pool, older_than=0) == 22
            counts = dict(
                await admin.fetch("SELECT status::text, count(*) FROM outbox_events_all GROUP BY 1")
            )
            assert counts == {"pending": 1}
    finally:
        await producer.close()
        await admin.close()


async def _wait(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _async(predicate: object) -> object:
    async def wrapped() -> bool:
        return bool(predicate())  # type: ignore[operator]

    return wrapped


def _idle_probe(consumer: aiooutbox.OutboxConsumer) -> object:
    async def idle() -> bool:
        if not consumer.listening or consumer.stats.in_flight:
            return False
        claims = consumer.stats.claims
        await asyncio.sleep(0.3)
        return consumer.stats.claims == claims

    return idle


async def test_viewer_role_reads_the_read_only_dashboard_and_changes_nothing(dsn: str) -> None:
    """The documented viewer grants are enough for every dashboard page (read-only) and
    for `stats`; a write is refused by PostgreSQL itself."""
    import httpx

    from aiooutbox.web import create_app

    role = f"aiooutbox_viewer_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(f'CREATE ROLE "{role}" LOGIN')
        for statement in documented_grants("viewer", role):
            await admin.execute(statement)
        [dead, *_] = await aiooutbox.enqueue_many(
            admin, [aiooutbox.NewEvent("t", {"n": i}, ordering_key="k") for i in range(3)]
        )
        assert dead is not None
        await admin.execute(
            "UPDATE outbox_events SET status = 'dead', blocks_key = true WHERE id = $1", dead
        )
        await admin.execute(
            "INSERT INTO outbox_events_consumers (worker_id, host, pid, concurrency, prefetch,"
            " lease_timeout, version, expires_at)"
            " VALUES ('registered-7', 'h', 1, 7, 0, 30, 'v', now() + interval '1 minute')"
        )
        pool = await asyncpg.create_pool(as_user(dsn, role), min_size=1, max_size=2)
        try:
            app = create_app(pool=pool, read_only=True)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                for path in (
                    "/",
                    "/events",
                    f"/events/{dead}",
                    "/dead",
                    "/keys",
                    "/consumers",
                    "/audit",
                    "/events?status=dead&topic=t",
                ):
                    r = await client.get(path)
                    assert r.status_code == 200, (path, r.text[-2000:])
                    if path == "/consumers":  # the registry is readable: concurrency shown
                        assert '<td class="concurrency">7</td>' in r.text, r.text[-3000:]
                        assert "may not read" not in r.text
            await app.state.dashboard.aclose()
            assert (await aiooutbox.admin.stats(pool)).topics
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await aiooutbox.admin.dead_retry(pool, ids=[dead])
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await pool.execute(
                    "INSERT INTO outbox_events_audit (actor, action, affected) VALUES ('x', 'y', 0)"
                )
        finally:
            await pool.close()
    finally:
        await admin.execute(f'DROP OWNED BY "{role}"')
        await admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        await admin.close()
