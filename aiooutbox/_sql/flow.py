"""The statements of flow control (migration 0010), named, for one outbox.

What consumers run to read the controls and claim limited topics, and what operators
run to change and list them. Same rules as `_sql`: identifiers validated and quoted,
values always bind parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .groups import first_due
from .marks import redelivered
from .statements import DEFAULT_SCHEMA, DEFAULT_TABLE, Queries, queries

__all__ = ["ALL_TOPICS", "FLOW_NOTICE", "FlowQueries", "flow_queries"]

# The control row of every topic at once (no event has an empty topic).
ALL_TOPICS = ""
# The notification payload that tells consumers the controls changed: longer than any
# topic (the table's CHECK caps topics at 255 characters), so no consumer mistakes it
# for a wake-up of a topic (older ones that consume every topic merely claim once).
FLOW_NOTICE = "\x02aiooutbox-flow-control:".ljust(256, ".")


@lru_cache(maxsize=64)
def flow_queries(schema: str = DEFAULT_SCHEMA, table: str = DEFAULT_TABLE) -> FlowQueries:
    return FlowQueries(queries(schema, table))


@dataclass(frozen=True)
class FlowQueries:
    outbox: Queries

    @property
    def controls_table(self) -> str:
        return f'"{self.outbox.schema}"."{self.outbox.table}_flow"'

    @property
    def log_table(self) -> str:
        return f'"{self.outbox.schema}"."{self.outbox.table}_flow_log"'

    @property
    def lock_key(self) -> str:
        # the key the claim functions take shared (0010)
        return f"aiooutbox-flow:{self.outbox.schema}.{self.outbox.table}"

    # -- consumers -------------------------------------------------------------------
    @property
    def controls(self) -> str:
        # the topics held back (paused or limited); '' is every topic
        return (
            "SELECT topic, paused, max_running, rate IS NOT NULL OR grouped AS rated"
            f" FROM {self.controls_table}"
            " WHERE paused OR max_running IS NOT NULL OR rate IS NOT NULL OR grouped"
        )

    @property
    def claim_limited(self) -> str:
        # $1 worker, $2 lease seconds, $3 topics (served in this order), $4 rows wanted of
        # each, $5 byte cap (of the whole claim), $6 rows the claim took before (their
        # bytes count); the claim's columns, then `held` and `retry_in` (status rows
        # have no id) and `bytes` (a claimed row's stored payload size), then `grp` and
        # `redelivered` (`ClaimedRow`)
        return (
            f"SELECT c.*, {redelivered(self.outbox.schema, self.outbox.table)} AS redelivered"
            f' FROM "{self.outbox.schema}"."{self.outbox.table}_claim_limited_v3"'
            "($1, $2::float8, $3::text[], $4::int[], $5::bigint, $6::bigint[]) AS c"
        )

    @property
    def claim_limited_in_turn(self) -> str:
        # `claim_limited`, resuming among groups after $7, the group cursor
        # (`GroupCursor`), visiting at most $8 groups (0018)
        return self.claim_limited.replace("$6::bigint[])", "$6::bigint[], $7::text, $8::int)")

    @property
    def open_topics(self) -> str:
        # every topic with claimable rows (a skip scan) but the held ones (paused or
        # limited, as the claim reads them), for a consumer of every topic; the held
        # topics are hashed once, not scanned for each topic found
        q = self.outbox.qualified
        held = f'"{self.outbox.schema}"."{self.outbox.table}_flow_held"()'
        return (
            "SELECT coalesce(array_agg(t.topic), '{}') FROM (WITH RECURSIVE t(topic) AS ("
            f" (SELECT topic FROM {q} WHERE status IN ('pending', 'retry')"
            "  ORDER BY topic LIMIT 1)"
            " UNION ALL SELECT (SELECT c.topic FROM"
            f"  {q} AS c WHERE c.status IN ('pending', 'retry')"
            "  AND c.topic > t.topic ORDER BY c.topic LIMIT 1) FROM t WHERE t.topic IS NOT NULL)"
            " SELECT t.topic FROM t WHERE t.topic IS NOT NULL) AS t"
            f" WHERE t.topic NOT IN (SELECT unnest({held}))"
        )

    @property
    def idle_probe_except(self) -> str:
        # `Queries.idle_probe_any` for a consumer of every topic, leaving out $1 (topics
        # held back: their due rows must not cut the idle wait short)
        q = self.outbox.qualified
        return (
            "SELECT (WITH RECURSIVE t(topic) AS ("
            f" (SELECT topic FROM {q} WHERE status IN ('pending', 'retry')"
            "  ORDER BY topic LIMIT 1)"
            " UNION ALL SELECT (SELECT c.topic FROM"
            f"  {q} AS c WHERE c.status IN ('pending', 'retry')"
            "  AND c.topic > t.topic ORDER BY c.topic LIMIT 1) FROM t WHERE t.topic IS NOT NULL)"
            " SELECT extract(epoch FROM (min(greatest(n.at, now())) - now()))::float8"
            " FROM t CROSS JOIN LATERAL ("
            f" {first_due(q)}) AS n"
            " WHERE t.topic IS NOT NULL AND t.topic NOT IN (SELECT unnest($1::text[]))) AS due,"
            f" ({self.outbox.open_writers}) > 0 AS writers"
        )

    # -- operators -------------------------------------------------------------------
    @property
    def lock_out_claims(self) -> str:
        # $1 lock_key: waits for the claims under way, holds new ones until commit
        return "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))"

    @property
    def all_controls(self) -> str:
        return (
            "SELECT topic, paused, max_running, rate, rate_text, burst, updated_at, updated_by"
            f" FROM {self.controls_table} ORDER BY topic"
        )

    @property
    def control_for_update(self) -> str:
        return (
            "SELECT topic, paused, max_running, rate, rate_text, burst, updated_at, updated_by"
            f" FROM {self.controls_table} WHERE topic = $1 FOR UPDATE"
        )

    @property
    def paused_for_update(self) -> str:
        # every paused row (resume --all)
        return (
            "SELECT topic, paused, max_running, rate, rate_text, burst, updated_at, updated_by"
            f" FROM {self.controls_table} WHERE paused ORDER BY topic FOR UPDATE"
        )

    @property
    def upsert_control(self) -> str:
        # $1 topic, $2 paused, $3 max_running, $4 rate, $5 rate_text, $6 burst, $7 actor,
        # $8 refill the bucket (a new rate or burst)
        return (
            f"INSERT INTO {self.controls_table} AS f (topic, paused, max_running, rate,"
            " rate_text, burst, tokens, tokens_at, updated_by)"
            " VALUES ($1::text, $2::boolean, $3::int, $4::float8, $5::text, $6::float8,"
            " coalesce($6::float8, 0), clock_timestamp(), $7::text)"
            " ON CONFLICT (topic) DO UPDATE SET paused = excluded.paused,"
            " max_running = excluded.max_running, rate = excluded.rate,"
            " rate_text = excluded.rate_text, burst = excluded.burst,"
            " tokens = CASE WHEN $8::boolean THEN excluded.tokens"
            "  ELSE least(f.tokens, coalesce(excluded.burst, 0)) END,"
            " tokens_at = CASE WHEN $8::boolean THEN excluded.tokens_at ELSE f.tokens_at END,"
            " updated_at = now(), updated_by = excluded.updated_by"
            " RETURNING topic, paused, max_running, rate, rate_text, burst, updated_at, updated_by"
        )

    @property
    def delete_control(self) -> str:
        # a topic with group limits keeps its row (its claims lock it: 0018)
        return f"DELETE FROM {self.controls_table} WHERE topic = $1 AND NOT grouped"

    @property
    def log_change(self) -> str:
        # $1 actor, $2 topic, $3 action, $4 before (json text or NULL), $5 after
        return (
            f"INSERT INTO {self.log_table} (actor, topic, action, before, after)"
            " VALUES ($1, $2, $3, $4::text::jsonb, $5::text::jsonb)"
            " RETURNING id, at, actor, topic, action, before::text, after::text"
        )

    @property
    def count_running(self) -> str:
        # $1 topic: rows of it claimed now, whoever claimed them (through the lease index,
        # which holds only rows being processed); counted once, when a limit is set
        return (
            f"UPDATE {self.outbox.qualified} SET flow_counted = true"
            " WHERE lease_expires_at IS NOT NULL AND status = 'processing' AND topic = $1"
            " AND flow_counted IS NOT TRUE"
        )

    @property
    def has_claimable(self) -> str:
        return (
            f"SELECT EXISTS (SELECT 1 FROM {self.outbox.qualified}"
            " WHERE status IN ('pending', 'retry') AND topic = $1)"
        )

    @property
    def claimable_topics(self) -> str:
        # every topic with claimable rows (a skip scan), to wake their consumers
        q = self.outbox.qualified
        return (
            "WITH RECURSIVE t(topic) AS ("
            f" (SELECT topic FROM {q} WHERE status IN ('pending', 'retry')"
            "  ORDER BY topic LIMIT 1)"
            " UNION ALL SELECT (SELECT c.topic FROM"
            f"  {q} AS c WHERE c.status IN ('pending', 'retry')"
            "  AND c.topic > t.topic ORDER BY c.topic LIMIT 1) FROM t WHERE t.topic IS NOT NULL)"
            " SELECT array_agg(t.topic) FROM t WHERE t.topic IS NOT NULL"
        )

    @property
    def overview(self) -> str:
        # $1 topic or NULL (every topic): topic, claimable, due, waiting, running, lag,
        # paused, max_running, rate, rate_text, burst, updated_at, updated_by. Every status
        # through its partial index (as `Queries.queue_gauges`); topics with controls
        # but no unfinished events are listed too.
        q = self.outbox.qualified
        return (
            "WITH c AS (SELECT topic, count(*) AS claimable,"
            "  count(*) FILTER (WHERE available_at <= now()) AS due,"
            "  extract(epoch FROM (now() - min(available_at)"
            "   FILTER (WHERE available_at <= now() AND available_at > '-infinity')))::float8"
            "   AS lag"
            f" FROM {q} WHERE status IN ('pending', 'retry')"
            "  AND ($1::text IS NULL OR topic = $1) GROUP BY topic),"
            " r AS (SELECT topic, count(*) AS running"
            f" FROM {q} WHERE lease_expires_at IS NOT NULL AND status = 'processing'"
            "  AND ($1::text IS NULL OR topic = $1) GROUP BY topic),"
            " w AS (SELECT topic, count(*) AS waiting"
            f" FROM {q} WHERE ordering_key IS NOT NULL AND status = 'waiting'"
            "  AND ($1::text IS NULL OR topic = $1) GROUP BY topic),"
            " f AS (SELECT * FROM"
            f" {self.controls_table} WHERE topic <> '' AND ($1::text IS NULL OR topic = $1)),"
            " n AS (SELECT topic FROM c UNION SELECT topic FROM r UNION SELECT topic FROM w"
            "  UNION SELECT topic FROM f)"
            " SELECT n.topic, coalesce(c.claimable, 0), coalesce(c.due, 0),"
            " coalesce(w.waiting, 0), coalesce(r.running, 0), c.lag,"
            " coalesce(f.paused, false), f.max_running, f.rate, f.rate_text, f.burst,"
            " f.updated_at, f.updated_by"
            " FROM n LEFT JOIN c USING (topic) LEFT JOIN r USING (topic)"
            " LEFT JOIN w USING (topic) LEFT JOIN f USING (topic) ORDER BY n.topic"
        )

    @property
    def everything_paused(self) -> str:
        return (
            f"SELECT coalesce((SELECT paused FROM {self.controls_table} WHERE topic = ''), false)"
        )

    @property
    def history(self) -> str:
        # $1 topic or NULL, $2 limit: the latest changes, newest first
        return (
            "SELECT id, at, actor, topic, action, before::text, after::text"
            f" FROM {self.log_table} WHERE $1::text IS NULL OR topic = $1"
            " ORDER BY id DESC LIMIT $2"
        )
