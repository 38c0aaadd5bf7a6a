"""The producer API against a real PostgreSQL: transactions, round trips, dedupe."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import asyncpg
import pytest

import aiooutbox
from aiooutbox import NewEvent

SEED_INSERT = (
    "INSERT INTO outbox_events (dedupe_key, topic, payload) "
    """VALUES ('order-42-created', 'orders.created', '{"order_id": 42}') """
    "ON CONFLICT (dedupe_key) DO NOTHING"
)


async def count(conn: asyncpg.Connection | asyncpg.Pool, where: str = "true") -> int:
    n: int = await conn.fetchval(f"SELECT count(*) FROM outbox_events_all WHERE {where}")
    return n


async def stored(conn: asyncpg.Connection | asyncpg.Pool, event_id: int) -> dict[str, Any]:
    """The row as PostgreSQL holds it, JSONB columns decoded from their text form."""
    row = await conn.fetchrow(
        "SELECT id, topic, payload::text AS payload, headers::text AS headers, dedupe_key,"
        " status::text AS status, attempts, max_attempts, available_at, created_at,"
        " updated_at, finished_at, last_error, locked_by"
        " FROM outbox_events_all WHERE id = $1",
        event_id,
    )
    assert row is not None, f"no row with id {event_id}"
    out = dict(row)
    out["payload"] = json.loads(out["payload"])
    out["headers"] = json.loads(out["headers"])
    return out


@pytest.fixture
async def txn_conn(shared_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection to the shared database inside a transaction that is rolled back."""
    c = await asyncpg.connect(shared_dsn)
    try:
        tr = c.transaction()
        await tr.start()
        assert await count(c) == 0
        yield c
        await tr.rollback()
    finally:
        await c.close()


# -- transactions ------------------------------------------------------------------------


async def test_rolled_back_transaction_leaves_no_row(conn: asyncpg.Connection, dsn: str) -> None:
    await conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")

    class Boom(Exception):
        pass

    async def place_order() -> None:
        async with conn.transaction():
            await conn.execute("INSERT INTO orders VALUES (42)")
            event_id = await aiooutbox.enqueue(conn, "orders.created", {"order_id": 42})
            assert isinstance(event_id, int)
            # visible inside the transaction...
            assert await count(conn) == 1
            raise Boom

    with pytest.raises(Boom):
        await place_order()

    # ...and gone with it, seen from this and from another session
    assert await count(conn) == 0
    assert await conn.fetchval("SELECT count(*) FROM orders") == 0
    other = await asyncpg.connect(dsn)
    try:
        assert await count(other) == 0
    finally:
        await other.close()


async def test_committed_transaction_leaves_exactly_one_row(
    conn: asyncpg.Connection, dsn: str
) -> None:
    await conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")
    other = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute("INSERT INTO orders VALUES (42)")
            event_id = await aiooutbox.enqueue(conn, "orders.created", {"order_id": 42})
            # not visible to anyone else before the commit
            assert await count(other) == 0
        assert await count(other) == 1
        row = await stored(other, event_id)  # type: ignore[arg-type]
    finally:
        await other.close()
    assert row["topic"] == "orders.created"
    assert row["payload"] == {"order_id": 42}
    assert row["status"] == "pending"
    assert row["attempts"] == 0
    assert row["dedupe_key"] is None
    assert row["headers"] == {}
    assert row["locked_by"] is None
    assert row["finished_at"] is None
    assert row["last_error"] is None


async def test_enqueue_many_rolls_back_with_the_transaction(conn: asyncpg.Connection) -> None:
    tr = conn.transaction()
    await tr.start()
    ids = await aiooutbox.enqueue_many(conn, [NewEvent("a", i) for i in range(10)])
    assert len(ids) == 10
    assert await count(conn) == 10
    await tr.rollback()
    assert await count(conn) == 0


async def test_enqueue_on_a_pool_commits_on_its_own(pool: asyncpg.Pool, dsn: str) -> None:
    event_id = await aiooutbox.enqueue(pool, "mail.send", {"to": "a@example.com"})
    ids = await aiooutbox.enqueue_many(pool, [NewEvent("mail.send", {"n": n}) for n in range(3)])
    assert isinstance(event_id, int)
    assert all(isinstance(i, int) for i in ids)
    other = await asyncpg.connect(dsn)
    try:
        assert await count(other) == 4
        assert (await stored(other, event_id))["payload"] == {"to": "a@example.com"}
        assert [(await stored(other, i))["payload"] for i in ids] == [  # type: ignore[arg-type]
            {"n": 0},
            {"n": 1},
            {"n": 2},
        ]
    finally:
        await other.close()
    # the pool's connections are idle, not inside a leftover transaction
    async with pool.acquire() as c:
        assert not c.is_in_transaction()


# -- what is stored ----------------------------------------------------------------------

PAYLOADS = [
    {"order_id": 42},
    {"nested": {"list": [1, 2.5, "three", None, True, False], "empty": {}}},
    [1, 2, 3],
    "just a string",
    12345,
    0.1,
    -1.5e-10,
    2**64 - 1,  # the largest integer accepted (tests/test_producer_checks.py)
    -(2**63),
    True,
    None,
    {"unicode": "żółć 😀 日本語", "quote": 'a"b\\c', "newline": "x\ny\tz"},
    {"literal backslash-u0000": "\\u0000", "escaped": "\\\\u0000"},
    {"": "empty key", "k" * 300: "long key"},
    {"big": "x" * 100_000},
]


@pytest.mark.parametrize("payload", PAYLOADS, ids=range(len(PAYLOADS)))
async def test_payload_round_trips(txn_conn: asyncpg.Connection, payload: Any) -> None:
    one = await aiooutbox.enqueue(txn_conn, "t", payload)
    [many] = await aiooutbox.enqueue_many(txn_conn, [NewEvent("t", payload)])
    for event_id in (one, many):
        assert event_id is not None
        row = await stored(txn_conn, event_id)
        assert row["payload"] == payload
        assert type(row["payload"]) is type(payload)
    # and PostgreSQL holds it as real JSONB, not a JSON string wrapping the text
    assert await txn_conn.fetchval(
        "SELECT payload = $1::text::jsonb FROM outbox_events_all WHERE id = $2",
        json.dumps(payload),
        one,
    )


async def test_headers_round_trip(txn_conn: asyncpg.Connection) -> None:
    headers = {"traceparent": "00-abc-def-01", "attempt": 1, "tags": ["x", "y"], "n": None}
    event_id = await aiooutbox.enqueue(txn_conn, "t", {}, headers=headers)
    [many_id] = await aiooutbox.enqueue_many(txn_conn, [NewEvent("t", {}, headers=headers)])
    for i in (event_id, many_id):
        assert (await stored(txn_conn, i))["headers"] == headers  # type: ignore[arg-type]
    assert await txn_conn.fetchval(
        "SELECT headers->>'traceparent' FROM outbox_events_all WHERE id = $1", event_id
    ) == ("00-abc-def-01")


async def test_json_codec_on_the_connection_does_not_double_encode(
    txn_conn: asyncpg.Connection,
) -> None:
    # applications often install a jsonb codec; the producer must still store an object
    await txn_conn.set_type_codec(
        "jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog"
    )
    event_id = await aiooutbox.enqueue(txn_conn, "t", {"a": 1}, headers={"h": "v"})
    assert await txn_conn.fetchval(
        "SELECT jsonb_typeof(payload) || ',' || jsonb_typeof(headers) FROM outbox_events_all"
        " WHERE id = $1",
        event_id,
    ) == ("object,object")
    assert await txn_conn.fetchval(
        "SELECT payload FROM outbox_events_all WHERE id = $1", event_id
    ) == {"a": 1}


async def test_custom_encoder_is_used(txn_conn: asyncpg.Connection) -> None:
    class Money:
        def __init__(self, cents: int) -> None:
            self.cents = cents

    def encode(value: Any) -> bytes:
        return json.dumps(value, default=lambda o: {"cents": o.cents}).encode()

    event_id = await aiooutbox.enqueue(txn_conn, "t", {"price": Money(250)}, encoder=encode)
    [many_id] = await aiooutbox.enqueue_many(
        txn_conn, [NewEvent("t", [Money(1)], headers={"m": Money(2)})], encoder=encode
    )
    assert (await stored(txn_conn, event_id))["payload"] == {"price": {"cents": 250}}  # type: ignore[arg-type]
    row = await stored(txn_conn, many_id)  # type: ignore[arg-type]
    assert row["payload"] == [{"cents": 1}]
    assert row["headers"] == {"m": {"cents": 2}}


async def test_default_schedule_and_max_attempts(txn_conn: asyncpg.Connection) -> None:
    event_id = await aiooutbox.enqueue(txn_conn, "t", {})
    row = await stored(txn_conn, event_id)  # type: ignore[arg-type]
    # due at once: placed when the row is written, after its transaction started
    assert row["available_at"] >= row["created_at"]
    assert row["max_attempts"] == aiooutbox.producer.DEFAULT_MAX_ATTEMPTS == 5


@pytest.mark.parametrize(
    ("delay", "expected"),
    [
        (60, timedelta(seconds=60)),
        (0.25, timedelta(milliseconds=250)),
        (0, timedelta(0)),
        (timedelta(minutes=5), timedelta(minutes=5)),
        (timedelta(days=400), timedelta(days=400)),
    ],
)
async def test_delay_sets_available_at(
    txn_conn: asyncpg.Connection, delay: float | timedelta, expected: timedelta
) -> None:
    # created_at and available_at both come from now() of the same statement; with no
    # delay, the row is placed when it is written instead (migration 0019: a time at or
    # before its statement's start becomes the row's clock_timestamp())
    event_id = await aiooutbox.enqueue(txn_conn, "t", {}, delay=delay)
    [many_id] = await aiooutbox.enqueue_many(txn_conn, [NewEvent("t", {}, delay=delay)])
    for i in (event_id, many_id):
        row = await stored(txn_conn, i)  # type: ignore[arg-type]
        if expected:
            assert row["available_at"] - row["created_at"] == expected
        else:
            assert row["available_at"] - row["created_at"] >= expected


async def test_available_at_is_stored_exactly(txn_conn: asyncpg.Connection) -> None:
    tz = timezone(timedelta(hours=5, minutes=30))
    when = datetime(2031, 2, 3, 4, 5, 6, 789000, tzinfo=tz)
    past = datetime(2001, 1, 1, tzinfo=UTC)
    event_id = await aiooutbox.enqueue(txn_conn, "t", {}, available_at=when)
    ids = await aiooutbox.enqueue_many(
        txn_conn, [NewEvent("t", {}, available_at=past), NewEvent("t", {}, available_at=when)]
    )
    assert (await stored(txn_conn, event_id))["available_at"] == when  # type: ignore[arg-type]
    # a time in the past is due now: the row is placed when it is written (0019)
    written = (await stored(txn_conn, ids[0]))["available_at"]  # type: ignore[arg-type]
    assert past < written <= await txn_conn.fetchval("SELECT clock_timestamp()")
    assert (await stored(txn_conn, ids[1]))["available_at"] == when  # type: ignore[arg-type]
    # the same instant, whatever the session's time zone
    await txn_conn.execute("SET TIME ZONE 'America/New_York'")
    assert await txn_conn.fetchval(
        "SELECT available_at = '2031-02-02 22:35:06.789+00' FROM outbox_events_all WHERE id = $1",
        event_id,
    )


@pytest.mark.parametrize("max_attempts", [1, 3, 25, 1_000_000])
async def test_max_attempts_is_stored(txn_conn: asyncpg.Connection, max_attempts: int) -> None:
    event_id = await aiooutbox.enqueue(txn_conn, "t", {}, max_attempts=max_attempts)
    [many_id] = await aiooutbox.enqueue_many(
        txn_conn, [NewEvent("t", {}, max_attempts=max_attempts)]
    )
    for i in (event_id, many_id):
        assert (await stored(txn_conn, i))["max_attempts"] == max_attempts  # type: ignore[arg-type]


async def test_limits_are_inclusive(txn_conn: asyncpg.Connection) -> None:
    topic = "t" * aiooutbox.producer.MAX_TOPIC_LENGTH
    wide_topic = "😀" * aiooutbox.producer.MAX_TOPIC_LENGTH
    key = "k" * aiooutbox.producer.MAX_DEDUPE_KEY_LENGTH
    wide_key = "😀" * (aiooutbox.producer.MAX_DEDUPE_KEY_LENGTH // 4)  # 1024 UTF-8 bytes
    a = await aiooutbox.enqueue(txn_conn, topic, 1, dedupe_key=key)
    b = await aiooutbox.enqueue(txn_conn, wide_topic, 2, dedupe_key=wide_key)
    assert (await stored(txn_conn, a))["topic"] == topic  # type: ignore[arg-type]
    row = await stored(txn_conn, b)  # type: ignore[arg-type]
    assert (row["topic"], row["dedupe_key"]) == (wide_topic, wide_key)
    assert await aiooutbox.enqueue(txn_conn, "t", 3, dedupe_key=wide_key) is None
    assert await count(txn_conn) == 2


# -- dedupe --------------------------------------------------------------------------------


async def test_repeated_dedupe_key_returns_none_and_keeps_the_first(
    conn: asyncpg.Connection,
) -> None:
    first = await aiooutbox.enqueue(conn, "orders.created", {"v": 1}, dedupe_key="order-42")
    assert isinstance(first, int)
    async with conn.transaction():
        again = await aiooutbox.enqueue(conn, "orders.created", {"v": 2}, dedupe_key="order-42")
        assert again is None
    # any topic: the key is unique across the table
    assert await aiooutbox.enqueue(conn, "other.topic", {"v": 3}, dedupe_key="order-42") is None
    assert await count(conn) == 1
    assert (await stored(conn, first))["payload"] == {"v": 1}
    assert (await stored(conn, first))["dedupe_key"] == "order-42"


async def test_dedupe_conflict_leaves_the_callers_transaction_usable(
    conn: asyncpg.Connection,
) -> None:
    await aiooutbox.enqueue(conn, "t", 1, dedupe_key="k")
    async with conn.transaction():
        assert await aiooutbox.enqueue(conn, "t", 2, dedupe_key="k") is None
        assert await aiooutbox.enqueue(conn, "t", 3, dedupe_key="k2") is not None
    assert await count(conn) == 2


async def test_dedupe_key_freed_by_rollback_can_be_used_again(conn: asyncpg.Connection) -> None:
    tr = conn.transaction()
    await tr.start()
    assert await aiooutbox.enqueue(conn, "t", 1, dedupe_key="k") is not None
    await tr.rollback()
    again = await aiooutbox.enqueue(conn, "t", 2, dedupe_key="k")
    assert again is not None
    assert (await stored(conn, again))["payload"] == 2
    assert await count(conn) == 1


async def test_concurrent_transactions_with_one_dedupe_key(dsn: str) -> None:
    a = await asyncpg.connect(dsn)
    b = await asyncpg.connect(dsn)
    try:
        tr = a.transaction()
        await tr.start()
        first = await aiooutbox.enqueue(a, "t", "a", dedupe_key="same")
        # b waits on a's uncommitted key, then sees it and dedupes
        second = asyncio.ensure_future(aiooutbox.enqueue(b, "t", "b", dedupe_key="same"))
        for _ in range(200):
            waiting = await a.fetchval(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND pid = $1",
                b.get_server_pid(),
            )
            if waiting:
                break
            await asyncio.sleep(0.01)
        assert waiting == 1, "the second producer should wait on the first one's key"
        assert not second.done()
        await tr.commit()
        assert await asyncio.wait_for(second, 10) is None
        assert await count(a) == 1
        assert (await stored(a, first))["payload"] == "a"  # type: ignore[arg-type]
    finally:
        await a.close()
        await b.close()


async def test_seed_raw_sql_insert_dedupes_against_itself_and_the_api(
    conn: asyncpg.Connection,
) -> None:
    assert await conn.execute(SEED_INSERT) == "INSERT 0 1"
    assert await conn.execute(SEED_INSERT) == "INSERT 0 0"
    again = await aiooutbox.enqueue(conn, "orders.created", {}, dedupe_key="order-42-created")
    assert again is None
    assert await aiooutbox.enqueue_many(
        conn, [NewEvent("orders.created", {}, dedupe_key="order-42-created")]
    ) == [None]
    assert await count(conn) == 1
    row = await conn.fetchrow(
        "SELECT topic, payload::text, status::text, headers::text, max_attempts, attempts"
        " FROM outbox_events_all"
    )
    assert row["topic"] == "orders.created"
    assert json.loads(row["payload"]) == {"order_id": 42}
    assert (row["status"], json.loads(row["headers"]), row["max_attempts"], row["attempts"]) == (
        "pending",
        {},
        5,
        0,
    )


async def test_seed_raw_sql_insert_after_the_api_is_a_no_op(conn: asyncpg.Connection) -> None:
    event_id = await aiooutbox.enqueue(
        conn, "orders.created", {"v": "api"}, dedupe_key="order-42-created"
    )
    assert await conn.execute(SEED_INSERT) == "INSERT 0 0"
    assert await count(conn) == 1
    assert (await stored(conn, event_id))["payload"] == {"v": "api"}  # type: ignore[arg-type]


async def test_null_dedupe_keys_never_collide(conn: asyncpg.Connection) -> None:
    ids = [await aiooutbox.enqueue(conn, "t", i) for i in range(3)]
    ids += await aiooutbox.enqueue_many(conn, [NewEvent("t", i) for i in range(3, 6)])
    for _ in range(2):
        await conn.execute(
            "INSERT INTO outbox_events (dedupe_key, topic, payload) VALUES (NULL, 't', '6')"
            " ON CONFLICT (dedupe_key) DO NOTHING"
        )
    assert all(isinstance(i, int) for i in ids)
    assert len(set(ids)) == 6
    assert await count(conn, "dedupe_key IS NULL") == 8


async def test_enqueue_many_dedupes_within_the_batch_and_against_the_table(
    conn: asyncpg.Connection,
) -> None:
    existing = await aiooutbox.enqueue(conn, "t", "existing", dedupe_key="old")
    batch = [
        NewEvent("t", "k1 first", dedupe_key="k1"),
        NewEvent("t", "unkeyed 1"),
        NewEvent("u", "k2 first", dedupe_key="k2"),
        NewEvent("t", "k1 again", dedupe_key="k1"),
        NewEvent("t", "old again", dedupe_key="old"),
        NewEvent("t", "unkeyed 2"),
        NewEvent("u", "k2 again", dedupe_key="k2"),
        NewEvent("t", "k1 third", dedupe_key="k1"),
        NewEvent("v", "k3", dedupe_key="k3"),
        NewEvent("t", "unkeyed 3"),
    ]
    ids = await aiooutbox.enqueue_many(conn, batch)
    assert len(ids) == len(batch)
    assert [i is None for i in ids] == [
        False,
        False,
        False,
        True,
        True,
        False,
        True,
        True,
        False,
        False,
    ]
    # every returned id is the row holding that event's payload, topic and key
    for event, event_id in zip(batch, ids, strict=True):
        if event_id is None:
            continue
        row = await stored(conn, event_id)
        assert (row["payload"], row["topic"], row["dedupe_key"]) == (
            event.payload,
            event.topic,
            event.dedupe_key,
        )
    inserted = [i for i in ids if i is not None]
    # keyed rows go in first, sorted by key (so producers sharing keys cannot deadlock),
    # then the keyless ones in input order
    pairs = list(zip(batch, ids, strict=True))
    keyed = {e.dedupe_key: i for e, i in pairs if i is not None and e.dedupe_key is not None}
    by_key = [keyed[k] for k in sorted(keyed)]
    unkeyed = [i for e, i in pairs if e.dedupe_key is None]
    assert by_key + unkeyed == sorted(inserted)
    assert len(set(inserted)) == 6
    assert await count(conn) == 7
    assert (await stored(conn, existing))["payload"] == "existing"  # type: ignore[arg-type]
    assert await conn.fetch(
        "SELECT payload::text FROM outbox_events_all WHERE dedupe_key = 'k1'"
    ) == [('"k1 first"',)]


async def test_enqueue_many_second_batch_is_all_duplicates(conn: asyncpg.Connection) -> None:
    batch = [NewEvent("t", n, dedupe_key=f"k{n}") for n in range(50)]
    first = await aiooutbox.enqueue_many(conn, batch)
    assert all(isinstance(i, int) for i in first)
    assert await aiooutbox.enqueue_many(conn, batch) == [None] * 50
    assert await count(conn) == 50


async def test_enqueue_many_large_mixed_batch_maps_ids_to_payloads(
    conn: asyncpg.Connection,
) -> None:
    # a few thousand events, keyed and unkeyed interleaved, some keys repeated
    batch = [
        NewEvent(
            f"topic.{n % 7}",
            {"n": n},
            dedupe_key=None if n % 3 else f"key-{n % 900}",
            max_attempts=1 + n % 9,
            headers={"n": str(n)},
        )
        for n in range(3000)
    ]
    ids = await aiooutbox.enqueue_many(conn, batch)
    assert len(ids) == 3000
    seen_keys: set[str] = set()
    expected_present = []
    for event in batch:
        if event.dedupe_key is None:
            expected_present.append(True)
        else:
            expected_present.append(event.dedupe_key not in seen_keys)
            seen_keys.add(event.dedupe_key)
    assert [i is not None for i in ids] == expected_present
    rows = {
        r["id"]: r
        for r in await conn.fetch(
            "SELECT id, topic, (payload->>'n')::int AS n, dedupe_key, max_attempts,"
            " headers->>'n' AS h FROM outbox_events_all"
        )
    }
    assert len(rows) == sum(expected_present)
    for n, (event, event_id) in enumerate(zip(batch, ids, strict=True)):
        if event_id is None:
            continue
        r = rows[event_id]
        assert (r["n"], r["topic"], r["dedupe_key"], r["max_attempts"], r["h"]) == (
            n,
            event.topic,
            event.dedupe_key,
            event.max_attempts,
            str(n),
        )


async def test_enqueue_many_accepts_any_iterable_and_empty(conn: asyncpg.Connection) -> None:
    assert await aiooutbox.enqueue_many(conn, []) == []
    assert await aiooutbox.enqueue_many(conn, iter(())) == []
    ids = await aiooutbox.enqueue_many(conn, (NewEvent("t", n) for n in range(4)))
    assert [(await stored(conn, i))["payload"] for i in ids] == [0, 1, 2, 3]  # type: ignore[arg-type]
    assert await count(conn) == 4
