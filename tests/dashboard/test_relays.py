"""The consumers page's relays table, with real relays: two ``python -m aiooutbox relay``
processes publishing to the machine's Redis, one for two topics and one for every topic.
Each row shows its relay's destination (from the worker id the relay gives itself) and
its lag, the age of the oldest due event of its topics, as SQL measures it."""

from __future__ import annotations

import uuid

import asyncpg
import pytest
import redis.asyncio as aioredis

import aiooutbox
from aiooutbox import admin
from aiooutbox.web._data import age
from tests.dashboard.browser import browser_page
from tests.dashboard.server import dashboard
from tests.helpers import wait_until
from tests.programs import needs
from tests.relay.brokers import REDIS_URL
from tests.relay.common import RelayProcess

pytestmark = pytest.mark.slow

HELD = "relay.held"  # paused: its events wait, so its lag grows
FLOWING = "relay.flowing"


@needs("chromium")
async def test_the_relays_table_shows_each_relays_destination_and_lag(dsn: str) -> None:
    prefix = f"dash-{uuid.uuid4().hex[:10]}"
    named = f"{prefix}-{{topic}}"  # the two-topic relay's Redis streams
    every = f"{prefix}-all"  # the every-topic relay's one stream
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=3)
    relays: list[RelayProcess] = []
    try:
        await admin.pause_topic(pool, HELD, actor="test")
        ids = [await aiooutbox.enqueue(pool, HELD, {"n": i}) for i in range(3)]
        # waiting since three hours ago (as if paused then): a lag no clock step blurs
        await pool.execute(
            "UPDATE outbox_events SET available_at = now() - interval '3 hours',"
            " created_at = now() - interval '3 hours' WHERE id = ANY($1::bigint[])",
            ids,
        )
        relays.append(
            RelayProcess(dsn, REDIS_URL, "--topics", f"{HELD},{FLOWING}", "--destination", named)
        )
        relays.append(RelayProcess(dsn, REDIS_URL, "--destination", every))
        # they relay: the flowing topic's events reach Redis and end done
        for i in range(4):
            await aiooutbox.enqueue(pool, FLOWING, {"n": i})
        await wait_until(lambda: _relayed(pool, 4), timeout=60)

        async def both_registered() -> bool:
            return len(await _relay_rows(pool)) == 2

        await wait_until(both_registered, timeout=60)
        registered = await _relay_rows(pool)
        async with dashboard(dsn, "--read-only") as d, browser_page() as w:
            lag_before = await _lag(pool)
            await w.page.goto(d.at("/consumers"))
            lag_after = await _lag(pool)
            rows = w.page.locator("table.relays tr.relay")
            assert await rows.count() == 2, await w.page.inner_text("main")
            for worker_id, topics in registered.items():
                row = w.page.locator(f'table.relays tr[data-relay="{worker_id}"]')
                destination = await row.locator("td.destination").inner_text()
                shown_topics = await row.locator("td.topics").inner_text()
                lag = await row.locator("td.lag").inner_text()
                # the destination is what the relay put in its worker id, i.e. ours
                expected = f"redis:{named}" if topics else f"redis:{every}"
                assert destination == expected, (worker_id, destination)
                assert worker_id.startswith(f"relay {expected} @"), worker_id
                assert sorted(shown_topics.split(", ")) == (topics or ["*"]), shown_topics
                # both relays' topics include the held one, the only one with due events
                assert lag in (age(lag_before), age(lag_after)), (lag, lag_before, lag_after)
                assert lag.startswith("3h "), lag
            assert w.dialogs == []
        for relay in relays:
            assert await relay.stop() == 0, relay.stderr()
    finally:
        for relay in relays:
            if relay.proc.poll() is None:
                relay.kill()
        await pool.close()
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            keys = [k async for k in client.scan_iter(f"{prefix}-*")]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()


async def _relayed(pool: asyncpg.Pool, n: int) -> bool:
    done = await pool.fetchval(
        "SELECT count(*) FROM outbox_events_all WHERE topic = $1 AND status = 'done'", FLOWING
    )
    return bool(done == n)


async def _relay_rows(pool: asyncpg.Pool) -> dict[str, list[str] | None]:
    """The registered relays: worker id -> topics (None: every topic)."""
    rows = await pool.fetch(
        "SELECT worker_id, topics FROM outbox_events_consumers WHERE worker_id LIKE 'relay %'"
    )
    return {r[0]: None if r[1] is None else sorted(r[1]) for r in rows}


async def _lag(pool: asyncpg.Pool) -> float:
    """Seconds since the oldest due event of the relays' topics became available."""
    value = await pool.fetchval(
        "SELECT extract(epoch FROM (now() - min(available_at)))::float8 FROM outbox_events_all"
        " WHERE status IN ('pending', 'retry') AND available_at <= now()"
    )
    assert value is not None
    return float(value)
