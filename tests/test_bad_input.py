"""Bad input to the Python API raises a clear error before anything is written.

Every case runs inside the caller's open transaction and then shows that the table is
still empty and the transaction still usable: a valid enqueue succeeds in it and is then
the only row. The transaction is rolled back at the end, so the hundreds of cases here
share one migrated database (a fresh one per case would cost half a minute).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import UTC, date, datetime, timedelta, timezone
from typing import Any

import asyncpg
import pytest

import aiooutbox
from aiooutbox import InvalidArgument, NewEvent, OutboxConsumer


@pytest.fixture
async def conn(shared_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(shared_dsn)
    try:
        assert await c.fetchval("SELECT count(*) FROM outbox_events_all") == 0
        yield c
    finally:
        await c.close()


NOW = datetime.now(UTC)


class Unserialisable:
    pass


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def circular() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


# (id, enqueue keyword arguments, expected exception, message fragment)
BAD_EVENTS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("topic-empty", {"topic": ""}, InvalidArgument, "topic must be a non-empty"),
    ("topic-blank", {"topic": "   "}, InvalidArgument, "topic must be a non-empty"),
    ("topic-whitespace", {"topic": "\t\n"}, InvalidArgument, "topic must be a non-empty"),
    ("topic-256", {"topic": "t" * 256}, InvalidArgument, "256 characters long"),
    ("topic-256-wide", {"topic": "ż" * 256}, InvalidArgument, "the limit is 255"),
    ("topic-huge", {"topic": "t" * 100_000}, InvalidArgument, "the limit is 255"),
    ("topic-none", {"topic": None}, TypeError, "topic must be a str, not NoneType"),
    ("topic-int", {"topic": 42}, TypeError, "topic must be a str, not int"),
    ("topic-bytes", {"topic": b"orders"}, TypeError, "topic must be a str, not bytes"),
    ("topic-nul", {"topic": "a\x00b"}, InvalidArgument, "NUL"),
    ("topic-surrogate", {"topic": "a\ud800"}, InvalidArgument, "topic is not valid Unicode"),
    ("payload-object", {"payload": object()}, TypeError, "payload is not JSON-serialisable"),
    ("payload-set", {"payload": {1, 2}}, TypeError, "payload is not JSON-serialisable"),
    ("payload-nested-set", {"payload": {"a": [{1}]}}, TypeError, "not JSON-serialisable"),
    ("payload-class", {"payload": Unserialisable()}, TypeError, "not JSON-serialisable"),
    ("payload-bytes", {"payload": b"x"}, TypeError, "payload is not JSON-serialisable"),
    ("payload-datetime", {"payload": {"at": NOW}}, TypeError, "not JSON-serialisable"),
    ("payload-key", {"payload": {(1, 2): "v"}}, TypeError, "not JSON-serialisable"),
    ("payload-nan", {"payload": float("nan")}, InvalidArgument, "not JSON-serialisable"),
    ("payload-inf", {"payload": float("inf")}, InvalidArgument, "not JSON-serialisable"),
    ("payload-ninf", {"payload": [float("-inf")]}, InvalidArgument, "not JSON-serialisable"),
    ("payload-nested-nan", {"payload": {"a": {"b": float("nan")}}}, InvalidArgument, "JSON"),
    ("payload-circular", {"payload": circular()}, InvalidArgument, "not JSON-serialisable"),
    ("payload-deep", {"payload": nested(5000)}, InvalidArgument, "nested too deeply"),
    ("headers-deep", {"headers": {"h": nested(5000)}}, InvalidArgument, "nested too deeply"),
    ("payload-nul", {"payload": {"a": "x\x00y"}}, InvalidArgument, "NUL"),
    ("payload-nul-key", {"payload": {"\x00": 1}}, InvalidArgument, "NUL"),
    ("payload-surrogate", {"payload": {"a": "\udfff"}}, InvalidArgument, "not valid Unicode"),
    # a consumer's decoder (orjson) would turn these into floats, or fail on them
    ("payload-int-2**64", {"payload": {"n": 2**64}}, InvalidArgument, "fit in 64 bits"),
    ("payload-int-below-i64", {"payload": [-(2**63) - 1]}, InvalidArgument, "fit in 64 bits"),
    ("payload-int-23-digits", {"payload": 12345678901234567890123}, InvalidArgument, "64 bits"),
    ("payload-int-10**400", {"payload": {"n": [10**400]}}, InvalidArgument, "fit in 64 bits"),
    ("headers-int-2**64", {"headers": {"n": 2**64}}, InvalidArgument, "fit in 64 bits"),
    ("delay-negative", {"delay": -1}, InvalidArgument, "delay must be a finite number"),
    ("delay-tiny-negative", {"delay": -0.001}, InvalidArgument, "delay must be"),
    ("delay-negative-td", {"delay": timedelta(seconds=-1)}, InvalidArgument, "delay must be"),
    ("delay-nan", {"delay": float("nan")}, InvalidArgument, "delay must be a finite number"),
    ("delay-inf", {"delay": float("inf")}, InvalidArgument, "delay must be a finite number"),
    ("delay-huge", {"delay": 1e300}, InvalidArgument, "delay must be"),
    ("delay-huge-int", {"delay": 10**400}, InvalidArgument, "delay must be"),
    ("delay-td-max", {"delay": timedelta.max}, InvalidArgument, "delay must be"),
    ("delay-str", {"delay": "5"}, TypeError, "delay must be seconds or a timedelta, not str"),
    ("delay-bool", {"delay": True}, TypeError, "delay must be seconds or a timedelta"),
    (
        "delay-and-available-at",
        {"delay": 5, "available_at": NOW},
        InvalidArgument,
        "either delay or available_at, not both",
    ),
    (
        "available-at-naive",
        {"available_at": datetime(2030, 1, 1)},
        InvalidArgument,
        "available_at must be timezone-aware",
    ),
    (
        "available-at-str",
        {"available_at": "2030-01-01T00:00:00Z"},
        TypeError,
        "available_at must be a datetime, not str",
    ),
    (
        "available-at-date",
        {"available_at": date(2030, 1, 1)},
        TypeError,
        "available_at must be a datetime, not date",
    ),
    (
        "available-at-min",
        {"available_at": datetime.min.replace(tzinfo=timezone.utc)},
        InvalidArgument,
        "available_at must be between 1970-01-01 and 9000-01-01 (UTC)",
    ),
    (
        "available-at-1969",
        {"available_at": datetime(1969, 12, 31, 23, 59, tzinfo=timezone.utc)},
        InvalidArgument,
        "available_at must be between",
    ),
    (
        "available-at-max",
        {"available_at": datetime.max.replace(tzinfo=timezone.utc)},
        InvalidArgument,
        "available_at must be between",
    ),
    (
        "available-at-max-behind-utc",
        {"available_at": datetime.max.replace(tzinfo=timezone(-timedelta(hours=23)))},
        InvalidArgument,
        "available_at must be between",
    ),
    (
        "available-at-9001",
        {"available_at": datetime(9001, 1, 1, tzinfo=timezone.utc)},
        InvalidArgument,
        "available_at must be between",
    ),
    ("max-attempts-0", {"max_attempts": 0}, InvalidArgument, "max_attempts must be between 1"),
    ("max-attempts-neg", {"max_attempts": -1}, InvalidArgument, "max_attempts must be between"),
    ("max-attempts-huge", {"max_attempts": 10**7}, InvalidArgument, "max_attempts must be"),
    ("max-attempts-true", {"max_attempts": True}, TypeError, "max_attempts must be an int"),
    ("max-attempts-str", {"max_attempts": "3"}, TypeError, "max_attempts must be an int"),
    ("max-attempts-float", {"max_attempts": 3.0}, TypeError, "max_attempts must be an int"),
    ("dedupe-empty", {"dedupe_key": ""}, InvalidArgument, "dedupe_key must not be empty"),
    ("dedupe-int", {"dedupe_key": 42}, TypeError, "dedupe_key must be a str or None, not int"),
    ("dedupe-bytes", {"dedupe_key": b"k"}, TypeError, "dedupe_key must be a str or None"),
    ("dedupe-nul", {"dedupe_key": "a\x00b"}, InvalidArgument, "without NUL"),
    ("dedupe-long", {"dedupe_key": "k" * 1025}, InvalidArgument, "at most 1024 bytes"),
    # 257 four-byte characters: 1028 bytes, which the unique index would refuse mid-write
    ("dedupe-wide", {"dedupe_key": "😀" * 257}, InvalidArgument, "at most 1024 bytes"),
    ("dedupe-huge-wide", {"dedupe_key": "😀" * 1024}, InvalidArgument, "at most 1024 bytes"),
    ("dedupe-surrogate", {"dedupe_key": "\ud800"}, InvalidArgument, "not valid Unicode"),
    ("headers-list", {"headers": [("a", "b")]}, TypeError, "headers must be a mapping, not list"),
    ("headers-str", {"headers": "a=b"}, TypeError, "headers must be a mapping, not str"),
    ("headers-int-key", {"headers": {1: "a"}}, TypeError, "header names must be str"),
    ("headers-none-key", {"headers": {None: "a"}}, TypeError, "header names must be str"),
    ("headers-value", {"headers": {"a": object()}}, TypeError, "headers is not JSON-serialisable"),
    ("headers-nan", {"headers": {"a": float("nan")}}, InvalidArgument, "headers is not JSON"),
    ("headers-nul", {"headers": {"a": "\x00"}}, InvalidArgument, "headers contains a NUL"),
    ("group-empty", {"group": ""}, InvalidArgument, "group must not be empty (use None"),
    ("group-int", {"group": 42}, TypeError, "group must be a str or None, not int"),
    ("group-bytes", {"group": b"tenant"}, TypeError, "group must be a str or None, not bytes"),
    ("group-nul", {"group": "tenant\x00-42"}, InvalidArgument, "without NUL"),
    ("group-long", {"group": "g" * 513}, InvalidArgument, "group must be at most 512 bytes"),
    ("group-wide", {"group": "😀" * 129}, InvalidArgument, "group must be at most 512 bytes"),
    ("group-1mb", {"group": "g" * 1_000_000}, InvalidArgument, "group must be at most 512"),
    ("group-surrogate", {"group": "tenant-\udc00"}, InvalidArgument, "not valid Unicode"),
]

GOOD = {"topic": "orders.created", "payload": {"order_id": 42}}


def event_kwargs(case: dict[str, Any]) -> dict[str, Any]:
    return {**GOOD, **case}


async def assert_untouched_then_usable(conn: asyncpg.Connection) -> None:
    """Inside the still-open transaction: nothing written, and work can go on."""
    assert conn.is_in_transaction()
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_all") == 0
    good = await aiooutbox.enqueue(conn, "after.error", {"ok": True}, dedupe_key="after")
    assert isinstance(good, int)
    rows = await conn.fetch("SELECT topic, payload::text FROM outbox_events_all")
    assert [tuple(r) for r in rows] == [("after.error", '{"ok": true}')]


@pytest.mark.parametrize(
    ("case", "exc", "message"),
    [pytest.param(c, e, m, id=i) for i, c, e, m in BAD_EVENTS],
)
async def test_enqueue_rejects_bad_input_before_writing(
    conn: asyncpg.Connection, case: dict[str, Any], exc: type[Exception], message: str
) -> None:
    tr = conn.transaction()
    await tr.start()
    with pytest.raises(exc, match=re.escape(message)) as info:
        await aiooutbox.enqueue(conn, **event_kwargs(case))
    await assert_untouched_then_usable(conn)
    await tr.rollback()
    assert_clear(info.value)


@pytest.mark.parametrize(
    ("case", "exc", "message"),
    [pytest.param(c, e, m, id=i) for i, c, e, m in BAD_EVENTS],
)
async def test_enqueue_many_rejects_a_bad_event_and_writes_none(
    conn: asyncpg.Connection, case: dict[str, Any], exc: type[Exception], message: str
) -> None:
    batch = [
        NewEvent("orders.created", 1, dedupe_key="first"),
        NewEvent("orders.created", 2),
        NewEvent(**event_kwargs(case)),
        NewEvent("orders.created", 4),
    ]
    tr = conn.transaction()
    await tr.start()
    with pytest.raises(exc, match=re.escape(message)) as info:
        await aiooutbox.enqueue_many(conn, batch)
    await assert_untouched_then_usable(conn)
    # the key of the rejected batch's first event was not taken
    assert await aiooutbox.enqueue(conn, "t", 1, dedupe_key="first") is not None
    await tr.rollback()
    # the error names the offending item
    assert str(info.value).startswith("events[2].")
    assert_clear(info.value)


def assert_clear(error: Exception) -> None:
    assert isinstance(error, (ValueError, TypeError))
    if isinstance(error, InvalidArgument):
        assert isinstance(error, ValueError)
        assert isinstance(error, aiooutbox.OutboxError)
    # a clear message: says what is wrong, does not dump a 100k-character value
    assert 10 < len(str(error)) < 400


@pytest.mark.parametrize(
    ("items", "message"),
    [
        pytest.param(
            [NewEvent("a", 1), {"topic": "b", "payload": 2}, NewEvent("c", 3)],
            r"events\[1\] is a dict; wrap it in aiooutbox.NewEvent",
            id="dict-in-middle",
        ),
        pytest.param(
            [NewEvent("a", 1), NewEvent("a", 2), ("b", 2), NewEvent("c", 3)],
            r"events\[2\] is a tuple",
            id="tuple-in-middle",
        ),
        pytest.param([NewEvent("a", 1), None], r"events\[1\] is a NoneType", id="none-at-end"),
        pytest.param(["orders.created"], r"events\[0\] is a str", id="str-item"),
        pytest.param(NewEvent("a", 1), "iterable of aiooutbox.NewEvent", id="single-event"),
        pytest.param("abc", "iterable of aiooutbox.NewEvent", id="str"),
        pytest.param(b"abc", "iterable of aiooutbox.NewEvent", id="bytes"),
        pytest.param(42, "iterable of aiooutbox.NewEvent", id="int"),
        pytest.param(None, "iterable of aiooutbox.NewEvent", id="none"),
    ],
)
async def test_enqueue_many_rejects_non_events(
    conn: asyncpg.Connection, items: Any, message: str
) -> None:
    tr = conn.transaction()
    await tr.start()
    with pytest.raises(TypeError, match=message):
        await aiooutbox.enqueue_many(conn, items)
    await assert_untouched_then_usable(conn)
    await tr.rollback()


# -- identifiers ---------------------------------------------------------------------------

HOSTILE_NAMES: list[tuple[str, object, type[Exception]]] = [
    ("injection", 'x"; drop table y; --', InvalidArgument),
    ("quote", 'outbox"events', InvalidArgument),
    ("upper", "Upper", InvalidArgument),
    ("quoted-upper", '"Upper"', InvalidArgument),
    ("unicode", "événements", InvalidArgument),
    ("cyrillic-a", "outbox_\u0430", InvalidArgument),
    ("fullwidth", "\uff4f\uff55\uff54\uff42\uff4f\uff58", InvalidArgument),
    ("10k", "x" * 10_000, InvalidArgument),
    ("empty", "", InvalidArgument),
    ("pg-prefix", "pg_x", InvalidArgument),
    ("digit-first", "1abc", InvalidArgument),
    ("space", "a b", InvalidArgument),
    ("dash", "outbox-events", InvalidArgument),
    ("dot", "public.outbox", InvalidArgument),
    ("newline", "outbox\n", InvalidArgument),
    ("nul", "out\x00box", InvalidArgument),
    ("none", None, TypeError),
    ("int", 7, TypeError),
    ("bytes", b"outbox", TypeError),
]
IDENTIFIER_CASES = [
    pytest.param(kind, name, exc, id=f"{kind}-{case_id}")
    for kind in ("schema", "table")
    for case_id, name, exc in HOSTILE_NAMES
] + [
    # derived names ("<table>_claimable_idx", ...) must fit PostgreSQL's 63 bytes
    pytest.param("table", "t" * 41, InvalidArgument, id="table-41"),
    pytest.param("schema", "s" * 64, InvalidArgument, id="schema-64"),
]


async def snapshot(conn: asyncpg.Connection) -> list[tuple[str, str, str]]:
    """Every schema-level object a migration could create, outside the system schemas."""
    rows = await conn.fetch(
        "SELECT n.nspname, coalesce(c.relname, ''), coalesce(c.relkind::text, '')"
        " FROM pg_namespace n LEFT JOIN pg_class c ON c.relnamespace = n.oid"
        " WHERE n.nspname NOT LIKE 'pg\\_%' AND n.nspname <> 'information_schema'"
        " UNION ALL SELECT n.nspname, t.typname, 'type' FROM pg_type t"
        " JOIN pg_namespace n ON n.oid = t.typnamespace WHERE n.nspname = 'public'"
        " UNION ALL SELECT n.nspname, p.proname, 'function' FROM pg_proc p"
        " JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'public'"
        " ORDER BY 1, 2, 3"
    )
    return [tuple(r) for r in rows]


def assert_identifier_error(error: Exception, kind: str) -> None:
    message = str(error)
    assert kind in message
    assert len(message) < 400, "the message must not echo a huge name in full"
    if isinstance(error, InvalidArgument):
        assert "invalid" in message


@pytest.mark.parametrize(("kind", "name", "exc"), IDENTIFIER_CASES)
async def test_migrate_rejects_hostile_identifiers(
    conn: asyncpg.Connection, kind: str, name: object, exc: type[Exception]
) -> None:
    before = await snapshot(conn)
    with pytest.raises(exc) as info:
        await aiooutbox.migrate(conn, **{kind: name})  # type: ignore[arg-type]
    assert_identifier_error(info.value, kind)
    assert await snapshot(conn) == before
    with pytest.raises(exc):
        aiooutbox.migration_sql(**{kind: name})  # type: ignore[arg-type]
    with pytest.raises(exc):
        await aiooutbox.check_schema(conn, **{kind: name})  # type: ignore[arg-type]


@pytest.mark.parametrize(("kind", "name", "exc"), IDENTIFIER_CASES)
async def test_producers_reject_hostile_identifiers(
    conn: asyncpg.Connection, kind: str, name: object, exc: type[Exception]
) -> None:
    tr = conn.transaction()
    await tr.start()
    with pytest.raises(exc) as info:
        await aiooutbox.enqueue(conn, "t", {}, **{kind: name})  # type: ignore[arg-type]
    assert_identifier_error(info.value, kind)
    with pytest.raises(exc):
        await aiooutbox.enqueue_many(conn, [NewEvent("t", {})], **{kind: name})  # type: ignore[arg-type]
    await assert_untouched_then_usable(conn)
    await tr.rollback()


@pytest.mark.parametrize(("kind", "name", "exc"), IDENTIFIER_CASES)
async def test_consumer_rejects_hostile_identifiers(
    conn: asyncpg.Connection, shared_dsn: str, kind: str, name: object, exc: type[Exception]
) -> None:
    before = await snapshot(conn)
    async with asyncpg.create_pool(shared_dsn, min_size=1, max_size=1) as pool:
        with pytest.raises(exc) as info:
            OutboxConsumer(pool, **{kind: name})  # type: ignore[arg-type]
    assert_identifier_error(info.value, kind)
    assert await snapshot(conn) == before
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_idle") == 0
