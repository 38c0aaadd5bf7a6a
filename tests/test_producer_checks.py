"""What the producer checks and normalises before it writes, against a real PostgreSQL:
a dedupe key repeated in one batch, integers a consumer's decoder would change, a custom
encoder's output, and ``available_at`` offsets that psycopg2 cannot spell.

Every refusal runs in the caller's open transaction and then shows that nothing was
written and the transaction still works.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import asyncpg
import psycopg
import pytest

import aiooutbox
import aiooutbox.sync
from aiooutbox import InvalidArgument, NewEvent
from aiooutbox._values.codec import ENCODER_HINT, decode_json
from tests.producer_kinds import KINDS, Kind


@pytest.fixture
async def txn(shared_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection to the shared database inside a transaction that is rolled back."""
    c = await asyncpg.connect(shared_dsn)
    try:
        tr = c.transaction()
        await tr.start()
        assert await rows(c) == []
        yield c
        await tr.rollback()
    finally:
        await c.close()


async def rows(conn: asyncpg.Connection) -> list[tuple[Any, ...]]:
    found = await conn.fetch(
        "SELECT id, payload::text, dedupe_key, ordering_key FROM outbox_events_all ORDER BY id"
    )
    return [tuple(r) for r in found]


async def assert_nothing_written_and_usable(conn: asyncpg.Connection) -> None:
    assert conn.is_in_transaction()
    assert await rows(conn) == []
    good = await aiooutbox.enqueue(conn, "after.error", {"ok": True})
    assert [r[:2] for r in await rows(conn)] == [(good, '{"ok": true}')]


# -- a dedupe key repeated in one batch ------------------------------------------------------

REPEATS = {
    "ordered-b-then-ordered-a": [
        NewEvent("t", {"i": 0}, dedupe_key="k", ordering_key="b"),
        NewEvent("t", {"i": 1}, dedupe_key="k", ordering_key="a"),
    ],
    "ordered-then-unordered": [
        NewEvent("t", {"i": 0}, dedupe_key="k", ordering_key="a"),
        NewEvent("t", {"i": 1}, dedupe_key="k"),
    ],
    "unordered-then-ordered": [
        NewEvent("t", {"i": 0}, dedupe_key="k"),
        NewEvent("t", {"i": 1}, dedupe_key="k", ordering_key="a"),
    ],
    "three-copies-among-others": [
        NewEvent("t", {"i": 0}),
        NewEvent("t", {"i": 1}, dedupe_key="k", ordering_key="z"),
        NewEvent("t", {"i": 2}, dedupe_key="j", ordering_key="z"),
        NewEvent("t", {"i": 3}, dedupe_key="k", ordering_key="a"),
        NewEvent("t", {"i": 4}, ordering_key="a"),
        NewEvent("t", {"i": 5}, dedupe_key="k"),
        NewEvent("t", {"i": 6}, dedupe_key="j"),
    ],
}


@pytest.mark.parametrize("batch", list(REPEATS.values()), ids=list(REPEATS))
@pytest.mark.parametrize("blocking", [False, True], ids=["asyncpg", "psycopg-sync"])
async def test_a_repeated_dedupe_key_stores_its_first_copy_in_input_order(
    shared_dsn: str, txn: asyncpg.Connection, batch: list[NewEvent], blocking: bool
) -> None:
    if blocking:
        with psycopg.connect(shared_dsn) as sync_conn:
            ids = aiooutbox.sync.enqueue_many(sync_conn, batch)
            stored = sync_conn.execute(
                "SELECT id, payload::text, dedupe_key, ordering_key FROM outbox_events_all"
            ).fetchall()
            sync_conn.rollback()
    else:
        ids = await aiooutbox.enqueue_many(txn, batch)
        stored = await rows(txn)
    firsts: dict[str | None, int] = {}
    for index, event in enumerate(batch):
        firsts.setdefault(event.dedupe_key, index)
    # one result per input, in input order: an id for a key's first copy, None after
    expected_none = [
        e.dedupe_key is not None and firsts[e.dedupe_key] != i for i, e in enumerate(batch)
    ]
    assert [i is None for i in ids] == expected_none
    # and each returned id is the row holding that very event
    by_id = {r[0]: r[1:] for r in stored}
    assert len(by_id) == expected_none.count(False)
    for event, event_id in zip(batch, ids, strict=True):
        if event_id is not None:
            payload, dedupe_key, ordering_key = by_id[event_id]
            assert (json.loads(payload), dedupe_key, ordering_key) == (
                event.payload,
                event.dedupe_key,
                event.ordering_key,
            )


async def test_a_repeated_key_already_in_the_table_gives_none_to_every_copy(
    txn: asyncpg.Connection,
) -> None:
    old = await aiooutbox.enqueue(txn, "t", "old", dedupe_key="k")
    ids = await aiooutbox.enqueue_many(
        txn,
        [NewEvent("t", "a", dedupe_key="k", ordering_key="b"), NewEvent("t", "b", dedupe_key="k")],
    )
    assert ids == [None, None]
    assert await rows(txn) == [(old, '"old"', "k", None)]


# -- integers outside 64 bits ----------------------------------------------------------------

TOO_BIG = {
    "2**64": 2**64,
    "-(2**63)-1": -(2**63) - 1,
    "23-digit-id": 12345678901234567890123,
    "10**400": 10**400,
    "nested": {"a": [1, {"b": [2**70]}]},
}


@pytest.mark.parametrize("value", list(TOO_BIG.values()), ids=list(TOO_BIG))
async def test_integers_outside_64_bits_are_refused_before_writing(
    txn: asyncpg.Connection, value: Any
) -> None:
    fits = "integers must fit in 64 bits (-2**63 .. 2**64-1) to reach a handler unchanged"
    with pytest.raises(InvalidArgument, match=re.escape(fits)) as info:
        await aiooutbox.enqueue(txn, "t", {"n": value})
    assert str(info.value).startswith("payload holds the integer")
    assert len(str(info.value)) < 400
    with pytest.raises(InvalidArgument, match=r"^events\[1\]\.headers holds the integer"):
        await aiooutbox.enqueue_many(
            txn, [NewEvent("t", 1, dedupe_key="first"), NewEvent("t", 2, headers={"n": value})]
        )
    # a custom encoder's numbers are held to the same rule
    with pytest.raises(InvalidArgument, match=re.escape(fits)):
        await aiooutbox.enqueue(txn, "t", 1, encoder=lambda v: json.dumps({"n": value}))
    await assert_nothing_written_and_usable(txn)


async def test_integers_at_the_limits_and_long_digit_strings_reach_a_handler_unchanged(
    txn: asyncpg.Connection,
) -> None:
    payload = {
        "limits": [2**64 - 1, -(2**63), 10**18, -(10**18), 0],
        "digits in strings": ["12345678901234567890123", "1" * 400, "-9" * 30],
        "a key of digits": {"123456789012345678901234567890": 1},
        "floats": [1.5, -2.25e-300, 1e300],
        "digits beside": "x1234567890123456789y",
    }
    event_id = await aiooutbox.enqueue(txn, "t", payload)
    [many_id] = await aiooutbox.enqueue_many(txn, [NewEvent("t", payload, headers=payload)])
    for i in (event_id, many_id):
        text = await txn.fetchval("SELECT payload::text FROM outbox_events_all WHERE id = $1", i)
        # what the consumer's decoder (orjson when installed) hands to the handler
        assert decode_json(text) == payload
        assert [type(n) for n in decode_json(text)["limits"]] == [int] * 5


# -- a custom encoder's output ---------------------------------------------------------------

HINTED: Callable[[Any], str] = eval(ENCODER_HINT.split("e.g. encoder=", 1)[1])


def dumps_headers_as_list(value: Any) -> str:
    return json.dumps(list(value) if isinstance(value, dict) else value)


# (id, enqueue keyword arguments, exception, message fragment)
ENCODER_OUTPUTS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    (
        "hint-nan",
        {"payload": {"x": float("nan")}, "encoder": HINTED},
        InvalidArgument,
        "payload is not JSON-serialisable (from encoder <lambda>): Out of range float",
    ),
    (
        "allow-nan-inf-header",
        {"headers": {"h": float("inf")}, "encoder": lambda v: json.dumps(v, default=str)},
        InvalidArgument,
        "headers (from encoder <lambda>) holds Infinity, which is not JSON",
    ),
    ("invalid-json", {"encoder": lambda v: "{not json"}, InvalidArgument, "is not valid JSON"),
    ("empty-text", {"encoder": lambda v: ""}, InvalidArgument, "is not valid JSON"),
    ("empty-bytes", {"encoder": lambda v: b""}, InvalidArgument, "is not valid JSON"),
    ("two-values", {"encoder": lambda v: "1 2"}, InvalidArgument, "is not valid JSON"),
    ("not-utf8", {"encoder": lambda v: b'"\xff"'}, InvalidArgument, "is not UTF-8"),
    (
        "headers-a-list",
        {"headers": {"a": 1}, "encoder": dumps_headers_as_list},
        InvalidArgument,
        "headers (from encoder dumps_headers_as_list) is a JSON array, not an object",
    ),
    (
        "headers-a-string",
        {"headers": {"a": 1}, "encoder": lambda v: '"x"' if isinstance(v, dict) else "1"},
        InvalidArgument,
        "is a JSON string, not an object",
    ),
    ("returns-int", {"encoder": lambda v: 1}, TypeError, "is a int, expected str or bytes"),
    ("returns-none", {"encoder": lambda v: None}, TypeError, "expected str or bytes"),
    ("huge-float", {"encoder": lambda v: "1e400"}, InvalidArgument, "beyond a float's range"),
    ("huge-float-signed", {"encoder": lambda v: "[1.5E+400]"}, InvalidArgument, "float's range"),
    ("huge-int-text", {"encoder": lambda v: "[1" + "0" * 400 + "]"}, InvalidArgument, "64 bits"),
    ("nul-escape", {"encoder": lambda v: '"a\\u0000"'}, InvalidArgument, "contains a NUL"),
    ("lone-surrogate", {"payload": {"a": "\udfff"}, "encoder": HINTED}, InvalidArgument, "Unicode"),
    ("high-alone", {"encoder": lambda v: '"\\ud83dx"'}, InvalidArgument, "not valid Unicode"),
    ("raising", {"encoder": lambda v: int("x")}, InvalidArgument, "<lambda>): invalid literal"),
]


@pytest.mark.parametrize(
    ("case", "exc", "message"), [pytest.param(c, e, m, id=i) for i, c, e, m in ENCODER_OUTPUTS]
)
async def test_a_custom_encoders_bad_output_is_refused_before_writing(
    txn: asyncpg.Connection, case: dict[str, Any], exc: type[Exception], message: str
) -> None:
    kwargs = {"payload": 1, **case}
    with pytest.raises(exc, match=re.escape(message)) as info:
        await aiooutbox.enqueue(txn, "t", **kwargs)
    assert "(from encoder " in str(info.value)
    assert len(str(info.value)) < 400
    encoder = kwargs.pop("encoder")
    with pytest.raises(exc, match=re.escape(message)) as info:
        await aiooutbox.enqueue_many(txn, [NewEvent("t", **kwargs)], encoder=encoder)
    assert str(info.value).startswith("events[0].")
    await assert_nothing_written_and_usable(txn)


async def test_the_suggested_encoder_stores_what_json_cannot(txn: asyncpg.Connection) -> None:
    assert "allow_nan=False" in ENCODER_HINT
    at = datetime(2030, 1, 1, tzinfo=timezone.utc)
    key = uuid.UUID(int=1)
    value = {"at": at, "id": key, "price": Decimal("1.10"), "text": "żółć 😀", "big": str(2**70)}
    event_id = await aiooutbox.enqueue(txn, "t", value, headers={"h": "ą"}, encoder=HINTED)
    stored = await txn.fetchrow(
        "SELECT payload::text, headers::text FROM outbox_events_all WHERE id = $1", event_id
    )
    assert stored is not None
    assert json.loads(stored[0]) == {
        "at": str(at),
        "id": str(key),
        "price": "1.10",
        "text": "żółć 😀",
        "big": str(2**70),
    }
    assert json.loads(stored[1]) == {"h": "ą"}
    # orjson's bytes, ordinary JSON, are accepted as they are
    assert await aiooutbox.enqueue(txn, "t", 1, encoder=lambda v: json.dumps(v).encode())


# -- available_at's UTC offset -----------------------------------------------------------------

OFFSETS = [
    timedelta(hours=-16),
    timedelta(hours=20),
    timedelta(seconds=30),
    timedelta(hours=5, minutes=30, seconds=15),
    timedelta(microseconds=1),
    -timedelta(hours=23, minutes=59, seconds=59, microseconds=999999),
]


@pytest.mark.parametrize("kind_class", [pytest.param(k, id=k.name) for k in KINDS])
async def test_every_driver_stores_available_at_of_any_offset_exactly(
    dsn: str, conn: asyncpg.Connection, kind_class: type[Kind]
) -> None:
    ats = [datetime(2030, 1, 1, 12, tzinfo=timezone(offset)) for offset in OFFSETS]
    kind = kind_class()
    await kind.open(dsn)
    try:
        await kind.begin()
        one = [await kind.enqueue("t", i, available_at=at) for i, at in enumerate(ats)]
        many = await kind.enqueue_many(
            [NewEvent("t", i, available_at=at) for i, at in enumerate(ats)]
        )
        # the caller's transaction went on, and commits
        assert await kind.fetchval("SELECT count(*) FROM outbox_events_all") == 2 * len(ats)
        await kind.commit()
    finally:
        await kind.close()
    for ids in (one, many):
        stored = [
            await conn.fetchval("SELECT available_at FROM outbox_events_all WHERE id = $1", i)
            for i in ids
        ]
        assert stored == [at.astimezone(timezone.utc) for at in ats]


async def test_psycopg2_stores_available_at_of_any_offset_exactly(
    dsn: str, conn: asyncpg.Connection
) -> None:
    psycopg2 = pytest.importorskip("psycopg2")
    ats = [datetime(2030, 1, 1, 12, tzinfo=timezone(offset)) for offset in OFFSETS]
    sync_conn = psycopg2.connect(dsn)
    try:
        ids = [aiooutbox.sync.enqueue(sync_conn, "t", 1, available_at=at) for at in ats]
        ids += aiooutbox.sync.enqueue_many(
            sync_conn, [NewEvent("t", 2, available_at=at) for at in ats]
        )
        sync_conn.commit()
    finally:
        sync_conn.close()
    stored = [
        await conn.fetchval("SELECT available_at FROM outbox_events_all WHERE id = $1", i)
        for i in ids
    ]
    assert stored == [at.astimezone(timezone.utc) for at in ats] * 2
