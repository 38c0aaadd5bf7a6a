"""Every kind of connection a producer can enqueue on, behind one async test interface.

Each `Kind` opens its library's connection (or session) on a DSN and exposes the same
steps: begin/commit/rollback the caller's transaction, enter and roll back a savepoint the
library's own way, enqueue, and read a value inside the transaction. Blocking kinds run
every step in one dedicated thread (Django's connections are per thread), so a consumer on
the test's event loop keeps running while they block.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

import aiooutbox
import aiooutbox.sync


class Kind:
    name: ClassVar[str]
    asynchronous: ClassVar[bool] = True

    async def open(self, dsn: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def begin(self) -> None:
        """Open the caller's transaction (a no-op where the library autobegins)."""

    async def commit(self) -> None:
        raise NotImplementedError

    async def rollback(self) -> None:
        raise NotImplementedError

    async def savepoint(self) -> None:
        raise NotImplementedError

    async def rollback_savepoint(self) -> None:
        raise NotImplementedError

    async def enqueue(self, *args: Any, **kwargs: Any) -> Any:
        return await aiooutbox.enqueue(self.target(), *args, **kwargs)

    async def enqueue_many(self, *args: Any, **kwargs: Any) -> Any:
        return await aiooutbox.enqueue_many(self.target(), *args, **kwargs)

    async def fetchval(self, sql: str) -> Any:
        raise NotImplementedError

    def target(self) -> Any:
        """What the caller hands to enqueue."""
        raise NotImplementedError


# -- async ---------------------------------------------------------------------------------


class Asyncpg(Kind):
    name = "asyncpg"

    async def open(self, dsn: str) -> None:
        import asyncpg

        self.conn = await asyncpg.connect(dsn)
        self.stack: list[Any] = []

    async def close(self) -> None:
        await self.conn.close()

    async def begin(self) -> None:
        self.stack.append(self.conn.transaction())
        await self.stack[-1].start()

    async def commit(self) -> None:
        await self.stack.pop().commit()

    async def rollback(self) -> None:
        await self.stack.pop().rollback()

    async def savepoint(self) -> None:
        await self.begin()

    async def rollback_savepoint(self) -> None:
        await self.rollback()

    async def fetchval(self, sql: str) -> Any:
        return await self.conn.fetchval(sql)

    def target(self) -> Any:
        return self.conn


class SQLAlchemyAsync(Kind):
    """AsyncSession (``session=True``) or AsyncConnection, on asyncpg or psycopg."""

    driver: ClassVar[str]
    session: ClassVar[bool]

    async def open(self, dsn: str) -> None:
        from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

        self.engine = create_async_engine(sqlalchemy_url(dsn, self.driver), pool_size=1)
        if self.session:
            self.db: Any = AsyncSession(self.engine)
        else:
            self.db = await self.engine.connect()
        self.nested: Any = None

    async def close(self) -> None:
        await self.db.close()
        await self.engine.dispose()

    async def commit(self) -> None:
        await self.db.commit()

    async def rollback(self) -> None:
        await self.db.rollback()

    async def savepoint(self) -> None:
        self.nested = await self.db.begin_nested()

    async def rollback_savepoint(self) -> None:
        await self.nested.rollback()

    async def fetchval(self, sql: str) -> Any:
        from sqlalchemy import text

        return (await self.db.execute(text(sql))).scalar()

    def target(self) -> Any:
        return self.db


class SAAsyncpgSession(SQLAlchemyAsync):
    name, driver, session = "sqlalchemy-asyncpg-asyncsession", "asyncpg", True


class SAAsyncpgConnection(SQLAlchemyAsync):
    name, driver, session = "sqlalchemy-asyncpg-asyncconnection", "asyncpg", False


class SAPsycopgAsyncSession(SQLAlchemyAsync):
    name, driver, session = "sqlalchemy-psycopg-asyncsession", "psycopg", True


class SAPsycopgAsyncConnection(SQLAlchemyAsync):
    name, driver, session = "sqlalchemy-psycopg-asyncconnection", "psycopg", False


class PsycopgAsync(Kind):
    name = "psycopg-async"

    async def open(self, dsn: str) -> None:
        import psycopg

        self.conn = await psycopg.AsyncConnection.connect(dsn)
        self.stack: list[Any] = []

    async def close(self) -> None:
        await self.conn.close()

    async def begin(self) -> None:
        self.stack.append(self.conn.transaction())
        await self.stack[-1].__aenter__()

    async def commit(self) -> None:
        await self.stack.pop().__aexit__(None, None, None)

    async def rollback(self) -> None:
        import psycopg

        await self.stack.pop().__aexit__(psycopg.Rollback, psycopg.Rollback(), None)

    async def savepoint(self) -> None:
        await self.begin()  # transaction() inside transaction() is a savepoint

    async def rollback_savepoint(self) -> None:
        await self.rollback()

    async def fetchval(self, sql: str) -> Any:
        cursor = await self.conn.execute(sql)
        row = await cursor.fetchone()
        return None if row is None else row[0]

    def target(self) -> Any:
        return self.conn


# -- blocking ------------------------------------------------------------------------------


class Blocking(Kind):
    """A blocking library: every step runs in this kind's own thread."""

    asynchronous = False

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=self.name)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, lambda: fn(*args, **kwargs)
        )

    async def open(self, dsn: str) -> None:
        await self.call(self.open_sync, dsn)

    async def close(self) -> None:
        try:
            await self.call(self.close_sync)
        finally:
            self.pool.shutdown()

    async def begin(self) -> None:
        await self.call(self.begin_sync)

    async def commit(self) -> None:
        await self.call(self.commit_sync)

    async def rollback(self) -> None:
        await self.call(self.rollback_sync)

    async def savepoint(self) -> None:
        await self.call(self.savepoint_sync)

    async def rollback_savepoint(self) -> None:
        await self.call(self.rollback_savepoint_sync)

    async def enqueue(self, *args: Any, **kwargs: Any) -> Any:
        return await self.call(lambda: aiooutbox.sync.enqueue(self.target(), *args, **kwargs))

    async def enqueue_many(self, *args: Any, **kwargs: Any) -> Any:
        return await self.call(lambda: aiooutbox.sync.enqueue_many(self.target(), *args, **kwargs))

    async def fetchval(self, sql: str) -> Any:
        return await self.call(self.fetchval_sync, sql)

    def open_sync(self, dsn: str) -> None:
        raise NotImplementedError

    def close_sync(self) -> None:
        raise NotImplementedError

    def begin_sync(self) -> None:
        pass

    def commit_sync(self) -> None:
        raise NotImplementedError

    def rollback_sync(self) -> None:
        raise NotImplementedError

    def savepoint_sync(self) -> None:
        raise NotImplementedError

    def rollback_savepoint_sync(self) -> None:
        raise NotImplementedError

    def fetchval_sync(self, sql: str) -> Any:
        raise NotImplementedError


class Psycopg(Blocking):
    name = "psycopg"

    def open_sync(self, dsn: str) -> None:
        import psycopg

        self.conn = psycopg.connect(dsn)
        self.stack: list[Any] = []

    def close_sync(self) -> None:
        self.conn.close()

    def begin_sync(self) -> None:
        self.stack.append(self.conn.transaction())
        self.stack[-1].__enter__()

    def commit_sync(self) -> None:
        self.stack.pop().__exit__(None, None, None)

    def rollback_sync(self) -> None:
        import psycopg

        self.stack.pop().__exit__(psycopg.Rollback, psycopg.Rollback(), None)

    def savepoint_sync(self) -> None:
        self.begin_sync()

    def rollback_savepoint_sync(self) -> None:
        self.rollback_sync()

    def fetchval_sync(self, sql: str) -> Any:
        row = self.conn.execute(sql).fetchone()
        return None if row is None else row[0]

    def target(self) -> Any:
        return self.conn


class SQLAlchemySync(Blocking):
    """Session (``session=True``) or Connection, on psycopg or psycopg2."""

    driver: ClassVar[str]
    session: ClassVar[bool]

    def open_sync(self, dsn: str) -> None:
        from sqlalchemy import create_engine
        from sqlalchemy.orm import Session

        self.engine = create_engine(sqlalchemy_url(dsn, self.driver), pool_size=1)
        self.db: Any = Session(self.engine) if self.session else self.engine.connect()
        self.nested: Any = None

    def close_sync(self) -> None:
        self.db.close()
        self.engine.dispose()

    def commit_sync(self) -> None:
        self.db.commit()

    def rollback_sync(self) -> None:
        self.db.rollback()

    def savepoint_sync(self) -> None:
        self.nested = self.db.begin_nested()

    def rollback_savepoint_sync(self) -> None:
        self.nested.rollback()

    def fetchval_sync(self, sql: str) -> Any:
        from sqlalchemy import text

        return self.db.execute(text(sql)).scalar()

    def target(self) -> Any:
        return self.db


class SAPsycopgSession(SQLAlchemySync):
    name, driver, session = "sqlalchemy-psycopg-session", "psycopg", True


class SAPsycopg2Session(SQLAlchemySync):
    name, driver, session = "sqlalchemy-psycopg2-session", "psycopg2", True


class SAPsycopg2Connection(SQLAlchemySync):
    name, driver, session = "sqlalchemy-psycopg2-connection", "psycopg2", False


_django_lock = threading.Lock()


def configure_django(dsn: str) -> Any:
    """Configure Django once per process, pointing the "default" alias at ``dsn``.

    Connections are per thread and read the alias's settings when a thread first uses
    it, so a new database per test only needs a new thread and the new NAME.
    """
    import django
    from django.conf import settings
    from django.db import connections

    parts = urlsplit(dsn)
    database = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/"),
        "USER": parts.username or "postgres",
        "PASSWORD": parts.password or "",
        # a Unix-socket DSN (the embedded server) names its directory in ?host=
        "HOST": parse_qs(parts.query).get("host", [parts.hostname or "127.0.0.1"])[0],
        "PORT": parse_qs(parts.query).get("port", [str(parts.port or 5432)])[0],
    }
    with _django_lock:
        if not settings.configured:
            settings.configure(DATABASES={"default": database}, USE_TZ=True)
            django.setup()
        connections.settings["default"].update(database)
    return connections["default"]


class Django(Blocking):
    name = "django"

    def open_sync(self, dsn: str) -> None:
        self.conn = configure_django(dsn)
        self.stack: list[Any] = []

    def close_sync(self) -> None:
        self.conn.close()

    def _enter(self) -> None:
        from django.db import transaction

        block = transaction.atomic()
        block.__enter__()
        self.stack.append(block)

    def _exit(self, commit: bool) -> None:
        block = self.stack.pop()
        if commit:
            block.__exit__(None, None, None)
        else:
            error = RuntimeError("roll back")
            block.__exit__(RuntimeError, error, None)

    def begin_sync(self) -> None:
        self._enter()

    def commit_sync(self) -> None:
        self._exit(True)

    def rollback_sync(self) -> None:
        self._exit(False)

    def savepoint_sync(self) -> None:
        self._enter()  # atomic() inside atomic() is a savepoint

    def rollback_savepoint_sync(self) -> None:
        self._exit(False)

    def fetchval_sync(self, sql: str) -> Any:
        with self.conn.cursor() as cursor:
            cursor.execute(sql)
            row = cursor.fetchone()
        return None if row is None else row[0]

    def target(self) -> Any:
        return self.conn


def sqlalchemy_url(dsn: str, driver: str) -> str:
    return "postgresql+" + driver + "://" + dsn.split("://", 1)[1]


KINDS: list[type[Kind]] = [
    Asyncpg,
    SAAsyncpgSession,
    SAAsyncpgConnection,
    SAPsycopgAsyncSession,
    SAPsycopgAsyncConnection,
    PsycopgAsync,
    Psycopg,
    SAPsycopgSession,
    SAPsycopg2Session,
    SAPsycopg2Connection,
    Django,
]
