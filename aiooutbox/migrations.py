"""Versioned schema migrations: the numbered SQL files of the top-level ``schema/``.

`migrate` applies the missing files, each in its own transaction, under a transaction
advisory lock so that processes starting together don't race, and refuses to touch a
database migrated by a newer aiooutbox. `migration_sql` renders the same SQL for teams
that apply migrations with their own tool.

A file may split itself into steps with ``-- step: concurrent index`` and
``-- step: transaction`` lines. A concurrent-index step is one ``CREATE INDEX
CONCURRENTLY IF NOT EXISTS`` statement, run outside any transaction so that writers
keep writing while it reads the table; the transaction steps around it must be safe to
run again (an interrupted build leaves them committed), and the migration is recorded
with its last step. Such a file runs under a session-level advisory lock of its own
(the build lock), taken by polling so that no waiting `migrate` holds the snapshot a
concurrent build waits for; an index a cancelled build left invalid is dropped and built
again. ``concurrently=False`` builds it inside the migration's one transaction instead
(as PgBouncer in transaction mode requires; it blocks writes while it reads the rows).
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import asyncpg

from ._sql.db import PermanentDatabaseError, check_permanent
from ._sql.index_builds import (
    NOT_ONE_SESSION,
    POLL,
    TRY_XACT_LOCK,
    build_index,
    build_key,
    concurrent_index,
    in_transaction,
    release_build_lock,
    take_build_lock,
)
from ._sql.lock_waits import SET_LOCK_TIMEOUT, TRIED_AGAIN, wait_to_try_again
from ._sql.outbox_names import refuse_taken_names, suffixes
from ._sql.statements import DEFAULT_SCHEMA, DEFAULT_TABLE, Queries, queries
from ._values.text import exception_message
from .errors import SchemaNotReady, SchemaTooNew

__all__ = ["Migration", "check_schema", "migrate", "migration_sql", "migrations"]

logger = logging.getLogger("aiooutbox.migrations")

_FILE = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql\Z")


@dataclass(frozen=True)
class Step:
    """A part of a migration file: SQL run in a transaction, or one concurrent index build."""

    template: str
    concurrent_index: bool = False


_STEP = re.compile(r"^-- step: (concurrent index|transaction)[ \t]*$", re.MULTILINE)


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

    @property
    def steps(self) -> tuple[Step, ...]:
        """The file's steps, in order (one transaction step for most files)."""
        parts = _STEP.split(self.template)
        steps = [Step(parts[0])]
        for kind, text in zip(parts[1::2], parts[2::2], strict=True):
            steps.append(Step(text, concurrent_index=kind == "concurrent index"))
        return tuple(s for s in steps if s.concurrent_index or s.template.strip())

    @property
    def builds_concurrently(self) -> bool:
        return any(s.concurrent_index for s in self.steps)


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


@lru_cache(maxsize=1)
def _suffixes() -> frozenset[str]:
    return suffixes(m.template for m in migrations())


def migration_sql(
    *,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
    since: int = 0,
    concurrently: bool = False,
) -> str:
    """The SQL of every migration after ``since``, ready for psql or a migration tool.

    It also creates the version table and records each version, so a later `migrate`
    (or a consumer's startup check) sees the schema as current. Each migration is one
    transaction; with ``concurrently=True`` a migration that builds an index
    concurrently is rendered as its steps instead (its ``CREATE INDEX CONCURRENTLY``
    outside any transaction, as psql runs it; the version recorded with the last step).
    """
    q = queries(schema, table)
    parts = [
        f"{q.create_schema_if_missing};",
        f"{q.create_versions_table};",
        f"{q.create_compat_versions_table};",
    ]
    for m in migrations():
        if m.version <= since:
            continue
        parts.append(f"-- migration {m.version:04d}_{m.name}")
        if concurrently and m.builds_concurrently:
            for n, step in enumerate(m.steps, 1):
                last = n == len(m.steps)
                if step.concurrent_index:
                    index = concurrent_index(q, step.template)
                    parts += [
                        "-- outside a transaction; if it is interrupted, run "
                        f'DROP INDEX CONCURRENTLY IF EXISTS "{index.schema}"."{index.name}"; '
                        "and this statement again",
                        index.sql,
                    ] + ["BEGIN;"] * last
                else:
                    parts += ["BEGIN;", q.render(step.template).strip()] + ["COMMIT;"] * (not last)
        else:
            parts += ["BEGIN;", _in_one_transaction(q, m).strip()]
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


def _in_one_transaction(q: Queries, m: Migration) -> str:
    if not m.builds_concurrently:
        return q.render(m.template)
    return "".join(
        in_transaction(concurrent_index(q, s.template))
        if s.concurrent_index
        else q.render(s.template)
        for s in m.steps
    )


async def migrate(
    conn_or_pool: asyncpg.Connection | asyncpg.Pool,
    *,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
    concurrently: bool = True,
) -> list[int]:
    """Bring the outbox schema up to date; return the versions applied (often none).

    Idempotent and safe to call from many processes at once. An index that a migration
    builds on an existing outbox table is built with ``CREATE INDEX CONCURRENTLY``,
    outside a transaction, so producers and consumers keep writing meanwhile (an index
    on an outbox this call created is built in its transaction); that needs one
    server session for the whole call (a direct connection, or PgBouncer in session
    mode). ``concurrently=False`` builds it inside the migration's transaction instead,
    as behind PgBouncer in transaction mode: writes to the outbox then wait until the
    build has read the table's claimable rows.
    """
    q = queries(schema, table)
    if isinstance(conn_or_pool, asyncpg.Pool):
        async with conn_or_pool.acquire() as conn:
            return await _migrate(conn, q, concurrently)
    return await _migrate(conn_or_pool, q, concurrently)


async def _migrate(conn: asyncpg.Connection, q: Queries, concurrently: bool) -> list[int]:
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
        elif await conn.fetchval("SELECT to_regclass($1) IS NULL", q.versions_table):
            await refuse_taken_names(conn, q, _suffixes())  # a new outbox
        await conn.execute(q.create_versions_table)
        _refuse_newer(await _applied(conn, q), q)
        await conn.execute(q.create_compat_versions_table)
    done: list[int] = []
    for m in migrations():
        # an outbox this call created has no writers to keep going: its index is built in
        # the migration's transaction (a concurrent build would wait for every older
        # transaction in the database)
        if m.builds_concurrently and concurrently and 1 not in done:
            applied = await _apply_in_steps(conn, q, m, key)
        elif m.builds_concurrently:
            applied = await _apply(conn, q, m, key, build_key=build_key(q))
        else:
            applied = await _apply(conn, q, m, key)
        if not applied:
            continue
        logger.info(
            "applied migration %04d_%s to %s",
            m.version,
            m.name,
            q.qualified,
            extra={"version": m.version, "outbox": q.qualified},
        )
        done.append(m.version)
    return done


async def _record(conn: asyncpg.Connection, q: Queries, m: Migration) -> None:
    if _in_versions_table(m):
        await conn.execute(q.record_version, m.version, m.name)
    if m.compatible_with is not None:
        await conn.execute(q.record_compat_version, m.version, m.name, m.compatible_with)


async def _apply(
    conn: asyncpg.Connection, q: Queries, m: Migration, key: str, *, build_key: str | None = None
) -> bool:
    """The whole migration in one transaction; False if another process applied it.

    With ``build_key``, its transaction first takes that lock too, tried until no
    concurrent build holds it (a lock wait would hold the snapshot the build waits for).
    """
    nested = conn.is_in_transaction()  # the caller's: its lock_timeout is left alone
    while True:
        try:
            # each migration in its own transaction: 0004 adds an enum value that 0005 uses
            async with conn.transaction():
                if build_key is None or await conn.fetchval(TRY_XACT_LOCK, build_key):
                    await conn.execute(q.advisory_xact_lock, key)
                    if m.version in await _applied(conn, q):  # another process got here first
                        return False
                    if not nested:
                        await conn.execute(SET_LOCK_TIMEOUT)
                    await conn.execute(_in_one_transaction(q, m))
                    await _record(conn, q, m)
                    return True
        except TRIED_AGAIN as error:
            if nested:
                raise
            await wait_to_try_again(conn, m.version, m.name, q.qualified, error)
            continue
        await asyncio.sleep(POLL)  # a concurrent build runs: tried again, holding nothing


async def _step(
    conn: asyncpg.Connection, q: Queries, m: Migration, key: str, sql: str | None, last: bool
) -> bool:
    """One transaction step of `_apply_in_steps` (``sql`` None: only the record); False
    if the migration was applied meanwhile."""
    while True:
        try:
            async with conn.transaction():
                await conn.execute(q.advisory_xact_lock, key)
                if m.version in await _applied(conn, q):  # applied without the build lock
                    return False
                await conn.execute(SET_LOCK_TIMEOUT)
                if sql is not None:
                    await conn.execute(sql)
                if last:
                    await _record(conn, q, m)
                return True
        except TRIED_AGAIN as error:
            await wait_to_try_again(conn, m.version, m.name, q.qualified, error)


async def _apply_in_steps(conn: asyncpg.Connection, q: Queries, m: Migration, key: str) -> bool:
    """A migration with a concurrent index build, step by step under the build lock; the
    version is recorded with the last step. False if another process applied it.

    Every step but the last may run again (the migration is recorded only with the last),
    so its transaction steps are written to be run again, and a build finds its index."""
    if m.version in await _applied(conn, q):
        return False
    if conn.is_in_transaction():
        raise PermanentDatabaseError(NOT_ONE_SESSION.format(why="is inside a transaction"))
    await take_build_lock(conn, q)
    try:
        if m.version in await _applied(conn, q):  # by the migrate it waited for
            return False
        for n, step in enumerate(m.steps, 1):
            last = n == len(m.steps)
            if step.concurrent_index:
                await build_index(conn, q, concurrent_index(q, step.template))
                if not last:
                    continue
            sql = None if step.concurrent_index else q.render(step.template)
            if not await _step(conn, q, m, key, sql, last):
                return False
        return True
    finally:
        await release_build_lock(conn, q)


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
