"""The wake-up trigger's cost per INSERT against dead rows in the idle table.

``python -m benchmarks.idle_bloat --dsn postgresql://postgres@127.0.0.1:5432/postgres
[--cycles 5000] [--out FILE]``: in a fresh database ``idle_bloat_tax``, the backend's
CPU per single-row INSERT (a PL/pgSQL loop, rolled back; /proc/<pid>/schedstat) with the
trigger off and on, nobody idle: on a fresh idle table, after ``cycles`` advertise /
withdraw cycles of one consumer (the upsert and DELETE a consumer runs when it goes idle
and busy again; dead rows stay until VACUUM, and autovacuum may be off), and after a
VACUUM of the idle table. Medians of 5 probes of 2,000 INSERTs each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

from .harness.cpu import BackendCpu
from .harness.databases import drop_database
from .scenarios.tax import LOOP_FUNCTION, set_probe
from .systems import aiooutbox_runner


async def run(dsn: str, cycles: int, inserts: int = 2000) -> dict[str, Any]:
    system = aiooutbox_runner.System(dsn, "idle_bloat_tax")
    await system.setup()
    q = system.q
    conn = await system.connect()
    out: dict[str, Any] = {"cycles": cycles, "inserts_per_probe": inserts}
    try:
        await conn.execute(LOOP_FUNCTION.format(table=q.qualified))
        pid = await conn.fetchval("SELECT pg_backend_pid()")

        async def cpu_per_insert(variant: str) -> float:
            values = []
            for _ in range(5):
                tr = conn.transaction()
                await tr.start()
                try:
                    await set_probe(conn, q, variant)
                    before = BackendCpu._cpu(pid) or 0.0
                    await conn.fetchval("SELECT public.bench_insert_loop($1)", inserts)
                    values.append(((BackendCpu._cpu(pid) or 0.0) - before) / inserts * 1e6)
                finally:
                    await tr.rollback()
            return round(statistics.median(values), 2)

        async def state(label: str) -> None:
            pages = await conn.fetchval(f"SELECT pg_relation_size('{q.idle_table}') / 8192")
            off, on = await cpu_per_insert("off"), await cpu_per_insert("on")
            out[label] = {"idle_table_pages": pages, "off_us": off, "on_us": on,
                          "tax_us": round(on - off, 2)}  # fmt: skip
            print(label, out[label], flush=True)

        await state("fresh")
        other = await system.connect()
        try:
            for _ in range(cycles):  # advertised already expired: the trigger never notifies
                await other.execute(q.declare_idle, "bloat-probe", ["bench"], -1.0)
                await other.execute(q.declare_busy, "bloat-probe")
        finally:
            await other.close()
        await state("after_cycles")
        await conn.execute(f"VACUUM {q.idle_table}")
        await state("after_vacuum")
    finally:
        await conn.close()
        await drop_database(dsn, "idle_bloat_tax")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.idle_bloat")
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--cycles", type=int, default=5000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = asyncio.run(run(args.dsn, args.cycles))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
