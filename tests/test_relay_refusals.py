"""A relay tells a broker's refusal of one event from a broker outage.

A refusal that will never change (a destination the broker cannot take, a message over
its size limit, no route for it) sends the event to ``dead`` on its first attempt with
the broker's reason; it does not hold a worker for ``reconnect_wait`` as an outage
does, nor spend every attempt with backoff while its key waits. Each case runs against
the real broker; the retry policy here waits 10 minutes, so an event that was retried
instead of refused cannot reach ``dead`` within the test.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

import asyncpg
import nats
import pytest
import redis.asyncio as aioredis
import redis.exceptions
from aiohttp import web
from aiohttp.test_utils import TestServer

import aiooutbox
from aiooutbox.relay import KafkaSink, NatsSink, RabbitMQSink, RedisSink, WebhookSink
from tests.clirunner import clean_env, cli
from tests.programs import needs, program
from tests.relay.brokers import (
    AMQP_URL,
    NATS_URL,
    REDIS_URL,
    PrivateNats,
    PrivateRabbit,
    PrivateRedis,
    Tansu,
    free_port,
    tansu,
)
from tests.relay.common import kafka_read, kafka_topic, nats_read, nats_stream, relaying, unique

#: a retried event cannot come back within a test
RETRY_LATER = aiooutbox.RetryPolicy(base=600, jitter=0)
#: how long the refused events may take to settle: they need one claim and one publish
SETTLE_WITHIN = 20.0
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def kafka() -> Iterator[Tansu]:
    with tansu() as broker:
        yield broker


@pytest.fixture
async def nc() -> AsyncIterator[Any]:
    client = await nats.connect(NATS_URL)
    yield client
    await client.close()


async def enqueue(
    pool: asyncpg.Pool,
    topic: str,
    payload: Any = None,
    headers: dict[str, Any] | None = None,
    **kwargs: Any,
) -> int:
    async with pool.acquire() as conn:
        event_id = await aiooutbox.enqueue(
            conn, topic, payload if payload is not None else {}, headers=headers, **kwargs
        )
    assert event_id is not None
    return event_id


async def settled(pool: asyncpg.Pool, ids: list[int], within: float) -> dict[int, Any]:
    """Wait until every event of ``ids`` is done or dead; its rows by id."""
    began = time.monotonic()
    query = "SELECT id, topic, status::text, attempts, last_error FROM outbox_events_all"
    while True:
        rows = {r["id"]: r for r in await pool.fetch(query + " WHERE id = ANY($1)", ids)}
        if all(r["status"] in ("done", "dead") for r in rows.values()):
            print(f"settled in {time.monotonic() - began:.2f}s")
            return rows
        if time.monotonic() - began > within:
            found = {i: (r["topic"][:40], r["status"], r["attempts"]) for i, r in rows.items()}
            raise AssertionError(f"not settled after {within}s: {found}")
        await asyncio.sleep(0.1)


def assert_refused(rows: dict[int, Any], refused: dict[int, str]) -> None:
    """Each of ``refused`` dead on its first attempt, its last error naming the reason."""
    for event_id, reason in refused.items():
        row = rows[event_id]
        assert (row["status"], row["attempts"]) == ("dead", 1), (row["topic"][:60], dict(row))
        assert reason in row["last_error"], (reason, row["last_error"])


def no_outage_logged(caplog: pytest.LogCaptureFixture) -> None:
    outages = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert not outages, f"an event's own refusal was logged as an outage: {outages}"


# -- NATS JetStream ------------------------------------------------------------------------
async def test_nats_refusals_dead_at_once(
    pool: asyncpg.Pool, nc: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Subjects NATS cannot take, or would read as wildcards or as its own API, messages
    over ``max_payload`` (the payload, or payload and headers together: the server
    closes the connection for those), over a stream's ``max_msg_size``, and subjects
    no stream captures: dead at once, the broker's reason kept, the relay unharmed."""
    caplog.set_level(logging.WARNING, "aiooutbox")
    js = nc.jetstream()
    stream, prefix = unique("REFUSE"), unique("refuse")
    small, small_prefix = unique("REFUSESMALL"), unique("refusesmall")
    await nats_stream(js, stream, [prefix + ".>"], "memory")
    await js.add_stream(name=small, subjects=[small_prefix + ".>"], max_msg_size=1000)
    assert nc.max_payload == MIB, "the shared server's max_payload is the default"
    try:
        refused = {
            await enqueue(pool, prefix + "..created"): "empty token",
            await enqueue(pool, prefix + ".created."): "empty token",
            await enqueue(pool, prefix + ".*"): "wildcard",
            await enqueue(pool, prefix + ".orders.>"): "wildcard",
            await enqueue(pool, prefix + ".a b"): "whitespace",
            await enqueue(pool, f"$JS.API.STREAM.INFO.{stream}"): "reserved",
            await enqueue(pool, prefix + ".big", {"x": "a" * MIB}): "max_payload",
            await enqueue(
                pool, prefix + ".bigheaders", {"x": "a" * (MIB - 2000)}, {"h": "b" * 5000}
            ): "max_payload",
            await enqueue(pool, prefix + ".badheader", headers={"a b": "c"}): "header",
            await enqueue(pool, small_prefix + ".x", {"x": "a" * 2000}): (
                "message size exceeds maximum allowed"
            ),
            await enqueue(pool, unique("refuse.nostream.")): "no JetStream stream captures",
        }
        good = [await enqueue(pool, f"{prefix}.ok.{n}", {"n": n}) for n in range(3)]
        async with relaying(pool, NatsSink(NATS_URL), retry=RETRY_LATER):
            rows = await settled(pool, [*refused, *good], SETTLE_WITHIN)
        assert_refused(rows, refused)
        assert all(rows[i]["status"] == "done" for i in good), [dict(rows[i]) for i in good]
        stored = await nats_read(js, stream, prefix + ".>")
        assert sorted(m.subject for m in stored) == [f"{prefix}.ok.{n}" for n in range(3)]
        assert (await js.stream_info(small)).state.messages == 0
        no_outage_logged(caplog)
    finally:
        await js.delete_stream(stream)
        await js.delete_stream(small)


async def test_nats_reply_that_is_no_puback_is_not_stored(pool: asyncpg.Pool, nc: Any) -> None:
    """A plain NATS service answering on the subject is not JetStream storing it."""
    subject = unique("refuse.service.")

    async def answer(msg: Any) -> None:
        await msg.respond(b'{"ok":true}')

    sub = await nc.subscribe(subject, cb=answer)
    await nc.flush()
    try:
        event_id = await enqueue(pool, subject)
        async with relaying(pool, NatsSink(NATS_URL), retry=RETRY_LATER):
            rows = await settled(pool, [event_id], SETTLE_WITHIN)
        assert_refused(rows, {event_id: "not a JetStream PubAck"})
    finally:
        await sub.unsubscribe()


async def test_nats_sink_connects_again_after_the_server_closed_its_connection(
    pool: asyncpg.Pool, nc: Any
) -> None:
    """nats-py gives up a connection for good when the server answers a protocol error
    (-ERR) and closes it; the sink opens a new one instead of holding every event."""
    js = nc.jetstream()
    stream, prefix = unique("REOPEN"), unique("reopen")
    await nats_stream(js, stream, [prefix + ".>"], "memory")
    try:
        sink = NatsSink(NATS_URL)
        async with relaying(pool, sink, retry=RETRY_LATER):
            first = await enqueue(pool, prefix + ".first")
            await settled(pool, [first], SETTLE_WITHIN)
            # the fault: a line the server answers with -ERR (and closes the connection)
            client = sink._nc
            client._transport.write(b"NOT-A-NATS-OPERATION\r\n")
            await client._transport.drain()
            for _ in range(100):
                if client.is_closed:
                    break
                await asyncio.sleep(0.05)
            assert client.is_closed, "the server did not close the connection"
            later = [await enqueue(pool, f"{prefix}.later.{n}") for n in range(5)]
            rows = await settled(pool, later, SETTLE_WITHIN)
        assert {(r["status"], r["attempts"]) for r in rows.values()} == {("done", 1)}
        assert (await js.stream_info(stream)).state.messages == 6
    finally:
        await js.delete_stream(stream)


async def test_relay_command_refuses_a_destination_the_broker_cannot_take(dsn: str) -> None:
    result = await cli("relay", "--to", NATS_URL, "--destination", "outbox.>.{topic}", "--dsn", dsn)
    assert result.rc == 2, result.err
    assert result.err_lines == [
        "python -m aiooutbox: error: --to/--destination: destination 'outbox.>.{topic}' "
        "cannot work with nats: a '*' or '>' token is a wildcard to NATS, and a message "
        "cannot be published to a wildcard subject"
    ], result.err


@pytest.mark.slow
@needs("nats-server")
async def test_nats_publish_permission_violation_is_no_outage(pool: asyncpg.Pool) -> None:
    """A subject the user may not publish to: the server drops the message and says so
    (-ERR 'Permissions Violation'); no PubAck will ever come. The event is retried with
    the policy at once (a grant can fix it), not held for ``reconnect_wait`` as if the
    server were away, and the events beside it are published."""
    config = """
    authorization {
      users = [{user: relay, password: secret, permissions: {publish: {deny: ["denied.>"]}}}]
    }
    """
    broker = PrivateNats(config)
    broker.start()
    url = f"nats://relay:secret@127.0.0.1:{broker.port}"
    try:
        client = await nats.connect(url)
        await nats_stream(client.jetstream(), "PERMS", ["denied.>", "allowed.>"], "memory")
        await client.close()
        denied = await enqueue(pool, "denied.orders")
        allowed = [await enqueue(pool, f"allowed.orders.{n}") for n in range(5)]
        began = time.monotonic()
        async with relaying(pool, NatsSink(url), retry=RETRY_LATER):
            while True:
                row = await pool.fetchrow(
                    "SELECT status::text, attempts, last_error"
                    " FROM outbox_events_all WHERE id = $1",
                    denied,
                )
                if row["status"] == "retry" or time.monotonic() - began > SETTLE_WITHIN:
                    break
                await asyncio.sleep(0.1)
            rows = await settled(pool, allowed, SETTLE_WITHIN)
        print(f"the denied event failed after {time.monotonic() - began:.2f}s")
        assert (row["status"], row["attempts"]) == ("retry", 1), dict(row)
        assert "Permissions Violation" in row["last_error"], row["last_error"]
        assert {(r["status"], r["attempts"]) for r in rows.values()} == {("done", 1)}
    finally:
        broker.destroy()


def test_nats_destination_templates_checked_at_construction() -> None:
    with pytest.raises(aiooutbox.InvalidArgument, match="empty token"):
        NatsSink(NATS_URL, destination="outbox..{topic}")
    with pytest.raises(aiooutbox.InvalidArgument, match="wildcard"):
        NatsSink(NATS_URL, destination="outbox.*.{topic}")


# -- RabbitMQ ------------------------------------------------------------------------------
async def test_rabbitmq_refusals_dead_at_once(
    pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """No queue bound (the mandatory publish came back) and a routing key over AMQP's 255
    bytes: dead at once. A topic over 255 bytes routed by a short destination is
    delivered (AMQP's ``type`` property cannot hold it; the outbox-topic header does)."""
    import aio_pika

    caplog.set_level(logging.WARNING, "aiooutbox")
    queue_name = unique("refuse-q-")
    async with await aio_pika.connect(AMQP_URL) as connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(queue_name)
        try:
            long_topic = "é" * 200  # 200 characters, 400 bytes
            refused = {
                await enqueue(pool, unique("refuse-nowhere-"), ordering_key="k"): "NO_ROUTE",
                await enqueue(pool, long_topic, ordering_key="k"): "255 bytes at most",
            }
            async with relaying(
                pool,
                RabbitMQSink(AMQP_URL, destination="{ordering_key}{topic}"),
                retry=RETRY_LATER,
            ):
                rows = await settled(pool, list(refused), SETTLE_WITHIN)
            assert_refused(rows, refused)
            delivered = await enqueue(pool, long_topic, {"n": 1})
            sink = RabbitMQSink(AMQP_URL, destination=queue_name)
            async with relaying(pool, sink, retry=RETRY_LATER, topics=[long_topic]):
                rows = await settled(pool, [delivered], SETTLE_WITHIN)
            assert (rows[delivered]["status"], rows[delivered]["attempts"]) == ("done", 1)
            (message,) = [m async for m in _drain(queue)]
            assert message.headers["outbox-topic"] == long_topic
            assert message.type is None
            no_outage_logged(caplog)
        finally:
            await queue.delete(if_unused=False, if_empty=False)


async def _drain(queue: Any) -> AsyncIterator[Any]:
    while (message := await queue.get(no_ack=True, fail=False, timeout=5)) is not None:
        yield message


def test_rabbitmq_destination_templates_checked_at_construction() -> None:
    with pytest.raises(aiooutbox.InvalidArgument, match="255 bytes at most"):
        RabbitMQSink(AMQP_URL, destination="x" * 256 + "{topic}")


@pytest.mark.slow
@needs("rabbitmq-server")
async def test_rabbitmq_message_over_max_message_size_dead_at_once(pool: asyncpg.Pool) -> None:
    """RabbitMQ closes the channel on a message over ``max_message_size``: the event is
    dead at once with the broker's reason, the others published beside it are
    published again on the reopened channel (no attempt spent), and a second
    oversized event is refused without publishing it."""
    import aio_pika

    broker = PrivateRabbit()
    with (broker.dir / "rabbit.conf").open("a") as conf:
        conf.write("max_message_size = 4096\n")
    broker.start()
    try:
        async with await aio_pika.connect(broker.url) as connection:
            channel = await connection.channel()
            await channel.declare_queue("refuse")
        big = await enqueue(pool, "refuse", {"x": "a" * 5000})
        small = [await enqueue(pool, "refuse", {"n": n}) for n in range(20)]
        sink = RabbitMQSink(broker.url, destination="refuse")
        async with relaying(pool, sink, retry=RETRY_LATER, concurrency=32):
            rows = await settled(pool, [big, *small], 60)
            second = await enqueue(pool, "refuse", {"x": "b" * 5000})
            rows.update(await settled(pool, [second], SETTLE_WITHIN))
        reason = "larger than configured max size 4096"
        assert_refused(rows, {big: reason, second: reason})
        assert {(rows[i]["status"], rows[i]["attempts"]) for i in small} == {("done", 1)}
    finally:
        broker.destroy()


@pytest.mark.slow
@needs("rabbitmq-server", "rabbitmqctl")
async def test_rabbitmq_access_refused_is_no_outage(pool: asyncpg.Pool) -> None:
    """ACCESS_REFUSED closes the channel as an outage would, but it is the user's
    permissions: the event is retried with the policy at once, not held for
    ``reconnect_wait`` while the sink republishes it on channel after channel."""
    import aio_pika

    broker = PrivateRabbit()
    broker.start()
    try:
        # guest may write (publish) only to exchanges whose name starts with "allowed"
        permissions = ["set_permissions", "-p", "/", "guest", ".*", "^allowed.*", ".*"]
        subprocess.run(
            [program("rabbitmqctl"), "-n", broker.name, *permissions], check=True, timeout=60
        )
        async with await aio_pika.connect(broker.url) as connection:
            channel = await connection.channel()
            await channel.declare_exchange("denied", aio_pika.ExchangeType.FANOUT)
        event_id = await enqueue(pool, "orders")
        began = time.monotonic()
        sink = RabbitMQSink(broker.url, exchange="denied")
        async with relaying(pool, sink, retry=RETRY_LATER):
            while True:
                row = await pool.fetchrow(
                    "SELECT status::text, attempts, last_error"
                    " FROM outbox_events_all WHERE id = $1",
                    event_id,
                )
                if row["status"] == "retry" or time.monotonic() - began > SETTLE_WITHIN:
                    break
                await asyncio.sleep(0.1)
        print(f"the refused event failed after {time.monotonic() - began:.2f}s")
        assert (row["status"], row["attempts"]) == ("retry", 1), dict(row)
        assert "ACCESS_REFUSED" in row["last_error"], row["last_error"]
    finally:
        broker.destroy()


# -- Kafka (Tansu) -------------------------------------------------------------------------
@needs("tansu")
async def test_kafka_refusals_dead_at_once(
    pool: asyncpg.Pool, kafka: Tansu, caplog: pytest.LogCaptureFixture
) -> None:
    """Names Kafka's topic rules refuse (legal characters ``[a-zA-Z0-9._-]``, at most
    249 of them, not ``.`` or ``..``) and a record over ``max_request_size``: dead at
    once. Before, the client waited for metadata of a topic that cannot exist, which
    looked like an outage."""
    caplog.set_level(logging.WARNING, "aiooutbox")
    topic = unique("refuse.")
    await kafka_topic(kafka.bootstrap, topic)
    refused = {
        await enqueue(pool, "orders created"): "not a valid Kafka topic name",
        await enqueue(pool, ".."): "not a valid Kafka topic name",
        await enqueue(pool, "x" * 250): "not a valid Kafka topic name",
        await enqueue(pool, "zoë"): "not a valid Kafka topic name",
        await enqueue(pool, "orders/created"): "not a valid Kafka topic name",
        await enqueue(pool, topic, {"x": "a" * MIB}): "MessageSizeTooLargeError",
    }
    good = await enqueue(pool, topic, {"n": 1})
    sink = KafkaSink(kafka.bootstrap, enable_idempotence=False, publish_timeout=3)
    async with relaying(pool, sink, retry=RETRY_LATER):
        rows = await settled(pool, [*refused, good], SETTLE_WITHIN)
    assert_refused(rows, refused)
    assert (rows[good]["status"], rows[good]["attempts"]) == ("done", 1)
    (message,) = await kafka_read(kafka.bootstrap, topic, 1)
    assert json.loads(message.value) == {"n": 1}
    no_outage_logged(caplog)


def test_kafka_destination_templates_checked_at_construction() -> None:
    with pytest.raises(aiooutbox.InvalidArgument, match="not a valid Kafka topic name"):
        KafkaSink("127.0.0.1:9092", destination="outbox/{topic}")


@needs("tansu")
async def test_kafka_without_idempotent_producers_names_the_flag(dsn: str, kafka: Tansu) -> None:
    """Tansu's memory store refuses idempotent producers: one line naming the flag."""
    result = await cli("relay", "--to", f"kafka://{kafka.bootstrap}", "--dsn", dsn, env=clean_env())
    assert result.rc == 1, result.err
    errors = [line for line in result.err_lines if "error" in line.lower()]
    assert len(errors) == 1, result.err
    assert "--no-idempotence" in errors[0] and "idempotent" in errors[0], errors
    with pytest.raises(aiooutbox.relay.BrokerUnavailable, match="enable_idempotence=False"):
        await KafkaSink(kafka.bootstrap).start()


# -- Redis Streams -------------------------------------------------------------------------
async def test_redis_wrong_type_key_dead_at_once(pool: asyncpg.Pool) -> None:
    """A stream name that holds another type of value: the server says WRONGTYPE."""
    key = unique("refuse:string:")
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await client.set(key, "not a stream")
        refused = await enqueue(pool, key)
        async with relaying(pool, RedisSink(REDIS_URL), retry=RETRY_LATER):
            rows = await settled(pool, [refused], SETTLE_WITHIN)
        assert_refused(rows, {refused: "WRONGTYPE"})
        assert await client.get(key) == b"not a stream"
    finally:
        await client.delete(key)
        await client.aclose()


async def test_redis_headers_field_is_the_events_headers_as_json(pool: asyncpg.Pool) -> None:
    stream = unique("refuse:headers:")
    headers = {"x-num": 0, "flag": True, "list": [1, "a"], "none": None, "text": "0"}
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        event_id = await enqueue(pool, stream, headers=headers)
        async with relaying(pool, RedisSink(REDIS_URL), retry=RETRY_LATER):
            await settled(pool, [event_id], SETTLE_WITHIN)
        ((_, fields),) = cast(Any, await client.xrange(stream))
        assert json.loads(fields[b"headers"]) == headers
    finally:
        await client.delete(stream)
        await client.aclose()


@pytest.mark.slow
@needs("redis-server")
async def test_redis_value_over_proto_max_bulk_len_dead_at_once(pool: asyncpg.Pool) -> None:
    """A private server with ``proto-max-bulk-len`` at its minimum (1 MB): the payload
    over it is refused ("invalid bulk length") and dead at once; the server drops the
    connection, and the events after it are published on a new one."""
    broker = PrivateRedis()
    broker.start()
    client = aioredis.Redis.from_url(broker.url)
    try:
        await client.config_set("proto-max-bulk-len", MIB)
        refused = await enqueue(pool, "refuse", {"x": "a" * MIB})
        later = [await enqueue(pool, "refuse", {"n": n}) for n in range(5)]
        async with relaying(pool, RedisSink(broker.url), retry=RETRY_LATER):
            rows = await settled(pool, [refused, *later], SETTLE_WITHIN)
        assert_refused(rows, {refused: "proto-max-bulk-len"})
        assert {(rows[i]["status"], rows[i]["attempts"]) for i in later} == {("done", 1)}
        assert await client.xlen("refuse") == 5
    finally:
        await client.aclose()
        broker.destroy()


@pytest.mark.slow
@needs("redis-server")
async def test_redis_out_of_memory_is_held_as_an_outage(pool: asyncpg.Pool) -> None:
    """A server over its ``maxmemory`` answers OOM to every write until memory frees:
    the events wait (no attempt spent), as for a lost connection, and are published
    once it has room, every one on its first attempt."""
    broker = PrivateRedis()
    broker.start()
    client = aioredis.Redis.from_url(broker.url)
    try:
        await client.set("ballast", "x" * (4 * MIB))
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", MIB)  # now over it: every write is refused
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            await client.xadd("probe", {"a": "b"})
        ids = [await enqueue(pool, "full", {"n": n}) for n in range(5)]
        sink = RedisSink(broker.url, reconnect_wait=60)
        async with relaying(pool, sink, retry=RETRY_LATER):
            await asyncio.sleep(3)
            held = await pool.fetch(
                "SELECT status::text, attempts FROM outbox_events_all WHERE id = ANY($1)", ids
            )
            await client.config_set("maxmemory", 0)  # room again
            rows = await settled(pool, ids, SETTLE_WITHIN)
        assert {(r["status"], r["attempts"]) for r in held} == {("processing", 1)}, held
        assert {(r["status"], r["attempts"]) for r in rows.values()} == {("done", 1)}
        assert await client.xlen("full") == 5
        assert sink.republished > 0
    finally:
        await client.aclose()
        broker.destroy()


# -- webhooks ------------------------------------------------------------------------------
SECRET = "whsec_" + base64.b64encode(b"a test secret of 24 bytes").decode()


async def test_webhook_topic_is_one_path_segment_and_bad_headers_dead_at_once(
    pool: asyncpg.Pool,
) -> None:
    """``{topic}`` in a webhook URL is percent-encoded: a topic with ``/``, ``..``, ``?``
    or ``#`` no longer changes the path or adds a query. A non-ASCII topic travels in
    the outbox-topic header as UTF-8; a header HTTP cannot carry is dead at once."""
    seen: list[tuple[str, str]] = []

    async def receive(request: web.Request) -> web.Response:
        seen.append((request.raw_path, request.headers["outbox-topic"]))
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/{tail:.*}", receive)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        delivered = {
            await enqueue(pool, "a/../../admin"): "/hooks/a%2F..%2F..%2Fadmin/in",
            await enqueue(pool, ".."): "/hooks/%2E%2E/in",
            await enqueue(pool, "a?x=1#f"): "/hooks/a%3Fx%3D1%23f/in",
            await enqueue(pool, "zoë"): "/hooks/zo%C3%AB/in",
        }
        refused = {await enqueue(pool, "t", headers={"x": "a\nb"}): "header"}
        url = f"http://127.0.0.1:{server.port}/hooks/{{topic}}/in"
        async with relaying(pool, WebhookSink(url, secret=SECRET), retry=RETRY_LATER):
            rows = await settled(pool, [*delivered, *refused], SETTLE_WITHIN)
    finally:
        await server.close()
    assert_refused(rows, refused)
    assert {(rows[i]["status"], rows[i]["attempts"]) for i in delivered} == {("done", 1)}
    topics = {rows[i]["topic"]: path for i, path in delivered.items()}
    assert sorted(seen) == sorted((path, topic) for topic, path in topics.items())
