"""The relay into NATS JetStream and RabbitMQ against its limit, a consumer of every topic
against one of a topic list, and the latency from commit to broker ack.

- **JetStream / RabbitMQ**: events/s of the relay at the relay command's defaults
  (`bare.at_defaults`: its batch handler, its concurrency; unordered, and over
  ``bare.KEYS`` ordering keys) against its limit (`bare.alternate`, `bare.limit`): the
  best bare client loop with the bare claim+settle loop. ``tasks`` is 256 tasks each
  awaiting its publish in turn (``js.publish``, aio-pika's confirming ``publish``);
  ``pipelined`` is, for JetStream, one loop through nats-py's ``publish_async`` with at
  most 256 PubAcks pending, for RabbitMQ 256 confirming publishes at a time, their
  confirms awaited together; ``pipelined_keyed`` the same with the ordering key header.
- **all topics vs a topic list**: drain rate with a handler under ``"*"`` (claims with
  no topic filter) over the same with the topics listed.
- **latency**: commit (from the start of the committing ``enqueue_many``) → broker
  ack (the relay's batch handler returned), p50/p99, at a steady offered load (2k
  events/s), the relay at its defaults, for JetStream, RabbitMQ, Kafka and Redis; and,
  as its reference, RabbitMQ's own client at the same rate (``client_latency``:
  aio-pika's confirming publishes, each tick's messages at once, no database).

The machine's NATS (JetStream) at 127.0.0.1:4222 and RabbitMQ at 127.0.0.1:5672.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from typing import Any, cast

import asyncpg

import aiooutbox
from aiooutbox.relay import NatsSink, RabbitMQSink, Sink
from aiooutbox.relay._message import payload_body

from ..harness.stats import median, ratio, summarize_ms
from .bare import (
    IN_FLIGHT,
    KEYS,
    TOPICS,
    ClaimSettle,
    Log,
    Messages,
    alternate,
    at_defaults,
    drain,
    fill,
    in_tasks,
    reset,
    timed_latency,
    with_whole_claims,
)

NATS_URL = "nats://127.0.0.1:4222"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"


async def jetstream(
    pool: asyncpg.Pool, n: int, rounds: int, log: Log, claim_settle: ClaimSettle
) -> dict[str, Any]:
    import nats
    from nats.js.api import StorageType, StreamConfig

    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    piped = nc.jetstream(publish_async_max_pending=IN_FLIGHT)
    stream = f"BENCH{uuid.uuid4().hex[:8]}"
    await js.add_stream(StreamConfig(name=stream, subjects=list(TOPICS), storage=StorageType.FILE))
    sink = NatsSink(NATS_URL)
    await sink.start()
    messages, keyed = Messages(n), Messages(n, KEYS)

    def headers(m: Messages, i: int) -> dict[str, str]:
        h = m.headers(i)
        h["Nats-Msg-Id"] = m.rows[i][2]
        return h

    async def publish(i: int) -> None:
        topic, payload = messages.rows[i][:2]
        await js.publish(topic, payload_body(payload), headers=headers(messages, i))

    async def tasks() -> None:
        await in_tasks(n, publish)

    async def pipelined_of(m: Messages) -> None:
        acks = []
        for i in range(n):
            topic, payload = m.rows[i][:2]
            acks.append(
                await piped.publish_async(topic, payload_body(payload), headers=headers(m, i))
            )
        for ack in acks:
            await ack

    async def pipelined() -> None:
        await pipelined_of(messages)

    async def pipelined_keyed() -> None:
        await pipelined_of(keyed)

    try:
        out = await alternate(
            pool, n, rounds, {"tasks": tasks, "pipelined": pipelined},
            with_whole_claims({"relay": at_defaults(sink), "relay_keyed": at_defaults(sink, KEYS)}),
            "jetstream", log, claim_settle=claim_settle,
            keyed_bares={"pipelined_keyed": pipelined_keyed},
        )  # fmt: skip
    finally:
        await sink.close()
        await js.delete_stream(stream)
        await nc.close()
    return out


async def rabbitmq(
    pool: asyncpg.Pool, n: int, rounds: int, log: Log, claim_settle: ClaimSettle
) -> dict[str, Any]:
    import aio_pika

    queue = f"bench-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(AMQP_URL)
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    q = await channel.declare_queue(queue, durable=True)
    sink = RabbitMQSink(AMQP_URL, destination=queue)
    await sink.start()
    messages, keyed = Messages(n), Messages(n, KEYS)
    created = datetime.now(UTC)

    async def publish_of(m: Messages, i: int) -> None:
        message = _amqp_message(m, i, created)
        await channel.default_exchange.publish(message, routing_key=queue, mandatory=True)

    async def tasks() -> None:
        await in_tasks(n, lambda i: publish_of(messages, i))

    async def pipelined_of(m: Messages) -> None:
        for start in range(0, n, IN_FLIGHT):
            chunk = range(start, min(start + IN_FLIGHT, n))
            await asyncio.gather(*(publish_of(m, i) for i in chunk))

    async def pipelined() -> None:
        await pipelined_of(messages)

    async def pipelined_keyed() -> None:
        await pipelined_of(keyed)

    async def purge() -> None:
        await q.purge()

    try:
        out = await alternate(
            pool, n, rounds, {"tasks": tasks, "pipelined": pipelined},
            with_whole_claims({"relay": at_defaults(sink), "relay_keyed": at_defaults(sink, KEYS)}),
            "rabbitmq", log, purge, claim_settle=claim_settle,
            keyed_bares={"pipelined_keyed": pipelined_keyed},
        )  # fmt: skip
    finally:
        await sink.close()
        await q.delete(if_unused=False, if_empty=False)
        await connection.close()
    return out


async def all_topics(pool: asyncpg.Pool, n: int, rounds: int, log: Log) -> dict[str, Any]:
    async def noop(event: aiooutbox.Event) -> None:
        return None

    star: list[float] = []
    listed: list[float] = []
    for _ in range(rounds):
        for handlers, rates in (({"*": noop}, star), (dict.fromkeys(TOPICS, noop), listed)):
            await reset(pool)
            await fill(pool, n)
            rates.append(n / await drain(pool, handlers, n))
    out = {
        "events": n,
        "all_topics_per_s": [round(x) for x in star],
        "topic_list_per_s": [round(x) for x in listed],
        "ratio": round(ratio(median(star), median(listed)), 3),
    }
    log(f"  all topics / topic list drain rate = {out['ratio']:.2f}")
    return out


async def latency(pool: asyncpg.Pool, rate: float, seconds: float, log: Log) -> dict[str, Any]:
    import aio_pika
    import nats
    from nats.js.api import StorageType, StreamConfig

    out: dict[str, Any] = {}
    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    stream = f"BENCHL{uuid.uuid4().hex[:8]}"
    await js.add_stream(StreamConfig(name=stream, subjects=["lat.>"], storage=StorageType.FILE))
    queue = f"bench-lat-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(AMQP_URL)
    channel = await connection.channel()
    q = await channel.declare_queue(queue, durable=True)
    sinks: dict[str, Sink] = {
        "jetstream": NatsSink(NATS_URL, destination="lat.{topic}"),
        "rabbitmq": RabbitMQSink(AMQP_URL, destination=queue),
    }
    try:
        for name, sink in sinks.items():
            async with sink:
                out[name] = await timed_latency(pool, sink, rate, seconds, name, log)
        out["clients"] = {"rabbitmq": await client_latency(queue, rate, seconds, log)}
    finally:
        await js.delete_stream(stream)
        await nc.close()
        await q.delete(if_unused=False, if_empty=False)
        await connection.close()
    return out


def _amqp_message(m: Messages, i: int, created: datetime) -> Any:
    """Message ``i`` as the relay sends it: its body and headers, persistent."""
    import aio_pika

    topic, payload, message_id, _ = m.rows[i]
    return aio_pika.Message(
        payload_body(payload),
        headers=cast(Any, m.headers(i)),
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=message_id,
        timestamp=created,
        type=topic,
    )


async def client_latency(queue: str, rate: float, seconds: float, log: Log) -> dict[str, Any]:
    """RabbitMQ's own client at the relay's steady rate, its reference: every 10 ms the
    messages due by then (the relay's bodies and headers, persistent, ``mandatory``)
    published at once with aio-pika's ``publish`` on a confirming channel; the latency
    of each from its tick to its confirm, and the rate offered."""
    import aio_pika

    total = int(rate * seconds)
    messages = Messages(total)
    created = datetime.now(UTC)
    latencies: list[float] = []
    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)

        async def publish(i: int, due: float) -> None:
            message = _amqp_message(messages, i, created)
            await channel.default_exchange.publish(message, routing_key=queue, mandatory=True)
            latencies.append(time.perf_counter() - due)

        pending: set[asyncio.Task[None]] = set()
        sent, started = 0, time.perf_counter()
        while sent < total:
            due = min(total, int((time.perf_counter() - started) * rate) + 1)
            now = time.perf_counter()
            for i in range(sent, due):
                task = asyncio.ensure_future(publish(i, now))
                pending.add(task)
                task.add_done_callback(pending.discard)
            sent = due
            await asyncio.sleep(0.01)
        offered = total / (time.perf_counter() - started)
        if pending:
            await asyncio.gather(*pending)
    finally:
        await connection.close()
    summary = summarize_ms(latencies)
    log(
        f"  latency of RabbitMQ's own client at {offered:,.0f}/s: "
        f"p50 {summary['p50']:.1f} ms, p99 {summary['p99']:.1f} ms"
    )
    return {"rate": rate, "offered_per_s": round(offered), "seconds": seconds, **summary}
