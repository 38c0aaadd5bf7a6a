"""The inbox records a message id only inside the caller's transaction, on every driver:
a connection whose statements commit on their own is refused before anything is
written (the id would commit alone, the work could fail, and the copy redelivered
after it would be skipped: a lost message), and a snapshot transaction (REPEATABLE
READ) skips a copy committed after its snapshot instead of failing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import psycopg
import psycopg2
import pytest
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import aiooutbox
from aiooutbox import inbox
from tests.producer_kinds import KINDS, Kind, configure_django, sqlalchemy_url

OUTSIDE = "inside the transaction"


async def count(pool: asyncpg.Pool) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM outbox_events_inbox"))


# -- refused: statements that commit on their own -------------------------------------------
@asynccontextmanager
async def sqlalchemy_async(dsn: str, driver: str, session: bool) -> AsyncIterator[Any]:
    """An AsyncSession or AsyncConnection whose engine runs in AUTOCOMMIT isolation."""
    engine = create_async_engine(sqlalchemy_url(dsn, driver), isolation_level="AUTOCOMMIT")
    try:
        if session:
            async with AsyncSession(engine) as db:
                yield db
        else:
            async with engine.connect() as connection:
                yield connection
    finally:
        await engine.dispose()


@asynccontextmanager
async def sqlalchemy_async_option(dsn: str) -> AsyncIterator[Any]:
    """AUTOCOMMIT set on one connection, by execution option."""
    engine = create_async_engine(sqlalchemy_url(dsn, "asyncpg"))
    try:
        async with engine.connect() as connection:
            yield await connection.execution_options(isolation_level="AUTOCOMMIT")
    finally:
        await engine.dispose()


@asynccontextmanager
async def psycopg_async_autocommit(dsn: str) -> AsyncIterator[Any]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
        yield aconn


@asynccontextmanager
async def asyncpg_outside(dsn: str) -> AsyncIterator[Any]:
    connection = await asyncpg.connect(dsn)
    try:
        yield connection
    finally:
        await connection.close()


@asynccontextmanager
async def asyncpg_pool(dsn: str) -> AsyncIterator[Any]:
    async with asyncpg.create_pool(dsn, min_size=1, max_size=1) as pool:
        yield pool


ASYNC_AUTOCOMMIT: dict[str, Callable[[str], Any]] = {
    "asyncpg-connection": asyncpg_outside,
    "asyncpg-pool": asyncpg_pool,
    "psycopg-async-autocommit": psycopg_async_autocommit,
    "sqlalchemy-asyncpg-asyncsession": lambda dsn: sqlalchemy_async(dsn, "asyncpg", True),
    "sqlalchemy-asyncpg-asyncconnection": lambda dsn: sqlalchemy_async(dsn, "asyncpg", False),
    "sqlalchemy-psycopg-asyncsession": lambda dsn: sqlalchemy_async(dsn, "psycopg", True),
    "sqlalchemy-psycopg-asyncconnection": lambda dsn: sqlalchemy_async(dsn, "psycopg", False),
    "sqlalchemy-asyncconnection-execution-option": sqlalchemy_async_option,
}


@pytest.mark.parametrize("name", list(ASYNC_AUTOCOMMIT))
async def test_an_async_connection_outside_a_transaction_is_refused(
    name: str, dsn: str, pool: asyncpg.Pool
) -> None:
    async with ASYNC_AUTOCOMMIT[name](dsn) as conn:
        if name.startswith("sqlalchemy"):
            # begun the library's way: SQLAlchemy's begin() under AUTOCOMMIT sends nothing
            with pytest.raises(aiooutbox.InvalidArgument, match=OUTSIDE):
                async with conn.begin():
                    await inbox.record(conn, "m-auto")
        with pytest.raises(aiooutbox.InvalidArgument, match=OUTSIDE):
            await inbox.record(conn, "m-auto")
    assert await count(pool) == 0


def sqlalchemy_sync(dsn: str, driver: str, session: bool, by_option: bool = False) -> Any:
    engine: Any
    if by_option:
        engine = create_engine(sqlalchemy_url(dsn, driver)).execution_options(
            isolation_level="AUTOCOMMIT"
        )
    else:
        engine = create_engine(sqlalchemy_url(dsn, driver), isolation_level="AUTOCOMMIT")
    return engine, (Session(engine) if session else engine.connect())


def refuse_sync(name: str, dsn: str) -> None:
    """Open ``name``'s connection in autocommit, try to record; runs in a thread."""
    closers: list[Callable[[], Any]] = []
    try:
        if name == "psycopg-autocommit":
            conn: Any = psycopg.connect(dsn, autocommit=True)
            closers.append(conn.close)
        elif name == "psycopg2-autocommit":
            conn = psycopg2.connect(dsn)
            conn.autocommit = True
            closers.append(conn.close)
        elif name == "django-outside-atomic":
            conn = configure_django(dsn)
            closers.append(conn.close)
        else:
            _, driver, kind, *option = name.split("-")
            engine, conn = sqlalchemy_sync(dsn, driver, kind == "session", bool(option))
            closers += [engine.dispose, conn.close]
        if name.startswith("sqlalchemy"):
            with pytest.raises(aiooutbox.InvalidArgument, match=OUTSIDE), conn.begin():
                inbox.record_sync(conn, "m-auto")
        with pytest.raises(aiooutbox.InvalidArgument, match=OUTSIDE):
            inbox.record_sync(conn, "m-auto")
    finally:
        for close in reversed(closers):
            close()


SYNC_AUTOCOMMIT = [
    "psycopg-autocommit",
    "psycopg2-autocommit",
    "django-outside-atomic",
    "sqlalchemy-psycopg-session",
    "sqlalchemy-psycopg-connection",
    "sqlalchemy-psycopg2-session",
    "sqlalchemy-psycopg2-connection",
    "sqlalchemy-psycopg2-session-option",
]


@pytest.mark.parametrize("name", SYNC_AUTOCOMMIT)
async def test_a_blocking_connection_outside_a_transaction_is_refused(
    name: str, dsn: str, pool: asyncpg.Pool
) -> None:
    await asyncio.to_thread(refuse_sync, name, dsn)
    assert await count(pool) == 0


# -- accepted: autocommit connections inside a transaction they began -----------------------
async def test_psycopg_autocommit_inside_its_transaction_records_with_the_work(
    dsn: str, pool: asyncpg.Pool
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:

        async def work_that_fails() -> None:
            async with aconn.transaction():
                assert await inbox.record(aconn, "m-a") is True
                raise RuntimeError("the work failed")

        with pytest.raises(RuntimeError, match="the work failed"):
            await work_that_fails()
        async with aconn.transaction():
            assert await inbox.record(aconn, "m-a") is True  # redelivered: done now
        async with aconn.transaction():
            assert await inbox.record(aconn, "m-a") is False

    def blocking() -> None:
        with psycopg.connect(dsn, autocommit=True) as sconn:

            def work_that_fails() -> None:
                with sconn.transaction():
                    assert inbox.record_sync(sconn, "m-s") is True
                    raise RuntimeError("the work failed")

            with pytest.raises(RuntimeError, match="the work failed"):
                work_that_fails()
            with sconn.transaction():
                assert inbox.record_sync(sconn, "m-s") is True
            with sconn.transaction():
                assert inbox.record_sync(sconn, "m-s") is False
        legacy = psycopg2.connect(dsn)  # autocommit, its transaction begun by hand
        try:
            legacy.autocommit = True
            with legacy.cursor() as cursor:
                cursor.execute("BEGIN")
                assert inbox.record_sync(legacy, "m-2") is True
                cursor.execute("ROLLBACK")
                cursor.execute("BEGIN")
                assert inbox.record_sync(legacy, "m-2") is True
                cursor.execute("COMMIT")
        finally:
            legacy.close()

    await asyncio.to_thread(blocking)
    rows = await pool.fetch("SELECT message_id FROM outbox_events_inbox ORDER BY 1")
    assert [r[0] for r in rows] == ["m-2", "m-a", "m-s"]


@pytest.mark.parametrize("kind_type", KINDS, ids=[k.name for k in KINDS])
async def test_every_driver_in_a_transaction_records_with_the_work(
    kind_type: type[Kind], dsn: str, pool: asyncpg.Pool
) -> None:
    """The issue's lost invoice, on each driver inside its transaction: the work fails
    and rolls the id back with it, so the redelivered copy does the work."""
    kind = kind_type()
    await kind.open(dsn)
    try:
        await kind.begin()
        assert await record(kind, "m-1") is True
        await kind.rollback()  # the work failed
        await kind.begin()
        assert await record(kind, "m-1") is True
        await kind.commit()
        await kind.begin()
        assert await record(kind, "m-1") is False
        await kind.commit()
    finally:
        await kind.close()
    assert await count(pool) == 1


async def record(kind: Kind, message_id: str) -> bool:
    if kind.asynchronous:
        return await inbox.record(kind.target(), message_id)
    found: bool = await kind.call(inbox.record_sync, kind.target(), message_id)  # type: ignore[attr-defined]
    return found


# -- REPEATABLE READ: a copy committed after the snapshot is skipped -----------------------
@asynccontextmanager
async def isolation(pool: asyncpg.Pool, level: str) -> AsyncIterator[None]:
    """New connections to the test's database begin their transactions at ``level``."""
    database = await pool.fetchval("SELECT current_database()")
    await pool.execute(
        f"ALTER DATABASE \"{database}\" SET default_transaction_isolation = '{level}'"
    )
    try:
        yield
    finally:
        await pool.execute(f'ALTER DATABASE "{database}" RESET default_transaction_isolation')


async def blocked(pool: asyncpg.Pool) -> None:
    """Until a backend of this database waits on another's lock."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while not await pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND cardinality(pg_blocking_pids(pid)) > 0"
    ):
        assert loop.time() < deadline, "the second record never waited on the first"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("kind_type", KINDS, ids=[k.name for k in KINDS])
async def test_repeatable_read_skips_a_copy_committed_after_its_snapshot(
    kind_type: type[Kind], dsn: str, pool: asyncpg.Pool
) -> None:
    async with isolation(pool, "repeatable read"):
        kind = kind_type()
        await kind.open(dsn)
        try:
            # committed before the record, after the snapshot
            await kind.begin()
            level = "SELECT current_setting('transaction_isolation')"
            assert await kind.fetchval(level) == "repeatable read"  # the snapshot
            async with pool.acquire() as first, first.transaction():
                assert await inbox.record(first, "m-after") is True
            assert await record(kind, "m-after") is False
            # the transaction goes on: the caller's own statements and its commit
            assert await kind.fetchval("SELECT count(*) FROM outbox_events_inbox") == 0
            await kind.commit()

            # two copies at once: the second waits on the first, which commits
            async def race(message_id: str, first_commits: bool) -> bool:
                async with pool.acquire() as first:
                    tx = first.transaction()
                    await tx.start()
                    assert await inbox.record(first, message_id) is True
                    await kind.begin()
                    assert await kind.fetchval(level) == "repeatable read"
                    second = asyncio.ensure_future(record(kind, message_id))
                    await blocked(pool)
                    await (tx.commit() if first_commits else tx.rollback())
                    found = await asyncio.wait_for(second, 60)
                    await kind.commit()
                    return found

            assert await race("m-race", first_commits=True) is False
            assert await race("m-lost", first_commits=False) is True  # the work is its own
        finally:
            await kind.close()
    rows = await pool.fetch("SELECT message_id FROM outbox_events_inbox ORDER BY 1")
    assert [r[0] for r in rows] == ["m-after", "m-lost", "m-race"]


async def test_serializable_leaves_the_retry_to_the_caller(
    conn: asyncpg.Connection, pool: asyncpg.Pool
) -> None:
    """Under SERIALIZABLE the copy is PostgreSQL's serialization failure, which such a
    caller retries anyway; the retry's snapshot sees the first commit: False."""

    async def attempt(meanwhile: Callable[[], Awaitable[None]]) -> bool:
        async with conn.transaction(isolation="serializable"):
            await conn.fetchval("SELECT 1")  # the snapshot
            await meanwhile()
            return await inbox.record(conn, "m-ser")

    async def first_commits() -> None:
        async with pool.acquire() as first, first.transaction():
            assert await inbox.record(first, "m-ser") is True

    async def nothing() -> None:
        pass

    with pytest.raises(asyncpg.SerializationError):
        await attempt(first_commits)
    assert await attempt(nothing) is False
    assert await count(pool) == 1
