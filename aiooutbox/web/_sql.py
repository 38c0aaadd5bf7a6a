"""The dashboard's SQL, named, for one (schema, table) outbox.

Like `aiooutbox._sql` and `aiooutbox._admin_sql`: identifiers validated and quoted,
values always bind parameters. Every statement here reaches its rows through an index
(the tests check the plans at scale): counts are bounded with ``LIMIT`` and fall back to
the planner's estimate when the bound is hit (`aiooutbox.web._counts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .._sql.statements import DEFAULT_SCHEMA, DEFAULT_TABLE, Queries, queries

__all__ = ["WebQueries", "web_queries"]

# claimable, running and blocked: the statuses a partial index covers
UNFINISHED = ("pending", "retry", "processing", "waiting")


@lru_cache(maxsize=64)
def web_queries(schema: str = DEFAULT_SCHEMA, table: str = DEFAULT_TABLE) -> WebQueries:
    return WebQueries(queries(schema, table))


@dataclass(frozen=True)
class WebQueries:
    outbox: Queries

    @property
    def t(self) -> str:
        return self.outbox.qualified

    @property
    def audit_table(self) -> str:
        return f'"{self.outbox.schema}"."{self.outbox.table}_audit"'

    # -- the live pulse: one cheap statement per interval, shared by every browser ----
    @property
    def pulse(self) -> str:
        # newest id (the primary key's last entry), the table's write counters, the
        # newest audit entry, and the registry's inserts and deletes (a consumer started
        # or stopped; its heartbeats are updates, left out): any change means the pages
        # may have changed. The counters are read with the functions behind
        # pg_stat_user_tables, not the view (which joins pg_index and groups: 5x the
        # time); to_regclass is NULL for a registry not migrated yet, and so its counts.
        # $1 schema, $2 table
        return (
            f"SELECT (SELECT max(id) FROM {self.t}),"
            " (SELECT pg_catalog.pg_stat_get_tuples_inserted(r)"
            " + pg_catalog.pg_stat_get_tuples_updated(r)"
            " + pg_catalog.pg_stat_get_tuples_deleted(r)"
            " FROM pg_catalog.to_regclass(pg_catalog.quote_ident($1) || '.'"
            " || pg_catalog.quote_ident($2)) AS r),"
            f" (SELECT max(id) FROM {self.audit_table}),"
            " (SELECT pg_catalog.pg_stat_get_tuples_inserted(r)"
            " + pg_catalog.pg_stat_get_tuples_deleted(r)"
            " FROM pg_catalog.to_regclass(pg_catalog.quote_ident($1) || '.'"
            " || pg_catalog.quote_ident($2 || '_consumers')) AS r)"
        )

    # -- overview -------------------------------------------------------------------
    @property
    def sample(self) -> str:
        # $1 percent of the table's pages, chosen at random by the seed $2 (TABLESAMPLE
        # SYSTEM; one seed for ten minutes: the same pages, cached, and numbers that do
        # not jitter between refreshes): rows by
        # topic, status and, for those done in the last day, the hour they finished in
        # (0 = this hour); died in the last day; due now. 100 percent reads every row.
        return (
            "SELECT topic, status::text, hour, count(*),"
            " count(*) FILTER (WHERE status = 'dead' AND finished_at > now() - interval '1 day'),"
            " count(*) FILTER (WHERE status IN ('pending', 'retry') AND available_at <= now())"
            " FROM (SELECT topic, status, finished_at, available_at,"
            "  CASE WHEN status = 'done' AND finished_at > now() - interval '1 day'"
            "   THEN floor(extract(epoch FROM (now() - finished_at)) / 3600)::int END AS hour"
            f"  FROM {self.t} TABLESAMPLE SYSTEM ($1::float4) REPEATABLE ($2::float8)) s"
            " GROUP BY topic, status, hour"
        )

    @property
    def pages(self) -> str:
        return "SELECT relpages::float8 FROM pg_catalog.pg_class WHERE oid = $1::regclass"

    @property
    def claimable_count(self) -> str:
        # $1 bound: pending + retry, index-only on the topic-first claim index
        return (
            "SELECT count(*) FROM (SELECT 1 FROM"
            f" {self.t} WHERE status IN ('pending', 'retry') LIMIT $1) s"
        )

    @property
    def claimable_by_topic(self) -> str:
        # topic, pending, retry, due now (run only when the bounded count says few)
        return (
            "SELECT topic, count(*) FILTER (WHERE status = 'pending'),"
            " count(*) FILTER (WHERE status = 'retry'),"
            " count(*) FILTER (WHERE available_at <= now())"
            f" FROM {self.t} WHERE status IN ('pending', 'retry') GROUP BY topic"
        )

    @property
    def topic_lags(self) -> str:
        # every topic with claimable events and its oldest available_at, by a skip scan
        # of the topic-first claim index: one descent per topic, however deep
        claimable = "status IN ('pending', 'retry')"
        return (
            "WITH RECURSIVE topics AS ("
            f" (SELECT topic FROM {self.t} WHERE {claimable} ORDER BY topic LIMIT 1)"
            " UNION ALL"
            f" SELECT (SELECT c.topic FROM {self.t} c WHERE c.{claimable}"
            "  AND c.topic > topics.topic ORDER BY c.topic LIMIT 1)"
            " FROM topics WHERE topics.topic IS NOT NULL)"
            " SELECT topic, extract(epoch FROM (now() - (SELECT min(m.available_at)"
            f"  FROM {self.t} m WHERE m.{claimable} AND m.topic = topics.topic)))::float8"
            " FROM topics WHERE topic IS NOT NULL"
        )

    @property
    def processing_by_topic(self) -> str:
        # $1 bound: through the lease index (only held rows have a lease)
        return (
            "SELECT topic, count(*) FROM (SELECT topic FROM"
            f" {self.t} WHERE lease_expires_at IS NOT NULL AND status = 'processing' LIMIT $1) s"
            " GROUP BY topic"
        )

    @property
    def waiting_by_topic(self) -> str:
        # $1 bound: ordered events behind their key's head, through the key index
        return (
            "SELECT topic, count(*) FROM (SELECT topic FROM"
            f" {self.t} WHERE ordering_key IS NOT NULL AND status = 'waiting' LIMIT $1) s"
            " GROUP BY topic"
        )

    @property
    def dead_by_topic(self) -> str:
        # $1 bound: through the dead index (0011), index-only; with those that died in
        # the last day
        return (
            "SELECT topic, count(*), count(*) FILTER (WHERE finished_at > now() - interval '1 day')"
            f" FROM (SELECT topic, finished_at FROM {self.t} WHERE status = 'dead' LIMIT $1) s"
            " GROUP BY topic"
        )

    @property
    def finished_since(self) -> str:
        # $1 seconds, $2 bound: done events finished in the window, index-only on the
        # retention index (finished_at)
        return (
            "SELECT count(*) FROM (SELECT 1 FROM"
            f" {self.t} WHERE status = 'done'"
            " AND finished_at > now() - make_interval(secs => $1::float8) LIMIT $2) s"
        )

    @property
    def finished_by_topic(self) -> str:
        # $1 seconds: done in the window by topic and hour (run only when few)
        return (
            "SELECT topic, floor(extract(epoch FROM (now() - finished_at)) / 3600)::int,"
            f" count(*) FROM {self.t} WHERE status = 'done'"
            " AND finished_at > now() - make_interval(secs => $1::float8) GROUP BY 1, 2"
        )

    @property
    def workers(self) -> str:
        # each worker holding leases: rows held, oldest claim, latest lease expiry
        # (renewed by its heartbeat), topics
        return (
            "SELECT locked_by, count(*),"
            " extract(epoch FROM (now() - min(locked_at)))::float8,"
            " extract(epoch FROM (max(lease_expires_at) - now()))::float8,"
            " array_agg(DISTINCT topic ORDER BY topic)"
            f" FROM {self.t} WHERE lease_expires_at IS NOT NULL AND status = 'processing'"
            " GROUP BY locked_by ORDER BY locked_by LIMIT 200"
        )

    @property
    def idle_workers(self) -> str:
        # consumers that found no work and wait on LISTEN (their advert expires)
        return (
            "SELECT worker_id, topics, extract(epoch FROM (expires_at - now()))::float8"
            f" FROM {self.outbox.idle_table} ORDER BY worker_id LIMIT 200"
        )

    @property
    def listeners(self) -> str:
        # sessions whose last statement was LISTEN on this outbox's channel (a consumer's
        # listener connection); other roles' query text needs pg_read_all_stats
        return (
            "SELECT pid, application_name, usename::text, state,"
            " extract(epoch FROM (now() - backend_start))::float8,"
            " client_addr::text"
            " FROM pg_catalog.pg_stat_activity"
            " WHERE datname = pg_catalog.current_database() AND query = $1"
            " ORDER BY backend_start LIMIT 50"
        )

    @property
    def hidden_sessions(self) -> str:
        # sessions in this database whose query text we may not read
        return (
            "SELECT count(*) FROM pg_catalog.pg_stat_activity"
            " WHERE datname = pg_catalog.current_database()"
            " AND query = '<insufficient privilege>'"
        )

    # -- events ---------------------------------------------------------------------
    _COLUMNS = (
        "id, topic, status::text, ordering_key, dedupe_key, attempts, max_attempts,"
        " created_at, available_at, finished_at, left(last_error, 200), locked_by"
    )

    def event_list(self, where: str, limit: int) -> str:
        # `where` is built by `_filters` from fixed fragments with bind parameters only;
        # ``$limit`` is the page size
        return f"SELECT {self._COLUMNS} FROM {self.t} WHERE {where} ORDER BY id DESC LIMIT ${limit}"

    def event_count(self, where: str, limit: int) -> str:
        # bounded by ``$limit``
        return f"SELECT count(*) FROM (SELECT 1 FROM {self.t} WHERE {where} LIMIT ${limit}) s"

    def event_ids(self, where: str) -> str:
        return f"SELECT id FROM {self.t} WHERE {where} ORDER BY id"

    def explain_count(self, where: str) -> str:
        return f"EXPLAIN (FORMAT JSON) SELECT 1 FROM {self.t} WHERE {where}"

    @property
    def event(self) -> str:
        return (
            "SELECT id, topic, status::text, ordering_key, dedupe_key, attempts,"
            " max_attempts, created_at, available_at, updated_at, finished_at, locked_by,"
            " locked_at, lease_expires_at, last_error, payload::text, headers::text,"
            " message_id, blocks_key"
            f" FROM {self.t} WHERE id = $1"
        )

    @property
    def key_position(self) -> str:
        # $1 key, $2 id, $3 bound: the key's unfinished events before this one, and its
        # head (the lowest), through the key index
        return (
            "SELECT count(*), min(id) FROM (SELECT id FROM"
            f" {self.t} WHERE ordering_key = $1 AND id < $2"
            " AND (status IN ('pending', 'retry', 'processing', 'waiting') OR blocks_key)"
            " ORDER BY id LIMIT $3) s"
        )

    # -- ordering keys ----------------------------------------------------------------
    @property
    def blocked_heads(self) -> str:
        # $1 limit: heads that cannot run now: failing (retry, through the key-head
        # index) or dead and blocking (through the dead index)
        return (
            "SELECT ordering_key, id, topic, status::text, attempts, available_at,"
            " left(last_error, 200) AS last_error FROM ("
            f" (SELECT * FROM {self.t} WHERE ordering_key IS NOT NULL"
            "   AND status IN ('pending', 'retry') AND status = 'retry' ORDER BY id LIMIT $1)"
            " UNION ALL"
            f" (SELECT * FROM {self.t} WHERE status = 'dead' AND blocks_key"
            "   AND ordering_key IS NOT NULL ORDER BY id LIMIT $1)) h"
            " ORDER BY id LIMIT $1"
        )

    @property
    def waiting_of_keys(self) -> str:
        # $1 keys, $2 bound per key: events waiting behind each (the key index)
        return (
            "SELECT k, (SELECT count(*) FROM (SELECT 1 FROM"
            f" {self.t} w WHERE w.ordering_key = k AND w.status = 'waiting' LIMIT $2) s)"
            " FROM unnest($1::text[]) AS k"
        )

    # -- audit ------------------------------------------------------------------------
    @property
    def audit_insert(self) -> str:
        return (
            f"INSERT INTO {self.audit_table} (actor, action, target, affected)"
            " VALUES ($1, $2, $3::jsonb, $4) RETURNING id"
        )

    @property
    def audit_list(self) -> str:
        # $1 before id (or NULL), $2 limit
        return (
            "SELECT id, at, actor, action, target::text, affected"
            f" FROM {self.audit_table} WHERE ($1::bigint IS NULL OR id < $1)"
            " ORDER BY id DESC LIMIT $2"
        )
