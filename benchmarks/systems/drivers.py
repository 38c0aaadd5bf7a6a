"""Producer throughput per driver path, one child process per driver.

``python -m benchmarks.systems.drivers DSN DRIVER CONNECTIONS SECONDS`` opens ``CONNECTIONS``
connections (sessions, threads for the blocking drivers) and loops one-event transactions
through aiooutbox's public API for ``SECONDS`` after a short warm-up, then prints one JSON
line: ``{"driver": …, "commits": n, "seconds": s, "commits_per_s": r}``. A child of its own
keeps each library's imports, thread pools and Django's settings out of the others' way.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiooutbox
import aiooutbox.sync

TOPIC = "bench.drivers"
WARM_UP = 0.3
ASYNC_DRIVERS = (
    "asyncpg",
    "sqlalchemy+asyncpg",
    "psycopg-async",
    "sqlalchemy+psycopg-async",
)
SYNC_DRIVERS = ("psycopg", "sqlalchemy+psycopg", "sqlalchemy+psycopg2", "django")
DRIVERS = ASYNC_DRIVERS + SYNC_DRIVERS


def _url(dsn: str, driver: str) -> str:
    return f"postgresql+{driver}://" + dsn.split("://", 1)[1]


async def _async_producers(dsn: str, driver: str, n: int) -> tuple[list[Any], Any]:
    """``n`` one-event-transaction callables for an async driver, and a closer."""
    if driver == "asyncpg":
        import asyncpg

        conns = [await asyncpg.connect(dsn) for _ in range(n)]

        def make(conn: Any) -> Callable[[], Awaitable[None]]:
            async def one() -> None:
                async with conn.transaction():
                    await aiooutbox.enqueue(conn, TOPIC, {"t": time.time()})

            return one

        async def close() -> None:
            for conn in conns:
                await conn.close()

        return [make(c) for c in conns], close
    if driver == "psycopg-async":
        import psycopg

        conns = [await psycopg.AsyncConnection.connect(dsn) for _ in range(n)]

        def make_pg(conn: Any) -> Callable[[], Awaitable[None]]:
            async def one() -> None:
                await aiooutbox.enqueue(conn, TOPIC, {"t": time.time()})
                await conn.commit()

            return one

        async def close_pg() -> None:
            for conn in conns:
                await conn.close()

        return [make_pg(c) for c in conns], close_pg
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    engine = create_async_engine(
        _url(dsn, driver.split("+")[1].removesuffix("-async")), pool_size=n, max_overflow=0
    )
    sessions = async_sessionmaker(engine)

    async def one_session() -> None:  # a session per transaction, as per request in an app
        async with sessions() as session:
            await aiooutbox.enqueue(session, TOPIC, {"t": time.time()})
            await session.commit()

    return [one_session] * n, engine.dispose


async def run_async(dsn: str, driver: str, n: int, seconds: float) -> tuple[int, float]:
    producers, close = await _async_producers(dsn, driver, n)
    done = 0
    stop = asyncio.Event()

    async def loop(one: Callable[[], Awaitable[None]]) -> None:
        nonlocal done
        while not stop.is_set():
            await one()
            done += 1

    tasks = [asyncio.ensure_future(loop(p)) for p in producers]
    try:
        await asyncio.sleep(WARM_UP)
        start, t0 = done, time.perf_counter()
        await asyncio.sleep(seconds)
        counted, elapsed = done - start, time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await close()
    return counted, elapsed


def _sync_producer(dsn: str, driver: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """A one-event-transaction callable for a blocking driver (one per thread), and a closer."""
    if driver == "psycopg":
        import psycopg

        conn = psycopg.connect(dsn)

        def one() -> None:
            aiooutbox.sync.enqueue(conn, TOPIC, {"t": time.time()})
            conn.commit()

        return one, conn.close
    if driver == "django":
        from django.db import connection, transaction

        def one_django() -> None:
            with transaction.atomic():
                aiooutbox.sync.enqueue(connection, TOPIC, {"t": time.time()})

        return one_django, connection.close
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    engine = create_engine(_url(dsn, driver.split("+")[1]), pool_size=1, max_overflow=0)

    def one_session() -> None:
        with Session(engine) as session:
            aiooutbox.sync.enqueue(session, TOPIC, {"t": time.time()})
            session.commit()

    return one_session, engine.dispose


def _configure_django(dsn: str) -> None:
    import django
    from django.conf import settings

    parts = urlsplit(dsn)
    settings.configure(
        USE_TZ=True,
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": parts.path.lstrip("/"),
                "USER": parts.username or "postgres",
                "PASSWORD": parts.password or "",
                # a Unix-socket DSN (the embedded server) names its directory in ?host=
                "HOST": parse_qs(parts.query).get("host", [parts.hostname or "127.0.0.1"])[0],
                "PORT": parse_qs(parts.query).get("port", [str(parts.port or 5432)])[0],
            }
        },
    )
    django.setup()


def run_sync(dsn: str, driver: str, n: int, seconds: float) -> tuple[int, float]:
    if driver == "django":
        _configure_django(dsn)
    counts = [0] * n
    stop = threading.Event()
    ready = threading.Barrier(n + 1)
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            one, close = _sync_producer(dsn, driver)
        except BaseException as exc:
            errors.append(exc)
            ready.abort()
            raise
        try:
            ready.wait()
            while not stop.is_set():
                one()
                counts[index] += 1
        except BaseException as exc:
            errors.append(exc)
            raise
        finally:
            close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    try:
        ready.wait()
        time.sleep(WARM_UP)
        start, t0 = sum(counts), time.perf_counter()
        time.sleep(seconds)
        counted, elapsed = sum(counts) - start, time.perf_counter() - t0
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    if errors:
        raise errors[0]
    return counted, elapsed


def main(argv: list[str]) -> int:
    dsn, driver, n, seconds = argv[0], argv[1], int(argv[2]), float(argv[3])
    if driver not in DRIVERS:
        print(f"unknown driver {driver!r}; one of {', '.join(DRIVERS)}", file=sys.stderr)
        return 2
    if driver in ASYNC_DRIVERS:
        commits, elapsed = asyncio.run(run_async(dsn, driver, n, seconds))
    else:
        commits, elapsed = run_sync(dsn, driver, n, seconds)
    result = {
        "driver": driver,
        "connections": n,
        "commits": commits,
        "seconds": round(elapsed, 3),
        "commits_per_s": round(commits / elapsed, 1),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
