"""Shared fixtures: one server per session, one fresh migrated database per test."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

import aiooutbox
from tests.pgserver import postgres_server

TEMPLATE = f"aiooutbox_tpl_{os.getpid()}"
# A DROP DATABASE waits 0.3-1.6 s on PostgreSQL 15 (most of it for other backends to
# let go of the database's files), but drops running together wait together: 8 took
# 13 s one after another and 0.6 s at once. So the per-test databases are dropped by
# these threads while the next tests run; the session waits for every drop (`pg_server`).
_DROPPER = ThreadPoolExecutor(max_workers=8, thread_name_prefix="aiooutbox-test-dropper")
_DROPS: list[Future[None]] = []


def with_database(dsn: str, database: str) -> str:
    """The same DSN pointed at another database."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


async def _create_template(admin_dsn: str) -> None:
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE}"')
        await conn.execute(f'CREATE DATABASE "{TEMPLATE}"')
    finally:
        await conn.close()
    tpl = await asyncpg.connect(with_database(admin_dsn, TEMPLATE))
    try:
        await aiooutbox.migrate(tpl)
    finally:
        await tpl.close()


async def _drop(admin_dsn: str, database: str) -> None:
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """Admin DSN of the session's server."""
    with postgres_server() as (dsn, _kind):
        admin = dsn if urlsplit(dsn).path not in ("", "/") else with_database(dsn, "postgres")
        asyncio.run(_create_template(admin))
        try:
            yield admin
        finally:
            _DROPPER.shutdown(wait=True)
            asyncio.run(_drop(admin, TEMPLATE))
            failed = [f.exception() for f in _DROPS if f.exception() is not None]
            assert not failed, f"{len(failed)} test database(s) not dropped: {failed[:3]}"


def _drop_later(admin_dsn: str, database: str) -> None:
    _DROPS.append(_DROPPER.submit(asyncio.run, _drop(admin_dsn, database)))


async def _new_database(admin_dsn: str, template: str) -> str:
    name = f"aiooutbox_t_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    finally:
        await conn.close()
    return name


@pytest.fixture
async def dsn(pg_server: str) -> AsyncIterator[str]:
    """DSN of a fresh database with the outbox schema migrated (a template copy)."""
    name = await _new_database(pg_server, TEMPLATE)
    try:
        yield with_database(pg_server, name)
    finally:
        _drop_later(pg_server, name)


@pytest.fixture(scope="module")
def shared_dsn(pg_server: str) -> Iterator[str]:
    """One migrated database for a whole module, for many small cases that each leave it
    as they found it (a fresh database per case would cost more than the cases)."""
    name = asyncio.run(_new_database(pg_server, TEMPLATE))
    try:
        yield with_database(pg_server, name)
    finally:
        asyncio.run(_drop(pg_server, name))


@pytest.fixture
async def empty_dsn(pg_server: str) -> AsyncIterator[str]:
    """DSN of a fresh database without the outbox schema."""
    name = await _new_database(pg_server, "template0")
    try:
        yield with_database(pg_server, name)
    finally:
        _drop_later(pg_server, name)


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    async with asyncpg.create_pool(dsn, min_size=1, max_size=10) as p:
        yield p


@pytest.fixture
async def conn(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(dsn)
    try:
        yield c
    finally:
        await c.close()
