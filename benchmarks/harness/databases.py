"""The benchmark's databases: each scenario's own, created and dropped on the server the
run was given (its DSN needs the right to CREATE DATABASE)."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit, urlunsplit

import asyncpg

#: the topic of the no-op events every system drains
TOPIC = "bench"


def with_database(dsn: str, database: str) -> str:
    """The same DSN pointed at another database."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


async def recreate_database(admin_dsn: str, name: str) -> str:
    """Drop and create ``name``; return its DSN."""
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return with_database(admin_dsn, name)


async def drop_database(admin_dsn: str, name: str) -> None:
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def free_connections(admin_dsn: str, want: int = 0, wait: float = 0.0) -> int:
    """How many more client connections the server accepts right now (approximately);
    with ``want``, waiting up to ``wait`` seconds for that many to be free (a server
    shared with other clients frees them as their work ends)."""
    deadline = time.monotonic() + wait
    while True:
        free = await _free_connections(admin_dsn)
        if free >= want or time.monotonic() >= deadline:
            return free
        await asyncio.sleep(0.5)


async def _free_connections(admin_dsn: str) -> int:
    conn = await asyncpg.connect(admin_dsn)
    try:
        limit = int(await conn.fetchval("SHOW max_connections"))
        reserved = int(await conn.fetchval("SHOW superuser_reserved_connections"))
        used = int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = $1", "client backend"
            )
        )
    finally:
        await conn.close()
    return limit - reserved - used
