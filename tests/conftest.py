"""Shared fixtures: one server per session, one fresh migrated database per test."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

import aiooutbox
from tests.pgserver import postgres_server

TEMPLATE = f"aiooutbox_tpl_{os.getpid()}"


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
            asyncio.run(_drop(admin, TEMPLATE))


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
        await _drop(pg_server, name)


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
        await _drop(pg_server, name)


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
