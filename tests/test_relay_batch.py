"""A sink's batch handler (`Sink.publish_batch`) against the real brokers: one pipelined
call per wave, a result per message (a refusal among good ones is that one's alone),
a key's events in order in the broker, a key whose event failed holding its later
events back unpublished, and the look-ups of repeated events sharing one read.

The batches here are made by hand, as a consumer hands them to a batch handler; the
relay under a consumer is tested in the other tests/test_relay*.py files.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any, cast

import asyncpg
import nats
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestServer

import aiooutbox
from aiooutbox.cli.parser import build_parser
from aiooutbox.relay import (
    HeldBack,
    KafkaSink,
    NatsSink,
    RabbitMQSink,
    RedisSink,
    Sink,
    WebhookSink,
    _amqp,
)
from aiooutbox.relay._batch import Window
from tests.clirunner import clean_env, cli
from tests.helpers import wait_until
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
    RelayProcess,
    kafka_read,
    kafka_topic,
    nats_read,
    nats_stream,
    rabbit_read,
    relaying,
    unique,
)
from tests.test_flow_claims import Claims
from tests.test_relay_refusals import SETTLE_WITHIN, enqueue, settled

KEYS, PER_KEY = 8, 6
MIB = 1024 * 1024
SECRET = "whsec_" + "c2VjcmV0LWtleS1mb3ItdGVzdHM="
_ids = itertools.count(1)


@pytest.fixture(scope="module")
def kafka() -> Iterator[Tansu]:
    with tansu() as broker:
        yield broker


@pytest.fixture
async def nc() -> AsyncIterator[Any]:
    client = await nats.connect(NATS_URL)
    yield client
    await client.close()


def event(topic: str, payload: Any, key: str | None = None, attempts: int = 1) -> aiooutbox.Event:
    """An event as a consumer hands it to a handler (a claimed row's fields)."""
    return aiooutbox.Event(
        id=next(_ids),
        topic=topic,
        payload=payload,
        dedupe_key=None,
        headers={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
        attempts=attempts,
        created_at=datetime.now(UTC),
        message_id=str(uuid.uuid4()),
        ordering_key=key,
    )


def keyed(topic: str) -> list[aiooutbox.Event]:
    """KEYS keys x PER_KEY events, interleaved as a claim hands them out (each key's in
    order), and a few unordered ones between them."""
    events = []
    for seq in range(PER_KEY):
        for k in range(KEYS):
            events.append(event(topic, {"key": k, "seq": seq}, key=f"k{k}"))
        events.append(event(topic, {"key": None, "seq": seq}))
    return events


def assert_in_order(payloads: list[dict[str, Any]]) -> None:
    seen: dict[int, list[int]] = {}
    for p in payloads:
        if p["key"] is not None:
            seen.setdefault(p["key"], []).append(p["seq"])
    assert len(seen) == KEYS
    for key, seqs in seen.items():
        assert seqs == list(range(PER_KEY)), f"key {key} out of order: {seqs}"


class Recording:
    """Wraps a sink's pipelined call: how many calls, how many messages in each (the
    call that takes several events of a key, `_send_runs`, on the sinks that have it)."""

    def __init__(self, sink: Sink) -> None:
        self.calls: list[int] = []
        send = sink._send_many
        runs = getattr(sink, "_send_runs", None)

        async def recorded(messages: Any) -> list[BaseException | None]:
            self.calls.append(len(messages))
            return await send(messages)

        async def recorded_runs(messages: Any, hold: bool) -> list[BaseException | None]:
            self.calls.append(len(messages))
            assert runs is not None
            return await runs(messages, hold)  # type: ignore[no-any-return]

        sink._send_many = recorded  # type: ignore[method-assign]
        if runs is not None:
            sink._send_runs = recorded_runs  # type: ignore[attr-defined]


# -- every broker: a refusal among good ones, order per key ---------------------------------
async def test_nats_batch_one_refused_among_good_and_order_per_key(nc: Any) -> None:
    js = nc.jetstream()
    stream, topic = unique("BATCH"), unique("relay.batch.")
    await nats_stream(js, stream, [topic], "memory")
    try:
        async with NatsSink(NATS_URL) as sink:
            calls = Recording(sink)
            events = keyed(topic)
            nowhere = event(unique("relay.nostream."), {"n": 0})
            failures = await sink.publish_batch([*events[:5], nowhere, *events[5:]])
        assert failures is not None and set(failures) == {nowhere.id}
        assert isinstance(failures[nowhere.id], aiooutbox.Dead)
        assert "no JetStream stream captures" in str(failures[nowhere.id])
        # one call a wave: PER_KEY waves, the first with the unordered ones and the refused
        assert calls.calls == [KEYS + PER_KEY + 1] + [KEYS] * (PER_KEY - 1)
        found = await nats_read(js, stream, topic)
        assert len(found) == len(events)
        assert_in_order([json.loads(m.data) for m in found])
    finally:
        await js.delete_stream(stream)


async def test_rabbitmq_batch_one_refused_among_good_and_order_per_key() -> None:
    import aio_pika

    queue = unique("relay-batch-")
    async with await aio_pika.connect(AMQP_URL) as connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue)
        try:
            async with RabbitMQSink(AMQP_URL) as sink:
                events = keyed(queue)
                unroutable = event(unique("relay-nobody-"), {"n": 0})
                failures = await sink.publish_batch([unroutable, *events])
            assert failures is not None and set(failures) == {unroutable.id}
            assert "NO_ROUTE" in str(failures[unroutable.id])
            found = await rabbit_read(AMQP_URL, queue, len(events))
            assert len(found) == len(events)
            assert_in_order([json.loads(m.body) for m in found])
        finally:
            await declared.delete(if_unused=False, if_empty=False)


@needs("tansu")
async def test_kafka_batch_one_refused_among_good_and_order_per_key(kafka: Tansu) -> None:
    topic = unique("relay.batch.")
    await kafka_topic(kafka.bootstrap, topic)
    async with KafkaSink(kafka.bootstrap, enable_idempotence=False) as sink:
        calls = Recording(sink)
        events = keyed(topic)
        too_large = event(topic, {"x": "a" * 1024 * 1024})
        failures = await sink.publish_batch([*events[:3], too_large, *events[3:]])
    assert failures is not None and set(failures) == {too_large.id}
    assert "MessageSizeTooLargeError" in str(failures[too_large.id])
    # one call: a key's events of one partition go in one record batch, in order
    assert calls.calls == [len(events) + 1]
    found = await kafka_read(kafka.bootstrap, topic, len(events))
    assert len(found) == len(events)
    by_partition: dict[int, list[dict[str, Any]]] = {}
    for m in sorted(found, key=lambda m: (m.partition, m.offset)):
        by_partition.setdefault(m.partition, []).append(json.loads(m.value))
    for payloads in by_partition.values():  # a key's records are in one partition
        seen: dict[int, list[int]] = {}
        for p in payloads:
            if p["key"] is not None:
                seen.setdefault(p["key"], []).append(p["seq"])
        assert all(seqs == list(range(PER_KEY)) for seqs in seen.values()), seen


async def test_redis_batch_one_refused_among_good_and_order_per_key() -> None:
    stream, wrong = unique("batch:"), unique("batch:string:")
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await client.set(wrong, "not a stream")
        async with RedisSink(REDIS_URL) as sink:
            calls = Recording(sink)
            events = keyed(stream)
            refused = event(wrong, {"n": 0})
            failures = await sink.publish_batch([*events[:7], refused, *events[7:]])
        assert failures is not None and set(failures) == {refused.id}
        assert "WRONGTYPE" in str(failures[refused.id])
        assert calls.calls == [KEYS + PER_KEY + 1] + [KEYS] * (PER_KEY - 1)
        entries = cast(Any, await client.xrange(stream))
        assert len(entries) == len(events)
        assert_in_order([json.loads(f[b"payload"]) for _, f in entries])
    finally:
        await client.delete(stream, wrong)
        await client.aclose()


@pytest.mark.slow
@needs("redis-server")
async def test_redis_batch_value_over_proto_max_bulk_len_refused_alone() -> None:
    """The server drops the connection on a value over ``proto-max-bulk-len``: that one
    goes in a command of its own, so the pipeline of the others is not cut short."""
    broker = PrivateRedis()
    broker.start()
    client = aioredis.Redis.from_url(broker.url)
    try:
        await client.config_set("proto-max-bulk-len", MIB)
        async with RedisSink(broker.url, reconnect_wait=5) as sink:
            small = [event("bulk", {"n": n}) for n in range(20)]
            big = event("bulk", {"x": "a" * MIB})
            failures = await sink.publish_batch([*small[:10], big, *small[10:]])
        assert failures is not None and set(failures) == {big.id}, failures
        assert "proto-max-bulk-len" in str(failures[big.id])
        # only the big value may have been sent again: the server may reset the
        # connection while the client still writes it, before its error reply can be
        # read (an outage then, and the repeat reads the refusal); the 20 others went
        # in one pipeline, once (a cut pipeline would count them here)
        assert sink.republished <= 2, sink.republished
        assert await client.xlen("bulk") == 20
    finally:
        await client.aclose()
        broker.destroy()


# -- a key whose event failed holds its later ones back ------------------------------------
async def test_webhook_batch_failure_holds_its_key_back_and_refusal_does_not() -> None:
    """Key ``a``: its second event answers 500 (retried): its third is not sent.
    Key ``b``: its first answers 404 (dead): its second is sent (the key moves on, as
    ``on_dead="skip"`` does), unless the batch holds keys behind refusals too. An
    unordered 429 with ``Retry-After`` is a `Retry` of that delay."""
    answers = {"a1": 500, "b0": 404, "u0": 429}
    received: list[str] = []
    in_flight, peak = 0, 0

    async def receive(request: web.Request) -> web.Response:
        nonlocal in_flight, peak
        name = (await request.json())["name"]
        received.append(name)
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        status = answers.get(name, 200)
        return web.Response(status=status, headers={"Retry-After": "7"} if status == 429 else {})

    app = web.Application()
    app.router.add_post("/hook", receive)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    try:
        async with WebhookSink(f"http://127.0.0.1:{server.port}/hook", secret=SECRET) as sink:
            for hold in (False, True):
                received.clear()
                batch = {
                    name: event("hook", {"name": name}, key=name[0] if name[0] != "u" else None)
                    for name in ("a0", "b0", "u0", "a1", "b1", "a2", "u1")
                }
                failures = await sink.publish_batch(list(batch.values()), hold_after_dead=hold)
                assert failures is not None
                held = {"a2", "b1"} if hold else {"a2"}
                assert {n for n, e in batch.items() if e.id in failures} == {
                    "a1",
                    "b0",
                    "u0",
                } | held
                assert isinstance(failures[batch["b0"].id], aiooutbox.Dead)
                assert isinstance(failures[batch["a2"].id], HeldBack)
                retry = failures[batch["u0"].id]
                assert isinstance(retry, aiooutbox.Retry) and retry.delay == 7
                assert "HTTP 500" in str(failures[batch["a1"].id])
                assert sorted(received) == sorted(set(batch) - held)
                # a key's next event is sent only once the one before it was answered
                assert received.index("a0") < received.index("a1")
            # a large batch runs its requests side by side, at most 64 at once
            many = [event("hook", {"name": f"m{i}"}) for i in range(200)]
            assert await sink.publish_batch(many) is None
            assert 1 < peak <= 64, peak
    finally:
        await server.close()


# -- read-back: the repeats of a batch share one read --------------------------------------
async def test_redis_batch_repeats_looked_up_with_one_read() -> None:
    stream = unique("batch:readback:")
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        async with RedisSink(REDIS_URL) as sink:
            first = [event(stream, {"n": i}, key=f"k{i % 3}") for i in range(30)]
            assert await sink.publish_batch(first) is None
            assert sink._lookup is not None and sink._lookup.lookups == 0  # first attempts
            fresh = [event(stream, {"n": i}, attempts=2) for i in range(30, 40)]
            assert await sink.publish_batch([*map(_again, first), *fresh]) is None
        lookup = sink._lookup
        assert lookup is not None
        assert sink.found_published == 30
        assert (lookup.lookups, lookup.scans) == (40, 1), lookup.summary()
        assert lookup.entries == 30, lookup.summary()  # the stream read once
        entries = cast(Any, await client.xrange(stream))
        assert sorted(json.loads(f[b"payload"])["n"] for _, f in entries) == list(range(40))
    finally:
        await client.delete(stream)
        await client.aclose()


@needs("tansu")
async def test_kafka_batch_repeats_looked_up_with_one_read_a_partition(kafka: Tansu) -> None:
    topic = unique("relay.batch.readback.")
    await kafka_topic(kafka.bootstrap, topic)
    async with KafkaSink(kafka.bootstrap, enable_idempotence=False) as sink:
        first = [event(topic, {"n": i}) for i in range(30)]
        assert await sink.publish_batch(first) is None
        fresh = [event(topic, {"n": i}, attempts=2) for i in range(30, 40)]
        assert await sink.publish_batch([*map(_again, first), *fresh]) is None
    lookup = sink._lookup
    assert lookup is not None
    assert sink.found_published == 30
    assert (lookup.lookups, lookup.scans) == (40, 3), lookup.summary()
    found = await kafka_read(kafka.bootstrap, topic, 40)
    assert sorted(json.loads(m.value)["n"] for m in found) == list(range(40))


def _again(e: aiooutbox.Event) -> aiooutbox.Event:
    """``e`` claimed again after its relay died: its second attempt."""
    return dataclasses.replace(e, attempts=2)


# -- the window ------------------------------------------------------------------------------
async def test_window_counts_messages_first_come_first_served() -> None:
    window = Window(10)
    await window.acquire(8)
    order: list[str] = []

    async def take(name: str, n: int) -> None:
        await window.acquire(n)
        order.append(name)

    big = asyncio.ensure_future(take("big", 5))
    await asyncio.sleep(0)
    small = asyncio.ensure_future(take("small", 1))  # fits now, but waits its turn
    await asyncio.sleep(0.01)
    assert order == []
    cancelled = asyncio.ensure_future(take("cancelled", 4))
    await asyncio.sleep(0)
    cancelled.cancel()
    window.release(8)
    await asyncio.gather(big, small)
    assert order == ["big", "small"]
    assert cancelled.cancelled()
    window.release(6)
    await window.acquire(10)  # everything given back: the whole window is free


async def test_sink_not_started_fails_the_batch_whole() -> None:
    sink = RedisSink(REDIS_URL)
    with pytest.raises(aiooutbox.relay.SinkClosed):
        await sink.publish_batch([event("s", {})])


# -- under a consumer: outcomes per event, order across batches ------------------------------
@needs("redis-server")
async def test_redis_failed_and_refused_events_among_good_ones_only_they_repeat(
    pool: asyncpg.Pool,
) -> None:
    """One batch (a batch holds one topic's events: the stream is the ordering key
    here): 40 good events, one the server refuses for good (WRONGTYPE: dead at once)
    and one it refuses for now (NOPERM: a user without the key; retried). Only that one
    is published again, once granted; every other is in its stream once, on its first
    attempt."""
    broker = PrivateRedis()
    broker.start()
    admin = aioredis.Redis.from_url(broker.url)
    try:
        await admin.acl_setuser(
            "relay", enabled=True, passwords=["+pw"], keys=["good*"], commands=["+@all"]
        )
        await admin.set("good:string", "not a stream")
        good = [await enqueue(pool, "t", {"n": n}, ordering_key=f"good:s{n}") for n in range(40)]
        refused = await enqueue(pool, "t", ordering_key="good:string")
        failed = await enqueue(pool, "t", ordering_key="other:stream")
        url = f"redis://relay:pw@127.0.0.1:{broker.port}/0"
        sink = RedisSink(url, destination="{ordering_key}")
        calls = Recording(sink)
        retry = aiooutbox.RetryPolicy(base=1, jitter=0)
        async with relaying(pool, sink, retry=retry, concurrency=512):
            rows = await settled(pool, [*good, refused], SETTLE_WITHIN)
            first = await pool.fetchrow(
                "SELECT status::text, attempts, last_error FROM outbox_events_all WHERE id = $1",
                failed,
            )
            await admin.acl_setuser("relay", enabled=True, keys=["other*"])
            again = await settled(pool, [failed], SETTLE_WITHIN)
        assert max(calls.calls) == 42, calls.calls  # one call held all 42
        assert {(rows[i]["status"], rows[i]["attempts"]) for i in good} == {("done", 1)}
        assert (rows[refused]["status"], rows[refused]["attempts"]) == ("dead", 1)
        assert "WRONGTYPE" in rows[refused]["last_error"]
        assert first["attempts"] == 1 and "NoPermissionError" in (first["last_error"] or ""), first
        assert (again[failed]["status"], again[failed]["attempts"]) == ("done", 2)
        for n in range(40):
            ((_, fields),) = cast(Any, await admin.xrange(f"good:s{n}"))
            assert json.loads(fields[b"payload"]) == {"n": n}
        assert await admin.xlen("other:stream") == 1
        assert sink.republished == 0 and sink.found_published == 0
    finally:
        await admin.aclose()
        broker.destroy()


@pytest.mark.parametrize("broker", ["nats", "redis", "kafka", "rabbitmq"])
@needs("tansu")
async def test_order_per_key_across_batches(
    pool: asyncpg.Pool, nc: Any, kafka: Tansu, broker: str
) -> None:
    """4 keys x 120 events through batches of 16: every key's run spans many batches,
    and a batch holds several events of a key (published one after another); each
    key's events are in the broker in commit order (into RabbitMQ too, whose sink
    publishes over several channels in turn: a key's event goes out only once the one
    before it is confirmed, whichever channel took it)."""
    keys, per_key, topic = 4, 120, unique("relay.across.")
    events = [
        aiooutbox.NewEvent(topic, {"key": k, "seq": seq}, ordering_key=f"k{k}")
        for seq in range(per_key)
        for k in range(keys)
    ]
    async with pool.acquire() as conn:
        await aiooutbox.enqueue_many(conn, events)
    js = nc.jetstream()
    sink: Sink
    amqp: Any = None
    if broker == "rabbitmq":  # the default exchange routes the topic to its queue
        import aio_pika

        amqp = await aio_pika.connect(AMQP_URL)
        await (await amqp.channel()).declare_queue(topic)
        sink = RabbitMQSink(AMQP_URL)
        assert sink_channels(sink) is None  # opened at start
    elif broker == "nats":
        await nats_stream(js, topic.replace(".", "_"), [topic], "memory")
        sink = NatsSink(NATS_URL)
    elif broker == "redis":
        sink = RedisSink(REDIS_URL)
    else:
        await kafka_topic(kafka.bootstrap, topic)
        sink = KafkaSink(kafka.bootstrap, enable_idempotence=False)
    calls = Recording(sink)
    try:
        async with relaying(pool, sink, batch=16, concurrency=64):
            await settled_all(pool, keys * per_key)
            if broker == "rabbitmq":
                assert sink_channels(sink) == _amqp.CHANNELS > 1
        if broker == "rabbitmq":
            found = await rabbit_read(AMQP_URL, topic, keys * per_key)
            payloads = [json.loads(m.body) for m in found]
        elif broker == "nats":
            payloads = [
                json.loads(m.data) for m in await nats_read(js, topic.replace(".", "_"), topic)
            ]
        elif broker == "redis":
            client = aioredis.Redis.from_url(REDIS_URL)
            entries = cast(Any, await client.xrange(topic))
            await client.delete(topic)
            await client.aclose()
            payloads = [json.loads(f[b"payload"]) for _, f in entries]
        else:
            found = await kafka_read(kafka.bootstrap, topic, keys * per_key)
            found.sort(key=lambda m: (m.partition, m.offset))
            payloads = [json.loads(m.value) for m in found]
    finally:
        if broker == "nats":
            await js.delete_stream(topic.replace(".", "_"))
        if amqp is not None:
            queue = await (await amqp.channel()).get_queue(topic)
            await queue.delete(if_unused=False, if_empty=False)
            await amqp.close()
    assert len(payloads) == keys * per_key
    seen: dict[int, list[int]] = {}
    for p in payloads:  # Kafka: a key's records are in one partition, read in offset order
        seen.setdefault(p["key"], []).append(p["seq"])
    assert all(seqs == list(range(per_key)) for seqs in seen.values()), seen
    # the waves: calls of fewer events than their batch, a key's next event in the next
    assert len(calls.calls) > keys * per_key / 16, calls.calls


def sink_channels(sink: Sink) -> int | None:
    """How many open channels a RabbitMQ sink publishes on (None: none yet)."""
    channels = cast(RabbitMQSink, sink)._channels
    return sum(not c.is_closed for c in channels) or None


async def settled_all(pool: asyncpg.Pool, total: int, within: float = 60) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while (done := await pool.fetchval(_DONE)) < total:
        assert loop.time() < deadline, f"{done} of {total} done after {within}s"
        await asyncio.sleep(0.05)


_DONE = "SELECT count(*) FROM outbox_events_all WHERE status = 'done'"


# -- the runner's flags ----------------------------------------------------------------------
async def test_relay_batch_flag_and_the_relays_own_concurrency(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--batch`` (default 256) and the relay's default ``--concurrency`` 2048 (``run``
    keeps 64; the environment still wins); a bad ``--batch`` is a usage error."""
    env = clean_env()
    shown = (await cli("relay", "--help", env=env)).out
    assert "AIOOUTBOX_RELAY_BATCH; default 256" in " ".join(shown.split()), shown
    assert "default 2048: eight batches of 256" in " ".join(shown.split()), shown
    assert "default 64" in " ".join((await cli("run", "--help", env=env)).out.split())
    for bad in ("0", "-1", "x"):
        result = await cli("relay", "--to", NATS_URL, "--batch", bad, "--dsn", dsn, env=env)
        assert result.rc == 2 and "--batch" in result.err, result.err
    result = await cli(
        "relay", "--to", NATS_URL, "--dsn", dsn, env={**env, "AIOOUTBOX_RELAY_BATCH": "0"}
    )
    assert result.rc == 2 and "AIOOUTBOX_RELAY_BATCH" in result.err, result.err
    for name in ("AIOOUTBOX_CONCURRENCY", "AIOOUTBOX_RELAY_BATCH"):
        monkeypatch.delenv(name, raising=False)
    parser = build_parser()
    assert parser.parse_args(["relay"]).concurrency == 2048
    assert parser.parse_args(["relay"]).batch == 256
    assert parser.parse_args(["run", "m:h"]).concurrency == 64
    monkeypatch.setenv("AIOOUTBOX_CONCURRENCY", "300")
    assert build_parser().parse_args(["relay"]).concurrency == 300


async def test_the_relay_claims_one_batch_at_a_time(pool: asyncpg.Pool, dsn: str, nc: Any) -> None:
    """``python -m aiooutbox relay`` claims at most ``--batch`` events a claim unless
    ``--batch-size`` says otherwise (one batch is published while the next is claimed);
    its start-up line says which. Under a consumer built the same way (concurrency
    2048, claims of 100), no claim takes more than 100 of a 3,000-event backlog."""
    js = nc.jetstream()
    stream, prefix = unique("CLAIMS"), unique("claims.") + "."
    await nats_stream(js, stream, [prefix + ">"], "memory")
    try:
        await aiooutbox.enqueue_many(
            pool, [aiooutbox.NewEvent(prefix + "a", {"n": i}) for i in range(3000)]
        )
        claims = Claims()
        consumer = aiooutbox.OutboxConsumer(
            pool, concurrency=2048, batch_size=100, retention=None, observers=[claims]
        )
        async with NatsSink(NATS_URL) as sink, consumer:
            task = asyncio.ensure_future(consumer.run({"*": sink.handler(batch=100)}))
            await settled_all(pool, 3000)
            consumer.stop()
            await task
        assert sum(claims.sizes) == 3000 and max(claims.sizes) <= 100, claims.sizes
        # the runner: its default, then the flag, each on its start-up line
        await aiooutbox.enqueue_many(
            pool, [aiooutbox.NewEvent(prefix + "b", {"n": i}) for i in range(300)]
        )
        relay = RelayProcess(dsn, NATS_URL, "--batch", "100")
        try:
            await settled_all(pool, 3300)
        finally:
            assert await relay.stop() == 0
        assert "batches of 100, claims of at most 100 (" in relay.said, relay.said
        relay = RelayProcess(dsn, NATS_URL, "--batch", "100", "--batch-size", "700")
        try:
            await wait_until(_said(relay, "relaying"), 30)
        finally:
            assert await relay.stop() == 0
        assert "batches of 100, claims of at most 700 (" in relay.said, relay.said
        assert (await js.stream_info(stream)).state.messages == 3300
    finally:
        await js.delete_stream(stream)


def _said(relay: RelayProcess, text: str) -> Any:
    async def said() -> bool:
        return text in relay.stderr(None)

    return said
