"""``drivers``: producer throughput per driver path (asyncpg, SQLAlchemy, psycopg,
psycopg2, Django): one-event transactions on ``driver_connections`` connections through
aiooutbox's public API, no consumer, each driver in a child process of its own
(``python -m benchmarks.systems.drivers``)."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from typing import Any

from ..harness.bench import AIO, Bench
from ..harness.markdown import fmt, table
from ..harness.scenario import Scenario, sizes_of
from ..systems.drivers import DRIVERS


@dataclass
class Sizes:
    driver_connections: int = 8
    driver_seconds: float = 1.5


async def run(bench: Bench) -> None:
    config, system = sizes_of(bench.config, Sizes), bench.systems[AIO]
    n = config.driver_connections
    bench.log(f"producer throughput per driver: one-event transactions, {n} connections")
    out: dict[str, Any] = {}
    for driver in DRIVERS:
        await system.reset()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.systems.drivers", system.dsn, driver, str(n),
            str(config.driver_seconds),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        stdout, stderr = await asyncio.wait_for(proc.communicate(), config.driver_seconds + 120)
        if proc.returncode != 0:
            last = (stderr.decode().strip().splitlines() or ["no output"])[-1]
            out[driver] = {"error": last}
            bench.log(f"  {driver:26} failed: {last}")
            continue
        out[driver] = json.loads(stdout.decode().strip().splitlines()[-1])
    base = out.get("asyncpg", {}).get("commits_per_s")
    for driver, row in out.items():
        if base and "commits_per_s" in row:
            row["ratio_to_asyncpg"] = round(row["commits_per_s"] / base, 3)
            bench.log(
                f"  {driver:26} {row['commits_per_s']:>8,.0f} commits/s "
                f"({row['ratio_to_asyncpg']:.2f} x asyncpg)"
            )
    bench.results["drivers"] = out


def section(results: dict[str, Any]) -> list[str]:
    drivers = results.get("drivers", {})
    if not drivers:
        return []
    first = next(iter(drivers.values()))
    lines = table(
        "Producer throughput per driver (one-event transactions/s, "
        f"{first.get('connections', 8)} connections, no consumer)",
        "| driver path | commits/s | x asyncpg |",
        "|---|---:|---:|",
    )
    for name, row in drivers.items():
        if "error" in row:
            lines.append(f"| {name} | failed: {row['error'][:80]} | |")
            continue
        lines.append(
            f"| {name} | {fmt(row['commits_per_s'])} | {fmt(row.get('ratio_to_asyncpg'), 2)} |"
        )
    return lines


SCENARIO = Scenario(
    "drivers", run, sizes=Sizes, quick={"driver_seconds": 1.0}, sections=((70, section),)
)
