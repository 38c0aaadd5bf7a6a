"""What the metrics and the MVCC watchdog read, run inside consumers and runners.

A part of `Queries` (its base class) kept apart: none of it is on the hot path.
"""

from __future__ import annotations

__all__ = ["MonitoringStatements"]


class MonitoringStatements:
    """The queue gauges' query and the watchdog's; `Queries` supplies ``qualified``."""

    @property
    def qualified(self) -> str:
        raise NotImplementedError

    @property
    def queue_gauges(self) -> str:
        # topic, status, rows, seconds since the oldest claimable row became due (NULL:
        # none is due yet). Only unfinished rows, each status through its partial index:
        # pending and retry through the topic-first claimable index, processing through
        # the lease index, waiting (ordered events behind their key's head) through the
        # key index; the history of done rows costs nothing. Dead rows have no index and
        # are not counted here (alert on events_total{outcome="dead"}). Rows a raw SQL
        # producer scheduled at -infinity are due but have no age.
        # A pending row not due yet counts as `scheduled`.
        return (
            "SELECT topic, CASE WHEN status = 'pending' AND available_at > now()"
            " THEN 'scheduled' ELSE status::text END, count(*)::bigint,"
            " extract(epoch FROM (now() - min(available_at)"
            "  FILTER (WHERE available_at <= now() AND available_at > '-infinity')))::float8"
            f" FROM {self.qualified} WHERE status IN ('pending', 'retry')"
            " GROUP BY 1, 2"
            " UNION ALL"
            " SELECT topic, 'processing', count(*)::bigint, NULL::float8"
            f" FROM {self.qualified}"
            " WHERE lease_expires_at IS NOT NULL AND status = 'processing'"
            " GROUP BY topic"
            " UNION ALL"
            " SELECT topic, 'waiting', count(*)::bigint, NULL::float8"
            f" FROM {self.qualified}"
            " WHERE ordering_key IS NOT NULL AND status = 'waiting'"
            " GROUP BY topic"
        )

    @property
    def watchdog_lock(self) -> str:
        # one consumer per outbox checks at a time; the lock ends with the transaction
        return "SELECT pg_try_advisory_xact_lock(1870616420, hashtext($1))"

    @property
    def horizon_holders(self) -> str:
        # kind, pid, name, state, seconds open (NULL for slots), xid age, detail; the
        # oldest first. Only what pins this database's tables: its own backends and
        # prepared transactions (other databases' do not hold back its vacuum), and
        # slots' xmin (hot_standby_feedback, server-wide); logical slots hold only
        # catalog_xmin, which never pins the outbox table.
        return (
            "SELECT kind, pid, name, state, age_seconds, xid_age, detail FROM ("
            " SELECT 'backend' AS kind, a.pid, a.application_name AS name, a.state,"
            "  extract(epoch FROM (now() - coalesce(a.xact_start, a.backend_start)))::float8"
            "   AS age_seconds,"
            "  greatest(age(a.backend_xmin), age(a.backend_xid))::bigint AS xid_age,"
            "  coalesce(a.datname, '') || coalesce(' as ' || a.usename, '')"
            "   || coalesce(': ' || left(a.query, 120), '') AS detail"
            " FROM pg_catalog.pg_stat_activity AS a"
            " WHERE (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)"
            "  AND a.pid <> pg_catalog.pg_backend_pid()"
            "  AND a.datname = pg_catalog.current_database()"
            " UNION ALL"
            " SELECT 'replication slot', s.active_pid, s.slot_name::text,"
            "  CASE WHEN s.active THEN 'active' ELSE 'inactive' END, NULL,"
            "  age(s.xmin)::bigint, s.slot_type || coalesce(' on ' || s.database, '')"
            " FROM pg_catalog.pg_replication_slots AS s WHERE s.xmin IS NOT NULL"
            " UNION ALL"
            " SELECT 'prepared transaction', NULL, p.gid, 'prepared',"
            "  extract(epoch FROM (now() - p.prepared))::float8, age(p.transaction)::bigint,"
            "  p.owner::text || ' on ' || p.database::text"
            " FROM pg_catalog.pg_prepared_xacts AS p"
            " WHERE p.database = pg_catalog.current_database()"
            ") AS h ORDER BY xid_age DESC NULLS LAST, age_seconds DESC NULLS LAST LIMIT $1"
        )

    @property
    def table_vacuum_stats(self) -> str:
        # dead tuples, live tuples, last (auto)vacuum of this outbox table
        return (
            "SELECT n_dead_tup, n_live_tup, greatest(last_vacuum, last_autovacuum)"
            " FROM pg_catalog.pg_stat_user_tables WHERE schemaname = $1 AND relname = $2"
        )
