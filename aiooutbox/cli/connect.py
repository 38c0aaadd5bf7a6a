"""Connecting from the command line: the DSN or the embedded server, one-line errors.

Every failure to connect is a `CommandError` naming the redacted DSN and the likely
cause, within `CONNECT_TIMEOUT` seconds; ``--pgbouncer`` turns off asyncpg's
prepared-statement cache.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from .. import embedded
from .._values.text import exception_message
from ..migrations import check_schema, migrate
from .args import env_value, redact
from .errors import CommandError, UsageError

logger = logging.getLogger("aiooutbox.cli")

CONNECT_TIMEOUT = 5.0


def _reason(exc: BaseException) -> str:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return f"no answer within {CONNECT_TIMEOUT:g}s"
    if isinstance(exc, ConnectionRefusedError):
        return f"{exception_message(exc)} (is PostgreSQL running there?)"
    if isinstance(exc, socket.gaierror):
        return f"{exception_message(exc)} (is the host name spelled right?)"
    return exception_message(exc) or type(exc).__name__


def resolve_data_dir(args: argparse.Namespace) -> Path:
    """``--data-dir`` as given, else ``$AIOOUTBOX_DATA_DIR``, else the project's
    (`embedded.default_data_dir`). The variable gets the option's checks here, when the
    server is first needed (a command given --dsn never reads it): a `UsageError`."""
    if args.data_dir is None:
        from_env = env_value("AIOOUTBOX_DATA_DIR")
        if from_env is None:
            args.data_dir = embedded.default_data_dir()
        else:
            refused = embedded.refusal(from_env)
            if refused is not None:
                raise UsageError(f"$AIOOUTBOX_DATA_DIR: {refused}")
            args.data_dir = Path(from_env)
    path: Path = args.data_dir
    return path


async def ensure_embedded(args: argparse.Namespace) -> str:
    """Start or reuse the embedded server; say loudly when this creates a new one.

    A server this command started is recorded in ``args.started_embedded``, so that
    `main` stops it again when the command fails.
    """
    data_dir = resolve_data_dir(args)
    fresh = not embedded.initialised(data_dir)
    running = embedded.status(data_dir) is not None if not fresh else False
    dsn = await embedded.ensure(data_dir)
    if not running:
        args.started_embedded = data_dir
    if fresh:
        print(
            f"{args.prog}: created a new embedded PostgreSQL in {data_dir.resolve()} "
            "(none there yet; commands run anywhere in this project share it, "
            "--data-dir or $AIOOUTBOX_DATA_DIR picks another)",
            file=sys.stderr,
        )
    return dsn


async def resolve_dsn(args: argparse.Namespace, *, log: bool = False) -> str:
    """``--dsn`` (or its environment variables), else the embedded server's DSN, announced."""
    if args.dsn:
        dsn: str = args.dsn
        return dsn
    dsn = await ensure_embedded(args)
    note = f"using the embedded PostgreSQL in {args.data_dir}: {dsn}"
    if log:  # a runner: say it once, with how to stop the server
        logger.info("%s (it keeps running; `%s embedded stop` stops it)", note, args.prog)
    else:
        print(f"{args.prog}: {note}", file=sys.stderr)
    return dsn


def _cache(pgbouncer: bool) -> dict[str, Any]:
    # asyncpg names and caches prepared statements per connection; behind PgBouncer in
    # transaction mode the next statement may run on another server connection, where
    # that name does not exist. Without the cache it uses unnamed statements.
    return {"statement_cache_size": 0} if pgbouncer else {}


async def connect(dsn: str, *, pgbouncer: bool = False) -> Any:
    """One connection, or a one-line `CommandError` within `CONNECT_TIMEOUT` seconds."""
    try:
        return await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT, **_cache(pgbouncer))
    except Exception as exc:
        raise CommandError(f"cannot connect to {redact(dsn)}: {_reason(exc)}") from None


@contextlib.asynccontextmanager
async def database(args: argparse.Namespace, *, check: bool = True) -> AsyncIterator[Any]:
    """A connection to the configured database, its outbox schema checked."""
    conn = await connect(await resolve_dsn(args), pgbouncer=args.pgbouncer)
    try:
        if check:
            await check_schema(conn, schema=args.schema, table=args.table)
        yield conn
    finally:
        with anyio.CancelScope(shield=True):
            await conn.close(timeout=5)


async def apply_migrations(
    db: asyncpg.Connection | asyncpg.Pool, args: argparse.Namespace
) -> list[int]:
    """`migrate`. Behind PgBouncer in transaction mode (``--pgbouncer``) every step is one
    transaction holding its own transaction-level advisory lock, and an index is built
    inside its migration's transaction: a concurrent build needs one server session."""
    pgbouncer = bool(getattr(args, "pgbouncer", False))
    return await migrate(db, schema=args.schema, table=args.table, concurrently=not pgbouncer)


@contextlib.asynccontextmanager
async def open_pool(dsn: str, *, pgbouncer: bool = False) -> AsyncIterator[asyncpg.Pool]:
    """A small pool (`make_pool`), closed on exit."""
    pool = await make_pool(dsn, pgbouncer=pgbouncer)
    try:
        yield pool
    finally:
        await close_pool(pool)


async def make_pool(dsn: str, *, pgbouncer: bool = False) -> asyncpg.Pool:
    """A small pool with one connection made, or a one-line `CommandError`.

    A consumer claims, settles and maintains on up to four connections at once; its
    LISTEN connection is its own.
    """
    try:
        return await asyncpg.create_pool(
            dsn, min_size=1, max_size=5, timeout=CONNECT_TIMEOUT, **_cache(pgbouncer)
        )
    except Exception as exc:
        raise CommandError(f"cannot connect to {redact(dsn)}: {_reason(exc)}") from None


async def close_pool(pool: asyncpg.Pool) -> None:
    """Close ``pool`` within 10 s, even when cancelled; terminate it past that."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(10) as scope:
        await pool.close()
    if scope.cancelled_caught:
        pool.terminate()
