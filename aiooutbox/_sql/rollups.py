"""The statements of the per-topic, per-minute counts (migration 0017), named, for one
outbox: what consumers write (`aiooutbox._engine.rollups`). The dashboard's reads of the
table are in `aiooutbox.web._sql`.

Same rules as `_sql`: identifiers validated and quoted, values always bind parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .statements import DEFAULT_SCHEMA, DEFAULT_TABLE, Queries, queries

__all__ = ["KEPT_DAYS", "RollupQueries", "rollup_queries"]

# minutes older than this are deleted by the consumers (the dashboard shows a day)
KEPT_DAYS = 8


@lru_cache(maxsize=64)
def rollup_queries(schema: str = DEFAULT_SCHEMA, table: str = DEFAULT_TABLE) -> RollupQueries:
    return RollupQueries(queries(schema, table))


@dataclass(frozen=True)
class RollupQueries:
    outbox: Queries

    @property
    def table(self) -> str:
        return f'"{self.outbox.schema}"."{self.outbox.table}_rollups"'

    @property
    def add(self) -> str:
        # one flush of a consumer's counts, one row per (minute, topic): $1 minutes (epoch
        # seconds of their start), $2 topics, $3 done, $4 retried, $5 dead, $6 claimed,
        # $7 lag sums, $8 lag maxima (seconds). Returns the server's clock (epoch s), by
        # which the consumer dates its next counts.
        return (
            f"WITH up AS (INSERT INTO {self.table} AS r"
            " (minute, topic, done, retried, dead, claimed, lag_sum, lag_max)"
            " SELECT to_timestamp(x.m), x.t, x.d, x.r, x.k, x.c, x.s, x.x"
            " FROM unnest($1::float8[], $2::text[], $3::bigint[], $4::bigint[], $5::bigint[],"
            " $6::bigint[], $7::float8[], $8::float8[]) AS x(m, t, d, r, k, c, s, x)"
            " ON CONFLICT (topic, minute) DO UPDATE SET done = r.done + excluded.done,"
            " retried = r.retried + excluded.retried, dead = r.dead + excluded.dead,"
            " claimed = r.claimed + excluded.claimed, lag_sum = r.lag_sum + excluded.lag_sum,"
            " lag_max = GREATEST(r.lag_max, excluded.lag_max) RETURNING 1)"
            " SELECT extract(epoch FROM now())::float8, (SELECT count(*) FROM up)"
        )

    @property
    def clock(self) -> str:
        # the server's clock (epoch s): what a consumer dates its counts by
        return "SELECT extract(epoch FROM now())::float8"

    @property
    def purge_old(self) -> str:
        # through the minute index; a few thousand rows at most between two purges
        return f"DELETE FROM {self.table} WHERE minute < now() - interval '{KEPT_DAYS} days'"
