"""The statements of the consumer registry (migration 0014), named, for one outbox.

Each consumer writes its row at start, its heartbeat touches it, a clean stop deletes
it; rows of consumers that stopped beating expire and are purged later. Same rules as
`_sql`: identifiers validated and quoted, values always bind parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .statements import DEFAULT_SCHEMA, DEFAULT_TABLE, Queries, queries

__all__ = ["RegistryQueries", "registry_queries"]

# a row whose heartbeat stopped is shown as gone for this long, then purged
GONE_KEPT = "1 hour"


@lru_cache(maxsize=64)
def registry_queries(schema: str = DEFAULT_SCHEMA, table: str = DEFAULT_TABLE) -> RegistryQueries:
    return RegistryQueries(queries(schema, table))


@dataclass(frozen=True)
class RegistryQueries:
    outbox: Queries

    @property
    def table(self) -> str:
        return f'"{self.outbox.schema}"."{self.outbox.table}_consumers"'

    @property
    def register(self) -> str:
        # at start: $1 worker id, $2 host, $3 pid, $4 concurrency, $5 prefetch, $6 topics
        # (NULL = all), $7 lease timeout (s), $8 version, $9 seconds until it expires;
        # a worker id used again (a restart with a fixed id) starts afresh
        return (
            f"INSERT INTO {self.table} AS c (worker_id, host, pid, concurrency, prefetch,"
            " topics, lease_timeout, version, started_at, seen_at, expires_at)"
            " VALUES ($1, $2, $3, $4, $5, $6::text[], $7, $8, now(), now(),"
            " now() + make_interval(secs => $9::float8))"
            " ON CONFLICT (worker_id) DO UPDATE SET host = excluded.host, pid = excluded.pid,"
            " concurrency = excluded.concurrency, prefetch = excluded.prefetch,"
            " topics = excluded.topics, lease_timeout = excluded.lease_timeout,"
            " version = excluded.version, started_at = excluded.started_at,"
            " seen_at = excluded.seen_at, expires_at = excluded.expires_at"
        )

    @property
    def touch(self) -> str:
        # each heartbeat: $1 worker id, $2 seconds until it expires; no row (purged after
        # a long stall, or truncated by a server crash) means: register again
        return (
            f"UPDATE {self.table} SET seen_at = now(),"
            " expires_at = now() + make_interval(secs => $2::float8) WHERE worker_id = $1"
        )

    @property
    def remove(self) -> str:
        return f"DELETE FROM {self.table} WHERE worker_id = $1"

    @property
    def purge_gone(self) -> str:
        return f"DELETE FROM {self.table} WHERE expires_at < now() - interval '{GONE_KEPT}'"

    @property
    def listing(self) -> str:
        # the dashboard: every registered consumer, alive or gone (bounded)
        return (
            "SELECT worker_id, host, pid, concurrency, prefetch, topics, lease_timeout,"
            " version, extract(epoch FROM (now() - started_at))::float8,"
            " extract(epoch FROM (now() - seen_at))::float8,"
            " extract(epoch FROM (expires_at - now()))::float8"
            f" FROM {self.table} ORDER BY worker_id LIMIT 500"
        )
