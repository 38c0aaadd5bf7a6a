"""``python -m benchmarks.mvcc_holder --dsn ADMIN_DSN [--events 200000]``

Drain rate with and without a transaction elsewhere pinning the xmin horizon
(docs/benchmarks.md, "A pinned xmin horizon"). For each mode: a fresh database, the
backlog inserted in one statement, then one in-process consumer (concurrency 64, a
no-op handler) drains it. In the ``held`` mode a REPEATABLE READ transaction takes its
snapshot before the drain and stays open until it ends, so vacuum can remove none of
the dead tuples the drain makes; the MVCC watchdog must name it. Prints one JSON line
per mode and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from typing import Any

import asyncpg

import aiooutbox

from .harness.databases import drop_database, recreate_database

DATABASE = "aiooutbox_bench_mvcc"


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def drain(
    admin_dsn: str, events: int, *, held: bool, database: str = DATABASE
) -> dict[str, Any]:
    dsn = await recreate_database(admin_dsn, database)
    warnings = _Warnings()
    logging.getLogger("aiooutbox.watchdog").addHandler(warnings)
    try:
        conn = await asyncpg.connect(dsn)
        holder = await asyncpg.connect(dsn, server_settings={"application_name": "long-report"})
        try:
            await aiooutbox.migrate(conn)
            await conn.execute(
                "INSERT INTO outbox_events (topic, payload)"
                " SELECT 'bench', jsonb_build_object('n', n) FROM generate_series(1, $1) AS n",
                events,
            )
            await conn.execute("VACUUM ANALYZE outbox_events")
            tx = holder.transaction(isolation="repeatable_read")
            if held:
                await tx.start()
                await holder.fetchval("SELECT count(*) FROM outbox_events")
            done = asyncio.Event()
            handled = 0

            async def handler(event: aiooutbox.Event) -> None:
                nonlocal handled
                handled += 1
                if handled >= events:
                    done.set()

            async with asyncpg.create_pool(dsn, min_size=2, max_size=5) as pool:
                consumer = aiooutbox.OutboxConsumer(
                    pool, concurrency=64, watchdog_interval=5, horizon_warning=10
                )
                async with consumer:
                    started = time.monotonic()
                    async with asyncio.TaskGroup() as tasks:
                        tasks.create_task(consumer.run({"bench": handler}))
                        await done.wait()
                        elapsed = time.monotonic() - started
                        # the watchdog's warning, if the drain was faster than a check
                        deadline = time.monotonic() + 30
                        while held and not warnings.messages and time.monotonic() < deadline:
                            await asyncio.sleep(0.5)
                        consumer.stop()
            dead = await conn.fetchval(
                "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox_events'"
            )
            if held:
                await tx.rollback()
        finally:
            await holder.close()
            await conn.close()
    finally:
        logging.getLogger("aiooutbox.watchdog").removeHandler(warnings)
        await drop_database(admin_dsn, database)
    return {
        "mode": "held" if held else "free",
        "events": events,
        "seconds": round(elapsed, 2),
        "events_per_s": round(events / elapsed),
        "dead_tuples_after": dead,
        "watchdog_named_holder": any("long-report" in m for m in warnings.messages),
    }


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mvcc_holder")
    parser.add_argument("--dsn", required=True, help="admin DSN (CREATE DATABASE rights)")
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--database", default=DATABASE, help="created and dropped")
    args = parser.parse_args(argv)
    free = await drain(args.dsn, args.events, held=False, database=args.database)
    print(json.dumps(free), flush=True)
    held = await drain(args.dsn, args.events, held=True, database=args.database)
    print(json.dumps(held), flush=True)
    print(json.dumps({"held_over_free": round(held["events_per_s"] / free["events_per_s"], 2)}))


if __name__ == "__main__":
    asyncio.run(main())
