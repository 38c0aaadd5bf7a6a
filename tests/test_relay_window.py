"""The publish window (``max_in_flight``) and NatsSink's own PubAck matching, against
the real brokers: many publishes in flight on one connection, each settled by its own
ack, a failure among them settling only its own event, order per key through the
window, PubAcks that never come failing after ``publish_timeout``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import nats
import pytest

import aiooutbox
from aiooutbox.relay import Message, NatsSink, RabbitMQSink
from tests.programs import needs
from tests.relay.brokers import AMQP_URL, NATS_URL, PrivateNats
from tests.relay.common import counts, nats_read, nats_stream, rabbit_read, relaying, unique

KEYS, PER_KEY = 32, 30


class Counting:
    """Counts the publishes awaiting their confirm at once: the window is what is tested."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    async def around(self, send: Any, messages: list[Message]) -> list[BaseException | None]:
        self.now += len(messages)
        self.peak = max(self.peak, self.now)
        try:
            results: list[BaseException | None] = await send(messages)
            return results
        finally:
            self.now -= len(messages)


class CountingNats(NatsSink):
    counting = Counting()

    async def _send_many(self, messages: list[Message]) -> list[BaseException | None]:
        return await self.counting.around(super()._send_many, messages)


class CountingRabbit(RabbitMQSink):
    counting = Counting()

    async def _send_many(self, messages: list[Message]) -> list[BaseException | None]:
        return await self.counting.around(super()._send_many, messages)


@pytest.fixture
async def js() -> AsyncIterator[Any]:
    nc = await nats.connect(NATS_URL)
    yield nc.jetstream()
    await nc.close()


async def enqueue_keyed(pool: asyncpg.Pool, topic: str) -> None:
    events = [
        aiooutbox.NewEvent(topic, {"key": key, "seq": seq}, ordering_key=f"k{key}")
        for seq in range(PER_KEY)
        for key in range(KEYS)
    ]
    async with pool.acquire() as conn:
        await aiooutbox.enqueue_many(conn, events)


async def wait_settled(pool: asyncpg.Pool, total: int, timeout: float = 90) -> dict[str, int]:
    """Wait until no row is pending, processing or waiting; the counts per status."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        found = await counts(pool)
        if found.get("done", 0) + found.get("retry", 0) + found.get("dead", 0) >= total:
            return found
        if loop.time() > deadline:
            raise AssertionError(f"after {timeout}s: {found}, expected {total} settled")
        await asyncio.sleep(0.05)


def assert_in_order(payloads: list[dict[str, int]]) -> None:
    seen: dict[int, list[int]] = {}
    for p in payloads:
        seen.setdefault(p["key"], []).append(p["seq"])
    assert len(seen) == KEYS
    for key, seqs in seen.items():
        assert seqs == list(range(PER_KEY)), f"key {key} out of order: {seqs}"


async def test_nats_window_bounds_publishes_and_keeps_order(pool: asyncpg.Pool, js: Any) -> None:
    """A consumer holding 256 rows, a window of 16: never more than 16 publishes await a
    PubAck, more than one is in flight at once, and each key's events reach the stream in
    order. (How full the window gets depends on how the claims' batches fall: CI under
    load once peaked at 15, so only the bound and the pipelining are asserted.)"""
    stream, topic = unique("WINDOW"), unique("relay.window.")
    await nats_stream(js, stream, [topic], "memory")
    sink = CountingNats(NATS_URL, max_in_flight=16)
    try:
        await enqueue_keyed(pool, topic)
        async with relaying(pool, sink, concurrency=256):
            await wait_settled(pool, KEYS * PER_KEY)
        print(f"peak publishes in flight: {sink.counting.peak}")
        assert 1 < sink.counting.peak <= 16
        assert await counts(pool) == {"done": KEYS * PER_KEY}
        assert_in_order([json.loads(m.data) for m in await nats_read(js, stream, topic)])
    finally:
        await js.delete_stream(stream)


async def test_rabbitmq_window_bounds_publishes_and_keeps_order(pool: asyncpg.Pool) -> None:
    import aio_pika

    queue = unique("relay-window-")
    async with await aio_pika.connect(AMQP_URL) as connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue)
        sink = CountingRabbit(AMQP_URL, max_in_flight=8)
        try:
            await enqueue_keyed(pool, queue)
            async with relaying(pool, sink, concurrency=128):
                await wait_settled(pool, KEYS * PER_KEY)
            print(f"peak publishes in flight: {sink.counting.peak}")
            assert 1 < sink.counting.peak <= 8
            assert await counts(pool) == {"done": KEYS * PER_KEY}
            found = await rabbit_read(AMQP_URL, queue, KEYS * PER_KEY)
            assert_in_order([json.loads(m.body) for m in found])
        finally:
            await declared.delete(if_unused=False, if_empty=False)


async def test_nats_failure_amid_concurrent_publishes_settles_only_its_event(
    pool: asyncpg.Pool, js: Any
) -> None:
    """Among 600 publishes in flight together, the one to a subject no stream captures
    fails alone (its reply is a no-responders status on the shared inbox): it is dead on
    its first attempt, every other event is done on its first attempt, each PubAck
    matched to its own event."""
    stream, topic = unique("AMID"), unique("relay.amid.")
    stray = unique("relay.nostream.")
    await nats_stream(js, stream, [topic], "memory")
    try:
        events = [aiooutbox.NewEvent(topic, {"n": i}) for i in range(600)]
        events.insert(300, aiooutbox.NewEvent(stray, {"n": -1}))
        async with pool.acquire() as conn:
            await aiooutbox.enqueue_many(conn, events)
        retry = aiooutbox.RetryPolicy(base=60, jitter=0)  # nothing comes back in the test
        async with relaying(pool, NatsSink(NATS_URL), concurrency=256, retry=retry):
            found = await wait_settled(pool, len(events))
        assert found == {"done": 600, "dead": 1}, found
        rows = await pool.fetch(
            "SELECT topic, status::text, attempts, last_error FROM outbox_events_all"
        )
        (failed,) = [r for r in rows if r["status"] == "dead"]
        assert failed["topic"] == stray
        assert "no JetStream stream captures subject" in failed["last_error"]
        assert {r["attempts"] for r in rows} == {1}
        stored = await nats_read(js, stream, topic)
        assert sorted(json.loads(m.data)["n"] for m in stored) == list(range(600))
    finally:
        await js.delete_stream(stream)


@needs("nats-server")
async def test_nats_pubacks_that_never_come_time_out_then_dedupe(pool: asyncpg.Pool) -> None:
    """A frozen server (SIGSTOP) answers no PubAck: each publish fails after about
    publish_timeout (the sweep), is retried by the consumer, and once the server thaws
    the stream holds every event exactly once (the same Nats-Msg-Id on every retry)."""
    broker = PrivateNats()
    broker.start()
    assert broker.proc is not None
    try:
        nc = await nats.connect(broker.url)
        js = nc.jetstream()
        await nats_stream(js, "FROZEN", ["frozen.>"], "memory")
        async with pool.acquire() as conn:
            await aiooutbox.enqueue_many(
                conn, [aiooutbox.NewEvent("frozen.a", {"n": i}) for i in range(50)]
            )
        sink = NatsSink(broker.url, publish_timeout=0.5, reconnect_wait=0)
        retry = aiooutbox.RetryPolicy(base=0.2, max_delay=0.5, jitter=0)
        async with sink:
            os.kill(broker.proc.pid, signal.SIGSTOP)
            try:
                consumer = aiooutbox.OutboxConsumer(pool, retry=retry, retention=None)
                async with consumer:
                    task = asyncio.ensure_future(consumer.run({"*": sink}))
                    for _ in range(200):
                        if consumer.stats.retried >= 50:
                            break
                        await asyncio.sleep(0.05)
                    retried = consumer.stats.retried
                    os.kill(broker.proc.pid, signal.SIGCONT)
                    for _ in range(400):
                        if consumer.stats.done >= 50:
                            break
                        await asyncio.sleep(0.05)
                    consumer.stop()
                    await task
            finally:
                os.kill(broker.proc.pid, signal.SIGCONT)
        print(f"attempts failed while frozen: {retried}; duplicates dropped: {sink.duplicates}")
        assert retried >= 50
        attempts = [r[0] for r in await pool.fetch("SELECT attempts FROM outbox_events_all")]
        assert min(attempts) >= 2, f"an event was done without a timed-out attempt: {attempts}"
        assert await counts(pool) == {"done": 50}
        await nc.flush()
        assert (await js.stream_info("FROZEN")).state.messages == 50
        await nc.close()
    finally:
        broker.destroy()


async def test_window_bad_input() -> None:
    with pytest.raises(aiooutbox.InvalidArgument, match="at least 1"):
        NatsSink(NATS_URL, max_in_flight=0)
    with pytest.raises(TypeError, match="max_in_flight"):
        RabbitMQSink(AMQP_URL, max_in_flight="8")  # type: ignore[arg-type]
