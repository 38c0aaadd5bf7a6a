"""The inbox: exactly-once processing on the side that consumes from a broker.

A relay publishes every event at least once, each copy with the event's ``message_id``
(the ``outbox-message-id`` header on Kafka and NATS, the AMQP ``message_id`` property,
the ``message_id`` field of a Redis entry, ``webhook-id`` on a webhook). A service
that consumes those messages and writes to its own PostgreSQL records the id in the
same transaction as its writes:

```python
async with conn.transaction():
    if await inbox.record(conn, message_id, consumer="billing"):
        await conn.execute("INSERT INTO invoices ...")  # the work, once
await message.ack()
```

`record` returns True the first time it sees ``message_id`` for ``consumer`` and False
for a copy already processed, so a message redelivered after a crash between the
commit and the ack is skipped. Two copies delivered at once to two workers: the second
`record` waits for the first transaction and returns False if it committed, True if it
rolled back. The table is ``<table>_inbox`` beside the outbox, made by ``migrate``.

Ids are kept until `purge` removes them: keep them longer than a message can be
redelivered (the broker's retention or redelivery window).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import asyncpg

from ._sql import drivers
from ._sql.inbox import InboxQueries, inbox_queries
from ._sql.statements import DEFAULT_SCHEMA, DEFAULT_TABLE
from ._values.limits import InvalidArgument, check_count, check_seconds

__all__ = ["DEFAULT_CONSUMER", "purge", "record", "record_sync"]

DEFAULT_CONSUMER = "default"
MAX_CONSUMER = 200
MAX_MESSAGE_ID = 1000


async def record(
    conn: Any,
    message_id: str,
    *,
    consumer: str = DEFAULT_CONSUMER,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> bool:
    """Record ``message_id`` as processed by ``consumer``, in ``conn``'s transaction;
    True if this is its first delivery (do the work), False if it was processed before.

    ``conn`` is an asyncpg ``Connection`` inside a transaction, a SQLAlchemy
    ``AsyncSession``/``AsyncConnection`` or a psycopg ``AsyncConnection`` not in
    autocommit mode: the record must commit or roll back with the work it guards, so a
    pool or a connection outside a transaction is refused with `InvalidArgument`.
    """
    execute = drivers.async_executor(conn, action="record an inbox message on")
    q, params = _prepare(conn, message_id, consumer, schema, table)
    return bool(await execute(q.outbox, q.record, params))


def record_sync(
    conn: Any,
    message_id: str,
    *,
    consumer: str = DEFAULT_CONSUMER,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> bool:
    """`record` for blocking code: a psycopg or psycopg2 connection, a SQLAlchemy
    ``Session``/``Connection``, or Django's ``connection`` inside ``atomic()``."""
    execute = drivers.sync_executor(conn, action="record an inbox message on")
    q, params = _prepare(conn, message_id, consumer, schema, table)
    return bool(execute(q.outbox, q.record, params))


async def purge(
    pool: asyncpg.Pool | asyncpg.Connection,
    older_than: float | timedelta,
    *,
    batch: int = 10_000,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> int:
    """Delete the ids recorded more than ``older_than`` ago, ``batch`` rows per
    statement (each its own short transaction), oldest first; return how many."""
    seconds = check_seconds("older_than", older_than, minimum=1.0)
    limit = check_count("batch", batch, 1, 1_000_000)
    q = inbox_queries(schema, table)
    removed = 0
    while True:
        status = await pool.execute(q.purge, seconds, limit)
        deleted = int(status.rpartition(" ")[2])
        removed += deleted
        if deleted < limit:
            return removed


def _prepare(
    conn: Any, message_id: object, consumer: object, schema: str, table: str
) -> tuple[InboxQueries, tuple[str, str]]:
    """Check every argument and that ``conn`` is inside a transaction, before any I/O."""
    q = inbox_queries(schema, table)
    for name, value, longest in (
        ("message_id", message_id, MAX_MESSAGE_ID),
        ("consumer", consumer, MAX_CONSUMER),
    ):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, not {type(value).__name__}")
        if not value or "\x00" in value or len(value) > longest:
            raise InvalidArgument(
                f"{name} must be 1-{longest} characters without NUL, got {value[:80]!r}"
            )
    if not _in_transaction(conn):
        raise InvalidArgument(
            "inbox.record must run inside the transaction that does the message's work "
            "(a pool, or a connection in autocommit mode, would record the id on its own)"
        )
    return q, (str(consumer), str(message_id))


def _in_transaction(conn: Any) -> bool:
    """Whether a statement on ``conn`` joins a transaction the caller commits."""
    if isinstance(conn, asyncpg.Pool):
        return False
    if isinstance(conn, asyncpg.Connection):
        return bool(conn.is_in_transaction())
    if hasattr(conn, "in_atomic_block"):  # Django: atomic() or autocommit off
        return bool(conn.in_atomic_block or not conn.get_autocommit())
    autocommit = getattr(conn, "autocommit", False)  # psycopg, psycopg2
    # SQLAlchemy sessions and connections begin one on their first statement
    return autocommit is False
