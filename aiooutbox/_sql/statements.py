"""The statements producers, consumers and migrations run, named, for one outbox.

Operator, demo and server-wide statements are in `_sql.admin`; the migrations' own SQL
is in the top-level ``schema/``.

Identifiers are validated to ``[a-z_][a-z0-9_]*`` and always double-quoted; values are
always bind parameters. Payloads and headers travel as ``text`` and are cast in SQL, so
a JSON codec the application installed on its pool cannot double-encode them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ..errors import InvalidArgument
from .groups import first_due
from .marks import CLAIMED as _CLAIMED
from .marks import MarkStatements
from .monitoring import MonitoringStatements

__all__ = [
    "DEFAULT_SCHEMA",
    "DEFAULT_TABLE",
    "Queries",
    "for_paramstyle",
    "id_array",
    "queries",
    "validate_identifier",
]

DEFAULT_SCHEMA = "public"
DEFAULT_TABLE = "outbox_events"

_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]*\Z")
_MAX_SCHEMA = 63
# derived names such as "<table>_claimable_idx" must stay within PostgreSQL's 63 bytes
_MAX_TABLE = 40


def validate_identifier(kind: str, name: object, max_length: int = _MAX_SCHEMA) -> str:
    """Return ``name`` if it is a safe lower-case SQL identifier, else raise `InvalidArgument`."""
    if not isinstance(name, str):
        raise TypeError(f"{kind} name must be a str, not {type(name).__name__}")
    if not name or len(name) > max_length or not _IDENTIFIER.match(name):
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise InvalidArgument(
            f"invalid {kind} name {shown!r}: use 1-{max_length} characters of lower-case "
            "letters, digits and underscores, not starting with a digit"
        )
    if name.startswith("pg_") or name == "information_schema":  # pg_dump leaves them out
        raise InvalidArgument(f"invalid {kind} name {name!r}: the name is reserved")
    return name


_DOLLAR = re.compile(r"\$(\d+)")


@lru_cache(maxsize=64)
def for_paramstyle(sql: str, style: str) -> str:
    """``sql`` written with ``$1..$n`` placeholders, rendered for a DB-API paramstyle.

    The statements are defined once, in asyncpg's numbering; psycopg, psycopg2, Django
    and SQLAlchemy's psycopg dialects take ``%s`` in the same positions. Each parameter
    must appear once, in order, so positional binding stays the same list of values.
    """
    if style == "numeric_dollar":
        return sql
    if style not in ("format", "pyformat"):
        raise ValueError(f"unsupported paramstyle {style!r}")
    numbers = [int(n) for n in _DOLLAR.findall(sql)]
    if numbers != list(range(1, len(numbers) + 1)):
        raise ValueError(f"placeholders must appear once each, in order: {numbers}")
    return _DOLLAR.sub("%s", sql.replace("%", "%%"))


def _channel(schema: str, table: str) -> str:
    # "." cannot occur in a validated identifier, so ("a_b", "c") and ("a", "b_c") differ
    name = f"aiooutbox.{schema}.{table}"
    if len(name) <= 63:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:12]
    return f"aiooutbox_{digest}"


def _fill(text: str, names: dict[str, str]) -> str:
    for key, value in names.items():
        text = text.replace("{{" + key + "}}", value)
    return text


def id_array(ids: Sequence[int]) -> str:
    """Row ids as the text of a PostgreSQL ``bigint[]``, for ``$n::text::bigint[]``.

    asyncpg's binary encoder took about half a microsecond of client CPU per element
    (a settlement of 470 ids: 314 µs against 80 µs as text, measured); the list's repr
    is made in C, and the server parses it in about the time it decodes the binary.
    """
    return "{" + repr(ids if type(ids) is list else list(ids))[1:-1] + "}"


@lru_cache(maxsize=64)
def queries(schema: str = DEFAULT_SCHEMA, table: str = DEFAULT_TABLE) -> Queries:
    """The validated, cached statement set for one outbox."""
    return Queries(
        validate_identifier("schema", schema), validate_identifier("table", table, _MAX_TABLE)
    )


@dataclass(frozen=True)
class Queries(MarkStatements, MonitoringStatements):
    schema: str
    table: str

    # -- names ---------------------------------------------------------------------
    @property
    def qualified(self) -> str:
        return f'"{self.schema}"."{self.table}"'

    @property
    def idle_table(self) -> str:
        return f'"{self.schema}"."{self.table}_idle"'

    @property
    def done_table(self) -> str:
        # finished events, in slots that retention empties with TRUNCATE (0022)
        return f'"{self.schema}"."{self.table}_done"'

    @property
    def all_events(self) -> str:
        # the view of the outbox and its finished events together (0022)
        return f'"{self.schema}"."{self.table}_all"'

    @property
    def versions_table(self) -> str:
        return f'"{self.schema}"."{self.table}_migrations"'

    @property
    def compat_versions_table(self) -> str:
        return f'"{self.schema}"."{self.table}_migrations_compat"'

    @property
    def status_type(self) -> str:
        return f'"{self.schema}"."{self.table}_status"'

    @property
    def channel(self) -> str:
        return _channel(self.schema, self.table)

    def render(self, template: str) -> str:
        """Fill a migration file's placeholders with this outbox's names.

        In comment lines they become ``<schema>``: the files' own notes about their
        placeholders must not come out as ``-- Placeholders: public, outbox_events``,
        nor keep braces that a templating migration tool would trip on.
        """
        names = {"schema": self.schema, "table": self.table, "channel": self.channel}
        return "".join(
            _fill(line, {k: f"<{k}>" for k in names})
            if line.lstrip().startswith("--")
            else _fill(line, names)
            for line in template.splitlines(keepends=True)
        )

    # -- migrations ----------------------------------------------------------------
    @property
    def create_schema(self) -> str:
        return f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"'

    @property
    def create_schema_if_missing(self) -> str:
        """For scripts: IF NOT EXISTS alone needs CREATE on the database (owners may lack it)."""
        return (
            "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_catalog.pg_namespace WHERE nspname ="
            f" '{self.schema}') THEN {self.create_schema}; END IF; END $$"
        )

    @property
    def schema_exists(self) -> str:
        return "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)"

    @property
    def create_versions_table(self) -> str:
        return (
            f"CREATE TABLE IF NOT EXISTS {self.versions_table} ("
            " version INT PRIMARY KEY, name TEXT NOT NULL,"
            " applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )

    @property
    def create_compat_versions_table(self) -> str:
        # migrations that declare the oldest schema version whose code still works on them
        return (
            f"CREATE TABLE IF NOT EXISTS {self.compat_versions_table} ("
            " version INT PRIMARY KEY, name TEXT NOT NULL, compatible_with INT NOT NULL,"
            " applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )

    @property
    def compat_versions(self) -> str:
        return f"SELECT version, compatible_with FROM {self.compat_versions_table}"

    @property
    def record_compat_version(self) -> str:
        return (
            f"INSERT INTO {self.compat_versions_table} (version, name, compatible_with)"
            " VALUES ($1, $2, $3)"
        )

    @property
    def versions_table_exists(self) -> str:
        return "SELECT to_regclass($1) IS NOT NULL"

    @property
    def unreadable_version_tables(self) -> str:
        # $1 the schema, $2 the version tables: the role, and those it cannot read
        # (asked only after a permission error, to name the GRANT that fixes it)
        return (
            "SELECT quote_ident(current_user), has_schema_privilege($1, 'USAGE'),"
            " array(SELECT t FROM unnest($2::text[]) AS t"
            " WHERE to_regclass(t) IS NOT NULL AND NOT has_table_privilege(t, 'SELECT'))"
        )

    @property
    def applied_versions(self) -> str:
        return f"SELECT version FROM {self.versions_table} ORDER BY version"

    @property
    def record_version(self) -> str:
        return f"INSERT INTO {self.versions_table} (version, name) VALUES ($1, $2)"

    @property
    def advisory_xact_lock(self) -> str:
        return "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))"

    # -- producer ------------------------------------------------------------------
    # Written once with $n placeholders; `for_paramstyle` renders them for %s drivers.
    @property
    def insert_one(self) -> str:
        # $1 topic, $2 payload json, $3 dedupe_key, $4 headers json, $5 max_attempts,
        # $6 available_at (absolute) or NULL, $7 delay seconds, $8 ordering_key, $9 group.
        # No delay: clock_timestamp(), the row's position after the statement's position
        # lock (migration 0019; now() would make its trigger move the row instead)
        return (
            f"INSERT INTO {self.qualified}"
            " (topic, payload, dedupe_key, headers, max_attempts, available_at, ordering_key, grp)"
            " VALUES ($1, $2::text::jsonb, $3, $4::text::jsonb, $5,"
            " COALESCE($6::timestamptz, NULLIF(now() + make_interval(secs => $7::float8), now()),"
            " clock_timestamp()), $8::text, $9::text)"
            " ON CONFLICT (dedupe_key) DO NOTHING RETURNING id"
        )

    @property
    def insert_many(self) -> str:
        return self._insert_many("ordering_key")

    @property
    def insert_many_unordered(self) -> str:
        # a batch without ordered rows does not read ordering_key back: a producer role
        # granted SELECT (id, dedupe_key) only, as before ordered delivery, can run it
        return self._insert_many("NULL::text")

    def _insert_many(self, ordering_key: str) -> str:
        return (
            f"INSERT INTO {self.qualified}"
            " (topic, payload, dedupe_key, headers, max_attempts, available_at, ordering_key, grp)"
            " SELECT u.topic, u.payload::jsonb, u.dedupe_key, u.headers::jsonb, u.max_attempts,"
            " COALESCE(u.available_at, NULLIF(now() + make_interval(secs => u.delay), now()),"
            " clock_timestamp()), u.ordering_key, u.grp"
            " FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int[],"
            " $6::timestamptz[], $7::float8[], $8::text[], $9::text[])"
            " WITH ORDINALITY AS u(topic, payload, dedupe_key, headers, max_attempts,"
            " available_at, delay, ordering_key, grp, ord)"
            " ORDER BY u.ord"
            f" ON CONFLICT (dedupe_key) DO NOTHING RETURNING id, dedupe_key, {ordering_key}"
        )

    # -- consumer ------------------------------------------------------------------
    # The claim and the settlements are functions (migrations 0002, 0005, 0006, 0008) whose SET
    # clauses pin them to index plans: a generic plan made while the table was small
    # would otherwise scan the whole table on every call once the backlog grows.
    def _function(self, name: str) -> str:
        return f'"{self.schema}"."{self.table}_{name}"'

    @property
    def claim(self) -> str:
        # $1 worker id, $2 lease seconds, $3 topics (NULL: every topic), $4 limit,
        # $5 byte cap, $6 run length behind an ordered head (0: heads only), $7 rows all
        # runs may take together; the claimed rows are `ClaimedRow`'s columns (0006,
        # 0018; ``redelivered`` from the rows the claim wrote, 0021); groups from their
        # first, in turn
        return (
            f"SELECT {_CLAIMED}, c.redelivered FROM {self._function('claim_v10')}"
            "($1, $2::float8, $3::text[], $4::int, $5::bigint, $6::int, $7::int) AS c"
        )

    @property
    def claim_after(self) -> str:
        # the claim, its ungrouped rows after a watermark: $8 available_at, $9 id
        return (
            f"SELECT {_CLAIMED}, c.redelivered FROM {self._function('claim_v10')}"
            "($1, $2::float8, $3::text[], $4::int, $5::bigint, $6::int, $7::int,"
            " $8::timestamptz, $9::bigint) AS c"
        )

    @property
    def claim_in_turn(self) -> str:
        # `claim`, resuming among groups after $10, the group cursor (`GroupCursor`),
        # visiting at most $11 groups; $8 and $9 the watermark, or NULL
        return (
            f"SELECT {_CLAIMED}, c.redelivered FROM {self._function('claim_v10')}"
            "($1, $2::float8, $3::text[], $4::int, $5::bigint, $6::int, $7::int,"
            " $8::timestamptz, $9::bigint, $10::text, $11::int) AS c"
        )

    @property
    def settle_done(self) -> str:
        # fenced: only the claim this worker holds, on the attempt it claimed
        # $1 ids, $2 worker id, $3 attempts; returns (settled, promoted, skipped keys)
        return f"SELECT * FROM {self._function('settle_done_v5')}($1::bigint[], $2, $3::int)"

    @property
    def settle_done_text(self) -> str:
        # `settle_done` with $1 the ids as text (`id_array`): what the settler sends
        return f"SELECT * FROM {self._function('settle_done_v5')}($1::text::bigint[], $2, $3::int)"

    @property
    def settle_failed(self) -> str:
        # $1 ids, $2 delays (s), $3 errors, $4 outcomes (see 0005), $5 worker id,
        # $6 attempts; returns (settled, promoted, skipped keys)
        return (
            f"SELECT * FROM {self._function('settle_failed_v5')}($1::bigint[], $2::float8[],"
            " $3::text[], $4::text[], $5, $6::int)"
        )

    @property
    def promote(self) -> str:
        # $1 keys whose next waiting event may be due; returns (promoted, skipped keys)
        return f"SELECT * FROM {self._function('promote')}($1::text[])"

    @property
    def promote_orphans(self) -> str:
        return f"SELECT * FROM {self._function('promote_orphans')}()"

    @property
    def orphan_sweep(self) -> str:
        # `promote_orphans`, and the seconds the server spent on it (the sweep spaces
        # itself out by what it costs the database, not by a connection's set-up)
        return (
            "SELECT p.promoted, p.skipped,"
            " extract(epoch FROM clock_timestamp() - statement_timestamp())::float8 AS seconds"
            f" FROM {self._function('promote_orphans')}() AS p"
        )

    @property
    def extend_leases(self) -> str:
        # $1 ids, $2 worker id, $3 lease seconds; rows (id, attempts) still held, so the
        # caller can tell its claim from a later claim of the same row. The rows are
        # locked in id order, as the settlements lock theirs: a plain UPDATE may take
        # them in heap order (a bitmap scan), and a heartbeat and a settlement of the
        # same rows then deadlocked, each holding a row the other wanted
        q = self.qualified
        return (
            f"UPDATE {q} AS e"
            " SET lease_expires_at = now() + make_interval(secs => $3::float8)"
            f" FROM (SELECT id FROM {q}"
            "  WHERE id = ANY ($1::bigint[]) AND status = 'processing' AND locked_by = $2"
            "  ORDER BY id FOR UPDATE) AS held"
            " WHERE e.id = held.id"
            " RETURNING e.id, e.attempts"
        )

    @property
    def recover_expired(self) -> str:
        # $1 batch limit; rows (id, topic, new status, worker that lost the lease)
        return (
            f"SELECT * FROM {self._function('requeue_v5')}(NULL, '{{}}', $1::int,"
            " 'lease expired: the worker stopped renewing it')"
        )

    @property
    def release_orphans(self) -> str:
        # $1 worker id, $2 ids this worker holds: rows claimed under our id whose claim
        # reply never reached us go back to retry at once (through the lease index,
        # which holds only rows being processed); a release never sends a row to dead
        return (
            f"SELECT * FROM {self._function('requeue_v5')}($1, $2::bigint[], 0,"
            " 'released: the claim reply never reached its worker')"
        )

    @property
    def next_available(self) -> str:
        # seconds until the earliest claimable row of these topics becomes due: one
        # probe of the topic-first index per topic, so a topic's backlog never slows
        # another's; rows a raw SQL producer scheduled at +-infinity neither break the
        # subtraction nor count as due
        return (
            "SELECT extract(epoch FROM (min(greatest(n.at, now())) - now()))::float8"
            " FROM unnest($1::text[]) AS t(topic) CROSS JOIN LATERAL ("
            f" {first_due(self.qualified)}) AS n"
        )

    @property
    def next_available_any(self) -> str:
        # the same over every topic (relays): the topics found by a skip scan
        return (
            "WITH RECURSIVE t(topic) AS ("
            f" (SELECT topic FROM {self.qualified} WHERE status IN ('pending', 'retry')"
            "  ORDER BY topic LIMIT 1)"
            " UNION ALL SELECT (SELECT c.topic FROM"
            f"  {self.qualified} AS c WHERE c.status IN ('pending', 'retry')"
            "  AND c.topic > t.topic ORDER BY c.topic LIMIT 1) FROM t WHERE t.topic IS NOT NULL)"
            " SELECT extract(epoch FROM (min(greatest(n.at, now())) - now()))::float8"
            " FROM t CROSS JOIN LATERAL ("
            f" {first_due(self.qualified)}) AS n"
            " WHERE t.topic IS NOT NULL"
        )

    @property
    def idle_probe(self) -> str:
        # before an idle wait, in one round trip: `next_available` ($1 topics) and
        # whether another session holds the table's write lock (`open_writers`)
        return f"SELECT ({self.next_available}) AS due, ({self.open_writers}) > 0 AS writers"

    @property
    def idle_probe_any(self) -> str:
        # the same for a consumer of every topic
        return f"SELECT ({self.next_available_any}) AS due, ({self.open_writers}) > 0 AS writers"

    @property
    def open_writers(self) -> str:
        # other sessions of this database (pg_locks is cluster-wide, readable by all) that
        # hold the table's write lock (RowExclusiveLock, kept to their transaction's end)
        return (
            "SELECT count(*) FROM pg_catalog.pg_locks"
            " WHERE locktype = 'relation' AND mode = 'RowExclusiveLock' AND granted AND database"
            " = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog"
            f".current_database()) AND relation = '{self.qualified}'::regclass"
            " AND pid <> pg_catalog.pg_backend_pid()"
        )

    @property
    def declare_idle(self) -> str:
        return (
            f"INSERT INTO {self.idle_table} (worker_id, topics, expires_at)"
            " VALUES ($1, $2::text[], now() + make_interval(secs => $3::float8))"
            " ON CONFLICT (worker_id) DO UPDATE"
            " SET topics = excluded.topics, expires_at = excluded.expires_at"
        )

    @property
    def declare_busy(self) -> str:
        return f"DELETE FROM {self.idle_table} WHERE worker_id = $1"

    @property
    def purge_expired_idle(self) -> str:
        return f"DELETE FROM {self.idle_table} WHERE expires_at < now() - interval '1 minute'"

    @property
    def retire_done(self) -> str:
        # $1 age seconds: empties the ring's slots whose every event is older (0022);
        # returns (truncated slots, whether the current slot moved on)
        return f"SELECT * FROM {self._function('retire_done')}($1::float8)"

    @property
    def purge_done(self) -> str:
        # $1 age seconds, $2 batch size
        return (
            f"DELETE FROM {self.qualified} WHERE id = ANY (ARRAY("
            f" SELECT id FROM {self.qualified}"
            "  WHERE status = 'done' AND finished_at < now() - make_interval(secs => $1::float8)"
            "  ORDER BY finished_at LIMIT $2))"
        )

    @property
    def notify(self) -> str:
        return "SELECT pg_notify($1, t) FROM unnest($2::text[]) AS t"
