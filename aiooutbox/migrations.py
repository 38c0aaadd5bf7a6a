"""Versioned schema migrations: numbered SQL files shipped in the wheel.

`migrate` applies the missing files, each in its own transaction, under a session
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

import asyncpg

from ._sql import DEFAULT_SCHEMA, DEFAULT_TABLE, Queries, queries
from .errors import SchemaNotReady, SchemaTooNew

__all__ = ["Migration", "check_schema", "migrate", "migration_sql", "migrations"]

logger = logging.getLogger("aiooutbox.migrations")

_FILE = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql\Z")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    template: str


@lru_cache(maxsize=1)
def migrations() -> tuple[Migration, ...]:
    """The migrations shipped with this version of the library, in order."""
    found = []
    for entry in resources.files("aiooutbox").joinpath("schema").iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
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
    parts = [f"{q.create_schema};", f"{q.create_versions_table};"]
    for m in migrations():
        if m.version <= since:
            continue
        parts += [
            f"-- migration {m.version:04d}_{m.name}",
            "BEGIN;",
            q.render(m.template).strip(),
            f"INSERT INTO {q.versions_table} (version, name) VALUES ({m.version}, '{m.name}');",
            "COMMIT;",
        ]
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
    # one lock per schema, not per table: outboxes migrated together into a new schema
    # would otherwise race on CREATE SCHEMA IF NOT EXISTS (a unique violation)
    lock_key = f"aiooutbox:{q.schema}"
    await conn.execute(q.advisory_lock, lock_key)
    try:
        # even with IF NOT EXISTS, CREATE SCHEMA needs CREATE on the database: a role
        # granted only rights on an existing schema must not need it
        if not await conn.fetchval(q.schema_exists, q.schema):
            await conn.execute(q.create_schema)
        await conn.execute(q.create_versions_table)
        applied = {r[0] for r in await conn.fetch(q.applied_versions)}
        _refuse_newer(applied, q)
        done: list[int] = []
        for m in migrations():
            if m.version in applied:
                continue
            async with conn.transaction():
                await conn.execute(q.render(m.template))
                await conn.execute(q.record_version, m.version, m.name)
            logger.info(
                "applied migration %04d_%s to %s",
                m.version,
                m.name,
                q.qualified,
                extra={"version": m.version, "outbox": q.qualified},
            )
            done.append(m.version)
        return done
    finally:
        if not conn.is_closed():
            await conn.execute(q.advisory_unlock, lock_key)


def _refuse_newer(applied: set[int], q: Queries) -> None:
    known = {m.version for m in migrations()}
    unknown = sorted(applied - known)
    if unknown:
        raise SchemaTooNew(
            f"{q.qualified} has migration {unknown[-1]}, newer than this aiooutbox knows "
            f"(latest {latest_version()}); upgrade aiooutbox"
        )


def schema_missing_message(q: Queries) -> str:
    """What `SchemaNotReady` says when the outbox was never migrated (consumer and producer)."""
    return (
        f"no aiooutbox schema in {q.qualified}: run `python -m aiooutbox migrate` "
        "or `await aiooutbox.migrate(pool)` first"
    )


async def check_schema(
    conn_or_pool: asyncpg.Connection | asyncpg.Pool,
    *,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
) -> None:
    """Raise `SchemaNotReady` or `SchemaTooNew` unless the outbox is at this library's version."""
    q = queries(schema, table)
    exists = await conn_or_pool.fetchval(q.versions_table_exists, q.versions_table)
    if not exists:
        raise SchemaNotReady(schema_missing_message(q))
    applied = {r[0] for r in await conn_or_pool.fetch(q.applied_versions)}
    _refuse_newer(applied, q)
    missing = [m.version for m in migrations() if m.version not in applied]
    if missing:
        raise SchemaNotReady(
            f"{q.qualified} lacks migration(s) {missing}: run `python -m aiooutbox migrate`"
        )
