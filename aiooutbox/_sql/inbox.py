"""The inbox's statements, for one ``(schema, table)`` outbox (`aiooutbox.inbox`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .statements import Queries, queries

__all__ = ["InboxQueries", "inbox_queries"]


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
        # committed), so exactly one of them goes on to do the work.
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
