"""Enqueue events on the caller's connection, so they commit with the caller's work.

`enqueue` writes one event, `enqueue_many` a batch in one statement, on an asyncpg
connection or pool, a SQLAlchemy ``AsyncSession``/``AsyncConnection`` or a psycopg
``AsyncConnection``; `aiooutbox.sync` is their blocking twin. Every argument is checked
before anything is written (docs/producers.md).
"""

# The one place that validates events and builds the statement and its parameters,
# whatever the driver; `_sql.drivers` only binds and executes them.

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from ._sql import drivers
from ._sql.statements import DEFAULT_SCHEMA, DEFAULT_TABLE, Queries, queries
from ._values.codec import Encoder, check_utf8, encode_json
from ._values.limits import (
    MAX_ATTEMPTS,
    MAX_ENQUEUE_DELAY_SECONDS,
    MAX_TOPIC_LENGTH,
    check_count,
    check_seconds,
    check_topic_name,
)
from .errors import InvalidArgument
from .events import NewEvent

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "EARLIEST_AVAILABLE_AT",
    "LATEST_AVAILABLE_AT",
    "MAX_TOPIC_LENGTH",
    "enqueue",
    "enqueue_many",
]

DEFAULT_MAX_ATTEMPTS = 5
# in UTF-8 bytes: the unique btree index refuses entries over 2704 bytes
MAX_DEDUPE_KEY_LENGTH = 1024
# The schedule's limits, in one place. An absolute ``available_at`` must fall within
# [EARLIEST_AVAILABLE_AT, LATEST_AVAILABLE_AT]: PostgreSQL would store datetime.min as
# -infinity, which no driver reads back as an aware datetime, and years past 9999 do not
# fit Python's datetime. ``now() + delay`` stays inside that range by construction: a
# delay is 0..1000 years (`MAX_ENQUEUE_DELAY_SECONDS`).
EARLIEST_AVAILABLE_AT = datetime(1970, 1, 1, tzinfo=timezone.utc)
LATEST_AVAILABLE_AT = datetime(9000, 1, 1, tzinfo=timezone.utc)
MAX_BATCH = 100_000
# in UTF-8 bytes, as the table's check constraints say (migrations 0005, 0018)
MAX_ORDERING_KEY_LENGTH = 512
MAX_GROUP_LENGTH = 512


class _Row:
    """One validated event, ready to bind."""

    __slots__ = (
        "available_at",
        "dedupe_key",
        "delay",
        "group",
        "headers",
        "max_attempts",
        "ordering_key",
        "payload",
        "topic",
    )

    def __init__(self, event: NewEvent, encoder: Encoder | None, where: str = "") -> None:
        self.topic = _check_topic(event.topic, where)
        self.payload = encode_json(event.payload, f"{where}payload", encoder)
        self.dedupe_key = _check_key(
            event.dedupe_key, f"{where}dedupe_key", MAX_DEDUPE_KEY_LENGTH, "no key"
        )
        self.headers = _check_headers(event.headers, encoder, where)
        self.max_attempts = _check_max_attempts(event.max_attempts, where)
        self.available_at, self.delay = _check_schedule(event.delay, event.available_at, where)
        self.ordering_key = _check_key(
            event.ordering_key, f"{where}ordering_key", MAX_ORDERING_KEY_LENGTH, "unordered"
        )
        self.group = _check_key(event.group, f"{where}group", MAX_GROUP_LENGTH, "no group")

    def params(self) -> tuple[Any, ...]:
        """The bind values of `Queries.insert_one`, in placeholder order."""
        return (
            self.topic,
            self.payload,
            self.dedupe_key,
            self.headers,
            self.max_attempts,
            self.available_at,
            self.delay,
            self.ordering_key,
            self.group,
        )


def _check_topic(topic: object, where: str) -> str:
    return check_topic_name(topic, f"{where}topic")


def _check_key(key: object, name: str, max_bytes: int, no_key: str) -> str | None:
    """A dedupe or ordering key: ``None``, or 1 to ``max_bytes`` UTF-8 bytes without NUL."""
    if key is None:
        return None
    if not isinstance(key, str):
        raise TypeError(f"{name} must be a str or None, not {type(key).__name__}")
    if not key:
        raise InvalidArgument(f"{name} must not be empty (use None for {no_key})")
    check_utf8(key, name)
    # len() first: a key of few characters cannot exceed the limit in bytes
    if "\x00" in key or (len(key) > max_bytes // 4 and len(key.encode()) > max_bytes):
        raise InvalidArgument(f"{name} must be at most {max_bytes} bytes (UTF-8) without NUL")
    return key


# The tracing hook: `aiooutbox.tracing.inject`, looked up on first use; None once
# OpenTelemetry proved not importable, so then it costs one global read per event.
_inject_trace: Callable[[Mapping[str, Any] | None], Mapping[str, Any] | None] | None
_inject_trace = None
_trace_looked_up = False


def _with_trace_context(headers: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``headers`` plus the current OpenTelemetry context (if any; caller's keys win)."""
    global _inject_trace, _trace_looked_up
    if not _trace_looked_up:
        from . import tracing

        _inject_trace = tracing.inject if tracing._otel() else None
        _trace_looked_up = True
    return headers if _inject_trace is None else _inject_trace(headers)


def _check_headers(headers: object, encoder: Encoder | None, where: str) -> str:
    if headers is not None:
        if not isinstance(headers, Mapping):
            raise TypeError(f"{where}headers must be a mapping, not {type(headers).__name__}")
        for name in headers:
            if not isinstance(name, str):
                raise TypeError(f"{where}header names must be str, got {name!r}")
    headers = _with_trace_context(headers)
    if headers is None:
        return "{}"
    return encode_json(dict(headers), f"{where}headers", encoder, json_object=True)


def _check_max_attempts(value: object, where: str) -> int:
    if value is None:
        return DEFAULT_MAX_ATTEMPTS
    return check_count(f"{where}max_attempts", value, 1, MAX_ATTEMPTS)


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
        try:
            in_range = EARLIEST_AVAILABLE_AT <= available_at <= LATEST_AVAILABLE_AT
        except OverflowError:  # an offset that pushes it past datetime's own range
            in_range = False
        if not in_range:
            raise InvalidArgument(
                f"{where}available_at must be between {EARLIEST_AVAILABLE_AT:%Y-%m-%d} and "
                f"{LATEST_AVAILABLE_AT:%Y-%m-%d} (UTC), got {available_at.isoformat()}"
            )
        # in UTC for every driver: psycopg2 writes the offset into the statement's text,
        # which PostgreSQL refuses beyond ±15:59 or with seconds
        return available_at.astimezone(timezone.utc), 0.0
    if delay is None:
        return None, 0.0
    seconds = check_seconds(f"{where}delay", delay, maximum=MAX_ENQUEUE_DELAY_SECONDS)
    return None, seconds


def prepare_one(
    topic: str,
    payload: Any,
    *,
    dedupe_key: str | None,
    delay: float | timedelta | None,
    available_at: datetime | None,
    max_attempts: int | None,
    headers: Mapping[str, Any] | None,
    schema: str,
    table: str,
    encoder: Encoder | None,
    ordering_key: str | None = None,
    group: str | None = None,
) -> tuple[Queries, str, tuple[Any, ...]]:
    """Validate one event; return the outbox, the statement and its parameters."""
    q = queries(schema, table)
    row = _Row(
        NewEvent(
            topic,
            payload,
            dedupe_key,
            delay,
            available_at,
            max_attempts,
            headers,
            ordering_key,
            group,
        ),
        encoder,
    )
    return q, q.insert_one, row.params()


def one_result(records: Sequence[Sequence[Any]]) -> int | None:
    """`enqueue`'s return value from the rows `insert_one` returned."""
    return int(records[0][0]) if records else None


class Batch:
    """A validated `enqueue_many` batch: the statement, its arrays, and how to map back.

    Rows are bound in `_insert_order`: unordered rows with a dedupe key sorted by it,
    then ordered rows grouped by ordering key, then keyless unordered rows, each group in
    input order. Producers whose batches share keys take the locks in the same order and
    wait for each other instead of deadlocking; `results` restores input order. A dedupe
    key's later copies in the batch are not bound at all: whichever copy came first in
    the sorted order would win the conflict, and it must be the first in input order.
    """

    __slots__ = ("inserted", "q", "rows")

    def __init__(
        self, events: Iterable[NewEvent], schema: str, table: str, encoder: Encoder | None
    ) -> None:
        self.q = queries(schema, table)
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
        self.rows = rows
        taken: set[str] = set()
        kept: list[int] = []
        for i, row in enumerate(rows):
            if row.dedupe_key is not None:
                if row.dedupe_key in taken:
                    continue  # a later copy: `results` gives it None
                taken.add(row.dedupe_key)
            kept.append(i)
        kept.sort(key=lambda i: _insert_order(rows[i], i))
        self.inserted = [rows[i] for i in kept]

    @property
    def statement(self) -> str:
        if any(r.ordering_key is not None for r in self.inserted):
            return self.q.insert_many
        return self.q.insert_many_unordered

    def params(self) -> tuple[list[Any], ...]:
        """The nine arrays of `Queries.insert_many`, in insertion order."""
        ordered = self.inserted
        return (
            [r.topic for r in ordered],
            [r.payload for r in ordered],
            [r.dedupe_key for r in ordered],
            [r.headers for r in ordered],
            [r.max_attempts for r in ordered],
            [r.available_at for r in ordered],
            [r.delay for r in ordered],
            [r.ordering_key for r in ordered],
            [r.group for r in ordered],
        )

    def results(self, records: Sequence[Sequence[Any]]) -> list[int | None]:
        """One id or ``None`` per input event, in input order, from the returned rows."""
        by_key: dict[str, int] = {}
        unkeyed: dict[str | None, list[int]] = {}
        for record in records:
            if record[1] is None:
                unkeyed.setdefault(record[2], []).append(int(record[0]))
            else:
                by_key[record[1]] = int(record[0])
        # keyless rows of one ordering key (or of none) are inserted in input order, so
        # their ids ascend with it
        for ids in unkeyed.values():
            ids.sort(reverse=True)
        results: list[int | None] = []
        for r in self.rows:
            if r.dedupe_key is None:
                results.append(unkeyed[r.ordering_key].pop())
            else:
                results.append(by_key.pop(r.dedupe_key, None))
        return results


def _insert_order(row: _Row, index: int) -> tuple[int, str, int]:
    """Where a batch row is inserted.

    Unordered rows with a dedupe key come first, sorted by it, so producers whose
    batches share keys take the unique index's locks in the same order and wait for each
    other instead of deadlocking (a key's later copies in the batch are dropped before
    this). Ordered rows follow, grouped by ordering key in key order (the per-key locks
    of migration 0005, taken in the same order by every producer) and in input order
    within a key, which is their delivery order. Keyless unordered rows come last.
    """
    if row.ordering_key is not None:
        return (1, row.ordering_key, index)
    if row.dedupe_key is not None:
        return (0, row.dedupe_key, index)
    return (2, "", index)


async def enqueue(
    conn: Any,
    topic: str,
    payload: Any,
    *,
    dedupe_key: str | None = None,
    delay: float | timedelta | None = None,
    available_at: datetime | None = None,
    max_attempts: int | None = None,
    headers: Mapping[str, Any] | None = None,
    ordering_key: str | None = None,
    group: str | None = None,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
    encoder: Encoder | None = None,
) -> int | None:
    """Insert one event and return its id, or ``None`` if ``dedupe_key`` already exists.

    Events with the same ``ordering_key`` are handled one at a time, in id order (see
    docs/guarantees.md, "Ordered delivery"); ``None`` means unordered. Consumers claim
    the events of different ``group`` values (tenants, say) in turn, so one group's
    backlog cannot hold back another's events; ``None`` is one group of its own.

    ``conn`` is an asyncpg ``Connection`` or ``Pool``, a SQLAlchemy ``AsyncSession`` or
    ``AsyncConnection`` (asyncpg or psycopg underneath), or a psycopg ``AsyncConnection``.
    On a connection or session the insert joins the caller's transaction (beginning one
    the way the library would on its own first statement), so the event exists if and
    only if that transaction commits; on a pool it commits on its own. Every argument is
    validated before anything is sent; ``payload`` and ``headers`` must be
    JSON-serialisable (no NaN or Infinity, integers within 64 bits), and an ``encoder``'s
    output is checked the same way (docs/producers.md).
    """
    execute = drivers.async_executor(conn)
    q, sql, params = prepare_one(
        topic,
        payload,
        dedupe_key=dedupe_key,
        delay=delay,
        available_at=available_at,
        max_attempts=max_attempts,
        headers=headers,
        schema=schema,
        table=table,
        encoder=encoder,
        ordering_key=ordering_key,
        group=group,
    )
    return one_result(await execute(q, sql, params))


async def enqueue_many(
    conn: Any,
    events: Iterable[NewEvent],
    *,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
    encoder: Encoder | None = None,
) -> list[int | None]:
    """Insert many events in one statement; return one id (or ``None``) per input, in order.

    ``None`` marks an event whose ``dedupe_key`` already existed, in the table or earlier
    in the same batch (the first in input order is the one stored). One statement means one wake-up
    notification per distinct topic, however many events. ``conn`` is what `enqueue`
    takes.
    """
    execute = drivers.async_executor(conn)
    batch = Batch(events, schema, table, encoder)
    if not batch.rows:
        return []
    return batch.results(await execute(batch.q, batch.statement, batch.params()))
