"""Relay benchmarks: the relay against bare client loops, in one run, alternated rounds.

``python -m benchmarks --dsn ... --only relay`` (part of every default run). Needs the
machine's NATS (JetStream) at 127.0.0.1:4222, RabbitMQ at 127.0.0.1:5672 and Redis at
127.0.0.1:6379; Kafka is a private Tansu broker. Kafka and Redis Streams, with
read-back on and off, are in `benchmarks.relay_streams`.

- **JetStream / RabbitMQ ratio**: events/s of an outbox relay (consumer + sink, every
  topic; the sink's ``max_in_flight=256``, the consumer's concurrency 512 so that
  claimed rows wait for a publish slot while the next claim runs, and, as
  ``relay_c256``, concurrency 256) draining N committed events, over events/s of bare
  client loops publishing the same messages (the same JSON bodies, the same headers and
  message ids, encoded per message as the relay must), acks awaited, 256 in flight:
  ``tasks`` is 256 tasks each awaiting its publish in turn (``js.publish``, aio-pika's
  confirming ``publish``); ``pipelined`` (JetStream only) is one loop through nats-py's
  ``publish_async`` with at most 256 PubAcks pending. Each round runs every variant,
  the order reversed every other round; medians are compared, and the ratio that counts
  is against the faster bare loop.
- **all topics vs a topic list**: drain rate with a handler under ``"*"`` (claims with
  no topic filter) over the same with the topics listed.
- **latency**: commit (from the start of the committing ``enqueue_many``) → broker
  ack (the sink returned),
  p50/p99, at a steady offered load (2k events/s), for JetStream and for RabbitMQ.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, cast

import asyncpg

import aiooutbox
from aiooutbox.relay import NatsSink, RabbitMQSink, Sink
from aiooutbox.relay._message import payload_body

from .common import drop_database, median, ratio, recreate_database, summarize_ms

NATS_URL = "nats://127.0.0.1:4222"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
TOPICS = ("orders.created", "orders.paid")
IN_FLIGHT = 256
#: the relay's consumer holds this many times IN_FLIGHT rows; its sink's max_in_flight
#: keeps the broker's window at IN_FLIGHT, as the bare loops'
PREFETCH = 2
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
Log = Callable[[str], None]
#: one bare loop: publishes messages[0:n] with acks, returns when all are acked
Bare = Callable[[], Awaitable[None]]


def _payload(i: int) -> dict[str, Any]:
    return {"order_id": i, "customer": f"c{i % 977}", "total_cents": 1999 + i % 100}


class Messages:
    """What the bare loops publish: the relay's messages, minus the database.

    The topic, payload (a dict, encoded per publish as the sink encodes it), message id
    and event id of every event; the headers are built per publish, as the sink does.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.rows = [(TOPICS[i % 2], _payload(i), str(uuid.uuid4()), str(i + 1)) for i in range(n)]

    def headers(self, i: int) -> dict[str, str]:
        topic, _, message_id, event_id = self.rows[i]
        return {
            "traceparent": TRACEPARENT,
            "outbox-topic": topic,
            "outbox-event-id": event_id,
            "outbox-message-id": message_id,
        }


async def _fill(pool: asyncpg.Pool, n: int, topics: tuple[str, ...] = TOPICS) -> None:
    for start in range(0, n, 5000):
        batch = [
            aiooutbox.NewEvent(
                topics[i % len(topics)], _payload(i), headers={"traceparent": TRACEPARENT}
            )
            for i in range(start, min(start + 5000, n))
        ]
        async with pool.acquire() as conn:
            await aiooutbox.enqueue_many(conn, batch)


async def _drain(
    pool: asyncpg.Pool, handlers: dict[str, Any], n: int, concurrency: int = IN_FLIGHT
) -> float:
    """Seconds for a consumer to settle ``n`` events, from when it is consuming (schema
    checked, LISTEN connection up: a relay's start-up, like the bare loops' connect, is
    not timed) to the last one."""
    consumer = aiooutbox.OutboxConsumer(
        pool, concurrency=concurrency, retention=None, poll_interval=0.2,
        topics=None if "*" in handlers else list(handlers),
    )  # fmt: skip
    async with consumer:
        task = asyncio.ensure_future(consumer.run(handlers))
        await consumer.wait_started()
        started = time.perf_counter()
        while consumer.stats.done < n:
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - started
        consumer.stop()
        await task
    return elapsed


async def _tasks(n: int, publish: Callable[[int], Awaitable[Any]]) -> None:
    """``IN_FLIGHT`` tasks, each publishing the next message and awaiting its ack."""
    todo = iter(range(n))

    async def worker() -> None:
        for i in todo:
            await publish(i)

    await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))


async def _reset(pool: asyncpg.Pool) -> None:
    await pool.execute("TRUNCATE outbox_events")


async def _nats(pool: asyncpg.Pool, n: int, rounds: int, log: Log) -> dict[str, Any]:
    import nats
    from nats.js.api import StorageType, StreamConfig

    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    piped = nc.jetstream(publish_async_max_pending=IN_FLIGHT)
    stream = f"BENCH{uuid.uuid4().hex[:8]}"
    await js.add_stream(StreamConfig(name=stream, subjects=list(TOPICS), storage=StorageType.FILE))
    sink = NatsSink(NATS_URL, max_in_flight=IN_FLIGHT)
    await sink.start()
    messages = Messages(n)

    def headers(i: int) -> dict[str, str]:
        h = messages.headers(i)
        h["Nats-Msg-Id"] = messages.rows[i][2]
        return h

    async def publish(i: int) -> None:
        topic, payload = messages.rows[i][:2]
        await js.publish(topic, payload_body(payload), headers=headers(i))

    async def tasks() -> None:
        await _tasks(n, publish)

    async def pipelined() -> None:
        acks = []
        for i in range(n):
            topic, payload = messages.rows[i][:2]
            acks.append(await piped.publish_async(topic, payload_body(payload), headers=headers(i)))
        for ack in acks:
            await ack

    try:
        bares = {"tasks": tasks, "pipelined": pipelined}
        out = await _alternate(pool, n, rounds, bares, sink, "jetstream", log)
    finally:
        await sink.close()
        await js.delete_stream(stream)
        await nc.close()
    return out


async def _rabbit(pool: asyncpg.Pool, n: int, rounds: int, log: Log) -> dict[str, Any]:
    import aio_pika

    queue = f"bench-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(AMQP_URL)
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    q = await channel.declare_queue(queue, durable=True)
    sink = RabbitMQSink(AMQP_URL, destination=queue, max_in_flight=IN_FLIGHT)
    await sink.start()
    messages = Messages(n)
    created = datetime.now(UTC)

    async def publish(i: int) -> None:
        topic, payload, message_id, _ = messages.rows[i]
        message = aio_pika.Message(
            payload_body(payload),
            headers=cast(Any, messages.headers(i)),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=message_id,
            timestamp=created,
            type=topic,
        )
        await channel.default_exchange.publish(message, routing_key=queue, mandatory=True)

    async def tasks() -> None:
        await _tasks(n, publish)

    async def purge() -> None:
        await q.purge()

    try:
        out = await _alternate(pool, n, rounds, {"tasks": tasks}, sink, "rabbitmq", log, purge)
    finally:
        await sink.close()
        await q.delete(if_unused=False, if_empty=False)
        await connection.close()
    return out


async def _alternate(
    pool: asyncpg.Pool,
    n: int,
    rounds: int,
    bares: Mapping[str, Bare],
    sink: Sink,
    name: str,
    log: Log,
    between: Callable[[], Awaitable[Any]] | None = None,
    relays: Mapping[str, tuple[Sink, int]] | None = None,
) -> dict[str, Any]:
    """Every bare loop and relay variant once a round, the order reversed every other
    round. ``relays``: variant -> (sink, consumer concurrency); by default ``relay``
    (``sink`` at ``PREFETCH * IN_FLIGHT``) and ``relay_c256`` (at ``IN_FLIGHT``)."""
    if relays is None:
        relays = {"relay": (sink, PREFETCH * IN_FLIGHT), "relay_c256": (sink, IN_FLIGHT)}
    rates: dict[str, list[float]] = {variant: [] for variant in bares}
    rates.update({variant: [] for variant in relays})

    async def relay(variant: str) -> None:
        await _reset(pool)
        await _fill(pool, n)
        to, concurrency = relays[variant]
        rates[variant].append(n / await _drain(pool, {"*": to}, n, concurrency))

    async def bare(variant: str) -> None:
        started = time.perf_counter()
        await bares[variant]()
        rates[variant].append(n / (time.perf_counter() - started))

    steps: list[Callable[[], Awaitable[None]]] = [functools.partial(bare, v) for v in bares]
    steps += [functools.partial(relay, v) for v in relays]
    for r in range(rounds):
        for step in steps if r % 2 == 0 else steps[::-1]:
            await step()
            if between:
                await between()
        shown = ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in rates.items())
        log(f"  {name} round {r + 1}: {shown}")
    medians = {k: median(v) for k, v in rates.items()}
    best = max(bares, key=lambda v: medians[v])
    out: dict[str, Any] = {
        "events": n,
        "in_flight": IN_FLIGHT,
        "rounds": rounds,
        **{f"{k}_per_s": [round(x) for x in v] for k, v in rates.items()},
        "bare_per_s": [round(x) for x in rates[best]],
        "bare_loop": best,
        "ratio": round(ratio(medians["relay"], medians[best]), 3),
        "ratios": {v: round(ratio(medians["relay"], medians[v]), 3) for v in bares},
        "relay_concurrency": relays["relay"][1],
    }
    shown = f"  {name}: relay / bare ({best}) = {out['ratio']:.2f}" + "".join(
        f"; / {v} {r:.2f}" for v, r in out["ratios"].items() if v != best
    )
    if "relay_c256" in medians:
        out["ratio_c256"] = round(ratio(medians["relay_c256"], medians[best]), 3)
        shown += f"; relay at concurrency {IN_FLIGHT} / bare = {out['ratio_c256']:.2f}"
    log(shown)
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


async def _steady(
    pool: asyncpg.Pool, sink: Sink, rate: float, seconds: float
) -> tuple[list[float], float]:
    """Commit ``rate`` events/s for ``seconds`` (10 ms ticks) while a relay publishes them;
    the commit → broker-ack latency of each, and the rate actually offered."""
    latencies: list[float] = []

    async def timed(event: aiooutbox.Event) -> None:
        await sink(event)
        latencies.append(time.perf_counter() - event.payload["t"])

    await _reset(pool)
    total = int(rate * seconds)
    consumer = aiooutbox.OutboxConsumer(pool, concurrency=IN_FLIGHT, retention=None)
    async with consumer:
        task = asyncio.ensure_future(consumer.run({"*": timed}))
        await consumer.wait_started()
        await asyncio.sleep(0.5)
        tick = 0.01
        sent, started = 0, time.perf_counter()
        while sent < total:
            due = min(total, int((time.perf_counter() - started) * rate) + 1)
            if due > sent:
                # stamped as the committing INSERT starts (the relay may see the row before
                # enqueue_many returns): the latency includes the commit itself
                now = time.perf_counter()
                batch = [aiooutbox.NewEvent(TOPICS[i % 2], {"t": now}) for i in range(sent, due)]
                async with pool.acquire() as conn:
                    await aiooutbox.enqueue_many(conn, batch)
                sent = due
            await asyncio.sleep(tick)
        offered = total / (time.perf_counter() - started)
        while consumer.stats.done < total:
            await asyncio.sleep(0.01)
        consumer.stop()
        await task
    return latencies, offered


async def _latency(pool: asyncpg.Pool, rate: float, seconds: float, log: Log) -> dict[str, Any]:
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
                latencies, offered = await _steady(pool, sink, rate, seconds)
            summary = summarize_ms(latencies)
            out[name] = {
                "rate": rate,
                "offered_per_s": round(offered),
                "seconds": seconds,
                "events": len(latencies),
                **summary,
            }
            log(
                f"  latency commit -> {name} ack at {offered:,.0f}/s: "
                f"p50 {summary['p50']:.1f} ms, p99 {summary['p99']:.1f} ms"
            )
    finally:
        await js.delete_stream(stream)
        await nc.close()
        await q.delete(if_unused=False, if_empty=False)
        await connection.close()
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
    from . import relay_streams

    name = prefix + "relay"
    dsn = await recreate_database(admin_dsn, name)
    results: dict[str, Any] = {}
    try:
        async with asyncpg.create_pool(dsn, min_size=2, max_size=8) as pool:
            await aiooutbox.migrate(pool)
            log(f"relay: {events:,} events, {rounds} alternated rounds, {IN_FLIGHT} in flight")
            results["jetstream"] = await _nats(pool, events, rounds, log)
            results["rabbitmq"] = await _rabbit(pool, events, rounds, log)
            results["kafka"] = await relay_streams.kafka(pool, events, rounds, log)
            results["redis"] = await relay_streams.redis(pool, events, rounds, log)
            results["all_topics"] = await _all_topics(pool, events, rounds, log)
            results["latency"] = await _latency(pool, latency_rate, latency_seconds, log)
    finally:
        await drop_database(admin_dsn, name)
    return results
