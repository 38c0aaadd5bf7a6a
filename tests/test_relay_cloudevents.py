"""``--format cloudevents``: every relayed message read back by the `cloudevents` SDK
(PyPI), in each broker's binding, against the real brokers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from datetime import UTC
from typing import Any
from urllib.parse import unquote, urlsplit

import asyncpg
import nats
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestServer
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings import amqp as ce_amqp
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.formats.json import JSONFormat

import aiooutbox
from aiooutbox.relay import KafkaSink, NatsSink, RabbitMQSink, RedisSink, WebhookSink
from tests.clirunner import clean_env, cli
from tests.conftest import Databases, with_database
from tests.programs import needs
from tests.relay.brokers import AMQP_URL, NATS_URL, REDIS_URL, Tansu, free_port, tansu
from tests.relay.common import (
    RelayProcess,
    counts,
    kafka_read,
    kafka_topic,
    nats_read,
    nats_stream,
    rabbit_read,
    relaying,
    unique,
    wait_done,
)

SECRET = "whsec_dGVzdCBzZWNyZXQgb2YgZW5vdWdoIGJ5dGVz"
KEY = 'order 1/100% "x"'  # space, '%' and '"': percent-encoded in HTTP and NATS headers
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
SOURCE = "https://example.com/shop/orders?region=eu"
FORMAT = JSONFormat()


@pytest.fixture(scope="module")
def kafka() -> Iterator[Tansu]:
    with tansu() as broker:
        yield broker


@pytest.fixture
async def js() -> AsyncIterator[Any]:
    nc = await nats.connect(NATS_URL)
    yield nc.jetstream()
    await nc.close()


async def two_events(pool: asyncpg.Pool, topic: str) -> dict[str, dict[str, Any]]:
    """One event with an ordering key and trace context, one with neither; by message id."""
    async with pool.acquire() as conn:
        await aiooutbox.enqueue(
            conn,
            topic,
            {"order": 1, "name": "Zoë"},
            ordering_key=KEY,
            headers={"traceparent": TRACEPARENT, "tracestate": TRACESTATE, "n": 7},
        )
        await aiooutbox.enqueue(conn, topic, {"order": 2})
    rows = await pool.fetch(
        "SELECT message_id::text, topic, payload, ordering_key, created_at FROM outbox_events_all"
    )
    return {r["message_id"]: dict(r) for r in rows}


def check(events: list[BaseCloudEvent], rows: dict[str, dict[str, Any]], source: str) -> None:
    """Every row arrived once, as a valid CloudEvent 1.0 with the attributes it must have."""
    assert sorted(e.get_id() for e in events) == sorted(rows)
    for event in events:
        row = rows[event.get_id()]
        assert event.get_specversion() == "1.0"
        assert event.get_source() == source
        assert event.get_type() == row["topic"]
        assert event.get_datacontenttype() == "application/json"
        when = event.get_time()
        assert when is not None and when.tzinfo is not None
        # RFC 3339 with microseconds: the same instant as the row's created_at
        assert when.astimezone(UTC) == row["created_at"].astimezone(UTC), (when, row)
        assert event.get_data() == json.loads(row["payload"])
        attributes = event.get_attributes()
        if row["ordering_key"] is not None:
            assert attributes["partitionkey"] == KEY
            assert attributes["traceparent"] == TRACEPARENT
            assert attributes["tracestate"] == TRACESTATE
        else:
            for name in ("partitionkey", "traceparent", "tracestate"):
                assert name not in attributes, attributes


# -- Kafka: binary mode, through the CLI with the default source ---------------------------
@needs("tansu")
async def test_kafka_binary_via_the_cli(dsn: str, pool: asyncpg.Pool, kafka: Tansu) -> None:
    topic = unique("ce-kafka-")
    await kafka_topic(kafka.bootstrap, topic)
    rows = await two_events(pool, topic)
    relay = RelayProcess(
        dsn, f"kafka://{kafka.bootstrap}", "--no-idempotence", "--format", "cloudevents"
    )
    try:
        await wait_done(pool, 2, timeout=60)
    finally:
        assert await relay.stop() == 0, relay.stderr()
    records = await kafka_read(kafka.bootstrap, topic, 2)
    events = []
    for record in records:
        headers = dict(record.headers)
        assert headers["content-type"] == b"application/json"
        assert "ce_id" in headers and "ce_datacontenttype" not in headers
        message = ce_kafka.KafkaMessage(headers=headers, key=record.key, value=record.value)
        events.append(ce_kafka.from_kafka(message, FORMAT))
        if headers.get("ce_partitionkey"):
            assert record.key == KEY.encode()  # the partition key is the record key too
    database = unquote(urlsplit(dsn).path.lstrip("/"))
    check(events, rows, f"/aiooutbox/{database}/public.outbox_events")


@pytest.fixture
async def other_dsn(databases: Databases) -> AsyncIterator[str]:
    """A second fresh migrated database on the session's server."""
    name = await asyncio.wrap_future(databases.take())
    try:
        yield with_database(databases.admin_dsn, name)
    finally:
        databases.drop_later(name)


async def test_several_databases_each_their_own_source(
    dsn: str, pool: asyncpg.Pool, other_dsn: str, js: Any
) -> None:
    """One relay, two databases: each event's default source names its own database."""
    stream, topic = unique("CE"), unique("ce.many.")
    await nats_stream(js, stream, [topic], "memory")
    other = await asyncpg.create_pool(other_dsn, min_size=1, max_size=2)
    try:
        first = await two_events(pool, topic)
        second = await two_events(other, topic)
        relay = RelayProcess(
            [f"tenant-a={dsn}", f"tenant-b={other_dsn}"], NATS_URL, "--format", "cloudevents"
        )
        try:
            await wait_done(pool, 2, timeout=60)
            await wait_done(other, 2, timeout=60)
        finally:
            assert await relay.stop() == 0, relay.stderr()
        messages = await nats_read(js, stream, topic)
    finally:
        await other.close()
        await js.delete_stream(stream)
    events = [
        ce_http.from_http(ce_http.HTTPMessage(headers=dict(m.headers), body=m.data), FORMAT)
        for m in messages
    ]
    check(
        [e for e in events if e.get_id() in first],
        first,
        "/aiooutbox/tenant-a/public.outbox_events",
    )
    check(
        [e for e in events if e.get_id() in second],
        second,
        "/aiooutbox/tenant-b/public.outbox_events",
    )
    assert len(events) == 4


# -- HTTP: binary and structured -----------------------------------------------------------
@pytest.mark.parametrize("fmt", ["cloudevents", "cloudevents-structured"])
async def test_webhook_binary_and_structured(pool: asyncpg.Pool, fmt: str) -> None:
    seen: list[tuple[dict[str, str], bytes]] = []

    async def receive(request: web.Request) -> web.Response:
        seen.append((dict(request.headers), await request.read()))
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hooks/{topic}", receive)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        rows = await two_events(pool, "orders.created")
        url = f"http://127.0.0.1:{server.port}/hooks/{{topic}}"
        sink = WebhookSink(url, secret=SECRET, format=fmt, cloudevents_source=SOURCE)
        async with relaying(pool, sink):
            await wait_done(pool, 2)
    finally:
        await server.close()
    events = []
    for headers, body in seen:
        ce_headers = {k.lower(): v for k, v in headers.items() if k.lower().startswith("ce-")}
        if fmt == "cloudevents":
            assert headers["Content-Type"] == "application/json"
            assert ce_headers["ce-source"] == SOURCE  # printable ASCII: not escaped
            if "ce-partitionkey" in ce_headers:  # space, '%', '"': escaped (HTTP binding)
                assert ce_headers["ce-partitionkey"] == "order%201/100%25%20%22x%22"
        else:
            assert headers["Content-Type"] == "application/cloudevents+json"
            assert ce_headers == {}
        assert headers["webhook-id"]  # still signed as a Standard Webhook
        events.append(ce_http.from_http(ce_http.HTTPMessage(headers=headers, body=body), FORMAT))
    check(events, rows, SOURCE)


# -- AMQP (RabbitMQ): binary mode, cloudEvents_ application properties ---------------------
async def test_rabbitmq_binary(pool: asyncpg.Pool) -> None:
    import aio_pika

    queue_name = unique("ce-q-")
    async with await aio_pika.connect(AMQP_URL) as connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(queue_name, durable=True)
        try:
            rows = await two_events(pool, queue_name)
            sink = RabbitMQSink(AMQP_URL, format="cloudevents", cloudevents_source=SOURCE)
            async with relaying(pool, sink):
                await wait_done(pool, 2)
            messages = await rabbit_read(AMQP_URL, queue_name, 2)
        finally:
            await queue.delete()
    events = []
    for msg in messages:
        assert msg.content_type == "application/json"
        assert msg.message_id in rows
        assert msg.headers["cloudEvents_id"] == msg.message_id
        message = ce_amqp.AMQPMessage(
            properties={"content-type": msg.content_type},
            application_properties=dict(msg.headers),
            application_data=msg.body,
        )
        events.append(ce_amqp.from_amqp(message, FORMAT))
    check(events, rows, SOURCE)


# -- NATS: binary mode (ce- headers, read with the SDK's HTTP-header mapping) ---------------
async def test_nats_binary_and_structured(pool: asyncpg.Pool, js: Any) -> None:
    stream, topic = unique("CE"), unique("ce.nats.")
    await nats_stream(js, stream, [topic + ".>"], "memory")
    try:
        binary = await two_events(pool, topic + ".binary")
        sink = NatsSink(NATS_URL, format="cloudevents", cloudevents_source=SOURCE)
        async with relaying(pool, sink):
            await wait_done(pool, 2)
        structured = await two_events(pool, topic + ".structured")
        structured = {k: v for k, v in structured.items() if k not in binary}
        sink = NatsSink(NATS_URL, format="cloudevents-structured", cloudevents_source=SOURCE)
        async with relaying(pool, sink):
            await wait_done(pool, 4)
        messages = await nats_read(js, stream, topic + ".>")
    finally:
        await js.delete_stream(stream)
    found: dict[str, list[BaseCloudEvent]] = {"binary": [], "structured": []}
    for msg in messages:
        kind = msg.subject.rsplit(".", 1)[1]
        assert msg.headers["Nats-Msg-Id"]  # JetStream's dedupe is unchanged
        if kind == "binary":
            assert msg.headers["content-type"] == "application/json"
        else:
            assert msg.headers["content-type"] == "application/cloudevents+json"
            assert not any(k.startswith("ce-") for k in msg.headers)
        message = ce_http.HTTPMessage(headers=dict(msg.headers), body=msg.data)
        found[kind].append(ce_http.from_http(message, FORMAT))
    check(found["binary"], binary, SOURCE)
    check(found["structured"], structured, SOURCE)


# -- Redis: no binding, structured JSON in the payload field --------------------------------
async def test_redis_structured(pool: asyncpg.Pool) -> None:
    stream = unique("ce-stream-")
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        rows = await two_events(pool, stream)
        sink = RedisSink(REDIS_URL, format="cloudevents", cloudevents_source=SOURCE)
        async with relaying(pool, sink):
            await wait_done(pool, 2)
        entries: list[Any] = list(await client.xrange(stream) or [])
    finally:
        await client.delete(stream)
        await client.aclose()
    events = [FORMAT.read(None, fields[b"payload"]) for _, fields in entries]
    assert all(fields[b"message_id"].decode() in rows for _, fields in entries)
    check(events, rows, SOURCE)


# -- hostile input ---------------------------------------------------------------------------
def test_sink_refuses_a_bad_format_or_source() -> None:
    with pytest.raises(aiooutbox.InvalidArgument, match="unknown format 'xml'"):
        NatsSink(NATS_URL, format="xml")
    for bad, why in [
        ("", "must not be empty"),
        ("/orders with space", "' ' is not allowed"),
        ("/orders/%zz", "%XX escape"),
        ("1http://x", "not a scheme"),
        ("/a#b#c", "two '#'"),
        ("/zoë", "'ë' is not allowed"),
    ]:
        with pytest.raises(aiooutbox.InvalidArgument, match=why):
            KafkaSink("127.0.0.1:9092", format="cloudevents", cloudevents_source=bad)
    with pytest.raises(aiooutbox.InvalidArgument, match="only to the cloudevents formats"):
        RedisSink(REDIS_URL, cloudevents_source="/x")
    for good in ("/x", "urn:uuid:6e8bc430-9c3a-11d9-9669-0800200c9a66", "x/y", "https://a/b?c#d"):
        KafkaSink("127.0.0.1:9092", format="cloudevents", cloudevents_source=good)


async def test_cli_bad_format_or_source_publishes_nothing(
    dsn: str, pool: asyncpg.Pool, js: Any
) -> None:
    stream, topic = unique("CE"), unique("ce.bad.")
    await nats_stream(js, stream, [topic], "memory")
    try:
        await two_events(pool, topic)
        env = clean_env()
        for args, expected in [
            (("--format", "xml"), "--format: unknown format 'xml'"),
            (
                ("--format", "cloudevents", "--cloudevents-source", "not a uri"),
                "--cloudevents-source: CloudEvents source 'not a uri' is not a URI-reference",
            ),
            (("--cloudevents-source", "/x"), "--cloudevents-source applies only with"),
        ]:
            result = await cli("relay", "--to", NATS_URL, "--dsn", dsn, *args, env=env)
            assert result.rc == 2, result.err
            errors = [line for line in result.err_lines if "error" in line]
            assert len(errors) == 1 and expected in errors[0], result.err
            assert "Traceback" not in result.err
        await asyncio.sleep(0.2)
        assert await counts(pool) == {"pending": 2}
        assert (await js.stream_info(stream)).state.messages == 0
    finally:
        await js.delete_stream(stream)
