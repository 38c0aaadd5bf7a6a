"""docs/cloudevents.md's reading code, run against what a relay published: for every
binding, each snippet turns the real broker client's message (both CloudEvents formats
where the broker has a binding) into the CloudEvents the outbox rows say."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import nats
import pytest
import redis.asyncio as aioredis
from cloudevents.core.base import BaseCloudEvent

import aiooutbox
from aiooutbox.relay import KafkaSink, NatsSink, RabbitMQSink, RedisSink, WebhookSink, sign
from tests.programs import needs
from tests.relay.brokers import AMQP_URL, NATS_URL, REDIS_URL, Tansu, tansu
from tests.relay.common import (
    kafka_read,
    kafka_topic,
    nats_read,
    nats_stream,
    rabbit_read,
    relaying,
    unique,
    wait_done,
)

DOC = Path(__file__).resolve().parent.parent / "docs" / "cloudevents.md"
SECRET = "whsec_dGVzdCBzZWNyZXQgb2YgZW5vdWdoIGJ5dGVz"
SOURCE = "/shop/orders"
KEY = "order 1/100%"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
FORMATS = ("cloudevents", "cloudevents-structured")
#: what each snippet defines, in the page's order
DEFINES = ["app", "read_kafka", "read_amqp", "read_nats", "read_redis"]


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def snippet(name: str) -> dict[str, Any]:
    """The namespace of the snippet that defines ``name``, run as a module would be."""
    (code,) = [c for c in snippets() if re.search(rf"^(?:async def |def )?{name}\b", c, re.M)]
    namespace: dict[str, Any] = {"__name__": "cloudevents_doc"}
    exec(compile(code, str(DOC), "exec"), namespace)
    return namespace


def test_every_snippet_is_run_here() -> None:
    assert len(snippets()) == len(DEFINES)
    for code, name in zip(snippets(), DEFINES, strict=True):
        assert re.search(rf"^(?:async def |def )?{name}\b", code, re.M), name
    assert "cloudevents.http import" not in DOC.read_text()  # the 1.x module, gone in 2.x


@pytest.fixture(scope="module")
def kafka() -> Iterator[Tansu]:
    with tansu() as broker:
        yield broker


async def enqueue_two(pool: asyncpg.Pool, topic: str) -> dict[str, dict[str, Any]]:
    """One event with an ordering key and trace context, one with neither; by message id."""
    async with pool.acquire() as conn:
        await aiooutbox.enqueue(
            conn,
            topic,
            {"order": 1, "name": "Zoë"},
            ordering_key=KEY,
            headers={"traceparent": TRACEPARENT},
        )
        await aiooutbox.enqueue(conn, topic, {"order": 2})
    rows = await pool.fetch(
        "SELECT message_id::text, topic, payload, ordering_key, created_at FROM outbox_events_all"
        " WHERE topic = $1",
        topic,
    )
    return {r["message_id"]: dict(r) for r in rows}


def check(events: list[BaseCloudEvent], rows: dict[str, dict[str, Any]]) -> None:
    """Each row read once, with what the page says a reader gets."""
    assert sorted(e.get_id() for e in events) == sorted(rows)
    for event in events:
        row = rows[event.get_id()]
        assert event.get_specversion() == "1.0" and event.get_source() == SOURCE
        assert event.get_type() == row["topic"]
        when = event.get_time()
        assert when is not None and when.astimezone(UTC) == row["created_at"].astimezone(UTC)
        assert event.get_data() == json.loads(row["payload"])
        attributes = event.get_attributes()
        if row["ordering_key"] is not None:
            assert attributes["partitionkey"] == KEY
            assert attributes["traceparent"] == TRACEPARENT
        else:
            assert "partitionkey" not in attributes and "traceparent" not in attributes


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """``app`` under uvicorn in this loop on a free loopback port; its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(30):
            while not server.started:
                assert not task.done(), "uvicorn stopped before it served"
                await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        sock.close()


async def test_webhook_receiver(pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOOUTBOX_WEBHOOK_SECRET", SECRET)
    doc = snippet("app")
    received: list[BaseCloudEvent] = doc["received"]
    async with serving(doc["app"]) as url:
        for fmt in FORMATS:
            rows = await enqueue_two(pool, unique("orders."))
            sink = WebhookSink(
                f"{url}/hooks/{{topic}}", secret=SECRET, format=fmt, cloudevents_source=SOURCE
            )
            async with relaying(pool, sink):
                await wait_done(pool, len(received) + 2)
            check(received[-2:], rows)
        # the page's signature check refuses a forged or replayed request
        body = b'{"order": 3}'
        now = int(time.time())
        headers = {"content-type": "application/json", "ce-id": "x", "ce-source": "/x",
                   "ce-type": "t", "ce-specversion": "1.0", "webhook-id": "msg_1"}  # fmt: skip
        async with httpx.AsyncClient() as client:
            for timestamp, signature in [
                (now, "v1,Zm9yZ2Vk"),
                (now - 600, sign(SECRET, "msg_1", now - 600, body)),
                ("soon", sign(SECRET, "msg_1", now, body)),
            ]:
                forged = {**headers, "webhook-timestamp": str(timestamp)}
                forged["webhook-signature"] = signature
                response = await client.post(f"{url}/hooks/t", content=body, headers=forged)
                assert response.status_code == 401
            good = {**headers, "webhook-timestamp": str(now)}
            good["webhook-signature"] = sign(SECRET, "msg_1", now, body)
            response = await client.post(f"{url}/hooks/t", content=body, headers=good)
            assert response.status_code == 204
    assert len(received) == 5 and received[-1].get_id() == "x"


@needs("tansu")
async def test_kafka_reader(pool: asyncpg.Pool, kafka: Tansu) -> None:
    read_kafka = snippet("read_kafka")["read_kafka"]
    for fmt in FORMATS:
        topic = unique("ce-doc-")
        await kafka_topic(kafka.bootstrap, topic)
        rows = await enqueue_two(pool, topic)
        sink = KafkaSink(
            kafka.bootstrap, format=fmt, cloudevents_source=SOURCE, enable_idempotence=False
        )
        async with relaying(pool, sink, topics=[topic]):
            await wait_done(pool, 2 if fmt == FORMATS[0] else 4)
        check([read_kafka(r) for r in await kafka_read(kafka.bootstrap, topic, 2)], rows)


async def test_amqp_reader(pool: asyncpg.Pool) -> None:
    import aio_pika

    read_amqp = snippet("read_amqp")["read_amqp"]
    for done, fmt in enumerate(FORMATS, start=1):
        queue_name = unique("ce-doc-q-")
        async with await aio_pika.connect(AMQP_URL) as connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(queue_name, durable=True)
            try:
                rows = await enqueue_two(pool, queue_name)
                sink = RabbitMQSink(AMQP_URL, format=fmt, cloudevents_source=SOURCE)
                async with relaying(pool, sink, topics=[queue_name]):
                    await wait_done(pool, 2 * done)
                messages = await rabbit_read(AMQP_URL, queue_name, 2)
            finally:
                await queue.delete()
        check([read_amqp(m) for m in messages], rows)


async def test_nats_reader(pool: asyncpg.Pool) -> None:
    read_nats = snippet("read_nats")["read_nats"]
    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    try:
        for done, fmt in enumerate(FORMATS, start=1):
            stream, topic = unique("CEDOC"), unique("ce.doc.")
            await nats_stream(js, stream, [topic], "memory")
            try:
                rows = await enqueue_two(pool, topic)
                sink = NatsSink(NATS_URL, format=fmt, cloudevents_source=SOURCE)
                async with relaying(pool, sink, topics=[topic]):
                    await wait_done(pool, 2 * done)
                messages = await nats_read(js, stream, topic)
            finally:
                await js.delete_stream(stream)
            check([read_nats(m) for m in messages], rows)
    finally:
        await nc.close()


async def test_redis_reader(pool: asyncpg.Pool) -> None:
    read_redis = snippet("read_redis")["read_redis"]
    stream = unique("ce-doc-stream-")
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        rows = await enqueue_two(pool, stream)
        sink = RedisSink(REDIS_URL, format="cloudevents", cloudevents_source=SOURCE)
        async with relaying(pool, sink):
            await wait_done(pool, 2)
        entries: list[Any] = list(await client.xrange(stream) or [])
    finally:
        await client.delete(stream)
        await client.aclose()
    check([read_redis(fields) for _, fields in entries], rows)
