"""Versioned schema migrations: the numbered SQL files of the top-level ``schema/``.

`migrate` applies the missing files, each in its own transaction, under a transaction
advisory lock so that processes starting together don't race, and refuses to touch a
database migrated by a newer aiooutbox. `migration_sql` renders the same SQL for teams
that apply migrations with their own tool.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import asyncpg

from ._sql.db import PermanentDatabaseError, check_permanent
from ._sql.statements import DEFAULT_SCHEMA, DEFAULT_TABLE, Queries, queries
from ._values.text import exception_message
from .errors import SchemaNotReady, SchemaTooNew

__all__ = ["Migration", "check_schema", "migrate", "migration_sql", "migrations"]

logger = logging.getLogger("aiooutbox.migrations")

_FILE = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql\Z")


@dataclass(frozen=True)
class Migration:
    """One numbered SQL file.

    ``compatible_with`` (from a ``-- compatible-with: N`` header line) is the oldest
    schema version whose code keeps working once this migration is applied; None means
    only code that knows this migration may run on it.
    """

    version: int
    name: str
    template: str
    compatible_with: int | None = None


_COMPATIBLE = re.compile(r"^-- compatible-with: (\d+)\s*$", re.MULTILINE)
# Schema 2 releases read only the versions table and refuse any version they don't
# know. A migration compatible with them is therefore recorded apart, in the
# compat-versions table, which newer releases read as well.
_PRE_FLOOR = 2


def _schema_dir() -> Traversable:
    """Where the numbered SQL files are: ``aiooutbox/schema`` inside an installed wheel
    (hatch's ``force-include`` puts them there), else the top-level ``schema/`` of the
    source checkout this package is imported from (``pip install -e``, or a test run)."""
    installed = resources.files("aiooutbox").joinpath("schema")
    if installed.is_dir():
        return installed
    checkout = Path(__file__).resolve().parent.parent / "schema"
    if (checkout / "0001_outbox.sql").is_file():
        return checkout
    raise RuntimeError(
        f"aiooutbox's SQL migrations are missing: neither {installed} nor {checkout} "
        "exists; reinstall aiooutbox"
    )


@lru_cache(maxsize=1)
def migrations() -> tuple[Migration, ...]:
    """The migrations shipped with this version of the library, in order."""
    found = []
    for entry in _schema_dir().iterdir():
        match = _FILE.match(entry.name)
        if match:
            text = entry.read_text(encoding="utf-8")
            floor = _COMPATIBLE.search(text)
            found.append(Migration(int(match[1]), match[2], text, int(floor[1]) if floor else None))
    found.sort(key=lambda m: m.version)
    return tuple(found)


def latest_version() -> int:
    return migrations()[-1].version


def migration_sql(
    *, schema: str = DEFAULT_SCHEMA, table: str = DEFAULT_TABLE, since: int = 0
) -> str:
    """The SQL of every migration after ``since``, ready for psql or a migration tool.

    It also creates the version table and records each version, so a later `migrate`
    (or a consumer's startup check) sees the schema as current.
    """
    q = queries(schema, table)
    parts = [
        f"{q.create_schema};",
        f"{q.create_versions_table};",
        f"{q.create_compat_versions_table};",
    ]
    for m in migrations():
        if m.version <= since:
            continue
        parts += [f"-- migration {m.version:04d}_{m.name}", "BEGIN;", q.render(m.template).strip()]
        if _in_versions_table(m):
            parts.append(
                f"INSERT INTO {q.versions_table} (version, name) VALUES ({m.version}, '{m.name}');"
            )
        if m.compatible_with is not None:
            parts.append(
                f"INSERT INTO {q.compat_versions_table} (version, name, compatible_with)"
                f" VALUES ({m.version}, '{m.name}', {m.compatible_with});"
            )
        parts.append("COMMIT;")
    return "\n".join(parts) + "\n"


async def migrate(
    conn_or_pool: asyncpg.Connection | asyncpg.Pool,
    *,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> list[int]:
    """Bring the outbox schema up to date; return the versions applied (often none).

    Idempotent and safe to call from many processes at once.
    """
    q = queries(schema, table)
    if isinstance(conn_or_pool, asyncpg.Pool):
        async with conn_or_pool.acquire() as conn:
            return await _migrate(conn, q)
    return await _migrate(conn_or_pool, q)


async def _migrate(conn: asyncpg.Connection, q: Queries) -> list[int]:
    # One lock per schema, not per table: outboxes migrated together into a new schema
    # would otherwise race on CREATE SCHEMA IF NOT EXISTS (a unique violation). A
    # transaction-level lock, taken again by every step: it needs no unlock, and each
    # step stays on one server connection behind PgBouncer in transaction mode.
    key = f"aiooutbox:{q.schema}"
    async with conn.transaction():
        await conn.execute(q.advisory_xact_lock, key)
        # even with IF NOT EXISTS, CREATE SCHEMA needs CREATE on the database: a role
        # granted only rights on an existing schema must not need it
        if not await conn.fetchval(q.schema_exists, q.schema):
            await conn.execute(q.create_schema)
        await conn.execute(q.create_versions_table)
        _refuse_newer(await _applied(conn, q), q)
        await conn.execute(q.create_compat_versions_table)
    done: list[int] = []
    for m in migrations():
        # each migration in its own transaction: 0004 adds an enum value that 0005 uses
        async with conn.transaction():
            await conn.execute(q.advisory_xact_lock, key)
            if m.version in await _applied(conn, q):  # another process got here first
                continue
            await conn.execute(q.render(m.template))
            if _in_versions_table(m):
                await conn.execute(q.record_version, m.version, m.name)
            if m.compatible_with is not None:
                await conn.execute(q.record_compat_version, m.version, m.name, m.compatible_with)
        logger.info(
            "applied migration %04d_%s to %s",
            m.version,
            m.name,
            q.qualified,
            extra={"version": m.version, "outbox": q.qualified},
        )
        done.append(m.version)
    return done


def _in_versions_table(m: Migration) -> bool:
    # releases of schema 2 refuse every version they find there that they don't know:
    # a migration they can run beside is recorded only in the compat table
    return m.compatible_with is None or m.compatible_with > _PRE_FLOOR


async def _applied(conn: asyncpg.Connection | asyncpg.Pool, q: Queries) -> dict[int, int | None]:
    """Applied versions, each with the oldest version it stays compatible with (or None)."""
    applied: dict[int, int | None] = {r[0]: None for r in await conn.fetch(q.applied_versions)}
    if await conn.fetchval(q.versions_table_exists, q.compat_versions_table):
        for version, floor in await conn.fetch(q.compat_versions):
            applied[version] = floor
    return applied


def _refuse_newer(applied: dict[int, int | None], q: Queries) -> None:
    known = {m.version for m in migrations()}
    latest = latest_version()
    unknown = sorted(applied.keys() - known)
    incompatible = [v for v in unknown if (floor := applied[v]) is None or floor > latest]
    if incompatible:
        raise SchemaTooNew(
            f"{q.qualified} has migration {incompatible[-1]}, newer than this aiooutbox knows "
            f"(latest {latest}) and not compatible with it; upgrade aiooutbox"
        )
    if unknown:
        logger.info(
            "%s has newer migration(s) %s that declare themselves compatible with schema %d",
            q.qualified,
            unknown,
            latest,
            extra={"outbox": q.qualified, "versions": unknown},
        )


async def _missing_grant(
    db: asyncpg.Connection | asyncpg.Pool, q: Queries, exc: asyncpg.PostgresError
) -> PermanentDatabaseError:
    """The version check was refused: one line naming the GRANT that fixes it.

    The version tables are read by every consumer at start; a role granted what an
    older release documented may lack one added since (the compat-versions table).
    """
    refused = exception_message(exc)
    try:
        role, usage, tables = await db.fetchrow(
            q.unreadable_version_tables, q.schema, [q.versions_table, q.compat_versions_table]
        )
    except (asyncpg.PostgresError, asyncpg.InterfaceError):  # e.g. an aborted transaction
        role, usage, tables = "<the consumer's role>", True, []
    grants = [] if usage else [f'GRANT USAGE ON SCHEMA "{q.schema}" TO {role}']
    grants += [f"GRANT SELECT ON {t} TO {role}" for t in tables]
    if not grants:
        fix = "grant the consumer's role the privileges listed in docs/guarantees.md"
    else:
        fix = (
            f"as the schema's owner run: {'; '.join(grants)}; (aiooutbox reads the schema "
            "version there at start; docs/guarantees.md lists every grant)"
        )
    return PermanentDatabaseError(f"checking the outbox schema version: {refused}; {fix}")


def schema_missing_message(q: Queries) -> str:
    """What `SchemaNotReady` says when the outbox was never migrated (consumer and producer)."""
    return (
        f"no aiooutbox schema in {q.qualified}: run `python -m aiooutbox migrate` "
        "or `await aiooutbox.migrate(pool)` first"
    )


def schema_behind_message(q: Queries) -> str:
    """What to do when the outbox predates this library (a rolling upgrade: migrate first)."""
    return (
        f"{q.qualified} is older than this aiooutbox (a column it writes is missing): run "
        "`python -m aiooutbox migrate` before deploying this version"
    )


async def check_schema(
    conn_or_pool: asyncpg.Connection | asyncpg.Pool,
    *,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> None:
    """Raise `SchemaNotReady` or `SchemaTooNew` unless the outbox is at this library's version."""
    q = queries(schema, table)
    try:
        exists = await conn_or_pool.fetchval(q.versions_table_exists, q.versions_table)
        if not exists:
            raise SchemaNotReady(schema_missing_message(q))
        applied = await _applied(conn_or_pool, q)
    except asyncpg.InsufficientPrivilegeError as exc:
        raise await _missing_grant(conn_or_pool, q, exc) from None
    except asyncpg.PostgresError as exc:
        check_permanent(exc, "checking the outbox schema version")  # e.g. behind PgBouncer
        raise
    _refuse_newer(applied, q)
    missing = [m.version for m in migrations() if m.version not in applied]
    if missing:
        raise SchemaNotReady(
            f"{q.qualified} lacks migration(s) {missing}: run `python -m aiooutbox migrate`"
        )
