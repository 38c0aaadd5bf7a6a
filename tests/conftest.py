"""Shared fixtures: one server per session, one fresh migrated database per test."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import threading
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

import aiooutbox
from tests.pgserver import postgres_server, prepare_embedded_user
from tests.programs import require

_T = TypeVar("_T")

TEMPLATE = f"aiooutbox_tpl_{os.getpid()}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "needs(*programs): starts these system programs (tests/programs.py); skipped with"
        " one line naming what to install when one is missing, failed under CI=true",
    )
    if not hasattr(config, "workerinput"):  # the controller, before any worker starts
        prepare_embedded_user()


# The files that take longest, longest first (seconds summed per file, `pytest
# --durations=0` at `-n 3` on the shared server, 2026-12-07). `--dist loadfile` hands
# files to workers in the order collected (`--no-loadscope-reorder` in pyproject.toml):
# started first, no long file is left to run alone at the end while the other workers
# idle. Order only: a stale entry costs time, never a test (test_layout checks each
# still names a file).
LONGEST_FIRST = (
    "tests/test_benchmarks_smoke.py",  # 351 s
    "tests/test_faults.py",  # 163
    "tests/test_relay_faults.py",  # 128
    "tests/test_state_machine.py",  # 113
    "tests/test_ordering.py",  # 91
    "tests/test_flow_processes.py",  # 80
    "tests/test_first_hour.py",  # 79
    "tests/test_relay_many.py",  # 77
    "tests/test_production.py",  # 75
    "tests/test_relay_outages.py",  # 73
    "tests/dashboard/test_browser.py",  # 65
    "tests/test_consumer.py",  # 63
    "tests/test_live_upgrade.py",  # 52
    "tests/test_relay_refusals.py",  # 52
    "tests/dashboard/test_hostile.py",  # 49
    "tests/test_group_limits.py",  # 47
    "tests/test_cli.py",  # 46
    "tests/test_benchmarks_peers_smoke.py",  # 46
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`LONGEST_FIRST`'s files first, in its order; the rest as collected (a stable sort)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked ``needs(...)`` skips (fails under ``CI=true``) before its fixtures
    start anything when the machine lacks one of the programs."""
    for mark in item.iter_markers("needs"):
        for name in mark.args:
            require(name)


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


async def _new_database(admin_dsn: str, template: str) -> str:
    name = f"aiooutbox_t_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    finally:
        await conn.close()
    return name


class Databases:
    """Copies of a template made a few tests ahead and dropped behind, off the tests' path.

    Each test still gets a database nobody has touched (a ``CREATE DATABASE ... TEMPLATE``
    copy, never a recycled one): the copies are only made earlier. Creating one takes
    20-300 ms and a ``DROP DATABASE`` 0.02-1.6 s on PostgreSQL 15 (most of it waiting for
    other backends to let go of the files), so both run in a thread of their own while
    the tests run; drops run together, which costs about what one costs. The session
    waits for every drop at its end (`pg_server`).
    """

    AHEAD = 3  # copies ready (or being made) per template

    def __init__(self, admin_dsn: str) -> None:
        self.admin_dsn = admin_dsn
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="aiooutbox-test-databases", daemon=True
        )
        self._thread.start()
        self._ready: dict[str, collections.deque[Future[str]]] = {}
        self._drops: list[Future[None]] = []
        # made and used in the thread's loop only; made here, once: made on first use, the
        # first few statements each made a pool (they ran concurrently) and leaked all
        # but one, which `-n 0` runs reported as unclosed sockets at the session's end
        self._admin: asyncpg.Pool = self._submit(self._make_pool()).result()

    async def _make_pool(self) -> asyncpg.Pool:
        # idle connections close after a few seconds: three workers' pools held 24 of the
        # shared server's 100 connections for the whole session, and a benchmark smoke
        # test beside the ordered SIGKILL test then met "too many clients" (90 measured)
        return await asyncpg.create_pool(
            self.admin_dsn, min_size=0, max_size=4, max_inactive_connection_lifetime=3.0
        )

    def _submit(self, coro: Coroutine[Any, Any, _T]) -> Future[_T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _execute(self, sql: str) -> None:
        await self._admin.execute(sql)  # a connection each would cost more than the statement

    async def _create(self, template: str) -> str:
        name = f"aiooutbox_t_{uuid.uuid4().hex[:12]}"
        await self._execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        return name

    def take(self, template: str = TEMPLATE) -> Future[str]:
        """A new database copied from ``template``; another copy is started in its place."""
        ready = self._ready.setdefault(template, collections.deque())
        while len(ready) <= self.AHEAD:
            ready.append(self._submit(self._create(template)))
        return ready.popleft()

    def drop_later(self, database: str) -> None:
        sql = f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'
        self._drops.append(self._submit(self._execute(sql)))

    def close(self) -> None:
        """Drop the unused copies, wait for every drop, stop the thread; raise if one failed."""
        for ready in self._ready.values():
            for made in ready:
                with contextlib.suppress(Exception):
                    self.drop_later(made.result())
        failed = [e for f in self._drops if (e := f.exception()) is not None]
        self._submit(self._admin.close()).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        assert not failed, f"{len(failed)} test database(s) not dropped: {failed[:3]}"


_databases: Databases | None = None


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """Admin DSN of the session's server."""
    global _databases
    with postgres_server() as (dsn, _kind):
        admin = dsn if urlsplit(dsn).path not in ("", "/") else with_database(dsn, "postgres")
        asyncio.run(_create_template(admin))
        _databases = Databases(admin)
        try:
            yield admin
        finally:
            databases, _databases = _databases, None
            try:
                databases.close()
            finally:
                asyncio.run(_drop(admin, TEMPLATE))


@pytest.fixture(scope="session")
def databases(pg_server: str) -> Databases:
    assert _databases is not None
    return _databases


@pytest.fixture
async def dsn(databases: Databases) -> AsyncIterator[str]:
    """DSN of a fresh database with the outbox schema migrated (a template copy)."""
    name = await asyncio.wrap_future(databases.take())
    try:
        yield with_database(databases.admin_dsn, name)
    finally:
        databases.drop_later(name)


@pytest.fixture(scope="module")
def shared_dsn(databases: Databases) -> Iterator[str]:
    """One migrated database for a whole module, for many small cases that each leave it
    as they found it (a fresh database per case would cost more than the cases)."""
    name = databases.take().result()
    try:
        yield with_database(databases.admin_dsn, name)
    finally:
        databases.drop_later(name)


@pytest.fixture
async def empty_dsn(databases: Databases) -> AsyncIterator[str]:
    """DSN of a fresh database without the outbox schema."""
    name = await asyncio.wrap_future(databases.take("template0"))
    try:
        yield with_database(databases.admin_dsn, name)
    finally:
        databases.drop_later(name)


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
