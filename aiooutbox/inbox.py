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
rolled back. Under REPEATABLE READ, a copy committed after the transaction's snapshot
is False as well (the insert runs in a savepoint there, its serialization failure taken
back); under SERIALIZABLE it is PostgreSQL's serialization failure, which such a caller
retries. The table is ``<table>_inbox`` beside the outbox, made by ``migrate``.

Ids are kept until `purge` removes them: keep them longer than a message can be
redelivered (the broker's retention or redelivery window).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import asyncpg

from ._sql import drivers
from ._sql.inbox import SAVEPOINT, InboxQueries, inbox_queries
from ._sql.statements import DEFAULT_SCHEMA, DEFAULT_TABLE
from ._values.codec import check_utf8
from ._values.limits import InvalidArgument, check_count, check_seconds

__all__ = ["DEFAULT_CONSUMER", "purge", "record", "record_sync"]

DEFAULT_CONSUMER = "default"
MAX_CONSUMER = 200
MAX_MESSAGE_ID = 1000
# in UTF-8 bytes: the primary key's btree refuses an entry over 2,704 bytes, which would
# abort the caller's transaction; a consumer name's 200 characters take at most 800
MAX_MESSAGE_ID_BYTES = 1800
#: the levels under which `InboxQueries.record` inserts at once (the same in PostgreSQL)
_INSERTED_AT_ONCE = frozenset({"read committed", "read uncommitted"})
_SNAPSHOT = "repeatable read"
_SERIALIZATION_FAILURE = "40001"


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
    ``AsyncSession``/``AsyncConnection`` or a psycopg ``AsyncConnection``, inside a
    transaction: the record must commit or roll back with the work it guards, so a pool,
    or a connection whose statements commit on their own (autocommit, SQLAlchemy's
    ``AUTOCOMMIT`` isolation), is refused with `InvalidArgument` before anything is
    written. Under REPEATABLE READ a copy committed after the transaction's snapshot is
    False too; under SERIALIZABLE it is PostgreSQL's serialization failure (retry).
    """
    execute = drivers.async_executor(conn, action="record an inbox message on")
    q, params = _prepare(message_id, consumer, schema, table)
    if not await drivers.async_in_transaction(conn):
        raise _outside(conn)
    rows = await execute(q.outbox, q.record, params)
    level, inserted = rows[0][0], rows[0][1]
    if level in _INSERTED_AT_ONCE:
        return bool(inserted)
    if level != _SNAPSHOT:  # serializable: a failure there is the caller's to retry
        return bool(await execute(q.outbox, q.record_checked, params))
    await execute(q.outbox, f"SAVEPOINT {SAVEPOINT}", ())
    try:
        rows = await execute(q.outbox, q.record_checked, params)
    except Exception as exc:
        if drivers.sqlstate(exc) != _SERIALIZATION_FAILURE:
            raise
        await execute(q.outbox, f"ROLLBACK TO SAVEPOINT {SAVEPOINT}", ())
        rows = []  # committed by another transaction after this one's snapshot
    await execute(q.outbox, f"RELEASE SAVEPOINT {SAVEPOINT}", ())
    return bool(rows)


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
    q, params = _prepare(message_id, consumer, schema, table)
    if not drivers.sync_in_transaction(conn):
        raise _outside(conn)
    rows = execute(q.outbox, q.record, params)
    level, inserted = rows[0][0], rows[0][1]
    if level in _INSERTED_AT_ONCE:
        return bool(inserted)
    if level != _SNAPSHOT:
        return bool(execute(q.outbox, q.record_checked, params))
    execute(q.outbox, f"SAVEPOINT {SAVEPOINT}", ())
    try:
        rows = execute(q.outbox, q.record_checked, params)
    except Exception as exc:
        if drivers.sqlstate(exc) != _SERIALIZATION_FAILURE:
            raise
        execute(q.outbox, f"ROLLBACK TO SAVEPOINT {SAVEPOINT}", ())
        rows = []
    execute(q.outbox, f"RELEASE SAVEPOINT {SAVEPOINT}", ())
    return bool(rows)


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
    message_id: object, consumer: object, schema: str, table: str
) -> tuple[InboxQueries, tuple[str, str]]:
    """Check every argument, before any I/O: what the server or the driver would refuse
    mid-transaction (an index entry too large, a lone surrogate) is refused here."""
    q = inbox_queries(schema, table)
    for name, value, longest, most_bytes in (
        ("message_id", message_id, MAX_MESSAGE_ID, MAX_MESSAGE_ID_BYTES),
        ("consumer", consumer, MAX_CONSUMER, 4 * MAX_CONSUMER),  # never more bytes
    ):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, not {type(value).__name__}")
        if not value.strip() or "\x00" in value or len(value) > longest:
            raise InvalidArgument(
                f"{name} must be 1-{longest} characters without NUL, not blank, got {value[:80]!r}"
            )
        check_utf8(value, name)
        # len() first: a value of few characters cannot exceed the limit in bytes
        if len(value) > most_bytes // 4 and len(value.encode()) > most_bytes:
            raise InvalidArgument(
                f"{name} must be at most {most_bytes} bytes in UTF-8, got"
                f" {len(value.encode())}: {value[:40]!r}..."
            )
    return q, (str(consumer), str(message_id))


def _outside(conn: object) -> InvalidArgument:
    kind = f"{type(conn).__module__}.{type(conn).__qualname__}"
    return InvalidArgument(
        "inbox.record must run inside the transaction that does the message's work: this "
        f"{kind} is not in one (a pool, or a connection in autocommit mode or SQLAlchemy's "
        "AUTOCOMMIT isolation, would commit the id on its own, and a failure of the work "
        "would then lose the message)"
    )
