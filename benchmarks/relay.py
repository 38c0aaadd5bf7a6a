"""Relay benchmarks: the relay against a bare client loop, in one run, alternated rounds.

``python -m benchmarks --dsn ... --only relay`` (part of every default run). Needs the
machine's NATS (JetStream) at 127.0.0.1:4222 and RabbitMQ at 127.0.0.1:5672.

- **JetStream / RabbitMQ ratio**: events/s of an outbox relay (consumer + sink,
  concurrency 256, every topic) draining N committed events, over events/s of a bare
  client loop publishing the same payloads and headers with acks/confirms, 256 in
  flight. Rounds alternate bare, relay, bare, relay...; the medians are compared.
- **all topics vs a topic list**: drain rate with a handler under ``"*"`` (claims with
  no topic filter) over the same with the topics listed.
- **latency**: enqueue → broker ack, p50/p99, at a steady offered load (2k events/s).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

import asyncpg

import aiooutbox
from aiooutbox.relay import NatsSink, RabbitMQSink, Sink

from .common import drop_database, median, ratio, recreate_database, summarize_ms

NATS_URL = "nats://127.0.0.1:4222"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
TOPICS = ("orders.created", "orders.paid")
IN_FLIGHT = 256
Log = Callable[[str], None]


def _payload(i: int) -> dict[str, Any]:
    return {"order_id": i, "customer": f"c{i % 977}", "total_cents": 1999 + i % 100}


def _headers() -> dict[str, str]:
    return {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


async def _fill(pool: asyncpg.Pool, n: int, topics: tuple[str, ...] = TOPICS) -> None:
    for start in range(0, n, 5000):
        batch = [
            aiooutbox.NewEvent(topics[i % len(topics)], _payload(i), headers=_headers())
            for i in range(start, min(start + 5000, n))
        ]
        async with pool.acquire() as conn:
            await aiooutbox.enqueue_many(conn, batch)


async def _drain(pool: asyncpg.Pool, handlers: dict[str, Any], n: int) -> float:
    """Seconds for a consumer to settle ``n`` events (from its start to the last one)."""
    consumer = aiooutbox.OutboxConsumer(
        pool, concurrency=IN_FLIGHT, retention=None, poll_interval=0.2,
        topics=None if "*" in handlers else list(handlers),
    )  # fmt: skip
    async with consumer:
        started = time.perf_counter()
        task = asyncio.ensure_future(consumer.run(handlers))
        while consumer.stats.done < n:
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - started
        consumer.stop()
        await task
    return elapsed


async def _bare(publish: Callable[[int], Any], n: int) -> float:
    """Seconds for ``n`` publishes awaited with ``IN_FLIGHT`` at once (no database)."""
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(i: int) -> None:
        async with gate:
            await publish(i)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - started


async def _reset(pool: asyncpg.Pool) -> None:
    await pool.execute("TRUNCATE outbox_events")


async def _nats(pool: asyncpg.Pool, n: int, rounds: int, log: Log) -> dict[str, Any]:
    import nats
    from nats.js.api import StorageType, StreamConfig

    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    stream = f"BENCH{uuid.uuid4().hex[:8]}"
    await js.add_stream(
        StreamConfig(name=stream, subjects=[f"{t}" for t in TOPICS], storage=StorageType.FILE)
    )
    sink = NatsSink(NATS_URL)
    await sink.start()
    import json

    async def bare_publish(i: int) -> None:
        body = json.dumps(_payload(i), separators=(",", ":")).encode()
        headers = {**_headers(), "Nats-Msg-Id": str(uuid.uuid4())}
        await js.publish(TOPICS[i % 2], body, headers=headers)

    try:
        out = await _alternate(pool, n, rounds, bare_publish, sink, "jetstream", log)
    finally:
        await sink.close()
        await js.delete_stream(stream)
        await nc.close()
    return out


async def _rabbit(pool: asyncpg.Pool, n: int, rounds: int, log: Log) -> dict[str, Any]:
    import json

    import aio_pika

    queue = f"bench-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(AMQP_URL)
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    q = await channel.declare_queue(queue, durable=True)
    sink = RabbitMQSink(AMQP_URL, destination=queue)
    await sink.start()

    async def bare_publish(i: int) -> None:
        message = aio_pika.Message(
            json.dumps(_payload(i), separators=(",", ":")).encode(),
            headers=cast(Any, _headers()),
            message_id=str(uuid.uuid4()),
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            content_type="application/json",
        )
        await channel.default_exchange.publish(message, routing_key=queue, mandatory=True)

    async def purge() -> None:
        await q.purge()

    try:
        out = await _alternate(pool, n, rounds, bare_publish, sink, "rabbitmq", log, purge)
    finally:
        await sink.close()
        await q.delete(if_unused=False, if_empty=False)
        await connection.close()
    return out


async def _alternate(
    pool: asyncpg.Pool,
    n: int,
    rounds: int,
    bare_publish: Callable[[int], Any],
    sink: Sink,
    name: str,
    log: Log,
    between: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    bare_rates: list[float] = []
    relay_rates: list[float] = []
    for r in range(rounds):
        bare_rates.append(n / await _bare(bare_publish, n))
        if between:
            await between()
        await _reset(pool)
        await _fill(pool, n)
        relay_rates.append(n / await _drain(pool, {"*": sink}, n))
        if between:
            await between()
        log(f"  {name} round {r + 1}: bare {bare_rates[-1]:,.0f}/s, relay {relay_rates[-1]:,.0f}/s")
    out = {
        "events": n,
        "in_flight": IN_FLIGHT,
        "bare_per_s": [round(x) for x in bare_rates],
        "relay_per_s": [round(x) for x in relay_rates],
        "ratio": round(ratio(median(relay_rates), median(bare_rates)), 3),
    }
    log(f"  {name}: relay / bare = {out['ratio']:.2f}")
    return out


async def _all_topics(pool: asyncpg.Pool, n: int, rounds: int, log: Log) -> dict[str, Any]:
    async def noop(event: aiooutbox.Event) -> None:
        return None

    star: list[float] = []
    listed: list[float] = []
    for _ in range(rounds):
        for handlers, rates in (({"*": noop}, star), (dict.fromkeys(TOPICS, noop), listed)):
            await _reset(pool)
            await _fill(pool, n)
            rates.append(n / await _drain(pool, handlers, n))
    out = {
        "events": n,
        "all_topics_per_s": [round(x) for x in star],
        "topic_list_per_s": [round(x) for x in listed],
        "ratio": round(ratio(median(star), median(listed)), 3),
    }
    log(f"  all topics / topic list drain rate = {out['ratio']:.2f}")
    return out


async def _latency(pool: asyncpg.Pool, rate: float, seconds: float, log: Log) -> dict[str, Any]:
    import nats
    from nats.js.api import StorageType, StreamConfig

    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    stream = f"BENCHL{uuid.uuid4().hex[:8]}"
    await js.add_stream(StreamConfig(name=stream, subjects=["lat.>"], storage=StorageType.FILE))
    await _reset(pool)
    latencies: list[float] = []
    sink = NatsSink(NATS_URL, destination="lat.{topic}")

    async def timed(event: aiooutbox.Event) -> None:
        await sink(event)
        latencies.append(time.time() - event.payload["t"])

    total = int(rate * seconds)
    async with sink:
        consumer = aiooutbox.OutboxConsumer(pool, concurrency=IN_FLIGHT, retention=None)
        async with consumer:
            task = asyncio.ensure_future(consumer.run({"*": timed}))
            await asyncio.sleep(0.5)
            tick = 0.01
            per_tick = rate * tick
            sent, started = 0, time.perf_counter()
            while sent < total:
                due = min(total, int((time.perf_counter() - started) / tick * per_tick) + 1)
                if due > sent:
                    batch = [
                        aiooutbox.NewEvent(TOPICS[i % 2], {"t": time.time(), "i": i})
                        for i in range(sent, due)
                    ]
                    async with pool.acquire() as conn:
                        await aiooutbox.enqueue_many(conn, batch)
                    sent = due
                await asyncio.sleep(tick)
            while consumer.stats.done < total:
                await asyncio.sleep(0.01)
            consumer.stop()
            await task
    await js.delete_stream(stream)
    await nc.close()
    summary = summarize_ms(latencies)
    out = {"rate": rate, "seconds": seconds, "events": total, **summary}
    log(
        f"  latency enqueue -> JetStream ack at {rate:,.0f}/s: p50 {summary['p50']:.1f} ms, "
        f"p99 {summary['p99']:.1f} ms"
    )
    return out


async def run(
    admin_dsn: str,
    *,
    prefix: str,
    events: int,
    rounds: int,
    latency_rate: float,
    latency_seconds: float,
    log: Log = print,
) -> dict[str, Any]:
    """All relay measurements on a database of their own; the results document."""
    name = prefix + "relay"
    dsn = await recreate_database(admin_dsn, name)
    results: dict[str, Any] = {}
    try:
        async with asyncpg.create_pool(dsn, min_size=2, max_size=8) as pool:
            await aiooutbox.migrate(pool)
            log(f"relay: {events:,} events, {rounds} alternated rounds, {IN_FLIGHT} in flight")
            results["jetstream"] = await _nats(pool, events, rounds, log)
            results["rabbitmq"] = await _rabbit(pool, events, rounds, log)
            results["all_topics"] = await _all_topics(pool, events, rounds, log)
            results["latency"] = await _latency(pool, latency_rate, latency_seconds, log)
    finally:
        await drop_database(admin_dsn, name)
    return results
