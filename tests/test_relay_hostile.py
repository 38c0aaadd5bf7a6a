"""Hostile input to a relay: events no broker can carry as they are, and URLs and
templates that must be refused in one line without showing a secret.

An event the relay cannot carry (headers over RabbitMQ's frame, a header name its
client would cut, a header value HTTP refuses, a payload nested past the JSON
encoder) is dead on its first attempt with the reason, its neighbours published; the
retry policy waits 10 minutes, so an event retried instead cannot reach ``dead`` here.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import asyncpg
import nats
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestServer

import aiooutbox
from aiooutbox.relay import NatsSink, RabbitMQSink, RedisSink, WebhookSink, sink_for_url
from tests.clirunner import clean_env, cli
from tests.relay.brokers import AMQP_URL, NATS_URL, REDIS_URL, free_port
from tests.relay.common import nats_read, nats_stream, relaying, unique

RETRY_LATER = aiooutbox.RetryPolicy(base=600, jitter=0)
SETTLE_WITHIN = 20.0
SECRET = "whsec_" + base64.b64encode(b"a test secret of 24 bytes").decode()


async def insert(
    pool: asyncpg.Pool, topic: str, payload_sql: str = "'{}'::jsonb", **values: Any
) -> int:
    """A row as a raw SQL producer writes it: jsonb takes what `enqueue` may not."""
    headers = values.get("headers", "'{}'::jsonb")
    event_id: int = await pool.fetchval(
        f"INSERT INTO outbox_events (topic, payload, headers, ordering_key)"
        f" VALUES ($1, {payload_sql}, {headers}, $2) RETURNING id",
        topic,
        values.get("key"),
    )
    return event_id


async def settled(pool: asyncpg.Pool, ids: list[int]) -> dict[int, Any]:
    """Every row of ``ids`` once each is done or dead (none may be left to retry)."""
    began = time.monotonic()
    query = "SELECT id, status::text, attempts, last_error, locked_by FROM outbox_events_all"
    while True:
        rows = {r["id"]: r for r in await pool.fetch(query + " WHERE id = ANY($1)", ids)}
        if all(r["status"] in ("done", "dead") for r in rows.values()):
            return rows
        if time.monotonic() - began > SETTLE_WITHIN:
            raise AssertionError(f"not settled: {[dict(r) for r in rows.values()]}")
        await asyncio.sleep(0.1)


def outcomes(rows: dict[int, Any], dead: dict[int, str]) -> None:
    """``dead`` (id -> reason) dead on their first attempt; every other row done on its."""
    for event_id, row in rows.items():
        if event_id in dead:
            assert (row["status"], row["attempts"]) == ("dead", 1), dict(row)
            assert dead[event_id] in row["last_error"], (dead[event_id], row["last_error"])
            assert "Traceback" not in row["last_error"]
        else:
            assert (row["status"], row["attempts"]) == ("done", 1), dict(row)


@pytest.fixture
async def rabbit_queue() -> AsyncIterator[tuple[str, Any]]:
    name = unique("hostile-q-")
    async with await aio_pika.connect(AMQP_URL) as connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(name)
        try:
            yield name, queue
        finally:
            await queue.delete(if_unused=False, if_empty=False)


async def drained(queue: Any) -> list[Any]:
    found = []
    while (message := await queue.get(no_ack=True, fail=False, timeout=5)) is not None:
        found.append(message)
    return found


# -- RabbitMQ ------------------------------------------------------------------------------
async def test_rabbitmq_headers_over_frame_max_dead_alone(
    pool: asyncpg.Pool, rabbit_queue: tuple[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Headers over the connection's frame_max (RabbitMQ closes the whole connection for
    them) are refused before publishing: no outage, no hold, the neighbours published;
    headers just under it go."""
    caplog.set_level(logging.WARNING, "aiooutbox")
    name, queue = rabbit_queue
    ids = [await insert(pool, "t", f"'{{\"n\": {n}}}'::jsonb") for n in range(3)]
    big = await insert(pool, "t", headers="jsonb_build_object('x-big', repeat('h', 200000))")
    near = await insert(pool, "t", headers="jsonb_build_object('x-near', repeat('h', 130000))")
    ids += [await insert(pool, "t", f"'{{\"n\": {n}}}'::jsonb") for n in range(3, 6)]
    sink = RabbitMQSink(AMQP_URL, destination=name, reconnect_wait=30)
    async with relaying(pool, sink, retry=RETRY_LATER):
        rows = await settled(pool, [*ids, big, near])
    outcomes(rows, {big: "over the connection's frame_max of 131072"})
    assert sink.republished == 0
    got = await drained(queue)
    assert len(got) == 7
    assert [len(m.headers.get("x-near", "")) for m in got].count(130000) == 1
    assert not [r for r in caplog.records if "unavailable" in r.getMessage()]


async def test_rabbitmq_header_names_over_128_bytes_dead(
    pool: asyncpg.Pool, rabbit_queue: tuple[str, Any]
) -> None:
    """pamqp cuts a header name to 128 bytes: two long names would merge, a value be
    lost. Refused instead; a 128-byte name goes whole."""
    name, queue = rabbit_queue
    collide = await insert(
        pool,
        "t",
        headers="jsonb_build_object(repeat('k', 130) || 'A', '1', repeat('k', 130) || 'B', '2')",
    )
    wide = await insert(pool, "t", headers="jsonb_build_object(repeat('€', 100), 'v')")
    fits = await insert(pool, "t", headers="jsonb_build_object(repeat('k', 128), 'whole')")
    sink = RabbitMQSink(AMQP_URL, destination=name)
    async with relaying(pool, sink, retry=RETRY_LATER):
        rows = await settled(pool, [collide, wide, fits])
    outcomes(rows, {collide: "is 131 bytes", wide: "is 300 bytes"})
    (message,) = await drained(queue)
    assert message.headers["k" * 128] == "whole"


# -- webhooks ------------------------------------------------------------------------------
async def receiver(status: int, seen: list[dict[str, str]]) -> TestServer:
    async def receive(request: web.Request) -> web.Response:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        return web.Response(status=status, text="no such hook")

    app = web.Application()
    app.router.add_post("/{tail:.*}", receive)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    return server


async def test_webhook_url_secrets_shown_nowhere(pool: asyncpg.Pool, dsn: str) -> None:
    """A webhook URL's password and query token reach no log line (the relay's, the
    consumer's, httpx's), no last_error and no locked_by."""
    seen: list[dict[str, str]] = []
    server = await receiver(404, seen)
    try:
        event_id = await insert(pool, "hook.t")
        url = f"http://hookuser:HOOKPASSWORD@127.0.0.1:{server.port}/hooks/{{topic}}?token=QTOKEN"
        env = clean_env(AIOOUTBOX_WEBHOOK_SECRET=SECRET)
        relay = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "aiooutbox", "relay", "--to", url, "--dsn", dsn),
            *("--log-level", "debug", "--retention", "none", "--poll-interval", "0.5s"),
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            rows = await settled(pool, [event_id])
        finally:
            relay.send_signal(signal.SIGTERM)
            said = (await asyncio.wait_for(relay.communicate(), 60))[1].decode()
        assert relay.returncode == 0, said
    finally:
        await server.close()
    row = rows[event_id]
    assert (row["status"], row["attempts"]) == ("dead", 1)
    assert "HTTP 404 from http://hookuser:***@127.0.0.1" in row["last_error"]
    assert row["locked_by"].startswith("relay webhook:http://hookuser:***@")
    assert "connected to http://hookuser:***@" in said
    for secret in ("HOOKPASSWORD", "QTOKEN"):
        assert secret not in said
        assert secret not in row["last_error"]
        assert secret not in row["locked_by"]
    assert seen and seen[0]["authorization"].startswith("Basic ")


async def test_webhook_headers_http_refuses_dead_at_once(pool: asyncpg.Pool) -> None:
    """A header value with whitespace around it (an event's own, or the outbox-topic or
    outbox-ordering-key of a topic or key with one) is refused before sending (h11
    would raise on every attempt); whitespace inside a value goes."""
    seen: list[dict[str, str]] = []
    server = await receiver(204, seen)
    try:
        dead = {
            await insert(pool, "t", headers='\'{"x-w": " padded"}\''): "leading or trailing",
            await insert(pool, "t", headers='\'{"x-w": "trail\\t"}\''): "leading or trailing",
            await insert(pool, "spaced "): "'outbox-topic' has a value with leading",
            await insert(pool, "t", key=" k"): "'outbox-ordering-key' has a value with leading",
        }
        fine = [
            await insert(pool, "t", headers='\'{"x-in": "a b\\tc"}\''),
            await insert(pool, "t", headers='\'{"x-e": ""}\''),
            await insert(pool, "t", key="k"),
        ]
        url = f"http://127.0.0.1:{server.port}/hooks/{{topic}}"
        async with relaying(pool, WebhookSink(url, secret=SECRET), retry=RETRY_LATER):
            rows = await settled(pool, [*dead, *fine])
    finally:
        await server.close()
    outcomes(rows, dead)
    assert len(seen) == len(fine)
    assert {h.get("x-in") for h in seen} == {"a b\tc", None}


# -- secrets and one-line refusals at construction -----------------------------------------
async def test_redis_query_password_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    """redis-py takes ``?password=``: describe() and the start-up lines mask it."""
    caplog.set_level(logging.DEBUG, "aiooutbox")
    sink = RedisSink(REDIS_URL + "?password=S3CRETPW")
    assert "S3CRETPW" not in sink.describe()
    async with sink:  # a server without requirepass takes any password
        assert sink.started
    logged = [r.getMessage() for r in caplog.records]
    assert logged and not [m for m in logged if "S3CRETPW" in m]


async def test_upper_case_schemes_accepted(rabbit_queue: tuple[str, Any]) -> None:
    """Schemes are case-insensitive (RFC 3986): AMQP://, NATS://, Redis:// and HTTPS://
    make the same sinks as their lower-case spelling, and start."""
    name, _ = rabbit_queue
    for url in (
        AMQP_URL.replace("amqp://", "AMQP://"),
        NATS_URL.replace("nats://", "NATS://"),
        REDIS_URL.replace("redis://", "Redis://"),
    ):
        sink = sink_for_url(url, destination=name)
        async with sink:
            assert sink.started
        assert "://" in sink.describe() or sink.name == "redis"
    hook = sink_for_url("HTTPS://u:TOPSECRET@h.example/{topic}", secret=SECRET)
    assert "TOPSECRET" not in hook.describe()
    assert RabbitMQSink("AmQp://guest:guest@127.0.0.1:5672/").url.startswith("amqp://")
    assert NatsSink("Nats://127.0.0.1:4222").servers == ["nats://127.0.0.1:4222"]


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: RabbitMQSink("ftp://guest:TOPSECRET@h/"), TypeError),
        (lambda: RabbitMQSink("amqp://guest:TOPSECRET@127.0.0.1:notaport/"), "not a valid URL"),
        (lambda: RabbitMQSink("amqp://guest:TOPSECRET@127.0.0.1:99999/"), "Port out of range"),
        (lambda: RabbitMQSink("amqp://"), "names no host"),
        (lambda: RedisSink("redis://:TOPSECRET@127.0.0.1:notaport/0"), "not a valid URL"),
        (lambda: RedisSink("http://:TOPSECRET@h/"), TypeError),
        (lambda: WebhookSink("http://u:TOPSECRET@h:bad/x", secret=SECRET), "not a valid URL"),
        (lambda: WebhookSink("ftp://u:TOPSECRET@h/x", secret=SECRET), TypeError),
        (lambda: NatsSink("nats://u:TOPSECRET@127.0.0.1:bad"), "not a valid URL"),
        (lambda: sink_for_url("nats://u:TOP/SECRET@127.0.0.1:4222"), "percent-encoded"),
        (lambda: sink_for_url("ftp://u:TOPSECRET@h/"), "cannot relay to"),
    ],
)
def test_bad_urls_refused_without_their_password(make: Any, error: Any) -> None:
    with pytest.raises((TypeError, aiooutbox.InvalidArgument)) as caught:
        make()
    text = str(caught.value)
    if isinstance(error, str):
        assert isinstance(caught.value, aiooutbox.InvalidArgument), text
        assert error in text, text
    else:
        assert isinstance(caught.value, error), text
    assert "SECRET" not in text and "\n" not in text


def test_describe_never_raises() -> None:
    sink = RabbitMQSink(AMQP_URL)
    sink.url = "amqp://guest:TOPSECRET@127.0.0.1:notaport/"
    assert "TOPSECRET" not in sink.describe()


BAD_TEMPLATES = ["{topic:d}", "{topic!x}", "{topic!r}", "{topic:.3}", "a.{ordering_key!s}"]


@pytest.mark.parametrize("template", BAD_TEMPLATES)
def test_templates_with_conversion_or_spec_refused(template: str) -> None:
    with pytest.raises(aiooutbox.InvalidArgument, match="only plain"):
        NatsSink(NATS_URL, destination=template)
    with pytest.raises(aiooutbox.InvalidArgument, match="only plain"):
        WebhookSink(f"http://127.0.0.1/{template}", secret=SECRET)


async def test_cli_refuses_bad_templates_and_urls_in_one_line(dsn: str) -> None:
    """Exit 2 and one line naming the fault, from the flag or the environment; and an
    upper-case scheme with a wrong password fails to connect without showing it."""
    runs = [
        (["--to", NATS_URL, "--destination", "{topic:d}"], {}, "only plain"),
        (["--to", NATS_URL], {"AIOOUTBOX_RELAY_DESTINATION": "{topic!x}"}, "only plain"),
        (["--to", "amqp://guest:TOPSECRET@127.0.0.1:notaport/"], {}, "not a valid URL"),
        (["--to", "redis://:TOPSECRET@127.0.0.1:99999/0"], {}, "Port out of range"),
    ]
    for args, env, reason in runs:
        result = await cli("relay", "--dsn", dsn, *args, env=clean_env(**env))
        assert result.rc == 2, result
        assert len(result.err_lines) == 1 and reason in result.err, result.err
        assert "TOPSECRET" not in result.err and "Traceback" not in result.err
    result = await cli(
        "relay", "--dsn", dsn, "--to", "AMQP://guest:TOPSECRET@127.0.0.1:5672/", "--no-listen"
    )
    assert result.rc == 1, result
    assert "ACCESS_REFUSED" in result.err_lines[-1]
    assert "TOPSECRET" not in result.err and "Traceback" not in result.err
    result = await cli("relay", "--dsn", dsn, "--to", "kafka://127.0.0.1:1", "--no-listen")
    assert result.rc == 1 and len(result.err_lines) == 1, result.err


# -- payloads and NATS header names ----------------------------------------------------------
async def test_payload_nested_past_the_encoder_dead(pool: asyncpg.Pool) -> None:
    """jsonb takes ~1000 levels; the relay's encoder writes fewer: refused for good
    (not retried, no traceback); 300 levels are written (the stdlib past orjson's)."""
    stream = unique("hostile-deep-")
    deep = await insert(pool, stream, "(repeat('[', 1010) || repeat(']', 1010))::jsonb")
    fine = [
        await insert(pool, stream, "(repeat('[', 300) || repeat(']', 300))::jsonb"),
        await insert(pool, stream, "'{\"ok\": 1}'::jsonb"),
    ]
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        async with relaying(pool, RedisSink(REDIS_URL), retry=RETRY_LATER):
            rows = await settled(pool, [deep, *fine])
        outcomes(rows, {deep: "the payload is nested 1010 levels deep"})
        assert await client.xlen(stream) == 2
    finally:
        await client.delete(stream)
        await client.aclose()


async def test_nats_header_names_with_whitespace_around_dead(pool: asyncpg.Pool) -> None:
    """nats-py strips a header name: ``x-a`` and `` x-a`` would merge into one."""
    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    stream, subject = unique("HOSTILE"), unique("hostile.")
    await nats_stream(js, stream, [subject], storage="memory")
    try:
        merged = await insert(pool, subject, headers='\'{"x-a": "1", " x-a": "2"}\'')
        fine = await insert(pool, subject, headers='\'{"x-a": "1"}\'')
        async with relaying(pool, NatsSink(NATS_URL), retry=RETRY_LATER):
            rows = await settled(pool, [merged, fine])
        outcomes(rows, {merged: "has whitespace around it"})
        (message,) = await nats_read(js, stream, subject)
        assert message.headers["x-a"] == "1"
    finally:
        await js.delete_stream(stream)
        await nc.close()
