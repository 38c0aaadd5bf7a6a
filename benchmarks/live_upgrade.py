"""A live outbox upgraded under load: the rig of the ``upgrade`` scenario and of
tests/test_live_upgrade.py.

An outbox is migrated to an older schema (`migrate_to`), given a backlog of pending
rows (`load_backlog`), and `upgrade` then runs ``aiooutbox.migrate`` to head while
producers insert with the older schema's plain SQL, one row per transaction, each
insert timed; a watcher samples, every few milliseconds, whether an index is being
built on the outbox (``pg_stat_progress_create_index``) and whether a producer is
waiting for the outbox table's lock (``pg_locks``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import asyncpg

import aiooutbox
from aiooutbox._sql.statements import Queries, queries
from aiooutbox.migrations import _in_one_transaction, _record, migrations

PRODUCER_APP = "aiooutbox-upgrade-producer"
TOPIC = "t"  # what the producers insert (and a consumer of the test handles)
BACKLOG_TOPIC = "backlog"


async def migrate_to(conn: asyncpg.Connection, version: int, q: Queries | None = None) -> None:
    """The outbox migrated up to ``version`` only, as that release's `migrate` left it."""
    q = q or queries()
    await conn.execute(q.create_schema)
    await conn.execute(q.create_versions_table)
    await conn.execute(q.create_compat_versions_table)
    for m in migrations():
        if m.version > version:
            break
        async with conn.transaction():
            await conn.execute(_in_one_transaction(q, m))
            await _record(conn, q, m)


async def load_backlog(
    conn: asyncpg.Connection,
    rows: int,
    q: Queries | None = None,
    *,
    chunk: int = 1_000_000,
    log: Any = None,
) -> None:
    """``rows`` pending events on `BACKLOG_TOPIC` (generate_series, in chunks), then
    VACUUM ANALYZE as autovacuum would."""
    q = q or queries()
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        await conn.execute(
            f"INSERT INTO {q.qualified} (topic, payload)"
            f" SELECT '{BACKLOG_TOPIC}', jsonb_build_object('i', g)"
            " FROM generate_series($1::int, $2::int) AS g",
            start + 1,
            stop,
        )
        if log is not None:
            log(f"  backlog: {stop:,} rows")
    await conn.execute(f"VACUUM (ANALYZE) {q.qualified}")


@dataclass
class Watch:
    """What the watcher saw: samples taken while an index was being built on the outbox,
    and how many of those found a producer waiting for a lock."""

    samples: int = 0
    building: int = 0
    blocked_while_building: int = 0
    blocked: int = 0
    phases: set[str] = field(default_factory=set)


@dataclass
class Produced:
    ids: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    @property
    def longest_stall_s(self) -> float:
        return max(self.latencies, default=0.0)


async def _produce(dsn: str, q: Queries, out: Produced, stop: asyncio.Event, n: int) -> None:
    conn = await asyncpg.connect(dsn, server_settings={"application_name": PRODUCER_APP})
    sql = (
        f"INSERT INTO {q.qualified} (topic, payload)"
        f" VALUES ('{TOPIC}', jsonb_build_object('p', $1::int)) RETURNING id"
    )
    try:
        while not stop.is_set():
            t = time.perf_counter()
            out.ids.append(await conn.fetchval(sql, n))
            out.latencies.append(time.perf_counter() - t)
            await asyncio.sleep(0.002)
    finally:
        await conn.close()


async def _watch(dsn: str, q: Queries, out: Watch, stop: asyncio.Event) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        table = await conn.fetchval("SELECT $1::regclass::oid", q.qualified)
        while not stop.is_set():
            # a producer waiting for the outbox table's lock (not for a relation
            # extension or a row, which a loaded server shows without any migration)
            row = await conn.fetchrow(
                "SELECT (SELECT string_agg(p.phase, ',') FROM pg_stat_progress_create_index p"
                "        WHERE p.relid = $1 AND p.datid = d.oid) AS phase,"
                " (SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                "  WHERE NOT l.granted AND l.locktype = 'relation' AND l.relation = $1"
                "    AND l.database = d.oid AND a.application_name = $2) AS blocked"
                " FROM pg_database d WHERE d.datname = current_database()",
                table,
                PRODUCER_APP,
            )
            out.samples += 1
            out.blocked += row["blocked"] > 0
            if row["phase"]:
                out.building += 1
                out.phases.update(row["phase"].split(","))
                out.blocked_while_building += row["blocked"] > 0
            await asyncio.sleep(0.005)
    finally:
        await conn.close()


async def upgrade(
    dsn: str,
    q: Queries | None = None,
    *,
    producers: int = 4,
    before: float = 0.5,
    after: float = 0.5,
    migrate_dsns: int = 1,
    concurrently: bool = True,
) -> dict[str, Any]:
    """``migrate`` to head (from ``migrate_dsns`` processes' worth of connections at
    once) while ``producers`` insert; producing starts ``before`` seconds ahead and
    goes on ``after`` seconds past it."""
    q = q or queries()
    stop = asyncio.Event()
    produced = Produced()
    watch = Watch()
    tasks = [asyncio.create_task(_produce(dsn, q, produced, stop, n)) for n in range(producers)]
    tasks.append(asyncio.create_task(_watch(dsn, q, watch, stop)))
    conns = [await asyncpg.connect(dsn) for _ in range(migrate_dsns)]
    try:
        await asyncio.sleep(before)
        t = time.perf_counter()
        applied = await asyncio.gather(
            *(
                aiooutbox.migrate(c, schema=q.schema, table=q.table, concurrently=concurrently)
                for c in conns
            )
        )
        migrate_s = time.perf_counter() - t
        await asyncio.sleep(after)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in conns:
            await c.close()
    for task in tasks:
        task.result()  # a producer's or the watcher's error
    lat = sorted(produced.latencies)
    return {
        "applied": applied,
        "migrate_s": round(migrate_s, 3),
        "inserts": len(produced.ids),
        "ids": produced.ids,
        "longest_stall_ms": round(produced.longest_stall_s * 1000, 1),
        "p99_insert_ms": round(lat[int(len(lat) * 0.99)] * 1000, 2) if lat else None,
        "samples": watch.samples,
        "building_samples": watch.building,
        "blocked_while_building": watch.blocked_while_building,
        "blocked_samples": watch.blocked,
        "phases": sorted(watch.phases),
    }
