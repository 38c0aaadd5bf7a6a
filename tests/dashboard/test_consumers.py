"""What the dashboard shows about consumers comes from what they record: leases held
(with their expiry, which the heartbeat renews), idle adverts, and the LISTEN session."""

from __future__ import annotations

import asyncio

import asyncpg
import httpx

import aiooutbox
from aiooutbox.web import create_app
from tests.helpers import running, wait_until


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
                    "SELECT count(*) FROM outbox_events WHERE status = 'processing'"
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
