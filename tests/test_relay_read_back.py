"""A repeated event is looked up in Kafka or a Redis stream before it is published again.

An event whose attempt is not its first may already be in the broker (its relay died
after the publish, before the settle). The tests make that state as a crash leaves it:
rows relayed, then put back to ``retry`` as lease recovery does, so their next claim is
attempt 2; and new rows whose next claim is attempt 2 too but which were never
published. A second relay must publish only the new ones. The SIGKILL tests with real
crashes are in tests/test_relay_faults.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any, cast

import asyncpg
import pytest
import redis.asyncio as aioredis

import aiooutbox
from aiooutbox.relay import KafkaSink, RedisSink
from tests.clirunner import cli
from tests.helpers import insert_unchecked
from tests.programs import needs
from tests.relay.brokers import AMQP_URL, NATS_URL, REDIS_URL, Tansu, tansu
from tests.relay.common import kafka_read, kafka_topic, relaying, unique, wait_done
from tests.test_relay_refusals import RETRY_LATER, enqueue, settled

#: rows put back as lease recovery puts a dead relay's rows back: their next claim is
#: attempt 2, the look-up's trigger. Their settlement moved them to the ring of finished
#: events (migration 0022): they come back from it as they were before it
RECOVERED = (
    "WITH m AS (DELETE FROM outbox_events_done WHERE id = ANY ($1::bigint[]) RETURNING *)"
    " INSERT INTO outbox_events (id, topic, payload, headers, status, attempts,"
    " max_attempts, available_at, created_at, message_id, ordering_key, grp)"
    " OVERRIDING SYSTEM VALUE SELECT id, topic, payload, headers, 'retry', attempts,"
    " max_attempts, now(), created_at, message_id, ordering_key, grp FROM m"
)
#: new rows as if an earlier attempt had failed before the publish: attempt 2 next
FAILED_ONCE = "UPDATE outbox_events SET attempts = 1 WHERE id = ANY($1)"


@pytest.fixture(scope="module")
def kafka() -> Iterator[Tansu]:
    with tansu() as broker:
        yield broker


async def events(pool: asyncpg.Pool, topic: str, n: int, first: int = 0) -> list[int]:
    """``n`` events: half with an ordering key each (keyed records), half without."""
    ids = []
    for i in range(first, first + n):
        key = f"k{i}" if i % 2 else None
        ids.append(await enqueue(pool, topic, {"n": i}, ordering_key=key))
    return ids


@needs("tansu")
async def test_kafka_repeat_already_in_its_partition_is_not_produced_again(
    pool: asyncpg.Pool, kafka: Tansu
) -> None:
    topic = unique("readback.")
    await kafka_topic(kafka.bootstrap, topic)
    published = await events(pool, topic, 60)
    async with relaying(pool, KafkaSink(kafka.bootstrap, enable_idempotence=False)):
        await wait_done(pool, 60, timeout=30)
    await insert_unchecked(pool, RECOVERED, published)
    fresh = await events(pool, topic, 10, first=60)
    refused = await enqueue(pool, "not a topic")  # refused before any look-up
    await pool.execute(FAILED_ONCE, [*fresh, refused])
    sink = KafkaSink(kafka.bootstrap, enable_idempotence=False)
    async with relaying(pool, sink, retry=RETRY_LATER):
        rows = await settled(pool, [*published, *fresh, refused], 30)
    assert {r["status"] for i, r in rows.items() if i != refused} == {"done"}
    assert {r["attempts"] for r in rows.values()} == {2}
    assert rows[refused]["status"] == "dead", dict(rows[refused])
    assert "not a valid Kafka topic name" in rows[refused]["last_error"]
    found = await kafka_read(kafka.bootstrap, topic, 70)
    ids = [dict(m.headers)["outbox-message-id"].decode() for m in found]
    print(f"{len(ids)} records; found already published: {sink.found_published}")
    assert sorted(json.loads(m.value)["n"] for m in found) == list(range(70))
    assert len(set(ids)) == len(ids) == 70
    assert sink.found_published == 60
    assert sink._lookup is not None and sink._lookup.lookups == 70
    # the keyed ones read their own partition; the unkeyed ones all three
    assert sink._lookup.scans == 3, sink._lookup.summary()


async def test_redis_repeat_already_in_the_stream_is_not_added_again(pool: asyncpg.Pool) -> None:
    stream = unique("readback:")
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        published = await events(pool, stream, 60)
        async with relaying(pool, RedisSink(REDIS_URL)):
            await wait_done(pool, 60, timeout=30)
        await insert_unchecked(pool, RECOVERED, published)
        fresh = await events(pool, stream, 10, first=60)
        await pool.execute(FAILED_ONCE, fresh)
        sink = RedisSink(REDIS_URL)
        async with relaying(pool, sink):
            rows = await settled(pool, [*published, *fresh], 30)
        assert {(r["status"], r["attempts"]) for r in rows.values()} == {("done", 2)}
        entries = cast(Any, await client.xrange(stream))
        ids = [f[b"message_id"].decode() for _, f in entries]
        assert len(set(ids)) == len(ids) == 70
        assert sorted(json.loads(f[b"payload"])["n"] for _, f in entries) == list(range(70))
        assert sink.found_published == 60
        assert sink._lookup is not None
        assert sink._lookup.scans == 1, sink._lookup.summary()
    finally:
        await client.delete(stream)
        await client.aclose()


async def test_redis_without_read_back_adds_the_repeat_again(pool: asyncpg.Pool) -> None:
    """``read_back=False``: what a crash did before, the repeat is a second entry."""
    stream = unique("readback:")
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        published = await events(pool, stream, 4)
        async with relaying(pool, RedisSink(REDIS_URL)):
            await wait_done(pool, 4, timeout=30)
        await insert_unchecked(pool, RECOVERED, published)
        async with relaying(pool, RedisSink(REDIS_URL, read_back=False)):
            await settled(pool, published, 30)
            await wait_done(pool, 4, timeout=30)
        assert await client.xlen(stream) == 8
    finally:
        await client.delete(stream)
        await client.aclose()


@needs("tansu")
async def test_kafka_bound_after_the_partitions_last_record(
    pool: asyncpg.Pool, kafka: Tansu
) -> None:
    """A bound past every record: Tansu answers ``offsets_for_times`` with offset 0 and
    timestamp -1 (Kafka answers no offset); the sink checks the last record instead of
    reading the partition from its start, finds nothing, and produces the event."""
    topic = unique("readback.")
    await kafka_topic(kafka.bootstrap, topic, partitions=1)
    await events(pool, topic, 6)
    async with relaying(pool, KafkaSink(kafka.bootstrap, enable_idempotence=False)):
        await wait_done(pool, 6, timeout=30)
    late = await enqueue(pool, topic, {"n": 6})
    await pool.execute(
        "UPDATE outbox_events SET attempts = 1, created_at = now() + interval '1 hour' "
        "WHERE id = $1",
        late,
    )
    sink = KafkaSink(kafka.bootstrap, enable_idempotence=False, clock_skew=0)
    async with relaying(pool, sink):
        rows = await settled(pool, [late], 30)
    assert (rows[late]["status"], rows[late]["attempts"]) == ("done", 2)
    assert len(await kafka_read(kafka.bootstrap, topic, 7)) == 7
    assert sink.found_published == 0
    assert sink._reader is not None
    assert (sink._reader.from_start, sink._reader.records) == (0, 0)


async def test_redelivered_marks_what_may_have_run(pool: asyncpg.Pool) -> None:
    """First runs: False. ``attempts > 1``: True. An ordered row a requeue gave its
    attempt back (what lease recovery does to a run member behind its head, leaving its
    error): True with ``attempts == 1``."""
    first = await enqueue(pool, "flag")
    ordered_first = await enqueue(pool, "flag", ordering_key="a")
    again = await enqueue(pool, "flag")
    behind = await enqueue(pool, "flag", ordering_key="b")
    await pool.execute(FAILED_ONCE, [again])
    await pool.execute(
        "UPDATE outbox_events SET last_error = 'lease expired: the worker stopped renewing it'"
        " WHERE id = $1",
        behind,
    )
    seen: dict[int, tuple[int, bool]] = {}

    async def handler(event: aiooutbox.Event) -> None:
        seen[event.id] = (event.attempts, event.redelivered)

    consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.1, retention=None)
    async with consumer:
        task = asyncio.ensure_future(consumer.run({"flag": handler}))
        await wait_done(pool, 4, timeout=30)
        consumer.stop()
        await task
    assert seen == {
        first: (1, False),
        ordered_first: (1, False),
        again: (2, True),
        behind: (1, True),
    }


# -- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (("--to", NATS_URL, "--no-read-back"), "--no-read-back applies only to kafka://"),
        (("--to", AMQP_URL, "--clock-skew", "5s"), "--clock-skew applies only to kafka://"),
        (
            ("--to", "kafka://127.0.0.1:9", "--destination", "orders created"),
            "destination 'orders created' cannot work with kafka: not a valid Kafka topic",
        ),
        (("--to", REDIS_URL, "--clock-skew", "-1s"), "--clock-skew"),
    ],
)
async def test_relay_read_back_flags_refused_before_anything(
    dsn: str, flags: tuple[str, ...], line: str
) -> None:
    result = await cli("relay", *flags, "--dsn", dsn)
    assert result.rc == 2, result.err
    assert line in result.err_lines[0] and "Traceback" not in result.err, result.err
    assert all(s.startswith("(see ") for s in result.err_lines[1:]), result.err


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"clock_skew": -1}, aiooutbox.InvalidArgument),
        ({"clock_skew": 86_400 * 8}, aiooutbox.InvalidArgument),
        ({"clock_skew": "1m"}, TypeError),
        ({"read_back": 1}, TypeError),
    ],
)
def test_sink_read_back_options_checked(options: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        KafkaSink("127.0.0.1:9092", **options)
    with pytest.raises(error):
        RedisSink(REDIS_URL, **options)
