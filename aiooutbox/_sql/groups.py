"""Statements about groups (fair claims, migration 0018) that several sets share."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GroupQueries", "busiest_groups", "first_due", "top_groups", "waiting_groups"]

# the groups the metrics show, of each kind: no label per tenant of thousands
TOP_GROUPS = 10


def top_groups(table: str) -> str:
    # $1 how many: over every topic, the named groups with the most due events and
    # those with the most claimed now (topic, group, 'due' or 'running', events)
    return (
        f"(SELECT topic, grp, 'due' AS kind, count(*) AS n FROM {table}"
        " WHERE status IN ('pending', 'retry') AND available_at <= now() AND grp IS NOT NULL"
        " GROUP BY 1, 2 ORDER BY 4 DESC, 1, 2 LIMIT $1)"
        " UNION ALL"
        f" (SELECT topic, grp, 'running', count(*) FROM {table}"
        " WHERE lease_expires_at IS NOT NULL AND status = 'processing' AND grp IS NOT NULL"
        " GROUP BY 1, 2 ORDER BY 4 DESC, 1, 2 LIMIT $1)"
    )


def busiest_groups(table: str) -> str:
    # $1 topic, $2 how many: the groups with the most events claimed now (through the
    # lease index, which holds only claimed rows); '' is the ungrouped events
    return (
        f"SELECT coalesce(grp, '') AS g, count(*) AS running FROM {table}"
        " WHERE lease_expires_at IS NOT NULL AND status = 'processing' AND topic = $1"
        " GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT $2"
    )


def waiting_groups(table: str) -> str:
    # $1 topic, $2 how many, $3 the most due events read: the groups with the most due
    # events among them, and how long their oldest has waited (an index-only read of
    # the topic's claimable range, bounded)
    return (
        "SELECT w.g, count(*) AS due, extract(epoch FROM (now() - min(w.at)))::float8 AS lag"
        f" FROM (SELECT coalesce(grp, '') AS g, available_at AS at FROM {table}"
        "  WHERE status IN ('pending', 'retry') AND topic = $1"
        "  AND available_at <= now() AND available_at > '-infinity' LIMIT $3) AS w"
        " GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT $2"
    )


def first_due(table: str, after: str = "") -> str:
    """A lateral subquery: the ``available_at`` of topic ``t.topic``'s first claimable
    row, finite, as ``at`` (no row when there is none): the ungrouped rows' first and
    each group's (a skip scan, one descent per group), each read in the claimable
    index's order. ``after``: a position ``(available_at, id)`` the rows lie after (a
    topic's low mark, migration 0019), also checked by the skip scan's descents in the
    index (entries before it, dead ones included, then cost no heap fetch)."""
    rows = f"FROM {table} AS c WHERE c.status IN ('pending', 'retry') AND c.topic = t.topic"
    if after:
        rows += f" AND (c.available_at, c.id) > {after}"
    first = "AND c.available_at < 'infinity' ORDER BY c.available_at, c.id LIMIT 1"
    g = "coalesce(c.grp, '')"  # the claimable index's second column
    return (
        "SELECT d.at FROM (SELECT least("
        f"(SELECT c.available_at {rows} AND {g} = '' {first}),"
        f" (WITH RECURSIVE g(grp) AS ((SELECT {g} {rows} AND {g} > '' ORDER BY {g} LIMIT 1)"
        f" UNION ALL SELECT (SELECT {g} {rows} AND {g} > g.grp ORDER BY {g} LIMIT 1)"
        " FROM g WHERE g.grp IS NOT NULL)"
        f" SELECT min((SELECT c.available_at {rows} AND {g} = g.grp {first}))"
        " FROM g WHERE g.grp IS NOT NULL)) AS at) AS d WHERE d.at IS NOT NULL"
    )


@dataclass(frozen=True)
class GroupQueries:
    """Per-group limits' statements for operators (`admin.limit_groups`), for one
    outbox whose names were validated (`_sql.flow.FlowQueries`)."""

    schema: str
    table: str

    @property
    def limits(self) -> str:
        return f'"{self.schema}"."{self.table}_group_limits"'

    @property
    def limit_for_update(self) -> str:
        return f"SELECT * FROM {self.limits} WHERE topic = $1 AND grp = $2 FOR UPDATE"

    @property
    def delete_limit(self) -> str:
        return f"DELETE FROM {self.limits} WHERE topic = $1 AND grp = $2"

    @property
    def upsert_limit(self) -> str:
        # $1 topic, $2 group ('' the default), $3 max_running, $4 rate, $5 rate_text,
        # $6 burst, $7 actor
        return (
            f"INSERT INTO {self.limits} AS g (topic, grp, max_running, rate, rate_text, burst,"
            " updated_by) VALUES ($1, $2, $3, $4, $5, $6, $7)"
            " ON CONFLICT (topic, grp) DO UPDATE SET max_running = excluded.max_running,"
            " rate = excluded.rate, rate_text = excluded.rate_text, burst = excluded.burst,"
            " updated_at = now(), updated_by = excluded.updated_by RETURNING *"
        )

    @property
    def refill(self) -> str:
        # $1 topic, $2 group ('': every group): their buckets start full again
        return (
            f'DELETE FROM "{self.schema}"."{self.table}_group_tokens"'
            " WHERE topic = $1 AND ($2 = '' OR grp = $2)"
        )

    @property
    def has_limits(self) -> str:
        return f"SELECT EXISTS (SELECT 1 FROM {self.limits} WHERE topic = $1)"

    @property
    def mark_grouped(self) -> str:
        # $1 topic, $2 actor, $3 whether it has group limits: its control row says so
        return (
            f'INSERT INTO "{self.schema}"."{self.table}_flow" (topic, updated_by, grouped)'
            " VALUES ($1, $2, $3) ON CONFLICT (topic) DO UPDATE SET grouped = excluded.grouped"
        )

    @property
    def drop_empty_control(self) -> str:
        return (
            f'DELETE FROM "{self.schema}"."{self.table}_flow" WHERE topic = $1 AND NOT grouped'
            " AND NOT paused AND max_running IS NULL AND rate IS NULL"
        )

    @property
    def topic_limits(self) -> str:
        return f"SELECT * FROM {self.limits} WHERE topic = $1 ORDER BY grp"
