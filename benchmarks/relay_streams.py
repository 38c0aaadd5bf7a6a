"""``python -m benchmarks.relay_streams --dsn ... [--events N] [--rounds R] --out F.json``

The relay into Kafka and into Redis Streams with read-back on against off, alone (no
bare loops: more rounds in the same time, for that ratio; benchmarks/brokers/streams.py
says how each is measured), on a database of its own; writes the JSON and, beside it,
its markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

import aiooutbox

from .brokers.bare import Log
from .brokers.streams import kafka, redis
from .harness.databases import drop_database, recreate_database
from .scenarios.relay import streams_lines


async def read_back_only(admin_dsn: str, events: int, rounds: int, log: Log) -> dict[str, Any]:
    """Read-back on / off alone (no bare loops), Kafka then Redis (its sinks at 100 in
    flight), on a database of its own: more rounds in the same time, for the normal
    path's ratio."""
    name = "bench_relay_read_back"
    dsn = await recreate_database(admin_dsn, name)
    loads = {"start": [round(x, 2) for x in os.getloadavg()]}
    out: dict[str, Any] = {}
    try:
        async with asyncpg.create_pool(dsn, min_size=2, max_size=8) as pool:
            await aiooutbox.migrate(pool)
            out["kafka"] = await kafka(pool, events, rounds, log, bare=False)
            # at most 100 in flight: no publish waits for a free connection (the
            # sink's pool holds 100), which would decide the rate (see `redis`)
            out["redis"] = await redis(pool, events, rounds, log, bare=False, in_flight=100)
    finally:
        await drop_database(admin_dsn, name)
    loads["end"] = [round(x, 2) for x in os.getloadavg()]
    return {"load_average": loads, **out}


def main() -> None:
    """``python -m benchmarks.relay_streams --dsn ... [--events N] [--rounds R] --out F``"""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.relay_streams")
    parser.add_argument("--dsn", required=True, help="admin DSN (CREATE DATABASE)")
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", type=Path, required=True, help="the JSON written")
    args = parser.parse_args()
    started, at = time.perf_counter(), datetime.now(UTC)

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {message}", flush=True)

    results = asyncio.run(read_back_only(args.dsn, args.events, args.rounds, log))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    results["run"] = {
        "command": "python -m benchmarks.relay_streams " + " ".join(sys.argv[1:]),
        "started": at.isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - started, 1),
        "aiooutbox": commit,
        "cpus": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(results, args.out.with_suffix(".md"))
    log(f"wrote {args.out} and its .md")


def write_markdown(results: dict[str, Any], path: Path) -> None:
    """`read_back_only`'s results as markdown: the tables, the run, the load."""
    run, load = results["run"], results["load_average"]
    lines = streams_lines(results)
    tables = "\n".join(lines) + "\n" if lines else ""
    path.write_text(
        tables.lstrip()
        + f"\n- command: `{run['command']}`; started {run['started']}, took {run['seconds']} s"
        + f"\n- aiooutbox: {run['aiooutbox']}; {run['cpus']} CPUs; load average at start "
        + " / ".join(f"{x:.1f}" for x in load["start"])
        + ", at end "
        + " / ".join(f"{x:.1f}" for x in load["end"])
        + " (a shared machine)\n"
    )


if __name__ == "__main__":
    main()
