"""An event's own headers cannot pass for the relay's: every reserved name (``outbox-*``,
the CloudEvents prefixes, ``webhook-*``, ``content-*``, what a broker or its clients
read) in every case variant is dropped, on every broker and in every format; read back
with the real clients and the `cloudevents` SDK, the relay's own values are the only
ones there."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

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
from aiooutbox.relay import KafkaSink, NatsSink, RabbitMQSink, RedisSink, Sink, WebhookSink
from aiooutbox.relay._webhook import sign
from tests.relay.brokers import AMQP_URL, NATS_URL, REDIS_URL, Tansu, free_port, tansu
from tests.relay.common import (
    counts,
    kafka_read,
    kafka_topic,
    nats_read,
    nats_stream,
    rabbit_read,
    relaying,
    unique,
)

SECRET = "whsec_dGVzdCBzZWNyZXQgb2YgZW5vdWdoIGJ5dGVz"
SOURCE = "https://example.com/shop"
KEY = "customer-7"
FORMAT = JSONFormat()
SPOOFED = "spoofed"

#: what the relay or a binding reads as its own on every broker, as a producer might
#: spell it (docs/relay.md, "Reserved headers")
OWN_NAMES = [
    "outbox-topic",
    "outbox-event-id",
    "outbox-message-id",
    "outbox-dedupe-key",
    "outbox-ordering-key",
    *(f"ce-{a}" for a in ("id", "source", "type", "specversion", "time", "partitionkey")),
    "ce-datacontenttype",
    "ce-traceparent",
    *(f"ce_{a}" for a in ("id", "source", "type", "specversion", "time", "partitionkey")),
    *(f"cloudEvents_{a}" for a in ("id", "source", "type", "specversion", "partitionkey")),
    "cloudEvents:id",
    "cloudEvents:type",
    "content-type",
    "content-length",
    "content-encoding",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
]
#: and what one broker, its clients or HTTP read besides
BROKER_NAMES = {
    "nats": ["Nats-Msg-Id", "Nats-Expected-Stream", "Nats-Rollup", "Status"],
    "rabbitmq": ["CC", "BCC"],
    "redis": [],
    "kafka": [],
    "webhook": ["host", "transfer-encoding", "connection", "expect", "user-agent", "accept"],
}
#: what an old relay passed on and the broker or receiver then refused (RabbitMQ's CC as
#: a string; a second User-Agent or an Expect, aiohttp) or acted on (JetStream's
#: Nats-Rollup and Nats-Expected-Stream, nats-py's Status)
ACTED_ON = {"cc", "bcc", "nats-rollup", "nats-expected-stream", "status", "user-agent", "expect"}


def case_variants(name: str) -> set[str]:
    return {name, name.lower(), name.upper(), name.title(), name.swapcase(), name.capitalize()}


def spoofing(broker: str) -> dict[str, str]:
    """The issue's spoofing: each name in every case variant, as far as the broker or
    HTTP carries it and an old relay sent it."""
    return {
        variant: SPOOFED
        for name in OWN_NAMES + BROKER_NAMES[broker]
        for variant in case_variants(name)
        if re.fullmatch(r"[A-Za-z0-9_\-]+", variant) and variant.casefold() not in ACTED_ON
    }


def hostile(broker: str) -> dict[str, str]:
    """Every variant besides: names no token (a space, a ':'), what brokers act on."""
    return {
        variant: SPOOFED
        for name in OWN_NAMES + BROKER_NAMES[broker]
        for variant in case_variants(name) | {f" {name}", f"{name.upper()} "}
    }


#: an event's own headers that are nobody else's: they travel as before
MINE = {
    "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "x-tenant": "acme",
}
#: reserved on one broker, an ordinary header on the others
ELSEWHERE = {"nats": {"CC": "cc-list"}}


@dataclass
class Received:
    """One message as a consumer of the broker reads it."""

    headers: list[tuple[str, str]]  # every header, duplicates kept, values as text
    body: bytes
    read: Callable[[], BaseCloudEvent] | None = None  # the SDK's reading (cloudevents formats)
    fields: dict[str, str] = field(default_factory=dict)  # Redis: the entry's fields


def text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode()
    return value if isinstance(value, str) else json.dumps(value)


# -- publishing through each broker and reading back ----------------------------------------
@pytest.fixture(scope="module")
def kafka() -> Iterator[Tansu]:
    with tansu() as broker:
        yield broker


async def through_nats(pool: asyncpg.Pool, fmt: str, topic: str, **_: Any) -> list[Received]:
    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    stream = unique("RESERVED")
    await nats_stream(js, stream, [topic], "memory")
    try:
        await relay(pool, NatsSink(NATS_URL, **options(fmt)))
        messages = await nats_read(js, stream, topic)
    finally:
        await js.delete_stream(stream)
        await nc.close()
    found = []
    for m in messages:
        headers = dict(m.headers or {})
        http = ce_http.HTTPMessage(headers=headers, body=m.data)
        read = (lambda http=http: ce_http.from_http(http, FORMAT)) if fmt != "outbox" else None
        found.append(Received(list(headers.items()), m.data, read))
    return found


async def through_rabbitmq(pool: asyncpg.Pool, fmt: str, topic: str, **_: Any) -> list[Received]:
    import aio_pika

    async with await aio_pika.connect(AMQP_URL) as connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(topic, durable=True)
        try:
            await relay(pool, RabbitMQSink(AMQP_URL, **options(fmt)))
            messages = await rabbit_read(AMQP_URL, topic, 2)
        finally:
            await queue.delete()
    found = []
    for m in messages:
        headers = [(k, text(v)) for k, v in (m.headers or {}).items()]
        amqp = ce_amqp.AMQPMessage(
            properties={"content-type": m.content_type},
            application_properties=dict(headers),
            application_data=m.body,
        )
        read = (lambda amqp=amqp: ce_amqp.from_amqp(amqp, FORMAT)) if fmt != "outbox" else None
        found.append(Received(headers, m.body, read, {"message_id": m.message_id}))
    return found


async def through_redis(pool: asyncpg.Pool, fmt: str, topic: str, **_: Any) -> list[Received]:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await relay(pool, RedisSink(REDIS_URL, **options(fmt)))
        entries = list(await client.xrange(topic) or [])
    finally:
        await client.delete(topic)
        await client.aclose()
    found = []
    entry: Any
    for _entry_id, entry in entries:
        fields = {k.decode(): v.decode() for k, v in entry.items()}
        own = json.loads(fields["headers"])  # the event's own headers, as a JSON object
        body: bytes = entry[b"payload"]
        read = (lambda body=body: FORMAT.read(None, body)) if fmt != "outbox" else None
        found.append(Received([(k, text(v)) for k, v in own.items()], body, read, fields))
    return found


async def through_kafka(
    pool: asyncpg.Pool, fmt: str, topic: str, kafka: Tansu, **_: Any
) -> list[Received]:
    await kafka_topic(kafka.bootstrap, topic, partitions=1)
    sink = KafkaSink(kafka.bootstrap, enable_idempotence=False, **options(fmt))
    await relay(pool, sink)
    found = []
    for record in await kafka_read(kafka.bootstrap, topic, 2):
        headers = [(k, v.decode()) for k, v in record.headers]
        kmsg = ce_kafka.KafkaMessage(
            headers=dict(record.headers), key=record.key, value=record.value
        )
        read = (lambda kmsg=kmsg: ce_kafka.from_kafka(kmsg, FORMAT)) if fmt != "outbox" else None
        found.append(Received(headers, record.value, read))
    return found


async def through_webhook(pool: asyncpg.Pool, fmt: str, topic: str, **_: Any) -> list[Received]:
    seen: list[tuple[list[tuple[str, str]], dict[str, str], bytes]] = []

    async def receive(request: web.Request) -> web.Response:
        # a receiver as the SDK's README writes one: the headers as a mapping
        seen.append((list(request.headers.items()), dict(request.headers), await request.read()))
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hooks/{topic}", receive)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        url = f"http://127.0.0.1:{server.port}/hooks/{{topic}}"
        await relay(pool, WebhookSink(url, secret=SECRET, **options(fmt)))
    finally:
        await server.close()
    found = []
    for pairs, mapping, body in seen:
        http = ce_http.HTTPMessage(headers=mapping, body=body)
        read = (lambda http=http: ce_http.from_http(http, FORMAT)) if fmt != "outbox" else None
        found.append(Received(pairs, body, read))
    return found


BROKERS: dict[str, Callable[..., Awaitable[list[Received]]]] = {
    "nats": through_nats,
    "rabbitmq": through_rabbitmq,
    "redis": through_redis,
    "kafka": through_kafka,
    "webhook": through_webhook,
}
FORMATS = ["outbox", "cloudevents", "cloudevents-structured"]


def options(fmt: str) -> dict[str, Any]:
    return {"format": fmt, "cloudevents_source": SOURCE} if fmt != "outbox" else {}


async def relay(pool: asyncpg.Pool, sink: Sink, timeout: float = 30) -> None:
    """Relay the outbox through ``sink`` until both events are settled (or ``timeout``:
    the test then shows what did arrive, and what did not)."""
    import asyncio

    async with relaying(pool, sink):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (found := await counts(pool)).get("done", 0) + found.get("dead", 0) < 2:
            if loop.time() > deadline:
                return
            await asyncio.sleep(0.05)


# -- the test ---------------------------------------------------------------------------------
@asynccontextmanager
async def two_spoofing_events(
    pool: asyncpg.Pool, broker: str, topic: str
) -> AsyncIterator[dict[str, Any]]:
    """One event with an ordering and a dedupe key spoofing every name in every case
    variant; one with neither, whose names are hostile besides. Yields their rows by
    message id."""
    mine = {**MINE, **ELSEWHERE.get(broker, {"Status": "shipped"})}
    async with pool.acquire() as conn:
        await aiooutbox.enqueue(
            conn,
            topic,
            {"n": 1},
            ordering_key=KEY,
            dedupe_key="d-1",
            headers={**spoofing(broker), **mine},
        )
        await aiooutbox.enqueue(conn, topic, {"n": 2}, headers={**hostile(broker), **mine})
    rows = await pool.fetch("SELECT id, message_id::text, topic, payload FROM outbox_events_all")
    yield {r["message_id"]: dict(r) for r in rows}


def reserved(broker: str, name: str) -> bool:
    folded = name.strip().casefold()
    names = {n.casefold() for n in OWN_NAMES + BROKER_NAMES[broker]}
    return folded in names or folded.startswith(
        ("outbox-", "ce-", "ce_", "cloudevents", "webhook-", "content-")
    )


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("broker", list(BROKERS))
async def test_spoofed_reserved_headers_never_reach_the_consumer(
    broker: str,
    fmt: str,
    pool: asyncpg.Pool,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = unique("reserved.") if broker == "nats" else unique("reserved-")
    extra = {"kafka": request.getfixturevalue("kafka")} if broker == "kafka" else {}
    async with two_spoofing_events(pool, broker, topic) as rows:
        received = await BROKERS[broker](pool, fmt, topic, **extra)
    for message in received:
        spoofed = [(n, v) for n, v in message.headers if SPOOFED in v]
        assert not spoofed, f"{broker} {fmt}: spoofed headers arrived: {spoofed}"
    errors = await pool.fetch("SELECT status, last_error FROM outbox_events_all")
    assert await counts(pool) == {"done": 2}, errors
    assert len(received) == 2
    ids = set()
    for message in received:
        # each reserved name at most once, whatever its case: nothing beside the relay's
        folded = [n.strip().casefold() for n, _ in message.headers if reserved(broker, n)]
        assert len(folded) == len(set(folded)), sorted(folded)
        # the event's own other headers still travel
        values = dict(message.headers)
        assert values["x-tenant"] == "acme" and values["traceparent"] == MINE["traceparent"]
        for name, value in ELSEWHERE.get(broker, {"Status": "shipped"}).items():
            assert values[name] == value, values
        if broker in ("redis", "rabbitmq"):
            message_id = message.fields["message_id"]
        elif broker == "webhook":
            message_id = values["webhook-id"]
            timestamp = int(values["webhook-timestamp"])
            assert values["webhook-signature"] == sign(SECRET, message_id, timestamp, message.body)
        else:
            message_id = values["outbox-message-id"]
        if broker == "redis":
            assert message.fields["topic"] == topic
        else:
            assert values["outbox-message-id"] == message_id
            assert values["outbox-topic"] == topic
        assert message_id in rows
        ids.add(message_id)
        row = rows[message_id]
        if message.read is None:
            assert json.loads(message.body) == json.loads(row["payload"])
            continue
        event: BaseCloudEvent = message.read()  # as the SDK reads it: the relay's attributes only
        assert event.get_id() == message_id
        assert event.get_type() == topic
        assert event.get_source() == SOURCE
        assert event.get_specversion() == "1.0"
        assert event.get_datacontenttype() == "application/json"
        assert event.get_data() == json.loads(row["payload"])
        attributes = event.get_attributes()
        assert not [k for k, v in attributes.items() if SPOOFED in str(v)], attributes
        if row["payload"] == '{"n": 1}':
            assert attributes["partitionkey"] == KEY
        else:
            assert "partitionkey" not in attributes
    assert ids == set(rows)
    # the relay said what it dropped, once a name (both events carried Ce-Id)
    said = [r.getMessage() for r in caplog.records if r.name == "aiooutbox.relay"]
    assert len([m for m in said if "header 'Ce-Id' is not published" in m]) == 1, said
