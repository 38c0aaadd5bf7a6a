"""Relay sinks against the real brokers; the brokers' own clients read back what arrived."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

import asyncpg
import nats
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestServer

import aiooutbox
from aiooutbox.relay import (
    BrokerUnavailable,
    KafkaSink,
    NatsSink,
    RabbitMQSink,
    RedisSink,
    WebhookSink,
    sink_for_url,
)
from tests.clirunner import clean_env, cli
from tests.programs import needs
from tests.relay.brokers import (
    AMQP_URL,
    NATS_URL,
    REDIS_URL,
    PrivateRedis,
    Tansu,
    free_port,
    tansu,
)
from tests.relay.common import (
    counts,
    fill,
    kafka_read,
    kafka_topic,
    message_ids,
    nats_read,
    nats_stream,
    rabbit_read,
    relaying,
    unique,
    wait_done,
)

HEADERS = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "n": 7}


@pytest.fixture(scope="module")
def kafka() -> Iterator[Tansu]:
    with tansu() as broker:
        yield broker


@pytest.fixture
async def js() -> AsyncIterator[Any]:
    nc = await nats.connect(NATS_URL)
    yield nc.jetstream()
    await nc.close()


async def one_event(pool: asyncpg.Pool, topic: str) -> dict[str, Any]:
    async with pool.acquire() as conn:
        await aiooutbox.enqueue(
            conn, topic, {"order": 42, "name": "Zoë"}, dedupe_key="order-42", headers=HEADERS
        )
    row = await pool.fetchrow("SELECT id, message_id::text FROM outbox_events_all")
    assert row is not None
    return dict(row)


def check_headers(headers: dict[str, str], topic: str, row: dict[str, Any]) -> None:
    assert headers["traceparent"] == HEADERS["traceparent"]
    assert headers["n"] == "7"  # non-string header values travel as JSON
    assert headers["outbox-topic"] == topic
    assert headers["outbox-event-id"] == str(row["id"])
    assert headers["outbox-message-id"] == row["message_id"]
    assert headers["outbox-dedupe-key"] == "order-42"


PAYLOAD = {"order": 42, "name": "Zoë"}


# -- NATS JetStream ------------------------------------------------------------------------
async def test_nats_message_format(pool: asyncpg.Pool, js: Any) -> None:
    stream, topic = unique("RELAY"), unique("relay.fmt.")
    await nats_stream(js, stream, [topic], "memory")
    try:
        row = await one_event(pool, topic)
        async with relaying(pool, NatsSink(NATS_URL)):
            await wait_done(pool, 1)
        (msg,) = await nats_read(js, stream, topic)
        assert json.loads(msg.data) == PAYLOAD
        assert msg.headers["Nats-Msg-Id"] == row["message_id"]
        check_headers(msg.headers, topic, row)
    finally:
        await js.delete_stream(stream)


async def test_nats_subject_no_stream_captures_ends_dead(pool: asyncpg.Pool) -> None:
    """No stream will capture it however often it is retried: dead on the first attempt."""
    topic = unique("relay.nostream.")
    async with pool.acquire() as conn:
        await aiooutbox.enqueue(conn, topic, {}, max_attempts=5)
    retry = aiooutbox.RetryPolicy(base=600, jitter=0)
    async with relaying(pool, NatsSink(NATS_URL), retry=retry):
        for _ in range(200):
            if (await counts(pool)).get("dead"):
                break
            await asyncio.sleep(0.05)
    row = await pool.fetchrow("SELECT status::text, attempts, last_error FROM outbox_events_all")
    assert row is not None
    assert (row["status"], row["attempts"]) == ("dead", 1)
    assert "no JetStream stream captures subject" in row["last_error"]


async def test_nats_redelivery_is_dropped_as_duplicate(pool: asyncpg.Pool, js: Any) -> None:
    """The same event published twice (a crash between the PubAck and the settle) is
    stored once: the Nats-Msg-Id is the message id, the same on every retry."""
    stream, topic = unique("RELAY"), unique("relay.dup.")
    await nats_stream(js, stream, [topic], "memory")
    try:
        await one_event(pool, topic)
        sink = NatsSink(NATS_URL)
        async with relaying(pool, sink):
            await wait_done(pool, 1)
        await pool.execute("UPDATE outbox_events SET status = 'pending', available_at = now()")
        sink = NatsSink(NATS_URL)
        async with relaying(pool, sink):
            await wait_done(pool, 1)
        assert sink.duplicates == 1
        assert (await js.stream_info(stream)).state.messages == 1
    finally:
        await js.delete_stream(stream)


# -- RabbitMQ ------------------------------------------------------------------------------
@pytest.fixture
async def amqp_channel() -> AsyncIterator[Any]:
    import aio_pika

    async with await aio_pika.connect(AMQP_URL) as connection:
        yield await connection.channel()


async def test_rabbitmq_message_format_via_an_exchange(
    pool: asyncpg.Pool, amqp_channel: Any
) -> None:
    import aio_pika

    exchange_name, queue_name, topic = unique("relay-x-"), unique("relay-q-"), "orders.created"
    exchange = await amqp_channel.declare_exchange(exchange_name, aio_pika.ExchangeType.TOPIC)
    queue = await amqp_channel.declare_queue(queue_name, durable=True)
    await queue.bind(exchange, "outbox.orders.#")
    try:
        row = await one_event(pool, topic)
        sink = RabbitMQSink(AMQP_URL, exchange=exchange_name, destination="outbox.{topic}")
        async with relaying(pool, sink):
            await wait_done(pool, 1)
        (msg,) = await rabbit_read(AMQP_URL, queue_name, 1)
        assert json.loads(msg.body) == PAYLOAD
        assert msg.message_id == row["message_id"]
        assert msg.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert msg.content_type == "application/json"
        assert msg.routing_key == "outbox.orders.created"
        check_headers(msg.headers, topic, row)
    finally:
        await queue.delete()
        await exchange.delete()


async def test_rabbitmq_unroutable_is_dead_at_once(pool: asyncpg.Pool) -> None:
    """The mandatory publish came back: never a silent drop, and dead on the first attempt."""
    topic = unique("relay-nowhere-")
    async with pool.acquire() as conn:
        await aiooutbox.enqueue(conn, topic, {}, max_attempts=5)
    retry = aiooutbox.RetryPolicy(base=600, jitter=0)
    async with relaying(pool, RabbitMQSink(AMQP_URL), retry=retry):
        for _ in range(200):
            if (await counts(pool)).get("dead"):
                break
            await asyncio.sleep(0.05)
    row = await pool.fetchrow("SELECT status::text, attempts, last_error FROM outbox_events_all")
    assert row is not None
    assert (row["status"], row["attempts"]) == ("dead", 1)
    assert "no queue is bound for routing key" in row["last_error"]


async def test_rabbitmq_missing_exchange_refused_at_start() -> None:
    with pytest.raises(BrokerUnavailable, match="no exchange"):
        await RabbitMQSink(AMQP_URL, exchange=unique("relay-missing-")).start()


# -- Redis Streams -------------------------------------------------------------------------
async def test_redis_message_format_and_maxlen(pool: asyncpg.Pool) -> None:
    stream = unique("relay:stream:")
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        row = await one_event(pool, "orders.created")
        sink = RedisSink(REDIS_URL, destination=stream + ":{topic}", maxlen=1000)
        key = stream + ":orders.created"
        async with relaying(pool, sink):
            await wait_done(pool, 1)
            ((_, fields),) = cast(Any, await client.xrange(key))
            await fill(pool, 3000, first=1)
            await wait_done(pool, 3001)
        assert json.loads(fields[b"payload"]) == PAYLOAD
        assert fields[b"message_id"].decode() == row["message_id"]
        assert fields[b"topic"] == b"orders.created"
        assert fields[b"event_id"] == str(row["id"]).encode()
        assert fields[b"dedupe_key"] == b"order-42"
        assert json.loads(fields[b"headers"]) == HEADERS  # the event's own, values as given
        length = await client.xlen(key)
        assert 1000 <= length < 1501, length  # MAXLEN ~ trims in whole nodes
    finally:
        await client.delete(stream + ":orders.created", stream + ":orders.paid")
        await client.aclose()


@needs("redis-server")
async def test_redis_past_a_hundred_publishes_in_flight_is_no_outage(
    pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """A relay at concurrency 300 with no max_in_flight, against a private Redis that
    holds every write for a second (`CLIENT PAUSE ... WRITE`): 300 XADDs are in flight
    at once, more than redis-py's default pool allows (100, whose 101st command fails
    with MaxConnectionsError: taken for an outage of the healthy server, events held
    and retried). Publishes past the pool's connections wait for one instead: no
    "unavailable", every event done on its first attempt."""
    broker = PrivateRedis()
    broker.start()
    client = aioredis.Redis.from_url(broker.url)
    try:
        stream = unique("relay:wide:")
        await cast(Any, client.client_pause(1500, all=False))  # writes only
        await fill(pool, 600, first=0)
        sink = RedisSink(broker.url, destination=stream)
        async with relaying(pool, sink, concurrency=300):
            await wait_done(pool, 600)
        held = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
        assert held == [], held[:3]
        attempts = await pool.fetch("SELECT attempts, count(*) FROM outbox_events_all GROUP BY 1")
        assert [tuple(r) for r in attempts] == [(1, 600)], attempts
        assert await client.xlen(stream) == 600
    finally:
        await client.aclose()
        broker.destroy()


# -- Kafka (Tansu) -------------------------------------------------------------------------
@needs("tansu")
async def test_kafka_message_format_and_key(pool: asyncpg.Pool, kafka: Tansu) -> None:
    topic = unique("relay.fmt.")
    await kafka_topic(kafka.bootstrap, topic)
    row = await one_event(pool, topic)
    sink = KafkaSink(kafka.bootstrap, enable_idempotence=False, default_key="fallback")
    async with relaying(pool, sink):
        await wait_done(pool, 1)
    (msg,) = await kafka_read(kafka.bootstrap, topic, 1)
    assert json.loads(msg.value) == PAYLOAD
    assert msg.key == b"fallback"  # no ordering_key: the configured default
    check_headers({k: v.decode() for k, v in msg.headers}, topic, row)


# -- per-key order under concurrency 256 ------------------------------------------------------
KEYS, PER_KEY = 64, 40


async def relay_keyed(pool: asyncpg.Pool, sink: Any, topic: str) -> None:
    """Events of 64 keys interleaved in commit order, relayed by a consumer with 256
    handlers at once: its per-key order runs one event of a key at a time, and the sink
    publishes the next only after the previous one's confirm."""
    events = [
        aiooutbox.NewEvent(topic, {"key": key, "seq": seq}, ordering_key=f"k{key}")
        for seq in range(PER_KEY)
        for key in range(KEYS)
    ]
    async with pool.acquire() as conn:
        await aiooutbox.enqueue_many(conn, events)
    async with relaying(pool, sink, concurrency=256):
        await wait_done(pool, KEYS * PER_KEY)


def assert_in_order(payloads: list[dict[str, int]]) -> None:
    seen: dict[int, list[int]] = {}
    for p in payloads:
        seen.setdefault(p["key"], []).append(p["seq"])
    assert len(seen) == KEYS
    for key, seqs in seen.items():
        assert seqs == list(range(PER_KEY)), f"key {key} out of order: {seqs}"


async def test_order_per_key_nats(pool: asyncpg.Pool, js: Any) -> None:
    stream, topic = unique("RELAY"), unique("relay.order.")
    await nats_stream(js, stream, [topic], "memory")
    try:
        await relay_keyed(pool, NatsSink(NATS_URL), topic)
        assert_in_order([json.loads(m.data) for m in await nats_read(js, stream, topic)])
    finally:
        await js.delete_stream(stream)


async def test_order_per_key_rabbitmq(pool: asyncpg.Pool, amqp_channel: Any) -> None:
    queue_name = unique("relay-order-")
    queue = await amqp_channel.declare_queue(queue_name)
    try:
        await relay_keyed(pool, RabbitMQSink(AMQP_URL), queue_name)
        found = await rabbit_read(AMQP_URL, queue_name, KEYS * PER_KEY)
        assert_in_order([json.loads(m.body) for m in found])
    finally:
        await queue.delete()


async def test_order_per_key_redis(pool: asyncpg.Pool) -> None:
    stream = unique("relay:order:")
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await relay_keyed(pool, RedisSink(REDIS_URL), stream)
        entries = cast(Any, await client.xrange(stream))
        assert_in_order([json.loads(f[b"payload"]) for _, f in entries])
        assert {f[b"ordering_key"] for _, f in entries} == {f"k{k}".encode() for k in range(KEYS)}
    finally:
        await client.delete(stream)
        await client.aclose()


@needs("tansu")
async def test_order_per_key_kafka(pool: asyncpg.Pool, kafka: Tansu) -> None:
    """Kafka keys by the ordering key: one key, one partition, in order within it."""
    topic = unique("relay.order.")
    await kafka_topic(kafka.bootstrap, topic, partitions=3)
    sink = KafkaSink(kafka.bootstrap, enable_idempotence=False, default_key="unused")
    await relay_keyed(pool, sink, topic)
    found = await kafka_read(kafka.bootstrap, topic, KEYS * PER_KEY)
    partitions: dict[bytes, set[int]] = {}
    for m in found:
        partitions.setdefault(m.key, set()).add(m.partition)
    assert set(partitions) == {f"k{k}".encode() for k in range(KEYS)}
    assert all(len(p) == 1 for p in partitions.values())  # one key, one partition
    assert len({p for ps in partitions.values() for p in ps}) > 1  # keys spread out
    by_partition = sorted(found, key=lambda m: (m.partition, m.offset))
    assert_in_order([json.loads(m.value) for m in by_partition])


# -- webhooks ------------------------------------------------------------------------------
SECRET = "whsec_" + base64.b64encode(b"a test secret of 24 bytes").decode()


def verify(request_headers: Any, body: bytes) -> bool:
    """Standard Webhooks verification, written from the spec (not with our `sign`)."""
    msg_id = request_headers["webhook-id"]
    stamp = request_headers["webhook-timestamp"]
    key = base64.b64decode(SECRET.removeprefix("whsec_"))
    expected = base64.b64encode(
        hmac.new(key, f"{msg_id}.{stamp}.".encode() + body, hashlib.sha256).digest()
    ).decode()
    given = [s.partition(",")[2] for s in request_headers["webhook-signature"].split()]
    return abs(time.time() - int(stamp)) < 300 and any(
        hmac.compare_digest(expected, g) for g in given
    )


async def test_webhook_outcomes(pool: asyncpg.Pool) -> None:
    script = {"flaky": [500, 200], "gone": [410], "busy": [429, 200], "slow": [503, 200]}
    seen: list[tuple[str, str, bool, str]] = []

    async def receive(request: web.Request) -> web.Response:
        body = await request.read()
        topic = request.match_info["topic"]
        seen.append(
            (
                topic,
                request.headers["webhook-id"],
                verify(request.headers, body),
                request.headers.get("traceparent", ""),
            )
        )
        status = script[topic].pop(0) if len(script[topic]) > 1 else script[topic][0]
        headers = {"Retry-After": "1"} if status in (429, 503) else {}
        return web.Response(status=status, text=f"answer {status}", headers=headers)

    app = web.Application()
    app.router.add_post("/hooks/{topic}", receive)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        async with pool.acquire() as conn:
            for topic in script:
                await aiooutbox.enqueue(conn, topic, {"t": topic}, headers=HEADERS)
        url = f"http://127.0.0.1:{server.port}/hooks/{{topic}}"
        retry = aiooutbox.RetryPolicy(base=0.05, jitter=0)
        async with relaying(pool, WebhookSink(url, secret=SECRET), retry=retry):
            for _ in range(300):
                if await counts(pool) == {"done": 3, "dead": 1}:
                    break
                await asyncio.sleep(0.05)
        rows = {
            r["topic"]: r
            for r in await pool.fetch(
                "SELECT topic, status::text, attempts, last_error, message_id::text "
                "FROM outbox_events_all"
            )
        }
    finally:
        await server.close()
    assert {t: (r["status"], r["attempts"]) for t, r in rows.items()} == {
        "flaky": ("done", 2),
        "gone": ("dead", 1),
        "busy": ("done", 2),
        "slow": ("done", 2),
    }
    assert "HTTP 410" in rows["gone"]["last_error"] and "answer 410" in rows["gone"]["last_error"]
    assert all(ok for _, _, ok, _ in seen), "every request verifies"
    assert all(tp == HEADERS["traceparent"] for *_, tp in seen)
    assert {(t, mid) for t, mid, _, _ in seen} == {(t, r["message_id"]) for t, r in rows.items()}
    # Retry-After: 1 was honoured: the second 429 attempt came at least ~1 s later
    assert rows["busy"]["attempts"] == 2


async def test_webhook_retry_after_sets_the_delay(pool: asyncpg.Pool) -> None:
    async def busy(request: web.Request) -> web.Response:
        return web.Response(status=429, headers={"Retry-After": "120"})

    app = web.Application()
    app.router.add_post("/", busy)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        async with pool.acquire() as conn:
            await aiooutbox.enqueue(conn, "hook", {})
        async with relaying(pool, WebhookSink(f"http://127.0.0.1:{server.port}/", secret=SECRET)):
            for _ in range(200):
                if (await counts(pool)).get("retry"):
                    break
                await asyncio.sleep(0.05)
    finally:
        await server.close()
    delay = await pool.fetchval(
        "SELECT extract(epoch FROM available_at - now()) FROM outbox_events_all"
    )
    assert 100 < delay <= 120, delay


# -- lifecycle, URLs, the runner -------------------------------------------------------------
@pytest.mark.parametrize(
    "url",
    [
        "nats://127.0.0.1:{port}",
        "amqp://guest:guest@127.0.0.1:{port}/",
        "kafka://127.0.0.1:{port}",
        "redis://127.0.0.1:{port}/0",
    ],
)
async def test_unreachable_broker_at_start_is_an_error(url: str) -> None:
    kwargs: dict[str, Any] = {"enable_idempotence": False} if url.startswith("kafka") else {}
    sink = sink_for_url(url.format(port=free_port()), connect_timeout=5, **kwargs)
    with pytest.raises(BrokerUnavailable):
        await sink.start()


async def test_sink_lifecycle_and_bad_input() -> None:
    sink = NatsSink(NATS_URL)
    with pytest.raises(aiooutbox.OutboxError, match="start it first"):
        await sink(aiooutbox.Event(1, "t", {}, None, message_id="m"))
    async with sink:
        assert sink.started
    await sink.close()  # twice is fine
    with pytest.raises(aiooutbox.OutboxError, match="starts once"):
        await sink.start()
    with pytest.raises(aiooutbox.InvalidArgument, match=r"only \{topic\} and \{ordering_key\}"):
        NatsSink(NATS_URL, destination="{topik}")
    with pytest.raises(aiooutbox.InvalidArgument, match="must start with"):
        sink_for_url("ftp://x")
    with pytest.raises(aiooutbox.InvalidArgument, match="secret"):
        sink_for_url("https://example.com/hook")
    with pytest.raises(aiooutbox.InvalidArgument, match="whsec_"):
        WebhookSink("https://example.com/hook", secret="whsec_not base64!")


async def test_runner_relays_every_topic_and_stops_on_sigterm(
    dsn: str, pool: asyncpg.Pool, js: Any
) -> None:
    stream, prefix = unique("RELAY"), unique("relay.cli.") + "."
    await nats_stream(js, stream, [prefix + ">"], "memory")
    try:
        await fill(pool, 200, topics=(prefix + "a", prefix + "b", prefix + "c"))
        from tests.relay.common import RelayProcess

        relay = RelayProcess(dsn, NATS_URL, "--concurrency", "128", "--max-in-flight", "32")
        await wait_done(pool, 200, timeout=60)
        assert await relay.stop() == 0
        assert (await js.stream_info(stream)).state.messages == 200
        found = {m.headers["Nats-Msg-Id"] for m in await nats_read(js, stream, prefix + ">")}
        assert found == await message_ids(pool)
    finally:
        await js.delete_stream(stream)


async def test_runner_bad_input_and_unreachable_broker(dsn: str) -> None:
    env = clean_env()
    result = await cli("relay", "--dsn", dsn, env=env)
    assert result.rc == 2 and "relay needs --to" in result.err
    result = await cli("relay", "--to", "ftp://x", "--dsn", dsn, env=env)
    assert result.rc == 2 and "must start with nats://" in result.err
    result = await cli("relay", "--to", NATS_URL, "--exchange", "x", "--dsn", dsn, env=env)
    assert result.rc == 2 and "only to amqp" in result.err
    result = await cli("relay", "--to", NATS_URL, "--max-in-flight", "0", "--dsn", dsn, env=env)
    assert result.rc == 2 and "--max-in-flight" in result.err, result.err
    port = free_port()
    result = await cli("relay", "--to", f"nats://127.0.0.1:{port}", "--dsn", dsn, env=env)
    assert result.rc == 1
    errors = [line for line in result.err_lines if "error" in line]
    assert errors == [
        f"python -m aiooutbox: error: nats at nats://127.0.0.1:{port}: "
        "NoServersError: nats: no servers available for connection"
    ], result.err
