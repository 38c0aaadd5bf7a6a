"""Relays through crashes (SIGKILL mid-relay): every row done, nothing lost, no duplicate
into JetStream, Kafka and Redis (read back), RabbitMQ's bounded by the in-flight window.
The broker outages are in test_relay_outages.py."""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

import asyncpg
import nats
import pytest
import redis.asyncio as aioredis

import aiooutbox
from aiooutbox._engine.options import ConsumerOptions
from tests.conftest import TEMPLATE, _drop, _new_database, with_database
from tests.programs import needs
from tests.relay.brokers import (
    AMQP_URL,
    NATS_URL,
    PrivateRedis,
    Tansu,
    tansu,
)
from tests.relay.common import (
    fill,
    kafka_read,
    kafka_topic,
    kill_midway,
    message_ids,
    nats_read,
    nats_stream,
    rabbit_read,
    unique,
    wait_done,
)

# a SIGKILL run of 20,000 events and its read-back: ~40 s alone, 100-120 s beside a busy
# suite on two cores
pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]

TOTAL = 20_000
#: the relay processes' options (--concurrency 256, tests.relay.common.kill_midway)
RELAY = ConsumerOptions(concurrency=256)
#: what a SIGKILL can leave published but not yet settled, so what may be published
#: twice: the rows the relay holds (its handlers' and the prefetched ones) plus the
#: outcomes not yet written, up to the bound where it stops claiming (docs/relay.md)
REPEATABLE = RELAY.concurrency + RELAY.ahead + RELAY.max_unwritten(0)  # unordered: no runs


@pytest.fixture(scope="module")
def kafka() -> Iterator[Tansu]:
    with tansu() as broker:
        yield broker


@pytest.fixture
async def js() -> AsyncIterator[Any]:
    nc = await nats.connect(NATS_URL)
    yield nc.jetstream()
    await nc.close()


def duplicates_within_window(ids: list[str], expected: set[str], repeated: int) -> int:
    """All ``expected`` ids arrived; return how many arrived more than once (bounded),
    ``repeated`` rows having been attempted again after the kill (none looked up)."""
    extra = len(ids) - len(set(ids))
    print(f"after SIGKILL: {len(ids)} messages, {extra} duplicates, {repeated} repeated rows")
    assert set(ids) == expected, f"{len(expected - set(ids))} events lost"
    assert extra <= REPEATABLE, f"{extra} duplicates exceed the bound of {REPEATABLE}"
    return extra


# -- SIGKILL a relay after a third, start it again ------------------------------------------
async def test_jetstream_exactly_once_through_sigkill(
    dsn: str, pool: asyncpg.Pool, js: Any
) -> None:
    stream, prefix = unique("RELAYK"), unique("relay.kill.") + "."
    await nats_stream(js, stream, [prefix + ">"])
    try:
        await fill(pool, TOTAL, topics=(prefix + "created", prefix + "paid"))
        await kill_midway(pool, dsn, NATS_URL, TOTAL)
        assert (await js.stream_info(stream)).state.messages == TOTAL
        found = [m.headers["Nats-Msg-Id"] for m in await nats_read(js, stream, prefix + ">")]
        assert sorted(found) == sorted(await message_ids(pool))
    finally:
        await js.delete_stream(stream)


async def test_two_outboxes_one_stream_exactly_40k(
    dsn: str, pool: asyncpg.Pool, pg_server: str, js: Any
) -> None:
    """Both outboxes' row ids run 1..20000; the message ids do not collide, so JetStream
    keeps all 40k (a relay keyed on row ids would lose the second outbox's 20k)."""
    stream, prefix = unique("RELAY2"), unique("relay.two.") + "."
    await nats_stream(js, stream, [prefix + ">"])
    other = await _new_database(pg_server, TEMPLATE)
    other_dsn = with_database(pg_server, other)
    try:
        async with asyncpg.create_pool(other_dsn, min_size=1, max_size=4) as other_pool:
            topics = (prefix + "created", prefix + "paid")
            await fill(pool, TOTAL, topics=topics)
            await fill(other_pool, TOTAL, topics=topics)
            ids = "SELECT min(id), max(id) FROM outbox_events_all"
            assert tuple(await pool.fetchrow(ids)) == tuple(await other_pool.fetchrow(ids))
            from tests.relay.common import RelayProcess

            steady = RelayProcess(other_dsn, NATS_URL, "--concurrency", "256")
            try:
                await kill_midway(pool, dsn, NATS_URL, TOTAL)
                await wait_done(other_pool, TOTAL, timeout=120)
            finally:
                assert await steady.stop() == 0, steady.stderr()
        assert (await js.stream_info(stream)).state.messages == 2 * TOTAL
    finally:
        await js.delete_stream(stream)
        await _drop(pg_server, other)


async def test_rabbitmq_all_ids_through_sigkill(dsn: str, pool: asyncpg.Pool) -> None:
    import aio_pika

    queue = unique("relay-kill-")
    async with await aio_pika.connect(AMQP_URL) as connection:
        channel = await connection.channel()
        q = await channel.declare_queue(queue, durable=True)
        try:
            await fill(pool, TOTAL)
            await kill_midway(pool, dsn, AMQP_URL, TOTAL, "--destination", queue)
            found = await rabbit_read(AMQP_URL, queue, TOTAL, timeout=60)
            ids = [m.message_id for m in found]
            duplicates_within_window(ids, await message_ids(pool), await repeats(pool))
        finally:
            await q.delete(if_unused=False, if_empty=False)


async def repeats(pool: asyncpg.Pool) -> int:
    """Rows attempted again after the kill, as the relay tells them (`Event.redelivered`):
    attempts > 1, or an ordered run member that recovery gave its attempt back (its
    available_at moved past its creation); the rows the killed relay held."""
    found: int = await pool.fetchval(
        "SELECT count(*) FROM outbox_events_all WHERE attempts > 1"
        " OR (ordering_key IS NOT NULL AND available_at > created_at)"
    )
    return found


def exactly_once(ids: list[str], expected: set[str], repeated: int) -> None:
    """Every ``expected`` id arrived exactly once, though ``repeated`` rows were attempted
    again after the kill (each looked up in the broker first)."""
    extra = len(ids) - len(set(ids))
    print(f"after SIGKILL: {len(ids)} messages, {extra} duplicates, {repeated} repeated rows")
    assert set(ids) == expected, f"{len(expected - set(ids))} events lost"
    assert repeated > 0, "the kill left no row to repeat: the test proves nothing"
    assert extra == 0, f"{extra} duplicates"


@needs("redis-server")
async def test_redis_exactly_once_through_sigkill(dsn: str, pool: asyncpg.Pool) -> None:
    """A private Redis: a repeated event is looked up by XRANGE before it is added."""
    broker = PrivateRedis()
    broker.start()
    # redis-py 8 reads with a 5 s timeout by default: 20k entries on a loaded machine
    client = aioredis.Redis.from_url(broker.url, socket_timeout=120)
    try:
        stream = unique("relay:kill:")
        await fill(pool, TOTAL)
        print(await kill_midway(pool, dsn, broker.url, TOTAL, "--destination", stream))
        entries = cast(Any, await client.xrange(stream))
        ids = [f[b"message_id"].decode() for _, f in entries]
        exactly_once(ids, await message_ids(pool), await repeats(pool))
    finally:
        await client.aclose()
        broker.destroy()


@needs("tansu")
async def test_kafka_exactly_once_through_sigkill(
    dsn: str, pool: asyncpg.Pool, kafka: Tansu
) -> None:
    """Three partitions, unkeyed: a repeated event is looked up in every partition from
    the offset of its creation (less the clock skew) before it is produced."""
    topic = unique("relay.kill.")
    await kafka_topic(kafka.bootstrap, topic)
    await fill(pool, TOTAL)
    to = f"kafka://{kafka.bootstrap}"
    print(await kill_midway(pool, dsn, to, TOTAL, "--destination", topic, "--no-idempotence"))
    found = await kafka_read(kafka.bootstrap, topic, TOTAL, timeout=60)
    ids = [dict(m.headers)["outbox-message-id"].decode() for m in found]
    exactly_once(ids, await message_ids(pool), await repeats(pool))


@needs("tansu")
async def test_kafka_without_read_back_repeats_within_the_window(
    dsn: str, pool: asyncpg.Pool, kafka: Tansu
) -> None:
    """``--no-read-back``: the bound of before, duplicates up to the in-flight window."""
    topic = unique("relay.kill.")
    await kafka_topic(kafka.bootstrap, topic)
    await fill(pool, TOTAL)
    to = f"kafka://{kafka.bootstrap}"
    await kill_midway(
        pool, dsn, to, TOTAL, "--destination", topic, "--no-idempotence", "--no-read-back"
    )
    found = await kafka_read(kafka.bootstrap, topic, TOTAL, timeout=60)
    ids = [dict(m.headers)["outbox-message-id"].decode() for m in found]
    duplicates_within_window(ids, await message_ids(pool), await repeats(pool))


@needs("redis-server")
async def test_redis_without_read_back_repeats_within_the_window(
    dsn: str, pool: asyncpg.Pool
) -> None:
    """``--no-read-back`` into a private Redis: the repeats are added again, up to the
    in-flight window (how many depends on where the kill lands: printed, not asserted)."""
    broker = PrivateRedis()
    broker.start()
    client = aioredis.Redis.from_url(broker.url, socket_timeout=120)
    try:
        stream = unique("relay:kill:")
        await fill(pool, TOTAL)
        await kill_midway(pool, dsn, broker.url, TOTAL, "--destination", stream, "--no-read-back")
        entries = cast(Any, await client.xrange(stream))
        ids = [f[b"message_id"].decode() for _, f in entries]
        duplicates_within_window(ids, await message_ids(pool), await repeats(pool))
    finally:
        await client.aclose()
        broker.destroy()


async def fill_ordered(pool: asyncpg.Pool, topic: str) -> None:
    """TOTAL events over 200 ordering keys, so the relay claims runs behind heads."""
    for start in range(0, TOTAL, 2000):
        batch = [
            aiooutbox.NewEvent(topic, {"n": i}, ordering_key=f"k{i % 200}")
            for i in range(start, start + 2000)
        ]
        async with pool.acquire() as conn:
            await aiooutbox.enqueue_many(conn, batch)


@needs("redis-server")
async def test_redis_ordered_exactly_once_through_sigkill(dsn: str, pool: asyncpg.Pool) -> None:
    """Ordered events: a run member behind a recovered head gets its attempt back
    (``attempts`` 1 again) but is ``redelivered``, so it is looked up too."""
    broker = PrivateRedis()
    broker.start()
    # redis-py 8 reads with a 5 s timeout by default: 20k entries on a loaded machine
    client = aioredis.Redis.from_url(broker.url, socket_timeout=120)
    try:
        stream = unique("relay:kill:")
        await fill_ordered(pool, stream)
        print(await kill_midway(pool, dsn, broker.url, TOTAL))
        entries = cast(Any, await client.xrange(stream))
        ids = [f[b"message_id"].decode() for _, f in entries]
        twice = [i for i, n in collections.Counter(ids).items() if n > 1]
        if twice:  # what the repeated rows looked like, to tell why
            for sid, f in entries:
                if f[b"message_id"].decode() in twice:
                    print("entry", sid, f[b"event_id"], f.get(b"ordering_key"))
            for r in await pool.fetch(
                "SELECT id, attempts, ordering_key, created_at, available_at, finished_at, "
                "last_error FROM outbox_events_all WHERE message_id::text = ANY($1)",
                twice,
            ):
                print("row", dict(r))
        exactly_once(ids, await message_ids(pool), await repeats(pool))
    finally:
        await client.aclose()
        broker.destroy()


@needs("tansu")
async def test_kafka_ordered_exactly_once_through_sigkill(
    dsn: str, pool: asyncpg.Pool, kafka: Tansu
) -> None:
    """Keyed records: each repeat is looked up in the one partition its key goes to."""
    topic = unique("relay.kill.")
    await kafka_topic(kafka.bootstrap, topic)
    await fill_ordered(pool, topic)
    to = f"kafka://{kafka.bootstrap}"
    print(await kill_midway(pool, dsn, to, TOTAL, "--no-idempotence"))
    found = await kafka_read(kafka.bootstrap, topic, TOTAL, timeout=60)
    ids = [dict(m.headers)["outbox-message-id"].decode() for m in found]
    exactly_once(ids, await message_ids(pool), await repeats(pool))
