"""``python -m benchmarks.ab --dsn ADMIN_DSN NAME=CHECKOUT NAME=CHECKOUT ...``

The same no-op drain with different aiooutbox checkouts, side by side: how every
hot-path change in docs/benchmarks-history.md was A/B-tested against the commit before it
(make one with ``git worktree add /tmp/before <commit>``). Each round drains ``--events``
events once per side, in an order that rotates by round, each in a fresh database and a
fresh process whose ``PYTHONPATH`` is that checkout; the medians per side and every
ratio between sides are printed and, with ``--out``, written as JSON.

Only the public API that every release has is used (``migrate``, ``OutboxConsumer``,
``run``), so any commit of the project can be a side. The rate is from the consumer's
start to the last settlement (startup included, as a user sees it); the client CPU is
the consumer process's, the server CPU that of the database's backends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from itertools import combinations
from pathlib import Path
from typing import Any

from .harness.config import settings_argument
from .harness.stats import median

# run in the child with the side's checkout first on sys.path
_CHILD = r"""
import asyncio, json, os, resource, sys, time

import asyncpg
import psutil

import aiooutbox

DSN, TABLE, N, SETTINGS = sys.argv[1], "outbox_events", int(sys.argv[2]), json.loads(sys.argv[3])
KEYS = int(sys.argv[4])  # 0: unordered; else event g has ordering key g % KEYS


async def main():
    conn = await asyncpg.connect(DSN)
    await aiooutbox.migrate(conn)
    if KEYS:
        await conn.execute(
            f"INSERT INTO {TABLE} (topic, payload, ordering_key)"
            " SELECT 'bench', jsonb_build_object('i', g), 'k' || (g % $2)"
            " FROM generate_series(1, $1) g",
            N,
            KEYS,
        )
    else:
        await conn.execute(
            f"INSERT INTO {TABLE} (topic, payload)"
            " SELECT 'bench', jsonb_build_object('i', g) FROM generate_series(1, $1) g",
            N,
        )
    await conn.execute(f"VACUUM ANALYZE {TABLE}")
    handled = 0
    finished = asyncio.Event()

    async def handler(event):
        nonlocal handled
        handled += 1
        if handled >= N:
            finished.set()

    async def batch_handler(events):
        nonlocal handled
        handled += len(events)
        if handled >= N:
            finished.set()

    batch = SETTINGS.pop("handler_batch", None)  # a batch handler of this size instead
    registered = aiooutbox.Handler(batch_handler, batch=batch) if batch else handler
    pool_size = SETTINGS.pop("pool_size", None)
    pool = await (
        asyncpg.create_pool(DSN, min_size=pool_size, max_size=pool_size)
        if pool_size
        else asyncpg.create_pool(DSN)
    )
    mine = await conn.fetchval("SELECT pg_backend_pid()")
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    async with aiooutbox.OutboxConsumer(pool, **SETTINGS) as consumer:
        task = asyncio.ensure_future(consumer.run({"bench": registered}))
        await asyncio.wait_for(finished.wait(), 600)
        while await conn.fetchval(f"SELECT count(*) FROM {TABLE} WHERE status <> 'done'"):
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - started
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        server = 0.0
        for (pid,) in await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> $1",
            mine,
        ):
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            server += times.user + times.system
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    await pool.close()
    await conn.close()
    client = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    print(json.dumps({"rate": N / elapsed, "client_cpu_s": client, "server_cpu_s": server}))


asyncio.run(main())
"""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ab", description=__doc__.split("\n")[0]
    )
    parser.add_argument("sides", nargs="+", metavar="NAME=CHECKOUT")
    parser.add_argument("--dsn", required=True, help="admin DSN (needs CREATE DATABASE)")
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument(
        "--keys",
        type=int,
        default=0,
        help="spread the events over this many ordering keys (0: unordered; every side"
        " must support ordered delivery)",
    )
    parser.add_argument(
        "--settings",
        default='{"concurrency": 500, "pool_size": 6}',
        help="OutboxConsumer keyword arguments as JSON, plus pool_size and handler_batch"
        " (a batch handler of that size) ('{}': the defaults)",
    )
    parser.add_argument("--database", default="bench_ab")
    parser.add_argument("--out", type=Path, help="write the rounds and medians here (JSON)")
    args = parser.parse_args(argv)
    sides: dict[str, Path] = {}
    for side in args.sides:
        name, sep, path = side.partition("=")
        checkout = Path(path)
        if not sep or not name or name in sides:
            parser.error(f"{side!r}: give each side as a distinct NAME=CHECKOUT")
        if not (checkout / "aiooutbox" / "__init__.py").is_file():
            parser.error(f"{side!r}: {checkout} is not an aiooutbox checkout")
        sides[name] = checkout.resolve()
    if len(sides) < 2:
        parser.error("give at least two sides to compare")
    if args.events < 1 or args.rounds < 1:
        parser.error("--events and --rounds must be positive")
    if args.keys < 0:
        parser.error("--keys must not be negative")
    args.sides, args.settings = sides, settings_argument(parser, "--settings", args.settings)
    return args


async def drain(args: argparse.Namespace, checkout: Path) -> dict[str, float]:
    """One drain of ``args.events`` in a fresh database, by ``checkout``'s aiooutbox."""
    import asyncpg

    from .harness.databases import recreate_database

    dsn = await recreate_database(args.dsn, args.database)
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CHILD,
        dsn,
        str(args.events),
        json.dumps(args.settings),
        str(args.keys),
        env=env,
        cwd="/",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await child.communicate()
    conn = await asyncpg.connect(args.dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{args.database}" WITH (FORCE)')
    finally:
        await conn.close()
    if child.returncode != 0:
        raise SystemExit(f"the drain with {checkout} failed:\n{err.decode()[-3000:]}")
    result: dict[str, float] = json.loads(out.decode().strip().splitlines()[-1])
    return result


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    medians = {
        name: {key: round(median([r[key] for r in rs]), 3) for key in rs[0]}
        for name, rs in runs.items()
    }
    ratios = {
        f"{b}/{a}": round(medians[b]["rate"] / medians[a]["rate"], 3)
        for a, b in combinations(runs, 2)
    }
    return {"medians": medians, "ratios": ratios}


async def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    names = list(args.sides)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            result = await drain(args, args.sides[name])
            runs[name].append(result)
            print(
                f"round {r + 1}: {name:12} {result['rate']:>9,.0f}/s  client cpu "
                f"{result['client_cpu_s']:.3f}s  server cpu {result['server_cpu_s']:.3f}s",
                flush=True,
            )
    summary = summarize(runs)
    for name, m in summary["medians"].items():
        print(
            f"median {name:12} {m['rate']:>9,.0f}/s  client cpu {m['client_cpu_s']:.3f}s"
            f"  server cpu {m['server_cpu_s']:.3f}s  ({args.rounds} rounds)"
        )
    for pair, value in summary["ratios"].items():
        print(f"ratio {pair}: {value}")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "events": args.events,
                    "settings": args.settings,
                    "sides": {n: str(p) for n, p in args.sides.items()},
                    "runs": runs,
                    **summary,
                },
                indent=2,
            )
        )
    return summary


if __name__ == "__main__":
    asyncio.run(main())
