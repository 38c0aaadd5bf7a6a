"""The idle-gated wake-up trigger, observed from a LISTENing connection.

The trigger notifies only when some consumer has advertised itself idle (a row in the
UNLOGGED ``<table>_idle`` table) for a topic the statement inserted, and then once per
such topic per statement, never per row.

How "no more notifications" is proved without sleeping: after the statement under test
has committed, the producer's connection sends a sentinel NOTIFY on the same channel.
PostgreSQL delivers notifications of different transactions in commit order, so once
the sentinel arrives every notification the statement caused has arrived before it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

import aiooutbox
from aiooutbox import NewEvent
from aiooutbox._sql.statements import queries
from tests.helpers import insert_unchecked

CHANNEL = queries().channel


class Listener:
    """Collects the payloads of NOTIFYs on one channel."""

    def __init__(self, conn: asyncpg.Connection, channel: str) -> None:
        self.conn = conn
        self.channel = channel
        self.queue: asyncio.Queue[str] = asyncio.Queue()

    def _on_notify(self, _conn: object, _pid: int, channel: str, payload: str) -> None:
        assert channel == self.channel
        self.queue.put_nowait(payload)

    async def start(self) -> Listener:
        await self.conn.add_listener(self.channel, self._on_notify)
        return self

    async def drain(self, producer: asyncpg.Connection, timeout: float = 10.0) -> list[str]:
        """Every payload received up to now (in arrival order), fenced by a sentinel."""
        assert not producer.is_in_transaction(), "commit the statement under test first"
        sentinel = f"sentinel-{uuid.uuid4().hex}"
        await producer.execute("SELECT pg_notify($1, $2)", self.channel, sentinel)
        received: list[str] = []

        async def until_sentinel() -> None:
            while (payload := await self.queue.get()) != sentinel:
                received.append(payload)

        await asyncio.wait_for(until_sentinel(), timeout)
        return received


@pytest.fixture
async def listen_conn(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(dsn)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
async def listener(listen_conn: asyncpg.Connection) -> Listener:
    return await Listener(listen_conn, CHANNEL).start()


async def advertise_idle(
    conn: asyncpg.Connection,
    topics: list[str],
    *,
    worker: str = "worker-1",
    seconds: float = 60.0,
    table: str = "outbox_events",
) -> None:
    await conn.execute(queries(table=table).declare_idle, worker, topics, seconds)


async def test_the_channel_is_derived_from_the_outbox() -> None:
    assert queries("public", "outbox_events").channel == CHANNEL
    assert queries(table="other").channel != CHANNEL
    assert queries("billing", "outbox_events").channel != CHANNEL
    # no two validated names map onto one channel
    assert queries("a_b", "c").channel != queries("a", "b_c").channel
    long_a, long_b = queries("s" * 63, "t" * 40).channel, queries("s" * 63, "u" * 40).channel
    assert long_a != long_b
    assert max(len(long_a.encode()), len(long_b.encode())) <= 63


async def test_one_notification_per_advertised_topic_per_statement(
    conn: asyncpg.Connection, listener: Listener
) -> None:
    await advertise_idle(conn, ["a", "b"])
    ids = await aiooutbox.enqueue_many(
        conn, [NewEvent("a", 1), NewEvent("a", 2), NewEvent("b", 3), NewEvent("c", 4)]
    )
    assert None not in ids
    received = await listener.drain(conn)
    assert sorted(received) == ["a", "b"]
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_all") == 4


async def test_the_trigger_runs_once_per_statement_not_per_row(
    conn: asyncpg.Connection, listener: Listener
) -> None:
    # PostgreSQL merges equal notifications within a transaction, so the payloads alone
    # cannot tell a per-row trigger from a per-statement one: count the function's calls
    row_level = await conn.fetchval(
        "SELECT (tgtype & 1) = 1 FROM pg_trigger WHERE tgname = 'outbox_events_wakeup'"
    )
    assert row_level is False
    await advertise_idle(conn, ["a", "b"])
    await conn.execute("SET track_functions = 'all'")
    async with conn.transaction():
        await aiooutbox.enqueue_many(conn, [NewEvent(t, 1) for t in "aabc" * 50])
        await conn.execute(
            "INSERT INTO outbox_events (topic, payload) SELECT 'b', '{}'"
            " FROM generate_series(1, 100)"
        )
        calls = await conn.fetchval(
            "SELECT pg_stat_get_xact_function_calls('public.outbox_events_wakeup'::regproc)"
        )
    assert calls == 2
    assert sorted(await listener.drain(conn)) == ["a", "b"]


async def test_raw_sql_producers_wake_consumers_too(
    conn: asyncpg.Connection, listener: Listener
) -> None:
    await advertise_idle(conn, ["a", "b"])
    # one plain multi-row INSERT from "any language": 3000 rows over four topics
    status = await conn.execute(
        "INSERT INTO outbox_events (topic, payload)"
        " SELECT (ARRAY['a', 'a', 'b', 'c'])[1 + n % 4], jsonb_build_object('n', n)"
        " FROM generate_series(1, 3000) AS n"
    )
    assert status == "INSERT 0 3000"
    assert sorted(await listener.drain(conn)) == ["a", "b"]


async def test_each_statement_notifies_separately(
    conn: asyncpg.Connection, listener: Listener
) -> None:
    await advertise_idle(conn, ["a", "b"])
    await aiooutbox.enqueue(conn, "a", 1)
    await aiooutbox.enqueue(conn, "a", 2)
    await aiooutbox.enqueue(conn, "c", 3)
    await aiooutbox.enqueue(conn, "b", 4)
    assert await listener.drain(conn) == ["a", "a", "b"]


async def test_overlapping_idle_adverts_still_notify_each_topic_once(
    conn: asyncpg.Connection, listener: Listener
) -> None:
    await advertise_idle(conn, ["a", "b"], worker="w1")
    await advertise_idle(conn, ["b", "c"], worker="w2")
    await advertise_idle(conn, ["a", "b", "c"], worker="w3")
    await aiooutbox.enqueue_many(
        conn, [NewEvent(t, n) for n, t in enumerate(["a", "b", "c", "d"] * 25)]
    )
    assert sorted(await listener.drain(conn)) == ["a", "b", "c"]


async def test_a_statement_that_inserts_nothing_notifies_nothing(
    conn: asyncpg.Connection, listener: Listener
) -> None:
    await aiooutbox.enqueue_many(conn, [NewEvent("a", 1, dedupe_key="k1")])
    await conn.execute(
        "INSERT INTO outbox_events (dedupe_key, topic, payload) VALUES ('k2', 'b', '{}')"
    )
    await advertise_idle(conn, ["a", "b"])
    assert await listener.drain(conn) == []

    # every row a dedupe conflict, through the API and through raw SQL
    assert await aiooutbox.enqueue(conn, "a", 2, dedupe_key="k1") is None
    assert await aiooutbox.enqueue_many(
        conn, [NewEvent("a", 3, dedupe_key="k1"), NewEvent("b", 4, dedupe_key="k2")]
    ) == [None, None]
    status = await conn.execute(
        "INSERT INTO outbox_events (dedupe_key, topic, payload) VALUES ('k2', 'b', '{}')"
        " ON CONFLICT (dedupe_key) DO NOTHING"
    )
    assert status == "INSERT 0 0"
    # and an INSERT ... SELECT that selects no rows
    assert await conn.execute(
        "INSERT INTO outbox_events (topic, payload) SELECT 'a', '{}' WHERE false"
    ) == ("INSERT 0 0")
    assert await listener.drain(conn) == []
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_all") == 2


async def test_a_partly_deduplicated_statement_notifies_only_inserted_topics(
    conn: asyncpg.Connection, listener: Listener
) -> None:
    await aiooutbox.enqueue(conn, "a", 1, dedupe_key="k1")
    await advertise_idle(conn, ["a", "b"])
    ids = await aiooutbox.enqueue_many(
        conn, [NewEvent("a", 2, dedupe_key="k1"), NewEvent("b", 3, dedupe_key="k2")]
    )
    assert ids[0] is None
    assert ids[1] is not None
    assert await listener.drain(conn) == ["b"]


async def test_no_idle_advert_means_no_notification(
    conn: asyncpg.Connection, listener: Listener
) -> None:
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_idle") == 0
    await aiooutbox.enqueue_many(conn, [NewEvent(t, 1) for t in "aabc"])
    await aiooutbox.enqueue(conn, "a", 2)
    await conn.execute("INSERT INTO outbox_events (topic, payload) VALUES ('a', '{}')")
    assert await listener.drain(conn) == []
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_all") == 6


async def test_an_expired_idle_advert_means_no_notification(
    conn: asyncpg.Connection, listener: Listener
) -> None:
    await advertise_idle(conn, ["a", "b"], seconds=-1)
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_idle") == 1
    await aiooutbox.enqueue_many(conn, [NewEvent(t, 1) for t in "aabc"])
    assert await listener.drain(conn) == []
    # the same consumer refreshing its advert is heard again
    await advertise_idle(conn, ["a", "b"], seconds=60)
    await aiooutbox.enqueue_many(conn, [NewEvent(t, 1) for t in "aabc"])
    assert sorted(await listener.drain(conn)) == ["a", "b"]


async def test_a_busy_consumer_is_not_notified(
    conn: asyncpg.Connection, listener: Listener
) -> None:
    await advertise_idle(conn, ["a"], worker="w1")
    await conn.execute(queries().declare_busy, "w1")
    await aiooutbox.enqueue(conn, "a", 1)
    assert await listener.drain(conn) == []


async def test_an_advert_for_other_topics_means_no_notification(
    conn: asyncpg.Connection, listener: Listener
) -> None:
    await advertise_idle(conn, ["x", "y"])
    await aiooutbox.enqueue_many(conn, [NewEvent(t, 1) for t in "aabc"])
    assert await listener.drain(conn) == []


async def test_a_rolled_back_insert_notifies_nothing(
    conn: asyncpg.Connection, listener: Listener
) -> None:
    await advertise_idle(conn, ["a"])
    tr = conn.transaction()
    await tr.start()
    await aiooutbox.enqueue(conn, "a", 1)
    await tr.rollback()
    assert await listener.drain(conn) == []
    # notifications are sent at commit, with the event
    async with conn.transaction():
        await aiooutbox.enqueue(conn, "a", 2)
        await aiooutbox.enqueue(conn, "a", 3)  # equal notifications in one transaction merge
        assert listener.queue.empty()
    assert await listener.drain(conn) == ["a"]


async def test_a_row_inserted_finished_notifies_nothing(
    conn: asyncpg.Connection, listener: Listener
) -> None:
    await advertise_idle(conn, ["a"])
    # (rows no producer may insert any more: as a restore with the insert check off would)
    await insert_unchecked(
        conn,
        "INSERT INTO outbox_events (topic, payload, status) VALUES ('a', '{}', 'done'),"
        " ('a', '{}', 'dead')",
    )
    assert await listener.drain(conn) == []


async def test_delayed_events_wake_idle_consumers_once_per_topic(
    conn: asyncpg.Connection, listener: Listener
) -> None:
    # by design (the consumer then sleeps until the event is due instead of polling),
    # a delayed insert notifies like an immediate one: once per advertised topic
    await advertise_idle(conn, ["a", "b"])
    later = datetime.now(UTC) + timedelta(hours=1)
    await aiooutbox.enqueue(conn, "a", 1, delay=3600)
    await aiooutbox.enqueue_many(
        conn,
        [
            NewEvent("b", 2, available_at=later),
            NewEvent("b", 3, delay=timedelta(days=1)),
            NewEvent("c", 4, delay=60),
        ],
    )
    assert await listener.drain(conn) == ["a", "b"]
    assert (
        await conn.fetchval("SELECT count(*) FROM outbox_events_all WHERE available_at > now()")
        == 4
    )


async def test_two_outboxes_use_separate_channels(
    conn: asyncpg.Connection, listener: Listener, dsn: str
) -> None:
    await aiooutbox.migrate(conn, table="other_outbox")
    await aiooutbox.migrate(conn, schema="a_b", table="c")
    await aiooutbox.migrate(conn, schema="a", table="b_c")
    other_conn = await asyncpg.connect(dsn)
    try:
        others = {
            key: await Listener(other_conn, queries(*key).channel).start()
            for key in [("public", "other_outbox"), ("a_b", "c"), ("a", "b_c")]
        }
        channels = {CHANNEL} | {lst.channel for lst in others.values()}
        assert len(channels) == 4

        await advertise_idle(conn, ["a"])
        for schema, table in others:
            await conn.execute(queries(schema, table).declare_idle, "w", ["a"], 60.0)

        await aiooutbox.enqueue(conn, "a", "default")
        assert await listener.drain(conn) == ["a"]
        for lst in others.values():
            assert await lst.drain(conn) == []

        for key, lst in others.items():
            await aiooutbox.enqueue_many(
                conn, [NewEvent("a", 1), NewEvent("a", 2)], schema=key[0], table=key[1]
            )
            assert await lst.drain(conn) == ["a"]
            assert await listener.drain(conn) == []
            for other_key, other in others.items():
                if other_key != key:
                    assert await other.drain(conn) == []

        # an idle advert in one outbox does not gate another outbox's trigger
        await conn.execute(queries().declare_busy, "worker-1")
        await aiooutbox.enqueue(conn, "a", "default again")
        assert await listener.drain(conn) == []
    finally:
        await other_conn.close()
