"""A soak: steady inflow for a long time into a fresh database of a private cluster
(`private_server`), one row per period (a minute, or a simulated hour): the commit ->
handler latency of the events handled in it, how many, the backlog at its end, the dead
row versions and the size of every outbox relation.

The producer and the consumer are child processes (`benchmarks.harness.soak_child`);
this process only samples the server. Everything is read through the public API and SQL
on the outbox's tables, so a soak measures any storage behind them: the relations
counted are every table whose name starts with the outbox table's (new side tables
included) and their partitions.

A *holder* pins the xmin horizon for the whole run: a REPEATABLE READ transaction on a
connection of its own, whose snapshot is taken before the consumer starts and kept to
the end. It reads the catalog (``catalog``: nothing of the outbox), or every outbox
relation as ``pg_dump`` would (``outbox``: its locks held to the end too).
"""

from __future__ import annotations

import asyncio
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from ..systems import aiooutbox_runner
from .databases import drop_database
from .private_server import PrivateServer
from .processes import Child, child_process
from .soak_child import Board

#: what the pinned mode's snapshot reads
HOLDERS = ("catalog", "outbox")
#: the outbox the consumer runs on at its defaults
SCHEMA, TABLE = "public", "outbox_events"
HOLDER_NAME = "soak-holder"

# every table whose name starts with the outbox's, and their partitions
_RELATIONS = """
WITH RECURSIVE rels AS (
    SELECT c.oid FROM pg_class c
    WHERE c.relnamespace = $1::regnamespace AND c.relkind IN ('r', 'p')
      AND starts_with(c.relname::text, $2)
    UNION
    SELECT i.inhrelid FROM pg_inherits i JOIN rels ON i.inhparent = rels.oid
)
SELECT c.oid, c.relname::text AS name, c.relkind::text AS kind,
       coalesce(s.n_dead_tup, 0) AS dead, coalesce(s.autovacuum_count, 0) AS autovacuums
FROM rels JOIN pg_class c ON c.oid = rels.oid
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
ORDER BY c.relname
"""
_SIZES = "SELECT pg_total_relation_size($1::oid), pg_indexes_size($1::oid)"
_STATEMENTS = """
SELECT calls, round(total_exec_time::numeric, 1)::float8 AS total_ms,
       round(mean_exec_time::numeric, 3)::float8 AS mean_ms, rows,
       regexp_replace(query, '\\s+', ' ', 'g') AS query
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY total_exec_time DESC LIMIT $1
"""

Log = Callable[[str], None]


@dataclass(frozen=True)
class Plan:
    """One soak: ``rate`` events/s committed in batches of ``batch`` for ``seconds``,
    a row every ``period`` seconds, the consumer built with ``options``."""

    rate: float
    batch: int
    seconds: float
    period: float
    options: dict[str, Any] = field(default_factory=dict)
    catch_up: float = 60.0
    patch: str | None = None  # Python file the consumer child runs first
    sql_patch: str | None = None  # SQL run on the database after migrating

    @property
    def periods(self) -> int:
        return max(1, math.ceil(self.seconds / self.period - 1e-9))


async def describe_server(server: PrivateServer) -> dict[str, Any]:
    conn = await asyncpg.connect(server.dsn)
    try:
        version = await conn.fetchval("SELECT version()")
        names = [
            "shared_buffers", "fsync", "synchronous_commit", "autovacuum",
            "autovacuum_naptime", "autovacuum_vacuum_scale_factor", "max_wal_size",
            "checkpoint_timeout", "shared_preload_libraries",
        ]  # fmt: skip
        rows = await conn.fetch(
            "SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY($1)", names
        )
    finally:
        await conn.close()
    return {"version": version, "bin": str(server.bin), "settings": {r[0]: r[1] for r in rows}}


async def relations(conn: asyncpg.Connection) -> dict[str, dict[str, Any]]:
    """Every outbox relation: bytes with indexes and TOAST, of which indexes, dead row
    versions, how many times autovacuum ran on it. A relation whose size waits on a
    lock (a TRUNCATE queued behind a holder) has ``bytes`` None rather than stall the
    sampling."""
    out: dict[str, dict[str, Any]] = {}
    for row in await conn.fetch(_RELATIONS, SCHEMA, TABLE):
        size: int | None = 0
        indexes: int | None = 0
        if row["kind"] == "r":  # a partitioned table's own size is its partitions'
            try:
                sized = await conn.fetchrow(_SIZES, row["oid"])
            except asyncpg.LockNotAvailableError:
                size = indexes = None
            else:  # NULL: dropped meanwhile
                size, indexes = (sized[0] or 0, sized[1] or 0) if sized else (0, 0)
        out[row["name"]] = {
            "bytes": size,
            "index_bytes": indexes,
            "dead": row["dead"],
            "autovacuums": row["autovacuums"],
        }
    return out


async def _hold(dsn: str, reads: str) -> asyncpg.Connection:
    """The holder's connection, its snapshot taken (see the module docstring)."""
    conn = await asyncpg.connect(dsn, server_settings={"application_name": HOLDER_NAME})
    await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    if reads == "catalog":
        await conn.fetchval("SELECT count(*) FROM pg_class")
    else:
        names = [r["name"] for r in await conn.fetch(_RELATIONS, SCHEMA, TABLE)]
        for name in names:
            await conn.fetchval(f'SELECT count(*) FROM "{SCHEMA}"."{name}"')
    return conn


async def _statements(conn: asyncpg.Connection, server: PrivateServer, reset: bool) -> Any:
    if not server.statements:
        return None
    if reset:
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        await conn.execute("SELECT pg_stat_statements_reset()")
        return None
    return [dict(r) for r in await conn.fetch(_STATEMENTS, 12)]


async def _period(child: Child, i: int, timeout: float) -> dict[str, Any]:
    message = await asyncio.wait_for(child.read(), timeout)
    if message.get("type") != "period" or message.get("i") != i:
        raise RuntimeError(f"expected period {i} from the {child.spec['mode']}, got {message}")
    return message


def _row(
    plan: Plan, i: int, made: dict[str, Any], seen: dict[str, Any], rels: dict[str, Any]
) -> dict[str, Any]:
    latency = seen["latency_ms"]
    sizes = [r["bytes"] for r in rels.values()]
    return {
        "minute": round((i + 1) * plan.period / 60, 2),
        "p50": latency.get("p50"),
        "p99": latency.get("p99"),
        "max": latency.get("max"),
        "handled": latency.get("n", 0),
        "committed_total": made["committed"],
        "handled_total": seen["handled"],
        # committed, not yet at a handler: counted by the processes, not by a query that
        # would walk the very index entries a pinned horizon keeps
        "backlog": max(0, made["committed"] - seen["handled"]),
        "dead": sum(r["dead"] for r in rels.values()),
        "bytes": None if None in sizes else sum(s for s in sizes if s is not None),
        "index_bytes": sum(r["index_bytes"] or 0 for r in rels.values()),
        "relations": rels,
        "autovacuums": sum(r["autovacuums"] for r in rels.values()),
        "producer_late_ms": made["late_ms"],
        "producer_transaction_p99_ms": made["transaction_ms"].get("p99"),
        "loadavg": round(os.getloadavg()[0], 2),
    }


async def soak_once(
    server: PrivateServer, database: str, plan: Plan, *, holder: str | None, log: Log
) -> dict[str, Any]:
    """One soak on a fresh ``database`` of ``server`` (dropped after); ``holder``: what
    the pinned snapshot reads (`HOLDERS`), None for a free run."""
    if holder is not None and holder not in HOLDERS:
        raise ValueError(f"holder must be one of {HOLDERS}, not {holder!r}")
    mode = "free" if holder is None else "pinned"
    system = aiooutbox_runner.System(server.dsn, database, sql_patch=plan.sql_patch)
    await system.setup()
    conn = await system.connect()
    await conn.execute("SET lock_timeout = '2s'")  # see `relations`
    held: asyncpg.Connection | None = None
    workdir = Path(tempfile.mkdtemp(prefix="aiooutbox-soak-"))
    board = workdir / "board"
    batches = int(plan.seconds * plan.rate / plan.batch) + 2
    Board.create(board, batches)
    common = {"system": "aiooutbox", "dsn": system.dsn, "board": str(board), "batches": batches}
    consumer_spec = {**common, "mode": "consumer", "role": "consumer", "options": plan.options}
    if plan.patch:
        consumer_spec["patch"] = plan.patch
    producer_spec = {
        **common, "mode": "producer", "role": "producer",
        "rate": plan.rate, "batch": plan.batch, "seconds": plan.seconds,
    }  # fmt: skip
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {"mode": mode, "holder": holder, "loadavg_start": os.getloadavg()}
    try:
        await _statements(conn, server, reset=True)
        if holder is not None:
            held = await _hold(system.dsn, holder)
        async with (
            child_process(consumer_spec, module="benchmarks.harness.soak_child") as consumer,
            child_process(producer_spec, module="benchmarks.harness.soak_child") as producer,
        ):
            await consumer.wait_ready()
            await producer.wait_ready()
            t0 = time.time() + 1.0
            for child in (consumer, producer):
                child.send(t0=t0, period=plan.period, periods=plan.periods)
            for i in range(plan.periods):
                wait = t0 + (i + 1) * plan.period - time.time() + 120
                made = await _period(producer, i, wait)
                seen = await _period(consumer, i, wait)
                row = _row(plan, i, made, seen, await relations(conn))
                if held is not None:
                    row["holder_xmin_age"] = await conn.fetchval(
                        "SELECT age(backend_xmin) FROM pg_stat_activity WHERE pid = $1",
                        held.get_server_pid(),
                    )
                rows.append(row)
                log(
                    f"  {mode:6} {row['minute']:6.1f} min: p50 {row['p50']} ms, p99 "
                    f"{row['p99']} ms, handled {row['handled']:,}, backlog {row['backlog']:,}, "
                    f"dead {row['dead']:,}, {(row['bytes'] or 0) / 2**20:,.0f} MB, "
                    f"load {row['loadavg']}"
                )
            made = await producer.result(timeout=120)
            consumer.send(stop_after=made["committed"], timeout=plan.catch_up)
            seen = await consumer.result(timeout=plan.catch_up + 120)
        out["statements"] = await _statements(conn, server, reset=False)
    finally:
        if held is not None:
            await held.close()
        await conn.close()
        await drop_database(server.dsn, database)
        for path in workdir.iterdir():
            path.unlink()
        workdir.rmdir()
    end = t0 + plan.seconds
    out.update(
        periods=rows,
        committed=made["committed"],
        handled=seen["handled"],
        caught_up=seen["caught_up"],
        catch_up_s=round(max(0.0, seen["t_last"] - end), 3) if seen["handled"] else None,
        producer_cpu_s=made["cpu_s"],
        consumer_cpu_s=seen["cpu_s"],
        consumer_stats=seen["stats"],
        loadavg_end=os.getloadavg(),
    )
    return out
