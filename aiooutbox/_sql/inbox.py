"""The inbox's statements, for one ``(schema, table)`` outbox (`aiooutbox.inbox`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .statements import Queries, queries

__all__ = ["SAVEPOINT", "InboxQueries", "inbox_queries"]

#: around `InboxQueries.record_checked` under REPEATABLE READ, so that its serialization
#: failure leaves the caller's transaction usable
SAVEPOINT = "aiooutbox_inbox"


@dataclass(frozen=True)
class InboxQueries:
    outbox: Queries  # the outbox whose migrations made the inbox table

    @property
    def table(self) -> str:
        return f'"{self.outbox.schema}"."{self.outbox.table}_inbox"'

    @property
    def record(self) -> str:
        # A concurrent transaction recording the same id waits here on the primary key
        # until the first one ends: it then inserts (the first rolled back) or not (it
        # committed), so exactly one of them goes on to do the work. Inserts only under
        # READ COMMITTED (and READ UNCOMMITTED, the same in PostgreSQL); the isolation
        # level comes back with the answer, so a snapshot transaction (which cannot see
        # a row committed after its snapshot, and fails on it) takes `record_checked`.
        return (
            "WITH level AS (SELECT current_setting('transaction_isolation') AS name),"
            f" inserted AS (INSERT INTO {self.table} (consumer, message_id)"
            " SELECT $1::text, $2::text FROM level"
            " WHERE name IN ('read committed', 'read uncommitted')"
            " ON CONFLICT (consumer, message_id) DO NOTHING RETURNING true)"
            " SELECT (SELECT name FROM level), EXISTS (SELECT FROM inserted)"
        )

    @property
    def record_checked(self) -> str:
        # Under REPEATABLE READ or SERIALIZABLE, a conflicting row committed after the
        # transaction's snapshot is a serialization failure (40001), not a conflict
        return (
            f"INSERT INTO {self.table} (consumer, message_id) VALUES ($1, $2)"
            " ON CONFLICT (consumer, message_id) DO NOTHING RETURNING true"
        )

    @property
    def purge(self) -> str:
        # oldest first through the received_at index, a bounded batch per statement
        return (
            f"DELETE FROM {self.table} WHERE ctid = ANY (ARRAY("
            f"SELECT ctid FROM {self.table} WHERE received_at < now() - make_interval(secs => $1)"
            " ORDER BY received_at LIMIT $2))"
        )


@lru_cache(maxsize=64)
def inbox_queries(schema: str, table: str) -> InboxQueries:
    """The inbox statements of the outbox ``schema.table`` (names validated once)."""
    return InboxQueries(queries(schema, table))
