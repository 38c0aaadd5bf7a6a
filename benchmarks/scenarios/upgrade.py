"""``upgrade`` (only with ``--only``): a live outbox of ``upgrade_rows`` pending rows
migrated from schema 17 to head while producers insert.

The outbox is loaded once at schema 17 (``generate_series``, the rows pending on a
topic of their own) and copied (``CREATE DATABASE ... TEMPLATE``); then ``migrate`` runs
on each copy while ``upgrade_producers`` producers insert one row per transaction with
schema 17's plain SQL, each insert timed (benchmarks/live_upgrade.py): once as
``migrate`` runs by default (migration 0018's index built ``CONCURRENTLY``, outside a
transaction) and once with the index built inside the migration's transaction
(``concurrently=False``, as ``migrate --pgbouncer`` does, and as every ``migrate`` did
before). Reported: the migration's duration, the longest insert (the stall a producer
saw), the 99th percentile, and the samples (every 5 ms) that found a producer waiting
for a lock while the index was being built.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import asyncpg

from ..harness.bench import Bench
from ..harness.databases import recreate_database, with_database
from ..harness.scenario import Scenario, sizes_of
from ..harness.stats import ratio
from ..live_upgrade import load_backlog, migrate_to, upgrade
from ..systems import aiooutbox_runner


@dataclass
class Sizes:
    upgrade_rows: int = 10_000_000
    upgrade_producers: int = 4


async def _copy(bench: Bench, source: str, name: str) -> aiooutbox_runner.System:
    system = aiooutbox_runner.System(bench.admin_dsn, bench.prefix + name)
    bench.extra_systems.append(system)
    admin = await asyncpg.connect(bench.admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{system.database}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{system.database}" TEMPLATE "{source}"')
    finally:
        await admin.close()
    system.dsn = with_database(bench.admin_dsn, system.database)
    return system


async def run(bench: Bench) -> None:
    config = sizes_of(bench.config, Sizes)
    rows = config.upgrade_rows
    bench.log(f"upgrade: {rows:,} pending rows at schema 17, migrate to head under producers")
    loaded = aiooutbox_runner.System(bench.admin_dsn, bench.prefix + "upgrade_17")
    bench.extra_systems.append(loaded)
    loaded.dsn = await recreate_database(bench.admin_dsn, loaded.database)
    t = time.perf_counter()
    conn = await asyncpg.connect(loaded.dsn)
    try:
        await migrate_to(conn, 17)
        await load_backlog(conn, rows, log=bench.log)
        size = await conn.fetchval("SELECT pg_total_relation_size('outbox_events')")
    finally:
        await conn.close()
    load_s = round(time.perf_counter() - t, 1)
    bench.log(f"  loaded in {load_s}s ({size / 2**20:,.0f} MB)")
    out: dict[str, Any] = {
        "rows": rows,
        "producers": config.upgrade_producers,
        "load_s": load_s,
        "table_mb": round(size / 2**20),
        "runs": {},
    }
    for label, concurrently in (("concurrently", True), ("in_transaction", False)):
        system = await _copy(bench, loaded.database, f"upgrade_{label}")
        result = await upgrade(
            system.dsn,
            producers=config.upgrade_producers,
            before=1.0,
            after=1.0,
            concurrently=concurrently,
        )
        result.pop("ids")
        out["runs"][label] = result
        bench.log(
            f"  {label:15} migrate {result['migrate_s']} s, longest insert"
            f" {result['longest_stall_ms']} ms (p99 {result['p99_insert_ms']} ms),"
            f" {result['blocked_while_building']}/{result['building_samples']} build samples"
            " with a producer waiting for a lock"
        )
    runs = out["runs"]
    out["ratios"] = {
        "longest_stall_in_transaction_vs_concurrently": round(
            ratio(
                runs["in_transaction"]["longest_stall_ms"], runs["concurrently"]["longest_stall_ms"]
            ),
            2,
        ),
        "migrate_s_concurrently_vs_in_transaction": round(
            ratio(runs["concurrently"]["migrate_s"], runs["in_transaction"]["migrate_s"]), 2
        ),
    }
    bench.log(f"  {out['ratios']}")
    bench.results["upgrade"] = out


def render(section: dict[str, Any]) -> list[str]:
    runs, ratios = section["runs"], section["ratios"]
    out = [
        "## A live upgrade from schema 17",
        "",
        f"{section['rows']:,} pending rows ({section['table_mb']:,} MB, loaded in"
        f" {section['load_s']} s), `migrate` to head while {section['producers']} producers"
        " insert one row per transaction with schema 17's SQL:",
        "",
        "| index build | migrate s | inserts | longest insert ms | p99 ms |"
        " build samples with a producer waiting for a lock |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, what in (
        ("concurrently", "`CONCURRENTLY` (the default)"),
        ("in_transaction", "in the transaction (`--pgbouncer`)"),
    ):
        r = runs[label]
        out.append(
            f"| {what} | {r['migrate_s']} | {r['inserts']:,} | {r['longest_stall_ms']:,} |"
            f" {r['p99_insert_ms']} | {r['blocked_while_building']} of {r['building_samples']} |"
        )
    out += [
        "",
        "Longest insert, in the transaction vs concurrently:"
        f" {ratios['longest_stall_in_transaction_vs_concurrently']}x; the migration's"
        f" duration, concurrently vs in the transaction:"
        f" {ratios['migrate_s_concurrently_vs_in_transaction']}x.",
        "",
    ]
    return out


def section(results: dict[str, Any]) -> list[str]:
    return ["", *render(results["upgrade"])] if results.get("upgrade") else []


SCENARIO = Scenario(
    "upgrade",
    run,
    sizes=Sizes,
    quick={"upgrade_rows": 200_000},
    default=False,  # 10M rows by default (--upgrade-rows)
    sections=((172, section),),
)
