"""The dashboard's SQL, named, for one (schema, table) outbox.

Like `aiooutbox._sql` and `aiooutbox._admin_sql`: identifiers validated and quoted,
values always bind parameters. Every statement here reaches its rows through an index
(the tests check the plans at scale): counts are bounded with ``LIMIT`` and fall back to
the planner's estimate when the bound is hit (`aiooutbox.web._counts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .._sql import DEFAULT_SCHEMA, DEFAULT_TABLE, Queries, queries

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
        # newest audit entry: any change means the pages may have changed
        return (
            f"SELECT (SELECT max(id) FROM {self.t}),"
            " (SELECT n_tup_ins + n_tup_upd + n_tup_del FROM pg_catalog.pg_stat_user_tables"
            "  WHERE schemaname = $1 AND relname = $2),"
            f" (SELECT max(id) FROM {self.audit_table})"
        )

    # -- overview -------------------------------------------------------------------
    @property
    def claimable_by_topic(self) -> str:
        # topic, queued (pending + retry), due now, oldest due: an index-only scan of the
        # topic-first claim index
        return (
            "SELECT topic, count(*), count(*) FILTER (WHERE available_at <= now()),"
            " extract(epoch FROM (now() - min(available_at)"
            "  FILTER (WHERE available_at <= now())))::float8"
            f" FROM {self.t} WHERE status IN ('pending', 'retry') GROUP BY topic"
        )

    @property
    def retry_by_topic(self) -> str:
        # $1 bound: failing events waiting for their next attempt, through the claim index
        return (
            "SELECT topic, count(*) FROM (SELECT topic FROM"
            f" {self.t} WHERE status IN ('pending', 'retry') AND status = 'retry' LIMIT $1) s"
            " GROUP BY topic"
        )

    @property
    def processing_by_topic(self) -> str:
        # through the lease index (only held rows have a lease)
        return (
            f"SELECT topic, count(*) FROM {self.t}"
            " WHERE lease_expires_at IS NOT NULL AND status = 'processing' GROUP BY topic"
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
        # $1 bound: through the dead index (0012), index-only
        return (
            "SELECT topic, count(*) FROM (SELECT topic FROM"
            f" {self.t} WHERE status = 'dead' LIMIT $1) s GROUP BY topic"
        )

    @property
    def table_estimate(self) -> str:
        # the planner's row count and the status and topic frequencies ANALYZE saw
        return (
            "SELECT c.reltuples::float8,"
            " (SELECT s.most_common_vals::text FROM pg_catalog.pg_stats s"
            "  WHERE s.schemaname = $1 AND s.tablename = $2 AND s.attname = 'status'),"
            " (SELECT s.most_common_freqs FROM pg_catalog.pg_stats s"
            "  WHERE s.schemaname = $1 AND s.tablename = $2 AND s.attname = 'status')"
            " FROM pg_catalog.pg_class c WHERE c.oid = $3::regclass"
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
    def finished_sample(self) -> str:
        # $1 seconds, $2 sample size: the topics and hours of the newest done events in
        # the window (to split a total that was too large to count by topic)
        return (
            "SELECT topic, extract(epoch FROM (now() - finished_at))::float8 FROM"
            f" {self.t} WHERE status = 'done'"
            " AND finished_at > now() - make_interval(secs => $1::float8)"
            " ORDER BY finished_at DESC LIMIT $2"
        )

    @property
    def failed_since(self) -> str:
        # $1 seconds, $2 bound: events that died in the window (dead index + heap)
        return (
            "SELECT topic, count(*) FROM (SELECT topic FROM"
            f" {self.t} WHERE status = 'dead'"
            " AND finished_at > now() - make_interval(secs => $1::float8) LIMIT $2) s"
            " GROUP BY topic"
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
