"""Operator, demo and server-wide SQL, named, for one (schema, table) outbox.

What `aiooutbox.admin`, the command line, ``aiooutbox demo`` and the embedded server
run. It lives apart from `Queries` (`_sql.statements`), which holds only what producers,
consumers and migrations run, so the hot path's statement set stays small and a
reader of it is not sent through reports. Same rules: identifiers validated and
quoted, values always bind parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .statements import DEFAULT_SCHEMA, DEFAULT_TABLE, Queries, queries, validate_identifier

__all__ = ["AdminQueries", "admin_queries"]


@lru_cache(maxsize=64)
def admin_queries(schema: str = DEFAULT_SCHEMA, table: str = DEFAULT_TABLE) -> AdminQueries:
    """The validated, cached operator statement set for one outbox."""
    return AdminQueries(queries(schema, table))


@dataclass(frozen=True)
class AdminQueries:
    outbox: Queries

    @property
    def qualified(self) -> str:
        return self.outbox.qualified

    @property
    def idle_table(self) -> str:
        return self.outbox.idle_table

    @property
    def status_type(self) -> str:
        return self.outbox.status_type

    def _function(self, name: str) -> str:
        return f'"{self.outbox.schema}"."{self.outbox.table}_{name}"'

    # -- operator ------------------------------------------------------------------
    @property
    def unfinished_by_topic(self) -> str:
        # topic, status, rows: the unfinished statuses and dead, each through its
        # partial index (the claim's, the lease's: only held rows have a lease, the
        # key's: waiting rows are ordered, the dead one), whatever the size of the history
        # (a pending row not due yet counts as `scheduled`)
        t = self.qualified
        return (
            "SELECT topic, CASE WHEN status = 'pending' AND available_at > now()"
            f" THEN 'scheduled' ELSE status::text END, count(*) FROM {t}"
            " WHERE status IN ('pending', 'retry') GROUP BY 1, 2"
            f" UNION ALL SELECT topic, 'processing', count(*) FROM {t}"
            " WHERE lease_expires_at IS NOT NULL AND status = 'processing' GROUP BY topic"
            f" UNION ALL SELECT topic, 'waiting', count(*) FROM {t}"
            " WHERE ordering_key IS NOT NULL AND status = 'waiting' GROUP BY topic"
            f" UNION ALL SELECT topic, 'dead', count(*) FROM {t}"
            " WHERE status = 'dead' GROUP BY topic"
        )

    @property
    def done_by_topic_bounded(self) -> str:
        # $1 bound: done rows by topic, the first $1 of the outbox's (by the retention
        # index, finished_at) and the first $1 of the ring's (0022); exact when each
        # part is below the bound
        return (
            "SELECT topic, count(*) FILTER (WHERE NOT ring), count(*) FILTER (WHERE ring)"
            f" FROM ((SELECT topic, false AS ring FROM {self.qualified}"
            "  WHERE status = 'done' ORDER BY finished_at LIMIT $1)"
            f" UNION ALL (SELECT topic, true FROM {self.outbox.done_table} LIMIT $1)) s"
            " GROUP BY topic"
        )

    def done_sample_by_topic(self, ring: bool) -> str:
        # $1 percent of the table's pages, $2 seed: done rows by topic in the sample,
        # of the outbox or of the ring
        source = self.outbox.done_table if ring else self.qualified
        where = "" if ring else " WHERE status = 'done'"
        return (
            f"SELECT topic, count(*) FROM {source}"
            f" TABLESAMPLE SYSTEM ($1::float4) REPEATABLE ($2::float8){where} GROUP BY topic"
        )

    @property
    def table_pages(self) -> str:
        # the heap's pages now (not pg_class.relpages, which only VACUUM and ANALYZE set),
        # of a table or of every partition of one
        return (
            "SELECT coalesce(sum(pg_catalog.pg_relation_size(t.relid)), 0)::float8"
            " / current_setting('block_size')::float8 FROM (SELECT $1::regclass AS relid"
            " UNION SELECT p.relid FROM pg_catalog.pg_partition_tree($1::regclass) AS p) AS t"
        )

    def explain_rows(self, ring: bool) -> str:
        # the planner's estimate of the table's rows: pg_class.reltuples scaled to the
        # heap's size now
        source = self.outbox.done_table if ring else self.qualified
        return f"EXPLAIN (FORMAT JSON) SELECT 1 FROM {source}"

    @property
    def oldest_claimable(self) -> str:
        return (
            "SELECT topic, extract(epoch FROM (now() - min(available_at)))::float8"
            f" FROM {self.qualified}"
            " WHERE status IN ('pending', 'retry') AND available_at <= now() GROUP BY topic"
        )

    @property
    def in_flight_by_worker(self) -> str:
        # worker, rows held, seconds since its oldest claim (through the lease index)
        return (
            "SELECT locked_by, count(*),"
            " extract(epoch FROM (now() - min(locked_at)))::float8"
            f" FROM {self.qualified}"
            " WHERE lease_expires_at IS NOT NULL AND status = 'processing'"
            " GROUP BY locked_by ORDER BY locked_by"
        )

    @property
    def attempts_by_topic(self) -> str:
        # topic, events, done, dead, attempts made (a full scan: for small tables and demos)
        return (
            "SELECT topic, count(*), count(*) FILTER (WHERE status = 'done'),"
            " count(*) FILTER (WHERE status = 'dead'), coalesce(sum(attempts), 0)::bigint"
            f" FROM {self.outbox.all_events} GROUP BY topic ORDER BY topic"
        )

    @property
    def reset_demo(self) -> str:
        # only ever run by `aiooutbox demo` on its own table
        return f"TRUNCATE {self.qualified}, {self.outbox.done_table} RESTART IDENTITY"

    @property
    def not_demo_events(self) -> str:
        # rows `aiooutbox demo` did not write: it marks its own with this header
        return (
            f"SELECT count(*) FROM {self.outbox.all_events}"
            """ WHERE NOT headers @> '{"demo": true}'"""
        )

    @property
    def dead_list(self) -> str:
        # $1 topic or NULL, $2 limit
        return (
            "SELECT id, topic, dedupe_key, attempts, max_attempts, last_error,"
            " created_at, finished_at, payload::text"
            f" FROM {self.qualified} WHERE status = 'dead'"
            " AND ($1::text IS NULL OR topic = $1) ORDER BY id LIMIT $2"
        )

    @property
    def dead_retry(self) -> str:
        # $1 ids or NULL, $2 topic or NULL; attempts reset, back to pending now (an
        # ordered event whose key has a head already waits behind it: migration 0005)
        return (
            f"SELECT id, topic, status, ordering_key FROM {self._function('requeue_dead')}"
            "($1::bigint[], $2::text)"
        )

    @property
    def later_done_of_keys(self) -> str:
        # $1 requeued dead ids: how many later events of their keys are already done
        # (a retried event that its key skipped runs late, out of order)
        return (
            f"SELECT d.id, count(l.id) FROM {self.qualified} d JOIN ("
            f"  SELECT id, ordering_key FROM {self.qualified} WHERE status = 'done'"
            f"  UNION ALL SELECT id, ordering_key FROM {self.outbox.done_table}) l"
            " ON l.ordering_key = d.ordering_key AND l.id > d.id"
            " WHERE d.id = ANY ($1::bigint[]) GROUP BY d.id"
        )

    @property
    def blocked_keys(self) -> str:
        # $1 limit: ordered keys whose head cannot run now (failing, or dead and
        # blocking) and that have events waiting behind it, oldest head first
        return (
            "SELECT h.ordering_key, h.id, h.topic, h.status::text, h.attempts,"
            " h.available_at, left(h.last_error, 200) AS last_error,"
            f" (SELECT count(*) FROM {self.qualified} w"
            "   WHERE w.ordering_key = h.ordering_key AND w.status = 'waiting') AS waiting"
            f" FROM {self.qualified} h"
            " WHERE h.ordering_key IS NOT NULL AND (h.status = 'retry' OR h.blocks_key)"
            " AND (h.status IN ('pending', 'retry', 'processing', 'waiting') OR h.blocks_key)"
            " ORDER BY h.id LIMIT $1"
        )

    @property
    def purge_ring(self) -> str:
        # $1 age seconds, $2 batch size: finished events of the ring, row by row (the
        # operator's purge; consumers' retention TRUNCATEs whole slots)
        ring = self.outbox.done_table
        return (
            f"DELETE FROM {ring} WHERE id = ANY (ARRAY("
            f" SELECT id FROM {ring}"
            "  WHERE finished_at < now() - make_interval(secs => $1::float8) LIMIT $2))"
        )

    @property
    def delete_dead(self) -> str:
        # $1 ids or NULL, $2 topic or NULL, $3 age in seconds or NULL, $4 the most rows
        # to delete or NULL: one row (deleted ids, keys promoted, keys skipped). The keys
        # a deleted event blocked move on to their next event (migration 0009)
        return (
            f"SELECT * FROM {self._function('delete_dead')}"
            "($1::bigint[], $2::text, $3::float8, $4::int)"
        )

    # -- operator: what the command line reports beyond counts ---------------------
    @property
    def event_statuses(self) -> str:
        # $1 ids: the status of those that exist (to say why a named id was not acted on)
        return (
            f"SELECT id, status::text FROM {self.outbox.all_events} WHERE id = ANY ($1::bigint[])"
        )

    @property
    def unconsumed_topics(self) -> str:
        # $1 topics handled by the caller (or NULL), $2 minimum wait in seconds.
        # Topics with events claimable now that no consumer seems to handle: none of
        # their rows is processing, and no idle consumer advertises the topic. Run once
        # by `run` at start-up and by `stats`; it reads the claimable rows once.
        return (
            "SELECT w.topic, w.waiting, w.lag FROM ("
            "  SELECT topic, count(*) AS waiting,"
            "   extract(epoch FROM (now() - min(available_at)))::float8 AS lag"
            f"  FROM {self.qualified}"
            "  WHERE status IN ('pending', 'retry') AND available_at <= now()"
            "  GROUP BY topic) AS w"
            " WHERE w.lag >= $2::float8"
            " AND NOT (w.topic = ANY (coalesce($1::text[], '{}')))"
            f" AND NOT EXISTS (SELECT 1 FROM {self.qualified} AS p"
            "  WHERE p.lease_expires_at IS NOT NULL AND p.status = 'processing'"
            "  AND p.topic = w.topic)"
            f" AND NOT EXISTS (SELECT 1 FROM {self.idle_table} AS i"
            "  WHERE i.expires_at > now() AND w.topic = ANY (i.topics))"
            " ORDER BY w.topic"
        )

    # -- server-wide, for bootstrapping the embedded server's database -------------
    @property
    def database_exists(self) -> str:
        return "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)"

    @staticmethod
    def create_database(name: str) -> str:
        return f'CREATE DATABASE "{validate_identifier("database", name)}"'
