"""Bind and execute the producer's statements on whatever connection the caller holds.

`aiooutbox.producer` validates and builds one statement and its parameters for every
driver; an executor here only renders the placeholders for the driver's paramstyle, runs
the statement in the caller's transaction and returns the rows. The connection's kind is
read from its class's module, so SQLAlchemy, psycopg and Django are imported only when
the caller passed one of theirs (the core depends on asyncpg alone).

Accepted, async: asyncpg ``Connection``/``Pool``, SQLAlchemy ``AsyncSession`` and
``AsyncConnection``, psycopg ``AsyncConnection``. Blocking (`aiooutbox.sync`): psycopg
``Connection``, psycopg2 connections, SQLAlchemy ``Session`` and ``Connection``, Django
database connections.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg

from ..errors import SchemaNotReady
from .statements import Queries, for_paramstyle

__all__ = [
    "ASYNC_ACCEPTED",
    "SYNC_ACCEPTED",
    "async_executor",
    "async_in_transaction",
    "sqlstate",
    "sync_executor",
    "sync_in_transaction",
]

Rows = Sequence[Sequence[Any]]
AsyncExecute = Callable[[Queries, str, Sequence[Any]], Awaitable[Rows]]
SyncExecute = Callable[[Queries, str, Sequence[Any]], Rows]

ASYNC_ACCEPTED = (
    "an asyncpg Connection or Pool, a SQLAlchemy AsyncSession or AsyncConnection, "
    "or a psycopg AsyncConnection"
)
SYNC_ACCEPTED = (
    "a psycopg Connection, a psycopg2 connection, a SQLAlchemy Session or Connection, "
    "or a Django database connection"
)
_LIBRARIES = ("sqlalchemy", "psycopg", "psycopg2", "django")
# undefined_table, invalid_schema_name: the outbox was never migrated into this database
# the table or schema is missing, or older than this library (a column it inserts)
_SCHEMA_MISSING = frozenset({"42P01", "3F000", "42703"})


def _library(conn: object) -> str | None:
    """The supported library ``conn``'s class (or a base class) comes from, if any."""
    for cls in type(conn).__mro__:
        root = cls.__module__.partition(".")[0]
        if root in _LIBRARIES:
            return root
    return None


def _unsupported(
    conn: object, accepted: str, hint: str = "", action: str = "enqueue on"
) -> TypeError:
    kind = f"{type(conn).__module__}.{type(conn).__qualname__}"
    return TypeError(f"cannot {action} a {kind}: pass {accepted}{hint}")


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver error, also when SQLAlchemy or Django wrapped it."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        for attribute in ("sqlstate", "pgcode"):
            code = getattr(error, attribute, None)
            if isinstance(code, str):
                return code
        orig = getattr(error, "orig", None)
        todo += [orig if isinstance(orig, BaseException) else None, error.__cause__]
    return None


def _translate(exc: Exception, q: Queries) -> None:
    """Raise `SchemaNotReady` (with the fix) if ``exc`` says the outbox table is missing
    or behind this library."""
    state = sqlstate(exc)
    if state in _SCHEMA_MISSING:
        from ..migrations import schema_behind_message, schema_missing_message

        message = schema_behind_message(q) if state == "42703" else schema_missing_message(q)
        raise SchemaNotReady(message) from exc


# -- async ---------------------------------------------------------------------------------


def async_executor(conn: object, action: str = "enqueue on") -> AsyncExecute:
    """The executor for an async connection, or `TypeError` listing what is accepted
    (``action`` names what the caller could not do: "cannot enqueue on a ...")."""
    if isinstance(conn, (asyncpg.Connection, asyncpg.Pool)):
        return _asyncpg(conn)
    library = _library(conn)
    sync_hint = "; for blocking code use aiooutbox.sync.enqueue/enqueue_many"
    if library == "sqlalchemy":
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session

        if isinstance(conn, (AsyncSession, async_scoped_session)):
            return _sqlalchemy_async_session(conn)
        if isinstance(conn, AsyncConnection):
            return _sqlalchemy_async_connection(conn)
        raise _unsupported(conn, ASYNC_ACCEPTED, sync_hint if _sync_kind(conn) else "", action)
    if library == "psycopg":
        import psycopg

        if isinstance(conn, psycopg.AsyncConnection):
            return _psycopg_async(conn)
    if library is not None and _sync_kind(conn):
        raise _unsupported(conn, ASYNC_ACCEPTED, sync_hint, action)
    raise _unsupported(conn, ASYNC_ACCEPTED, action=action)


def _asyncpg(conn: asyncpg.Connection | asyncpg.Pool) -> AsyncExecute:
    async def execute(q: Queries, sql: str, params: Sequence[Any]) -> Rows:
        try:
            rows: Rows = await conn.fetch(sql, *params)
        except asyncpg.PostgresError as exc:
            _translate(exc, q)
            raise
        return rows

    return execute


def _sqlalchemy_async_session(session: Any) -> AsyncExecute:
    _check_sqlalchemy_dialect(session.get_bind())

    async def execute(q: Queries, sql: str, params: Sequence[Any]) -> Rows:
        # like session.execute: joins the session's transaction, or autobegins one
        connection = await session.connection()
        return await _sqlalchemy_async_connection(connection)(q, sql, params)

    return execute


def _sqlalchemy_async_connection(connection: Any) -> AsyncExecute:
    _check_sqlalchemy_dialect(connection)

    async def execute(q: Queries, sql: str, params: Sequence[Any]) -> Rows:
        statement = for_paramstyle(sql, connection.dialect.paramstyle)
        try:
            result = await connection.exec_driver_sql(statement, tuple(params))
        except Exception as exc:
            _translate(exc, q)
            raise
        rows: Rows = result.fetchall() if result.returns_rows else []
        return rows

    return execute


def _psycopg_async(conn: Any) -> AsyncExecute:
    async def execute(q: Queries, sql: str, params: Sequence[Any]) -> Rows:
        try:
            async with conn.cursor() as cursor:
                await cursor.execute(for_paramstyle(sql, "format"), params)
                rows: Rows = [] if cursor.description is None else await cursor.fetchall()
        except Exception as exc:
            _translate(exc, q)
            raise
        return rows

    return execute


# -- blocking ------------------------------------------------------------------------------


def _sync_kind(conn: object) -> str | None:
    """Which blocking executor fits ``conn``: "sqlalchemy-session", "sqlalchemy", "dbapi"."""
    library = _library(conn)
    if library == "sqlalchemy":
        from sqlalchemy.engine import Connection
        from sqlalchemy.orm import Session, scoped_session

        if isinstance(conn, (Session, scoped_session)):
            return "sqlalchemy-session"
        if isinstance(conn, Connection):
            return "sqlalchemy"
    elif library == "psycopg":
        import psycopg

        if isinstance(conn, psycopg.Connection):
            return "dbapi"
    elif library == "psycopg2":
        import psycopg2.extensions

        if isinstance(conn, psycopg2.extensions.connection):
            return "dbapi"
    elif library == "django":
        from django.db.backends.base.base import BaseDatabaseWrapper
        from django.utils.connection import ConnectionProxy

        if isinstance(conn, (BaseDatabaseWrapper, ConnectionProxy)):
            return "django"
    return None


def sync_executor(conn: object, action: str = "enqueue on") -> SyncExecute:
    """The executor for a blocking connection, or `TypeError` listing what is accepted."""
    kind = _sync_kind(conn)
    if kind == "sqlalchemy-session":
        return _sqlalchemy_session(conn)
    if kind == "sqlalchemy":
        return _sqlalchemy_connection(conn)
    if kind == "dbapi":
        return _dbapi(conn)
    if kind == "django":
        vendor = getattr(conn, "vendor", None)
        if vendor != "postgresql":
            raise TypeError(f"cannot {action} a Django {vendor} connection: PostgreSQL only")
        return _dbapi(conn)
    async_hint = ""
    if isinstance(conn, (asyncpg.Connection, asyncpg.Pool)) or _library(conn):
        async_hint = "; for async connections use `await aiooutbox.enqueue(...)`"
    raise _unsupported(conn, SYNC_ACCEPTED, async_hint, action)


def _sqlalchemy_session(session: Any) -> SyncExecute:
    _check_sqlalchemy_dialect(session.get_bind())

    def execute(q: Queries, sql: str, params: Sequence[Any]) -> Rows:
        # like session.execute: joins the session's transaction, or autobegins one
        return _sqlalchemy_connection(session.connection())(q, sql, params)

    return execute


def _sqlalchemy_connection(connection: Any) -> SyncExecute:
    _check_sqlalchemy_dialect(connection)

    def execute(q: Queries, sql: str, params: Sequence[Any]) -> Rows:
        statement = for_paramstyle(sql, connection.dialect.paramstyle)
        try:
            result = connection.exec_driver_sql(statement, tuple(params))
            rows: Rows = result.fetchall() if result.returns_rows else []
        except Exception as exc:
            _translate(exc, q)
            raise
        return rows

    return execute


def _dbapi(conn: Any) -> SyncExecute:
    """psycopg, psycopg2 and Django connections: a DB-API cursor taking ``%s``."""

    def execute(q: Queries, sql: str, params: Sequence[Any]) -> Rows:
        try:
            with conn.cursor() as cursor:
                cursor.execute(for_paramstyle(sql, "format"), params)
                rows: Rows = [] if cursor.description is None else cursor.fetchall()
        except Exception as exc:
            _translate(exc, q)
            raise
        return rows

    return execute


def _check_sqlalchemy_dialect(bind: Any) -> None:
    """Refuse a non-PostgreSQL engine or a driver whose placeholders we do not render."""
    dialect = bind.dialect
    if dialect.name != "postgresql":
        raise TypeError(
            f"cannot enqueue on a SQLAlchemy {dialect.name} connection: PostgreSQL only"
        )
    if dialect.paramstyle not in ("numeric_dollar", "format", "pyformat"):
        raise TypeError(
            f"cannot enqueue through SQLAlchemy's {dialect.driver} driver "
            f"(paramstyle {dialect.paramstyle}): use asyncpg, psycopg or psycopg2"
        )


# -- inside the caller's transaction? ------------------------------------------------------
# libpq's PQtransactionStatus, as psycopg and psycopg2 report it: in a transaction block,
# or in one that failed (its statements fail until the caller rolls back)
_IN_BLOCK = frozenset({2, 3})


async def async_in_transaction(conn: object) -> bool:
    """Whether a statement on ``conn`` (an async connection `async_executor` took) joins a
    transaction that commits or rolls back as a whole, rather than committing on its own."""
    if isinstance(conn, asyncpg.Pool):
        return False
    if isinstance(conn, asyncpg.Connection):
        return bool(conn.is_in_transaction())
    if _library(conn) == "sqlalchemy":
        from sqlalchemy.ext.asyncio import AsyncConnection

        connection: Any = conn
        if not isinstance(conn, AsyncConnection):  # a session: its connection, autobegun
            connection = await conn.connection()  # type: ignore[attr-defined]
        sync = connection.sync_connection
        return sync is not None and _sqlalchemy_in_transaction(sync)
    return _driver_in_transaction(conn)


def sync_in_transaction(conn: object) -> bool:
    """`async_in_transaction` for a blocking connection `sync_executor` took."""
    kind = _sync_kind(conn)
    if kind == "sqlalchemy-session":
        return _sqlalchemy_in_transaction(conn.connection())  # type: ignore[attr-defined]
    if kind == "sqlalchemy":
        return _sqlalchemy_in_transaction(conn)
    if kind == "django":
        conn.ensure_connection()  # type: ignore[attr-defined]
        return _driver_in_transaction(conn.connection)  # type: ignore[attr-defined]
    return _driver_in_transaction(conn)


def _sqlalchemy_in_transaction(connection: Any) -> bool:
    """A SQLAlchemy ``Connection`` always has a transaction of its own (it begins one on
    its first statement), but under ``isolation_level="AUTOCOMMIT"`` that one is never
    sent to the server: ask the driver connection underneath."""
    proxied = connection.connection  # the pooled DB-API connection (checked out if need be)
    return _driver_in_transaction(proxied.driver_connection, proxied.dbapi_connection)


def _driver_in_transaction(driver: Any, adapter: Any = None) -> bool:
    """A driver connection: in a transaction block, or not in autocommit mode (the next
    statement begins one that only the caller's commit ends). ``adapter``: SQLAlchemy's
    DB-API adapter around an asyncpg connection, which begins that transaction itself."""
    if isinstance(driver, asyncpg.Connection):
        if driver.is_in_transaction():
            return True
        return adapter is not None and adapter.autocommit is False
    autocommit = getattr(driver, "autocommit", None)  # psycopg, psycopg2
    if autocommit is False:
        return True
    info = getattr(driver, "info", None)
    return autocommit is True and int(getattr(info, "transaction_status", 0)) in _IN_BLOCK
