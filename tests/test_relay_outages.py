"""Relays through broker outages: the broker down for 10 s mid-relay (stopped, or frozen
with SIGSTOP), every row done, no attempt spent, nothing lost. Apart from the SIGKILL
tests in test_relay_faults.py so the two long files run on two workers."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

import asyncpg
import nats
import pytest

from aiooutbox.relay import KafkaSink, NatsSink, RabbitMQSink, Sink
from tests.programs import needs
from tests.relay.brokers import PrivateNats, PrivateRabbit, tansu
from tests.relay.common import (
    counts,
    fill,
    kafka_read,
    kafka_topic,
    message_ids,
    nats_stream,
    rabbit_read,
    relaying,
    wait_done,
)

pytestmark = pytest.mark.slow

# -- the broker down for 10 s mid-relay -------------------------------------------------------
OUTAGE = 10.0


async def through_outage(
    pool: asyncpg.Pool, sink: Sink, stop: Callable[[], Any], start: Callable[[], Any]
) -> int:
    """Produce events steadily while the relay runs; take the broker away for 10 s in
    the middle. Returns how many events were produced. The outage costs no attempt:
    publishes wait for the connection (``reconnect_wait``) instead of failing."""
    produced = 0
    producing = True

    async def produce() -> None:
        nonlocal produced
        while producing:
            await fill(pool, 10, first=produced)
            produced += 10
            await asyncio.sleep(0.1)  # 100 events/s: well below what a relay keeps up with

    async with relaying(pool, sink, concurrency=64):
        producer = asyncio.ensure_future(produce())
        try:
            await wait_done(pool, 200)
            await asyncio.to_thread(stop)
            down = time.monotonic()
            await asyncio.sleep(OUTAGE / 2)
            held = (await counts(pool)).get("processing", 0)
            await asyncio.sleep(OUTAGE / 2)
            await asyncio.to_thread(start)
            print(f"broker down for {time.monotonic() - down:.1f}s")
            await asyncio.sleep(1)
        finally:
            producing = False
            await producer
        began = time.monotonic()
        await wait_done(pool, produced, timeout=120)
        print(f"caught up {time.monotonic() - began:.1f}s after the broker came back")
    statuses = await counts(pool)
    assert statuses == {"done": produced}, statuses
    attempts = collections.Counter(
        r[0] for r in await pool.fetch("SELECT attempts FROM outbox_events_all")
    )
    assert attempts == {1: produced}, f"the outage cost attempts: {attempts}"
    assert held > 0, "no event was in flight during the outage"
    print(f"events held mid-outage: {held}; publishes repeated: {sink.republished}")
    return produced


@needs("nats-server")
async def test_nats_outage_10s(pool: asyncpg.Pool) -> None:
    broker = PrivateNats()
    broker.start()
    try:
        nc = await nats.connect(broker.url)
        js = nc.jetstream()
        await nats_stream(js, "OUTAGE", ["orders.>"])
        sink = NatsSink(broker.url, reconnect_wait=60)
        produced = await through_outage(pool, sink, broker.stop, broker.start)
        await nc.flush()
        info = await js.stream_info("OUTAGE")
        assert info.state.messages == produced  # dedupe by Nats-Msg-Id: exactly once
        await nc.close()
    finally:
        broker.destroy()


@needs("rabbitmq-server")
async def test_rabbitmq_outage_10s(pool: asyncpg.Pool) -> None:
    import aio_pika

    broker = PrivateRabbit()
    broker.start()
    try:
        async with await aio_pika.connect(broker.url) as connection:
            channel = await connection.channel()
            await channel.declare_queue("outage", durable=True)
        sink = RabbitMQSink(broker.url, destination="outage", reconnect_wait=90)
        produced = await through_outage(pool, sink, broker.stop, broker.start)
        found = await rabbit_read(broker.url, "outage", produced, timeout=60)
        ids = [m.message_id for m in found]
        assert set(ids) == await message_ids(pool)
        print(f"duplicates after the outage: {len(ids) - len(set(ids))}")
    finally:
        broker.destroy()


@needs("tansu")
async def test_kafka_outage_10s(pool: asyncpg.Pool) -> None:
    """Tansu keeps its data in memory, so this outage freezes it (SIGSTOP) rather than
    restarting it: connections hang, requests time out, the client reconnects."""
    with tansu() as broker:
        await kafka_topic(broker.bootstrap, "outage")
        sink = KafkaSink(
            broker.bootstrap,
            destination="outage",
            enable_idempotence=False,
            publish_timeout=3,
            reconnect_wait=60,
        )
        produced = await through_outage(pool, sink, broker.pause, broker.resume)
        found = await kafka_read(broker.bootstrap, "outage", produced, timeout=60)
        ids = [dict(m.headers)["outbox-message-id"].decode() for m in found]
        assert set(ids) == await message_ids(pool)
        print(f"duplicates after the outage: {len(ids) - len(set(ids))}")
