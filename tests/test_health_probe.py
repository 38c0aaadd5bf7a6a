"""`ConsumerHealth`'s ``SELECT 1`` probe against a real server through a proxy this test
owns: one probe in flight however many checks ask, and a short bound of its own."""

from __future__ import annotations

import asyncio
import time

import asyncpg

import aiooutbox
from aiooutbox.health import ConsumerHealth
from tests.faults.proxy import TCPProxy
from tests.helpers import running, truthy, wait_until


async def test_concurrent_checks_share_one_probe_and_a_stall_is_bounded(
    dsn: str, pool: asyncpg.Pool
) -> None:
    probes: list[float] = []

    def logged(query: asyncpg.connection.LoggedQuery) -> None:
        if query.query == "SELECT 1":
            probes.append(query.elapsed)

    async def init(conn: asyncpg.Connection) -> None:
        conn.add_query_logger(logged)

    release = asyncio.Event()

    async def hold(event: aiooutbox.Event) -> None:
        await release.wait()

    await aiooutbox.enqueue(pool, "t", {})
    with TCPProxy.for_dsn(dsn) as proxy:
        async with asyncpg.create_pool(
            proxy.proxied(dsn), min_size=1, max_size=10, init=init
        ) as proxied:
            health = ConsumerHealth(max_silence=0.2)
            consumer = aiooutbox.OutboxConsumer(
                proxied, concurrency=1, listen=False, observers=[health]
            )
            async with consumer, running(consumer, {"t": hold}):
                await wait_until(truthy(lambda: consumer.stats.in_flight == 1))
                await asyncio.sleep(0.3)  # past max_silence, every slot busy: a probe is due
                await asyncio.sleep(1.1)  # and no probe cached
                # a slow database: the probes wait on a stalled path, then it flows again
                proxy.stall()
                checks = [asyncio.ensure_future(health.check()) for _ in range(8)]
                await asyncio.sleep(1.0)
                proxy.restore()
                answers = await asyncio.gather(*checks)
                assert all(a.ok and a.details["probe"] == "answered" for a in answers), answers
                assert len(probes) == 1, probes  # one SELECT 1 for the eight checks

                # a stall longer than the probe's bound (3 s, not statement_timeout's 10 s)
                await asyncio.sleep(1.1)
                proxy.stall()
                started = time.monotonic()
                answer = await health.check()
                took = time.monotonic() - started
                proxy.restore()
                assert not answer.ok and 2.5 < took < 6, (took, answer)
                assert "the database did not answer within 3s" in answer.reason, answer
                release.set()
