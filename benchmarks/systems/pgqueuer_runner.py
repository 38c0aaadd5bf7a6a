"""PgQueuer under benchmark: its database, loading, producers, and the child consumer.

Workers are PgQueuer ``QueueManager``s, each on its own asyncpg connection
(``AsyncpgDriver``), all in one process, so both systems get one Python process.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import asyncpg

from ..harness.databases import TOPIC, recreate_database

NAME = "pgqueuer"

# best drain settings found on the 2-core machine (see docs/benchmarks.md)
DEFAULT_SETTINGS: dict[str, Any] = {"workers": 5, "batch_size": 100}

_CHUNK = 100_000


def _queries(conn: asyncpg.Connection) -> Any:
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    return Queries(AsyncpgDriver(conn))


class System:
    name = NAME

    def __init__(self, admin_dsn: str, database: str) -> None:
        self.admin_dsn = admin_dsn
        self.database = database
        self.dsn = ""
        self._producers: dict[int, Any] = {}
        self.channel = "ch_pgqueuer"  # PgQueuer's default channel
        self.short_poll: dict[str, Any] = {"dequeue_timeout": 0.1}

    async def setup(self) -> None:
        self.dsn = await recreate_database(self.admin_dsn, self.database)
        conn = await asyncpg.connect(self.dsn)
        try:
            await _queries(conn).install()
        finally:
            await conn.close()

    async def connect(self) -> asyncpg.Connection:
        return await asyncpg.connect(self.dsn)

    async def reset(self) -> None:
        conn = await self.connect()
        try:
            await conn.execute(
                "TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics RESTART IDENTITY"
            )
            await conn.execute("VACUUM (ANALYZE) pgqueuer")
            await conn.execute("VACUUM (ANALYZE) pgqueuer_log")
        finally:
            await conn.close()

    async def load(self, n: int) -> None:
        """Insert ``n`` queued jobs with plain SQL, plus the 'queued' log rows PgQueuer's
        own enqueue writes, then VACUUM ANALYZE (autovacuum is off on our server)."""
        conn = await self.connect()
        try:
            for start in range(0, n, _CHUNK):
                stop = min(n, start + _CHUNK)
                await conn.execute(
                    "WITH ins AS (INSERT INTO pgqueuer (priority, entrypoint, payload, status)"
                    " SELECT 0, 'bench', convert_to(g::text, 'UTF8'), 'queued'"
                    " FROM generate_series($1::int, $2::int) AS g RETURNING id)"
                    " INSERT INTO pgqueuer_log (job_id, status, entrypoint, priority)"
                    " SELECT id, 'queued', 'bench', 0 FROM ins",
                    start + 1,
                    stop,
                )
            await conn.execute("VACUUM (ANALYZE) pgqueuer")
            await conn.execute("VACUUM (ANALYZE) pgqueuer_log")
        finally:
            await conn.close()

    def _q(self, conn: asyncpg.Connection) -> Any:
        q = self._producers.get(id(conn))
        if q is None:
            q = self._producers[id(conn)] = _queries(conn)
        return q

    async def produce_many(self, conn: asyncpg.Connection, count: int, sent: float) -> float:
        payload = repr(sent).encode()
        async with conn.transaction():
            await self._q(conn).enqueue([TOPIC] * count, [payload] * count, [0] * count)
            committing = time.time()
        return committing

    async def produce_one(self, conn: asyncpg.Connection, sent: float) -> float:
        async with conn.transaction():
            await self._q(conn).enqueue(TOPIC, repr(sent).encode())
            committing = time.time()
        return committing

    async def set_wakeup_trigger(self, enabled: bool) -> None:
        action = "ENABLE" if enabled else "DISABLE"
        conn = await self.connect()
        try:
            await conn.execute(f"ALTER TABLE pgqueuer {action} TRIGGER tg_pgqueuer_changed")
        finally:
            await conn.close()

    async def counts(self) -> dict[str, int]:
        conn = await self.connect()
        try:
            queued = await conn.fetchval("SELECT count(*) FROM pgqueuer")
            rows = await conn.fetch(
                "SELECT status::text, count(*) FROM pgqueuer_log"
                " WHERE status <> 'queued' AND status <> 'picked' GROUP BY 1"
            )
        finally:
            await conn.close()
        result = {r[0]: r[1] for r in rows}
        result["in_queue_table"] = queued
        return result

    async def backlog(self) -> int:
        """Jobs not yet picked."""
        conn = await self.connect()
        try:
            count: int = await conn.fetchval(
                "SELECT count(*) FROM pgqueuer WHERE status = 'queued'"
            )
        finally:
            await conn.close()
        return count

    async def finished(self) -> int:
        return (await self.counts()).get("successful", 0)


async def consume(dsn: str, settings: dict[str, Any], recorder: Any, stop: asyncio.Event) -> None:
    """Child side: ``workers`` QueueManagers with a no-op entrypoint until ``stop``."""
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.models import Job
    from pgqueuer.qm import QueueManager
    from pgqueuer.queries import Queries

    workers = int(settings.get("workers", 5))
    batch_size = int(settings.get("batch_size", 100))

    if recorder.latency:

        async def handler(job: Job) -> None:
            recorder.hit(float(job.payload or b"0"))

    else:

        async def handler(job: Job) -> None:
            recorder.count()

    conns = [await asyncpg.connect(dsn) for _ in range(workers)]
    try:
        managers = []
        for conn in conns:
            qm = QueueManager(Queries(AsyncpgDriver(conn)))
            qm.entrypoint(TOPIC)(handler)
            managers.append(qm)
        run_options: dict[str, Any] = {"batch_size": batch_size}
        if settings.get("max_concurrent_tasks"):
            run_options["max_concurrent_tasks"] = int(settings["max_concurrent_tasks"])
        if settings.get("dequeue_timeout"):
            run_options["dequeue_timeout"] = timedelta(seconds=settings["dequeue_timeout"])

        async def watch() -> None:
            await asyncio.sleep(0.3)  # PgQueuer's listener starts inside run()
            recorder.ready.set()
            await stop.wait()
            for qm in managers:
                qm.shutdown.set()

        watcher = asyncio.ensure_future(watch())
        recorder.started()
        try:
            await asyncio.gather(*(qm.run(**run_options) for qm in managers))
        finally:
            watcher.cancel()
    finally:
        for conn in conns:
            await conn.close()
