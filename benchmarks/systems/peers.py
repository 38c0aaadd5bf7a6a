"""The references beside aiooutbox and PgQueuer: the bare asyncpg loop (the limit), awa-pg
and procrastinate; each a parent-side ``System`` (its database, the backlog) and a
child-side ``consume_*`` (python -m benchmarks.harness.child runs it).

The bare loop is the least a work queue on one table can do per event: per connection,
one ``UPDATE … RETURNING`` claim of up to ``batch`` rows over ``FOR UPDATE SKIP LOCKED``,
the handler per row, one ``UPDATE … WHERE id = ANY($1)`` settle. No leases, retries,
ordering, topics or wake-up: what every guarantee is measured against.

awa-pg and procrastinate are optional (``pip install -e '.[bench]'``); ``missing()`` says
which is not installed and the references scenario then reports it as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import importlib.util
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from ..harness.databases import TOPIC, recreate_database

BARE, AWA, PROCRASTINATE = "bare", "awa", "procrastinate"
_PACKAGES = {AWA: ("awa", "awa-pg"), PROCRASTINATE: ("procrastinate", "procrastinate")}

_BARE_SCHEMA = """
CREATE TABLE jobs (
    id bigserial PRIMARY KEY,
    payload jsonb NOT NULL,
    status text NOT NULL DEFAULT 'pending',
    locked_at timestamptz
);
CREATE INDEX jobs_pending_idx ON jobs (id) WHERE status = 'pending';
"""
_BARE_CLAIM = (
    "UPDATE jobs SET status = 'running', locked_at = now() WHERE id IN ("
    " SELECT id FROM jobs WHERE status = 'pending' ORDER BY id LIMIT $1"
    " FOR UPDATE SKIP LOCKED) RETURNING id, payload"
)
_BARE_SETTLE = "UPDATE jobs SET status = 'done' WHERE id = ANY($1::bigint[])"


def missing(name: str) -> str | None:
    """The pip package to install when ``name``'s library is not importable, else None."""
    if name not in _PACKAGES:
        return None
    module, package = _PACKAGES[name]
    return None if importlib.util.find_spec(module) else package


def version(name: str) -> str:
    import importlib.metadata as md

    package = _PACKAGES.get(name, ("", "asyncpg"))[1]
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return "not installed"


@dataclass
class Noop:
    """awa's job arguments (its kind is derived from this class's name)."""

    i: int


class System:
    """Parent side of one reference: ``setup`` makes a fresh database, ``load`` the backlog."""

    def __init__(self, name: str, admin_dsn: str, database: str) -> None:
        self.name = name
        self.admin_dsn = admin_dsn
        self.database = database
        self.dsn = ""

    async def setup(self) -> None:
        self.dsn = await recreate_database(self.admin_dsn, self.database)
        conn = await asyncpg.connect(self.dsn)
        try:
            if self.name == BARE:
                await conn.execute(_BARE_SCHEMA)
            elif self.name == PROCRASTINATE:
                files = importlib.resources.files("procrastinate") / "sql" / "schema.sql"
                await conn.execute(files.read_text(encoding="utf-8"))
        finally:
            await conn.close()
        if self.name == AWA:
            from awa import AsyncClient

            client = AsyncClient(_sqlx_dsn(self.dsn), max_connections=2)
            await client.migrate()
            await client.close()

    async def reset(self) -> None:
        await self.setup()

    async def load(self, n: int) -> None:
        """``n`` no-op jobs: plain SQL where the table is plain (bare, procrastinate, whose
        insert trigger still runs), awa's own COPY insert for awa's storage."""
        if self.name == AWA:
            from awa import AsyncClient

            client = AsyncClient(_sqlx_dsn(self.dsn), max_connections=2)
            for start in range(0, n, 10_000):
                jobs = [Noop(i) for i in range(start, min(n, start + 10_000))]
                await client.insert_many_copy(jobs, queue=TOPIC)
            await client.close()
            return
        conn = await asyncpg.connect(self.dsn)
        try:
            if self.name == BARE:
                await conn.execute(
                    "INSERT INTO jobs (payload) SELECT jsonb_build_object('i', g)"
                    " FROM generate_series(1, $1::int) AS g",
                    n,
                )
                await conn.execute("VACUUM (ANALYZE) jobs")
            else:
                await conn.execute(
                    "INSERT INTO procrastinate_jobs (queue_name, task_name, args)"
                    " SELECT $2, $2, jsonb_build_object('i', g)"
                    " FROM generate_series(1, $1::int) AS g",
                    n,
                    TOPIC,
                )
                await conn.execute("VACUUM (ANALYZE) procrastinate_jobs")
        finally:
            await conn.close()

    async def finished(self) -> int | None:
        """Jobs settled as done (None for awa: its storage is its own; the child's count
        of handlers run stands in)."""
        sql = {
            BARE: "SELECT count(*) FROM jobs WHERE status = 'done'",
            PROCRASTINATE: "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'",
        }.get(self.name)
        if sql is None:
            return None
        conn = await asyncpg.connect(self.dsn)
        try:
            count: int = await conn.fetchval(sql)
        finally:
            await conn.close()
        return count


# -- child side ----------------------------------------------------------------------------
async def consume_bare(
    dsn: str, settings: dict[str, Any], recorder: Any, stop: asyncio.Event
) -> None:
    """``connections`` loops of claim ``batch`` → handlers → settle."""
    batch = int(settings.get("batch", 1000))
    conns = [await asyncpg.connect(dsn) for _ in range(int(settings.get("connections", 2)))]

    async def handler(payload: str) -> None:
        recorder.count()

    async def loop(conn: asyncpg.Connection) -> None:
        claim, settle = await conn.prepare(_BARE_CLAIM), await conn.prepare(_BARE_SETTLE)
        while not stop.is_set():
            rows = await claim.fetch(batch)
            if not rows:
                await asyncio.sleep(0.01)
                continue
            for row in rows:
                await handler(row[1])
            await settle.fetch([row[0] for row in rows])

    try:
        recorder.ready.set()
        recorder.started()
        await asyncio.gather(*(loop(c) for c in conns))
    finally:
        for conn in conns:
            await conn.close()


def _sqlx_dsn(dsn: str) -> str:
    """The DSN as awa's driver (sqlx) reads it: a unix-socket DSN written libpq's way
    (``postgresql://user@/db?host=/socket/dir``, as the embedded server gives it) needs a
    host in the authority, which the ``host`` parameter then overrides ("empty host")."""
    parts = urlsplit(dsn)
    if parts.hostname or "host=" not in parts.query:
        return dsn
    user = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{user}@localhost" if user else "localhost"))


async def consume_awa(
    dsn: str, settings: dict[str, Any], recorder: Any, stop: asyncio.Event
) -> None:
    """awa's AsyncClient, ``workers`` on the queue (its Rust runtime claims and settles)."""
    from awa import AsyncClient

    client = AsyncClient(_sqlx_dsn(dsn), max_connections=int(settings.get("max_connections", 10)))

    @client.task(Noop, queue=TOPIC)
    async def handler(job: Any) -> None:
        recorder.count()

    recorder.started()
    await client.start([(TOPIC, int(settings.get("workers", 1024)))])
    recorder.ready.set()
    try:
        await stop.wait()
    finally:
        await client.shutdown()
        await client.close()


async def consume_procrastinate(
    dsn: str, settings: dict[str, Any], recorder: Any, stop: asyncio.Event
) -> None:
    """procrastinate's async worker at ``concurrency`` on its psycopg connector."""
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name=TOPIC, queue=TOPIC)
    async def handler(i: int) -> None:
        recorder.count()

    async with app.open_async():
        recorder.started()
        worker = asyncio.ensure_future(
            app.run_worker_async(
                concurrency=int(settings.get("concurrency", 100)), wait=True, queues=[TOPIC]
            )
        )
        recorder.ready.set()
        await asyncio.wait(
            [worker, asyncio.ensure_future(stop.wait())], return_when="FIRST_COMPLETED"
        )
        worker.cancel()  # procrastinate's graceful stop: running jobs finish first
        with contextlib.suppress(asyncio.CancelledError):
            await worker
