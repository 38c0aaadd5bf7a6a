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
from ._times import as_text

__all__ = ["EVENT_TIMES", "WebQueries", "web_queries"]

# claimable, running and blocked: the statuses a partial index covers
UNFINISHED = ("pending", "retry", "processing", "waiting")


@lru_cache(maxsize=64)
def web_queries(schema: str = DEFAULT_SCHEMA, table: str = DEFAULT_TABLE) -> WebQueries:
    return WebQueries(queries(schema, table))


# the times of an event its page shows
EVENT_TIMES = (
    "created_at",
    "available_at",
    "updated_at",
    "finished_at",
    "locked_at",
    "lease_expires_at",
)
# a due time a lag can be taken from: a scheduled event has no lag yet, and a raw SQL
# producer's 'infinity' (never) or '-infinity' (due, with no age) cannot be subtracted
_DUE = "available_at <= now() AND available_at > '-infinity'"


@dataclass(frozen=True)
class WebQueries:
    outbox: Queries

    @property
    def t(self) -> str:
        return self.outbox.qualified

    @property
    def events(self) -> str:
        # what the event pages read: the outbox and its finished events (0022)
        return self.outbox.all_events

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
        # not jitter between refreshes): done rows by topic, the one number no index
        # gives cheaply. 100 percent reads every row.
        return (
            "SELECT topic, count(*)"
            f" FROM {self.t} TABLESAMPLE SYSTEM ($1::float4) REPEATABLE ($2::float8)"
            " WHERE status = 'done' GROUP BY topic"
        )

    @property
    def ring_sample(self) -> str:
        # `sample` of the ring of finished events (0022): every row there is done
        return (
            f"SELECT topic, count(*) FROM {self.outbox.done_table}"
            " TABLESAMPLE SYSTEM ($1::float4) REPEATABLE ($2::float8) GROUP BY topic"
        )

    @property
    def pages(self) -> str:
        # of a table, or of every partition of one
        return (
            "SELECT coalesce(sum(c.relpages), 0)::float8 FROM pg_catalog.pg_class c"
            " WHERE c.relpages > 0 AND (c.oid = $1::regclass OR c.oid IN"
            " (SELECT p.relid FROM pg_catalog.pg_partition_tree($1::regclass) AS p))"
        )

    # the backlog, exact: each count reads one partial index, index-only (the page
    # caches them with the pulse: they are read again only after a write, and at most
    # every 25 times what reading them took)
    @property
    def claimable_counts(self) -> str:
        # topic, pending + retry, those due now: the topic-first claim index
        return (
            "SELECT topic, count(*), count(*) FILTER (WHERE available_at <= now())"
            f" FROM {self.t} WHERE status IN ('pending', 'retry') GROUP BY topic"
        )

    @property
    def retry_counts(self) -> str:
        # topic, retry, those due now: the retry index (0017)
        return (
            "SELECT topic, count(*), count(*) FILTER (WHERE available_at <= now())"
            f" FROM {self.t} WHERE status = 'retry' GROUP BY topic"
        )

    @property
    def dead_counts(self) -> str:
        # topic, dead: the dead index (0011)
        return f"SELECT topic, count(*) FROM {self.t} WHERE status = 'dead' GROUP BY topic"

    def explain_status(self, status: str) -> str:
        # the planner's rows of one status (a literal from the fixed set: only a
        # constant lets the planner use the partial index's statistics)
        assert status in ("pending", "retry", "dead")
        return f"EXPLAIN (FORMAT JSON) SELECT 1 FROM {self.t} WHERE status = '{status}'"

    @property
    def topic_lags(self) -> str:
        # every topic with claimable events, its lag and the epoch of its oldest due
        # event (the page ticks the lag on from it; both NULL when none is due), by a
        # skip scan of the topic-first claim index: one descent per topic, however deep
        claimable = "status IN ('pending', 'retry')"
        return (
            "WITH RECURSIVE topics AS ("
            f" (SELECT topic FROM {self.t} WHERE {claimable} ORDER BY topic LIMIT 1)"
            " UNION ALL"
            f" SELECT (SELECT c.topic FROM {self.t} c WHERE c.{claimable}"
            "  AND c.topic > topics.topic ORDER BY c.topic LIMIT 1)"
            " FROM topics WHERE topics.topic IS NOT NULL)"
            " SELECT topic, extract(epoch FROM (now() - o.at))::float8,"
            " extract(epoch FROM o.at)::float8 FROM topics CROSS JOIN LATERAL"
            f" (SELECT min(m.available_at) AS at FROM {self.t} m WHERE m.{claimable}"
            f"  AND m.topic = topics.topic AND {_DUE}) o WHERE topic IS NOT NULL"
        )

    @property
    def topic_lag(self) -> str:
        # $1 topic: its lag and the epoch its oldest due event became due (the claim
        # index's first due entry of the topic; NULL when none is due)
        return (
            "SELECT extract(epoch FROM (now() - min(available_at)))::float8,"
            " extract(epoch FROM min(available_at))::float8"
            f" FROM {self.t} WHERE status IN ('pending', 'retry') AND topic = $1 AND {_DUE}"
        )

    @property
    def topic_counted(self) -> str:
        # $1 topic: did a consumer count any of its events in the last week (the
        # primary key of the per-minute counts)
        return f"SELECT EXISTS (SELECT 1 FROM {self.rollups_table} WHERE topic = $1)"

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
    # a pending event not due yet shows as scheduled
    STATE = (
        "CASE WHEN status = 'pending' AND available_at > now() THEN 'scheduled'"
        " ELSE status::text END"
    )
    # times as text: a stored one may be outside the years a datetime holds (`_times`)
    _COLUMNS = (
        f"id, topic, {STATE}, ordering_key, dedupe_key, attempts, max_attempts,"
        f" {as_text('created_at')}, {as_text('available_at')}, {as_text('finished_at')},"
        " left(last_error, 200), locked_by"
    )

    def event_list(self, where: str, limit: int) -> str:
        # `where` is built by `_filters` from fixed fragments with bind parameters only;
        # ``$limit`` is the page size
        return (
            f"SELECT {self._COLUMNS} FROM {self.events} WHERE {where}"
            f" ORDER BY id DESC LIMIT ${limit}"
        )

    def event_count(self, where: str, limit: int) -> str:
        # bounded by ``$limit``
        return f"SELECT count(*) FROM (SELECT 1 FROM {self.events} WHERE {where} LIMIT ${limit}) s"

    def event_ids(self, where: str) -> str:
        return f"SELECT id FROM {self.t} WHERE {where} ORDER BY id"

    def explain_count(self, where: str) -> str:
        return f"EXPLAIN (FORMAT JSON) SELECT 1 FROM {self.events} WHERE {where}"

    @property
    def event(self) -> str:
        return (
            f"SELECT id, topic, {self.STATE} AS status, ordering_key, dedupe_key, attempts,"
            f" max_attempts, {', '.join(as_text(c) for c in EVENT_TIMES)}, locked_by,"
            " last_error, payload::text, headers::text,"
            " message_id, blocks_key, failures::text AS failures"
            f" FROM {self.events} WHERE id = $1"
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
        # $1 limit, $2 topic or NULL: heads that cannot run now: failing (retry, through
        # the key-head index, or the retry index for one topic) or dead and blocking
        # (through the dead index)
        return (
            "SELECT ordering_key, id, topic, status::text, attempts,"
            f" {as_text('available_at')}, left(last_error, 200) AS last_error FROM ("
            f" (SELECT * FROM {self.t} WHERE ordering_key IS NOT NULL"
            "   AND status IN ('pending', 'retry') AND status = 'retry'"
            "   AND ($2::text IS NULL OR topic = $2) ORDER BY id LIMIT $1)"
            " UNION ALL"
            f" (SELECT * FROM {self.t} WHERE status = 'dead' AND blocks_key"
            "   AND ordering_key IS NOT NULL AND ($2::text IS NULL OR topic = $2)"
            "   ORDER BY id LIMIT $1)) h"
            " ORDER BY id LIMIT $1"
        )

    @property
    def blocked_heads_of_topic(self) -> str:
        # $1 limit, $2 topic: as `blocked_heads`, for one topic (the retry index and the
        # dead index both lead with the topic)
        return (
            "SELECT ordering_key, id, topic, status::text, attempts,"
            f" {as_text('available_at')}, left(last_error, 200) AS last_error FROM ("
            f" (SELECT * FROM {self.t} WHERE status = 'retry' AND topic = $2"
            "   AND ordering_key IS NOT NULL ORDER BY id LIMIT $1)"
            " UNION ALL"
            f" (SELECT * FROM {self.t} WHERE status = 'dead' AND topic = $2 AND blocks_key"
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

    @property
    def audit_entry(self) -> str:
        # $1 id: the entry a page's message describes (after an action)
        return (
            "SELECT id, at, actor, action, target::text, affected"
            f" FROM {self.audit_table} WHERE id = $1"
        )

    # -- the consumers' per-minute counts (0017) -----------------------------------------
    @property
    def rollups_table(self) -> str:
        return f'"{self.outbox.schema}"."{self.outbox.table}_rollups"'

    @property
    def topic_minutes(self) -> str:
        # $1 topic, $2 seconds back: per minute (epoch s of its start) done, retried,
        # dead, claimed, lag sum, lag max; through the primary key (topic, minute)
        return (
            "SELECT extract(epoch FROM minute)::float8, done, retried, dead, claimed,"
            f" lag_sum, lag_max FROM {self.rollups_table}"
            " WHERE topic = $1 AND minute >= now() - make_interval(secs => $2::float8)"
            " ORDER BY minute"
        )

    @property
    def rollups_past_hours(self) -> str:
        # per topic and past hour of the last day (1: the hour before the current one,
        # to 23): done, failed (retried + dead), dead; through the minute index. Those
        # hours no longer change, so the dashboard reads them once an hour.
        return (
            "SELECT topic, floor(extract(epoch FROM (date_trunc('hour', now())"
            " - date_trunc('hour', minute))) / 3600)::int, sum(done)::bigint,"
            " sum(retried + dead)::bigint, sum(dead)::bigint"
            f" FROM {self.rollups_table}"
            " WHERE minute >= date_trunc('hour', now()) - interval '23 hours'"
            " AND minute < date_trunc('hour', now())"
            " GROUP BY topic, date_trunc('hour', minute)"
        )

    @property
    def rollups_last_hour(self) -> str:
        # per topic, the last 60 minutes split at the current hour's start (true: in the
        # current hour): done, failed (retried + dead), dead; through the minute index
        return (
            "SELECT topic, minute >= date_trunc('hour', now()), sum(done)::bigint,"
            " sum(retried + dead)::bigint, sum(dead)::bigint"
            f" FROM {self.rollups_table} WHERE minute >= now() - interval '1 hour'"
            " GROUP BY 1, 2"
        )

    # -- actions on waiting work --------------------------------------------------------
    @property
    def waiting_states(self) -> str:
        # $1 ids: those that are pending, scheduled or retrying, with their key (a head
        # of its key if it has one: a pending or retry event with a key is its head)
        return (
            f"SELECT id, {self.STATE}, ordering_key, topic FROM {self.t}"
            " WHERE id = ANY ($1::bigint[]) AND status IN ('pending', 'retry') ORDER BY id"
        )

    @property
    def run_now(self) -> str:
        # $1 ids: scheduled and retrying events due now (a pending event due already is
        # left as it is); (id, topic) of each. Placed as the claim's functions place a
        # row (migration 0019): the position lock first, then clock_timestamp(), so no
        # consumer's low mark has passed the new position when it commits
        take = f'"{self.outbox.schema}"."{self.outbox.table}_take_position"()'
        return (
            f"UPDATE {self.t} SET available_at = clock_timestamp(), updated_at = now()"
            f" FROM (SELECT {take}) AS placed"
            " WHERE id = ANY ($1::bigint[]) AND status IN ('pending', 'retry')"
            " AND available_at > now() RETURNING id, topic"
        )

    @property
    def lock_keys(self) -> str:
        # $1 keys: their producers' locks (see 0005), in key order, waited for, so that
        # the promotion after a cancellation cannot be skipped (as `delete_dead` does)
        prefix = f"{self.outbox.schema}.{self.outbox.table}:"
        return (
            "SELECT count(pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended("
            f"'{prefix}' || k, 0))) FROM (SELECT DISTINCT k FROM unnest($1::text[]) AS k"
            " WHERE k IS NOT NULL ORDER BY k) s"
        )

    @property
    def keys_of(self) -> str:
        # $1 ids: the ordering keys of those still pending or retrying
        return (
            f"SELECT DISTINCT ordering_key FROM {self.t} WHERE id = ANY ($1::bigint[])"
            " AND status IN ('pending', 'retry') AND ordering_key IS NOT NULL"
        )

    @property
    def cancel(self) -> str:
        # $1 ids: delete those still pending, scheduled or retrying (a claim since has
        # made them processing: not touched); (id, topic, ordering key) of each
        return (
            f"DELETE FROM {self.t} WHERE id = ANY ($1::bigint[])"
            " AND status IN ('pending', 'retry') RETURNING id, topic, ordering_key"
        )
