"""Enqueue events on the caller's connection, so they commit with the caller's work."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from ._codec import Encoder, check_utf8, encode_json
from ._sql import DEFAULT_SCHEMA, DEFAULT_TABLE, queries
from .errors import InvalidArgument
from .events import NewEvent

__all__ = ["DEFAULT_MAX_ATTEMPTS", "MAX_TOPIC_LENGTH", "enqueue", "enqueue_many"]

DEFAULT_MAX_ATTEMPTS = 5
MAX_TOPIC_LENGTH = 255
# in UTF-8 bytes: the unique btree index refuses entries over 2704 bytes
MAX_DEDUPE_KEY_LENGTH = 1024
# now() + delay must stay a valid timestamptz (and a sane schedule)
MAX_DELAY_SECONDS = 1000 * 366 * 86400.0
MAX_BATCH = 100_000


class _Row:
    """One validated event, ready to bind."""

    __slots__ = (
        "available_at",
        "dedupe_key",
        "delay",
        "headers",
        "max_attempts",
        "payload",
        "topic",
    )

    def __init__(self, event: NewEvent, encoder: Encoder | None, where: str = "") -> None:
        self.topic = _check_topic(event.topic, where)
        self.payload = encode_json(event.payload, f"{where}payload", encoder)
        self.dedupe_key = _check_dedupe_key(event.dedupe_key, where)
        self.headers = _check_headers(event.headers, encoder, where)
        self.max_attempts = _check_max_attempts(event.max_attempts, where)
        self.available_at, self.delay = _check_schedule(event.delay, event.available_at, where)


def _check_topic(topic: object, where: str) -> str:
    if not isinstance(topic, str):
        raise TypeError(f"{where}topic must be a str, not {type(topic).__name__}")
    if not topic or not topic.strip():
        raise InvalidArgument(f"{where}topic must be a non-empty string")
    if len(topic) > MAX_TOPIC_LENGTH:
        raise InvalidArgument(
            f"{where}topic is {len(topic)} characters long; the limit is {MAX_TOPIC_LENGTH}"
        )
    if "\x00" in topic:
        raise InvalidArgument(f"{where}topic contains a NUL character")
    check_utf8(topic, f"{where}topic")
    return topic


def _check_dedupe_key(key: object, where: str) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str):
        raise TypeError(f"{where}dedupe_key must be a str or None, not {type(key).__name__}")
    if not key:
        raise InvalidArgument(f"{where}dedupe_key must not be empty (use None for no key)")
    check_utf8(key, f"{where}dedupe_key")
    if "\x00" in key or (
        len(key) > MAX_DEDUPE_KEY_LENGTH // 4 and len(key.encode()) > MAX_DEDUPE_KEY_LENGTH
    ):
        raise InvalidArgument(
            f"{where}dedupe_key must be at most {MAX_DEDUPE_KEY_LENGTH} bytes (UTF-8) without NUL"
        )
    return key


def _check_headers(headers: object, encoder: Encoder | None, where: str) -> str:
    if headers is None:
        return "{}"
    if not isinstance(headers, Mapping):
        raise TypeError(f"{where}headers must be a mapping, not {type(headers).__name__}")
    for name in headers:
        if not isinstance(name, str):
            raise TypeError(f"{where}header names must be str, got {name!r}")
    return encode_json(dict(headers), f"{where}headers", encoder)


def _check_max_attempts(value: object, where: str) -> int:
    if value is None:
        return DEFAULT_MAX_ATTEMPTS
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}max_attempts must be an int, not {type(value).__name__}")
    if not 1 <= value <= 1_000_000:
        raise InvalidArgument(f"{where}max_attempts must be between 1 and 1000000, got {value}")
    return value


def _check_schedule(
    delay: object, available_at: object, where: str
) -> tuple[datetime | None, float]:
    if delay is not None and available_at is not None:
        raise InvalidArgument(f"{where}pass either delay or available_at, not both")
    if available_at is not None:
        if not isinstance(available_at, datetime):
            raise TypeError(
                f"{where}available_at must be a datetime, not {type(available_at).__name__}"
            )
        if available_at.tzinfo is None or available_at.utcoffset() is None:
            raise InvalidArgument(
                f"{where}available_at must be timezone-aware (e.g. datetime.now(timezone.utc))"
            )
        return available_at, 0.0
    if delay is None:
        return None, 0.0
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, (int, float)) and not isinstance(delay, bool):
        try:
            seconds = float(delay)
        except OverflowError:  # an int too large for a float
            seconds = math.inf
    else:
        raise TypeError(f"{where}delay must be seconds or a timedelta, not {type(delay).__name__}")
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_DELAY_SECONDS:
        raise InvalidArgument(
            f"{where}delay must be a finite number of seconds between 0 and "
            f"{MAX_DELAY_SECONDS:.0f} (1000 years), got {seconds:g}"
        )
    return None, seconds


async def enqueue(
    conn: asyncpg.Connection | asyncpg.Pool,
    topic: str,
    payload: Any,
    *,
    dedupe_key: str | None = None,
    delay: float | timedelta | None = None,
    available_at: datetime | None = None,
    max_attempts: int | None = None,
    headers: Mapping[str, Any] | None = None,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
    encoder: Encoder | None = None,
) -> int | None:
    """Insert one event and return its id, or ``None`` if ``dedupe_key`` already exists.

    On a connection the insert joins the caller's transaction, so the event exists if and
    only if that transaction commits. On a pool it commits on its own. Every argument is
    validated before anything is sent; ``payload`` and ``headers`` must be JSON-serialisable
    (no NaN or Infinity) unless ``encoder`` says otherwise.
    """
    row = _Row(
        NewEvent(topic, payload, dedupe_key, delay, available_at, max_attempts, headers), encoder
    )
    q = queries(schema, table)
    result: int | None = await conn.fetchval(
        q.insert_one,
        row.topic,
        row.payload,
        row.dedupe_key,
        row.headers,
        row.max_attempts,
        row.available_at,
        row.delay,
    )
    return result


async def enqueue_many(
    conn: asyncpg.Connection | asyncpg.Pool,
    events: Iterable[NewEvent],
    *,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
    encoder: Encoder | None = None,
) -> list[int | None]:
    """Insert many events in one statement; return one id (or ``None``) per input, in order.

    ``None`` marks an event whose ``dedupe_key`` already existed, in the table or earlier
    in the same batch (the first occurrence wins). One statement means one wake-up
    notification per distinct topic, however many events.
    """
    if isinstance(events, (str, bytes, NewEvent)) or not isinstance(events, Iterable):
        raise TypeError("enqueue_many takes an iterable of aiooutbox.NewEvent")
    rows: list[_Row] = []
    for index, event in enumerate(events):
        if not isinstance(event, NewEvent):
            raise TypeError(
                f"events[{index}] is a {type(event).__name__}; wrap it in aiooutbox.NewEvent"
            )
        rows.append(_Row(event, encoder, f"events[{index}]."))
        if len(rows) > MAX_BATCH:
            raise InvalidArgument(f"enqueue_many takes at most {MAX_BATCH} events per call")
    if not rows:
        return []
    q = queries(schema, table)
    returned: Sequence[Any] = await conn.fetch(
        q.insert_many,
        [r.topic for r in rows],
        [r.payload for r in rows],
        [r.dedupe_key for r in rows],
        [r.headers for r in rows],
        [r.max_attempts for r in rows],
        [r.available_at for r in rows],
        [r.delay for r in rows],
    )
    by_key: dict[str, int] = {}
    unkeyed: list[int] = []
    for record in returned:
        if record[1] is None:
            unkeyed.append(record[0])
        else:
            by_key[record[1]] = record[0]
    # rows are inserted in input order, so identity values of unkeyed rows ascend with it
    unkeyed.sort(reverse=True)
    results: list[int | None] = []
    for r in rows:
        if r.dedupe_key is None:
            results.append(unkeyed.pop())
        else:
            results.append(by_key.pop(r.dedupe_key, None))
    return results
