"""Blocking `enqueue`/`enqueue_many` for code that writes through a blocking driver.

Same arguments, validation, statement, return values and errors as `aiooutbox.enqueue`
and `aiooutbox.enqueue_many`, on a psycopg ``Connection``, a psycopg2 connection, a
SQLAlchemy ``Session`` or ``Connection`` (psycopg or psycopg2 driver) or a Django
database connection (``django.db.connection`` or ``connections[alias]``). The event
joins the caller's transaction: it exists if and only if that transaction commits, and a
savepoint that rolls back removes it. On a connection in autocommit mode (Django outside
``atomic()``, psycopg with ``autocommit=True``) it commits on its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from ._sql import drivers
from ._sql.statements import DEFAULT_SCHEMA, DEFAULT_TABLE
from ._values.codec import Encoder
from .events import NewEvent
from .producer import Batch, one_result, prepare_one

__all__ = ["enqueue", "enqueue_many"]


def enqueue(
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
    """Insert one event and return its id, or ``None`` if ``dedupe_key`` already exists."""
    execute = drivers.sync_executor(conn)
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
    return one_result(execute(q, sql, params))


def enqueue_many(
    conn: Any,
    events: Iterable[NewEvent],
    *,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
    encoder: Encoder | None = None,
) -> list[int | None]:
    """Insert many events in one statement; return one id (or ``None``) per input, in order."""
    execute = drivers.sync_executor(conn)
    batch = Batch(events, schema, table, encoder)
    if not batch.rows:
        return []
    return batch.results(execute(batch.q, batch.statement, batch.params()))
