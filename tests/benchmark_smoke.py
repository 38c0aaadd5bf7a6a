"""What the benchmark smoke tests share: tiny sizes, a run within a generous limit, and
the checks on what a scenario wrote."""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg

from benchmarks import report
from benchmarks.scenarios import Bench, Config

# Each test below runs a few scenarios at tiny sizes. Most of their time is child
# processes starting (a consumer per drain, a process per producer driver), which a
# loaded machine stretches: the whole suite in one test once took over 90 s there.
# LIMIT is generous; a test that runs out says how long it ran, at what load, and
# which step it was in.
LIMIT = 420.0


def tiny(*scenarios: str) -> Config:
    return Config(
        drain_sizes=[200, 400],
        drain_rounds={200: 1, 400: 1},
        tune=False,
        steady_fractions=[0.5],
        steady_rates=[300.0],
        steady_seconds=0.6,
        floor_samples=3,
        floor_gap=0.05,
        capacity_steps=1,
        capacity_seconds=0.6,
        steady_producers=2,
        wakeup_samples=3,
        wakeup_gap=(0.1, 0.15),
        poll_only_interval=0.3,
        producer_levels=[1, 2],
        producer_seconds=0.2,
        producer_rounds=1,
        driver_connections=2,
        driver_seconds=0.2,
        history_rows=5_000,
        history_drain=200,
        history_rounds=1,
        observe_size=200,
        observe_rounds=1,
        sample_interval=0.05,
        settle=0.2,
        scenarios=list(scenarios),
    )


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


async def databases_left(pg_server: str, prefix: str) -> list[str]:
    """The databases named with ``prefix`` that still exist."""
    conn = await asyncpg.connect(pg_server)
    try:
        rows = await conn.fetch(
            "SELECT datname FROM pg_database WHERE starts_with(datname, $1)", prefix
        )
    finally:
        await conn.close()
    return [r[0] for r in rows]


async def run_tiny(
    pg_server: str, config: Config, out: Path, *, plots: bool = False
) -> tuple[dict[str, Any], dict[str, Path]]:
    """Run ``config`` within `LIMIT`; its results as written to ``out``, and the paths."""
    steps: list[str] = []
    prefix = f"bsmoke_{uuid.uuid4().hex[:8]}_"
    bench = Bench(pg_server, config, prefix=prefix, log=steps.append)
    what = "+".join(config.scenarios)
    started = time.monotonic()
    try:
        results = await asyncio.wait_for(bench.run(), LIMIT)
    except TimeoutError:
        raise AssertionError(
            f"benchmark scenarios {what} at tiny sizes still running after "
            f"{time.monotonic() - started:.0f}s (limit {LIMIT:.0f}s, load average "
            f"{os.getloadavg()[0]:.1f}); last steps: {steps[-4:]}"
        ) from None
    finally:
        await bench.cleanup()
    assert not await databases_left(pg_server, prefix), "a scenario left its database"
    print(
        f"\n[benchmark smoke {what}] {time.monotonic() - started:.1f}s, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    paths = report.write(results, out, plots=plots)
    loaded: dict[str, Any] = json.loads(paths["json"].read_text())
    assert loaded["meta"]["postgresql"]["version"].startswith("PostgreSQL")
    return loaded, paths
