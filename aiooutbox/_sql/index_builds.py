"""Concurrent index builds for migrations: a ``-- step: concurrent index`` of a schema
file parsed and rendered, the build lock that serialises `migrate` calls around it,
and the build itself (an index left invalid by an interrupted build dropped and built
again). `aiooutbox.migrations` runs the steps; docs/internals.md, "Migrations", says why
the locks are tried rather than waited for.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass

import asyncpg

from .._values.text import exception_message
from .db import PermanentDatabaseError
from .statements import Queries

__all__ = [
    "POLL",
    "TRY_XACT_LOCK",
    "ConcurrentIndex",
    "build_index",
    "build_key",
    "concurrent_index",
    "in_transaction",
    "NOT_ONE_SESSION",
    "release_build_lock",
    "take_build_lock",
]

logger = logging.getLogger("aiooutbox.migrations")

# a concurrent-index step, rendered: its index's name and table (identifiers validated
# by `queries`, so they hold no quote)
_CONCURRENT = re.compile(
    r'\A(?:\s*--[^\n]*\n)*\s*CREATE (UNIQUE )?INDEX CONCURRENTLY IF NOT EXISTS "([a-z0-9_]+)"\s+'
    r'ON "([a-z0-9_]+)"\."([a-z0-9_]+)"[^;]*;\s*\Z'
)


@dataclass(frozen=True)
class ConcurrentIndex:
    """A concurrent-index step, rendered for one outbox."""

    name: str
    schema: str
    table: str
    sql: str

    @property
    def catalog_name(self) -> str:
        return self.name[:63]  # as PostgreSQL stores it (the names are ASCII)


def concurrent_index(q: Queries, template: str) -> ConcurrentIndex:
    """A concurrent-index step's template, rendered for ``q``'s outbox and checked."""
    sql = q.render(template).strip()
    match = _CONCURRENT.match(sql)
    if match is None or match[3] != q.schema or match[4] != q.table:
        raise RuntimeError(
            "a concurrent-index step must be one CREATE INDEX CONCURRENTLY IF NOT EXISTS "
            f"statement on the outbox table, not: {sql[:200]}"
        )
    return ConcurrentIndex(match[2], match[3], match[4], sql)


def in_transaction(index: ConcurrentIndex) -> str:
    """A concurrent-index step as SQL for a transaction: a plain build, after dropping any
    index of that name (one an interrupted concurrent build left behind)."""
    plain = index.sql.replace("INDEX CONCURRENTLY IF NOT EXISTS", "INDEX", 1)
    return f'DROP INDEX IF EXISTS "{index.schema}"."{index.name}";\n{plain}\n'


_TRY_LOCK = "SELECT pg_try_advisory_lock(hashtextextended($1, 0))"
TRY_XACT_LOCK = "SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))"
_UNLOCK = "SELECT pg_advisory_unlock(hashtextextended($1, 0))"
# whether this server session holds the (session-level) build lock
_HOLDS_LOCK = """
SELECT EXISTS (
    SELECT 1 FROM pg_catalog.pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.pid = pg_catalog.pg_backend_pid() AND l.granted
      AND l.mode = 'ExclusiveLock' AND l.objsubid = 1
      AND l.classid = ((hashtextextended($1, 0) >> 32) & 4294967295)::oid
      AND l.objid = (hashtextextended($1, 0) & 4294967295)::oid)
"""
# who holds the build lock (to say whom a waiting migrate waits for)
_LOCK_HOLDER = """
SELECT l.pid, a.state, left(a.query, 120) FROM pg_catalog.pg_locks AS l
LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.classid = ((hashtextextended($1, 0) >> 32) & 4294967295)::oid
  AND l.objid = (hashtextextended($1, 0) & 4294967295)::oid
LIMIT 1
"""
# NULL: no such index; else whether it is usable (false: a build was interrupted)
_INDEX_STATE = """
SELECT i.indisvalid AND i.indisready AND i.indislive
FROM pg_catalog.pg_index AS i
JOIN pg_catalog.pg_class AS c ON c.oid = i.indexrelid
JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relname = $2
"""
POLL = 0.2  # seconds between tries of a lock another migrate holds
NOT_ONE_SESSION = (
    "a concurrent index build needs one server session for the whole migrate, and this "
    "connection {why}: run `python -m aiooutbox migrate` with a DSN straight to "
    "PostgreSQL (or through PgBouncer in session mode), or build the index inside the "
    "migration's transaction with `migrate --pgbouncer` / `migrate(..., "
    "concurrently=False)`, which blocks writes to the outbox while it reads the table"
)


def build_key(q: Queries) -> str:
    return f"aiooutbox-build:{q.schema}"


async def take_build_lock(conn: asyncpg.Connection, q: Queries) -> None:
    """The build lock, session-level, tried until it is free: a `migrate` blocked in a
    lock wait would hold a snapshot, which the running concurrent build waits for."""
    key = build_key(q)
    waited = 0.0
    while not await conn.fetchval(_TRY_LOCK, key):
        if waited % 30 == 0:
            holder = await conn.fetchrow(_LOCK_HOLDER, key)
            logger.info(
                "waiting for another migrate's index build on %s (backend %s: %s)",
                q.qualified,
                holder[0] if holder else "?",
                holder[2] if holder else "gone",
                extra={"outbox": q.qualified},
            )
        await asyncio.sleep(POLL)
        waited = round(waited + POLL, 1)
    if not await conn.fetchval(_HOLDS_LOCK, key):
        raise PermanentDatabaseError(
            NOT_ONE_SESSION.format(
                why="changed server sessions between two statements (PgBouncer in "
                "transaction mode?); its build lock is left on a pooled server session "
                "until that session ends"
            )
        )


async def release_build_lock(conn: asyncpg.Connection, q: Queries) -> None:
    if conn.is_closed():
        return  # the lock ended with the session
    try:
        released = await conn.fetchval(_UNLOCK, build_key(q))
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
        logger.warning("releasing the migration build lock: %s", exception_message(exc))
        return
    if not released:
        raise PermanentDatabaseError(
            NOT_ONE_SESSION.format(why="lost its build lock between two statements")
        )


async def build_index(conn: asyncpg.Connection, q: Queries, index: ConcurrentIndex) -> None:
    """``CREATE INDEX CONCURRENTLY``, unless the index is there and valid; an invalid one
    (its build was cancelled, or its session ended) is dropped and built again."""
    state = await conn.fetchval(_INDEX_STATE, index.schema, index.catalog_name)
    if state is True:
        return
    if state is False:
        logger.warning(
            "index %s on %s was left invalid by an interrupted build: building it again",
            index.name,
            q.qualified,
            extra={"outbox": q.qualified, "index": index.name},
        )
        await conn.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{index.schema}"."{index.name}"')
    logger.info(
        "building index %s on %s concurrently (writes go on meanwhile)",
        index.name,
        q.qualified,
        extra={"outbox": q.qualified, "index": index.name},
    )
    started = time.monotonic()
    await conn.execute(index.sql)
    if await conn.fetchval(_INDEX_STATE, index.schema, index.catalog_name) is not True:
        raise PermanentDatabaseError(
            f"index {index.name} on {q.qualified} is not valid after its concurrent build; "
            "run migrate again"
        )
    logger.info(
        "built index %s on %s in %.1f s",
        index.name,
        q.qualified,
        time.monotonic() - started,
        extra={"outbox": q.qualified, "index": index.name},
    )
