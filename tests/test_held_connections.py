"""The claim loop and the settler keep their pooled connection while work keeps coming,
and give it back to the pool when they go idle (`HeldConnection`)."""

from __future__ import annotations

import asyncpg

import aiooutbox
from aiooutbox._sql.db import HeldConnection

from .helpers import all_in, running, truthy, wait_until


async def _noop(event: aiooutbox.Event) -> None:
    pass


async def _drain(dsn: str, events: int, max_size: int) -> tuple[int, int]:
    """Drain ``events`` no-op events on a pool of ``max_size``; return the pool's resets
    during the drain (one per connection given back) and the consumer's claims, once
    every pooled connection is back in the pool."""
    resets = 0

    async def reset(conn: asyncpg.Connection) -> None:
        nonlocal resets
        resets += 1
        await conn.reset()

    watch = await asyncpg.connect(dsn)  # outside the pool: its statements reset nothing
    try:
        await watch.execute(
            "INSERT INTO outbox_events (topic, payload)"
            " SELECT 't', jsonb_build_object('i', g) FROM generate_series(1, $1) g",
            events,
        )
        async with asyncpg.create_pool(dsn, min_size=1, max_size=max_size, reset=reset) as pool:
            # small claims: hundreds of them, so the start-up's and the periodic loops'
            # own borrowings (a dozen, whatever the drain's size) cannot pass for them
            consumer = aiooutbox.OutboxConsumer(
                pool, concurrency=32, batch_size=16, poll_interval=30
            )
            async with running(consumer, {"t": _noop}):
                await wait_until(all_in(watch, "done", events), 60)
                claims, drained = consumer.stats.claims, resets
                # idle: nothing stays borrowed (the MVCC watchdog and the heartbeat
                # borrow briefly; this waits for a moment when neither does)
                await wait_until(truthy(lambda: pool.get_idle_size() == pool.get_size()), 5)
    finally:
        await watch.close()
    return drained, claims


async def test_a_drain_keeps_its_connections_and_gives_them_back_when_idle(dsn: str) -> None:
    resets, claims = await _drain(dsn, 5000, max_size=10)
    # hundreds of claims and as many flushes: each gave its connection back (a reset: a
    # round trip, four statements on the server) before the claim loop and the settler
    # kept theirs; now the resets are the start-up's schema check and the other loops'
    # first rounds (12 here, at any drain size)
    assert claims >= 200, claims
    assert resets < claims / 10, (resets, claims)


async def test_a_small_pool_is_never_held_from(dsn: str) -> None:
    # with 3 connections, holding two would starve the heartbeat and the handlers' own
    # use of the pool: every claim gives its connection back, as before
    resets, claims = await _drain(dsn, 1000, max_size=3)
    assert resets >= claims, (resets, claims)


async def test_a_held_connection_whose_backend_died_is_replaced(dsn: str) -> None:
    # terminated while held between two statements: the next use gets a new connection
    # from the pool, without an error, and the pool's slot came back (not two holders)
    async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
        held = HeldConnection(pool, 5.0)
        async with held.use() as conn:
            first = await conn.fetchval("SELECT pg_backend_pid()")
        assert held.held
        await pool.execute("SELECT pg_terminate_backend($1)", first)
        await wait_until(truthy(lambda: pool.get_idle_size() == pool.get_size()), 10)
        async with held.use() as conn:
            second = await conn.fetchval("SELECT pg_backend_pid()")
        assert second != first
        await held.release()
        await wait_until(truthy(lambda: pool.get_idle_size() == pool.get_size()), 10)
