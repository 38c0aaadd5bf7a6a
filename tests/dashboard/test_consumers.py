"""What the dashboard shows about consumers comes from what they record: leases held
(with their expiry, which the heartbeat renews), idle adverts, and the LISTEN session."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

import aiooutbox
from aiooutbox.web import create_app
from aiooutbox.web._live import LiveHub
from tests.helpers import running, wait_until
from tests.programs import needs
from tests.test_roles import as_user, documented_grants


async def test_a_running_consumer_its_leases_and_its_listener(dsn: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    release = asyncio.Event()

    async def slow(event: aiooutbox.Event) -> None:
        await release.wait()

    try:
        consumer = aiooutbox.OutboxConsumer(pool, concurrency=2, worker_id="busy-worker-1")
        idle = aiooutbox.OutboxConsumer(pool, concurrency=1, worker_id="idle-worker-2")
        async with running(consumer, {"slow": slow}), running(idle, {"other": slow}):
            await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("slow", {}) for _ in range(3)])

            async def held() -> bool:
                n = await pool.fetchval(
                    "SELECT count(*) FROM outbox_events_all WHERE status = 'processing'"
                )
                return bool(n == 2)

            await wait_until(held)
            await wait_until(lambda: _advertised(pool, "idle-worker-2"))
            app = create_app(pool=pool, read_only=True)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                page = (await client.get("/consumers")).text
            await app.state.dashboard.aclose()
            busy = page[page.index("busy-worker-1") :].split("</tr>")[0]
            assert "<td>2</td>" in busy  # leases held
            assert "in " in busy  # when its newest lease expires
            waiting = page[page.index("idle-worker-2") :].split("</tr>")[0]
            assert "waiting on LISTEN" in waiting and "other" in waiting
            # both consumers' LISTEN sessions, seen in pg_stat_activity
            listeners = page[page.index("Listener connections") :]
            assert listeners.count("<tr><td>") >= 2, listeners[:2000]
            release.set()
    finally:
        release.set()
        await pool.close()


async def _advertised(pool: asyncpg.Pool, worker: str) -> bool:
    return bool(
        await pool.fetchval("SELECT count(*) FROM outbox_events_idle WHERE worker_id = $1", worker)
    )


KILLED = """
import asyncio, sys
import asyncpg, aiooutbox

async def main() -> None:
    pool = await asyncpg.create_pool(sys.argv[1], min_size=1, max_size=2)
    consumer = aiooutbox.OutboxConsumer(
        pool, concurrency=5, worker_id="killed-worker", lease_timeout=2.0, poll_interval=0.2
    )
    async def nothing(event: aiooutbox.Event) -> None:
        pass
    async with consumer:
        task = asyncio.ensure_future(consumer.run({"c": nothing}))
        await consumer.wait_started()
        print("started", flush=True)
        await task

asyncio.run(main())
"""


async def _registered(pool: asyncpg.Pool) -> dict[str, tuple[int, int, float]]:
    rows = await pool.fetch(
        "SELECT worker_id, concurrency, prefetch,"
        " extract(epoch FROM (expires_at - now()))::float8 FROM outbox_events_consumers"
    )
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


@pytest.mark.slow
@needs("chromium")
async def test_the_consumers_page_shows_what_each_consumer_was_started_with(
    dsn: str, tmp_path: Path
) -> None:
    """Two live consumers with different settings show their own concurrency, prefetch,
    topics, host and pid in the browser; one stopped cleanly disappears; one killed
    shows as gone once its heartbeat stops (lease_timeout 2 s)."""
    from tests.dashboard.browser import browser_page, screenshot
    from tests.dashboard.server import dashboard

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=6)
    killed = await asyncio.create_subprocess_exec(
        sys.executable, "-c", KILLED, dsn, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert killed.stdout is not None
        line = await asyncio.wait_for(killed.stdout.readline(), 30)
        assert line.strip() == b"started", line
        small = aiooutbox.OutboxConsumer(pool, concurrency=3, prefetch=5, worker_id="small-3")
        big = aiooutbox.OutboxConsumer(
            pool, concurrency=11, prefetch=0, topics=["b"], worker_id="big-11"
        )
        leaving = aiooutbox.OutboxConsumer(pool, concurrency=2, worker_id="leaving-2")
        async with (
            running(small, {"a": _nothing}),
            running(big, {"a": _nothing, "b": _nothing}),
        ):
            async with running(leaving, {"a": _nothing}):
                await leaving.wait_started()
                await small.wait_started()
                await big.wait_started()
                seen = await _registered(pool)
                assert seen["small-3"][:2] == (3, 5) and seen["big-11"][:2] == (11, 0), seen
                assert seen["leaving-2"][0] == 2 and "killed-worker" in seen, seen
            # a clean stop removes its row at once
            assert "leaving-2" not in await _registered(pool)
            killed.kill()
            await killed.wait()
            await wait_until(lambda: _expired(pool, "killed-worker"), timeout=60)
            async with dashboard(dsn, "--read-only") as d, browser_page() as w:
                await w.page.goto(d.at("/consumers"))
                rows = w.page.locator("table.workers tr.worker")

                def cell(worker: str, name: str) -> Any:
                    return w.page.locator(f'tr[data-worker="{worker}"] td.{name}')

                assert await cell("small-3", "concurrency").inner_text() == "3"
                assert await cell("small-3", "prefetch").inner_text() == "5"
                assert await cell("big-11", "concurrency").inner_text() == "11"
                assert await cell("big-11", "prefetch").inner_text() == "0"
                assert await cell("small-3", "state").inner_text() == "alive"
                assert await cell("big-11", "state").inner_text() == "alive"
                big_row = await w.page.locator('tr[data-worker="big-11"]').inner_text()
                assert f"{socket.gethostname()}:{os.getpid()}" in big_row, big_row
                assert "\tb\t" in big_row, big_row  # its topics
                assert await cell("killed-worker", "state").inner_text() == "gone"
                assert await cell("killed-worker", "concurrency").inner_text() == "5"
                killed_row = await w.page.locator('tr[data-worker="killed-worker"]').inner_text()
                assert "in in" not in killed_row and "expired" in killed_row, killed_row
                assert await w.page.locator('tr[data-worker="leaving-2"]').count() == 0
                assert await rows.count() == 3, await w.page.inner_text("table.workers")
                assert w.dialogs == []
                await screenshot(w.page, "consumers", tmp_path)
    finally:
        if killed.returncode is None:
            killed.kill()
            await killed.wait()
        await pool.close()


async def _nothing(event: aiooutbox.Event) -> None:
    pass


async def _expired(pool: asyncpg.Pool, worker: str) -> bool:
    """Its registry row and its idle advert (if it left one) have both expired: they
    expire on clocks of their own, a beat apart."""
    row = (await _registered(pool)).get(worker)
    advert_left = await pool.fetch(
        "SELECT 1 FROM outbox_events_idle WHERE worker_id = $1 AND expires_at >= now()", worker
    )
    return row is not None and row[2] < 0 and not advert_left


async def test_a_viewer_without_select_on_the_registry_still_sees_the_page(dsn: str) -> None:
    """The grants the previous release gave the viewer (no SELECT on the registry): the
    consumers page renders, from leases and idle adverts, and names the missing GRANT."""
    role = f"old_viewer_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(f'CREATE ROLE "{role}" LOGIN')
        for statement in documented_grants("viewer", role):
            await admin.execute(statement.replace(", public.outbox_events_consumers", ""))
        await admin.execute(
            "INSERT INTO outbox_events_idle (worker_id, topics, expires_at)"
            " VALUES ('idle-one', '{t}', now() + interval '1 hour')"
        )
        pool = await asyncpg.create_pool(as_user(dsn, role), min_size=1, max_size=2)
        try:
            app = create_app(pool=pool, read_only=True)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                consumers = await client.get("/consumers")
                overview = await client.get("/")
            await app.state.dashboard.aclose()
        finally:
            await pool.close()
        for page in (consumers, overview):
            assert page.status_code == 200, page.text[-1000:]
            assert "idle-one" in page.text
            assert "may not read outbox_events_consumers: GRANT SELECT" in page.text
    finally:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role
        )
        await admin.execute(f'DROP OWNED BY "{role}"')
        await admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        await admin.close()


async def test_a_consumer_starting_and_stopping_moves_the_pulse(dsn: str) -> None:
    """Open pages refresh when a consumer registers or leaves (its row's insert and
    delete), though nothing else in the outbox changed; its heartbeats do not."""
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    app = create_app(pool=pool, read_only=True)
    hub: LiveHub = app.state.dashboard.hub
    try:
        before = await hub.read_pulse()
        consumer = aiooutbox.OutboxConsumer(pool, worker_id="pulse-mover", lease_timeout=3.0)
        async with running(consumer, {"t": _nothing}):
            await consumer.wait_started()

            async def moved() -> bool:
                return bool(await hub.read_pulse() != before)

            await wait_until(moved, timeout=15)
            registered = await hub.read_pulse()
            assert registered.split(".")[:3] == before.split(".")[:3], (before, registered)
        stopped = registered

        async def moved_again() -> bool:
            nonlocal stopped
            stopped = await hub.read_pulse()
            return bool(stopped != registered)

        await wait_until(moved_again, timeout=15)
        assert int(stopped.split(".")[3]) > int(registered.split(".")[3]), (registered, stopped)
    finally:
        await app.state.dashboard.aclose()
        await pool.close()
