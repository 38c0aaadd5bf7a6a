"""Small test helpers: run a consumer in the background, wait on database conditions."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import asyncpg

import aiooutbox


@contextlib.asynccontextmanager
async def running(
    consumer: aiooutbox.OutboxConsumer, handlers: Mapping[str, Any]
) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``consumer`` in a task for the block; stop it and re-raise its errors after."""
    task = asyncio.ensure_future(consumer.run(handlers))
    try:
        yield task
    finally:
        consumer.stop()
        await asyncio.wait_for(task, timeout=60)


async def wait_until(
    condition: Callable[[], Awaitable[bool]], timeout: float = 30.0, interval: float = 0.02
) -> float:
    """Poll ``condition`` until true; return the seconds it took, fail after ``timeout``."""
    start = time.monotonic()
    while True:
        if await condition():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


def truthy(check: Callable[[], object]) -> Callable[[], Awaitable[bool]]:
    """A `wait_until` condition from a plain (synchronous) check."""

    async def condition() -> bool:
        return bool(check())

    return condition


async def status_counts(db: asyncpg.Pool | asyncpg.Connection) -> dict[str, int]:
    rows = await db.fetch("SELECT status::text, count(*) FROM outbox_events_all GROUP BY 1")
    return {r[0]: r[1] for r in rows}


def all_in(
    db: asyncpg.Pool | asyncpg.Connection, status: str, total: int
) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (await status_counts(db)).get(status, 0) == total

    return check


async def insert_unchecked(
    db: asyncpg.Pool | asyncpg.Connection, sql: str, *args: Any
) -> list[asyncpg.Record]:
    """Run ``sql``, an INSERT of rows in states no producer may write (done, dead,
    processing, waiting...: fixtures), as a restore would: with the table's insert check
    (migration 0013) disabled for that one transaction. Returns the rows it returned."""
    async with contextlib.AsyncExitStack() as stack:
        conn = (
            db
            if isinstance(db, asyncpg.Connection)
            else await stack.enter_async_context(db.acquire())
        )
        async with conn.transaction():
            check = "outbox_events_insert_check"
            await conn.execute(f"ALTER TABLE outbox_events DISABLE TRIGGER {check}")
            rows: list[asyncpg.Record] = await conn.fetch(sql, *args)
            await conn.execute(f"ALTER TABLE outbox_events ENABLE TRIGGER {check}")
        return rows


async def backdate(db: asyncpg.Pool | asyncpg.Connection, sql: str, *args: Any) -> str:
    """Run ``sql``, an UPDATE that moves claimable rows' ``available_at`` into the past
    (an event due for a while: fixtures). Such an UPDATE can hide rows behind a running
    consumer's low marks (migration 0019), so fixtures run it before any consumer."""
    status: str = await db.execute(sql, *args)
    return status


def extract_release(where: Path, commit: str, *paths: str) -> Path:
    """``paths`` of this repository as of ``commit``, extracted into ``where`` (an older
    release of the package for the upgrade tests; a clone has the history)."""
    root = Path(__file__).resolve().parent.parent
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", commit, *paths], check=True, capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    return where


@contextlib.contextmanager
def embedded_home() -> Iterator[Path]:
    """A temporary directory for embedded servers' data, outside pytest's own tree.

    Run as root, the embedded server runs as a system user, which must traverse the
    directories above its data; every pytest run that starts meanwhile (another suite, a
    developer's single test) makes the root of pytest's tree private again (0700), which
    would lock a running server's user out of its data and fail its `pg_ctl stop`."""
    with tempfile.TemporaryDirectory(prefix="aiooutbox-embedded-") as tmp:
        yield Path(tmp)


def table_scans(plan: str) -> list[str]:
    """The plan's sequential scans, but of ``pg_database``: the idle probe looks up the
    current database there, and a cluster of a few databases is read whole (one page)."""
    return [
        line.strip()
        for line in plan.splitlines()
        if "Seq Scan" in line and "Seq Scan on pg_database" not in line
    ]
