"""``python -m benchmarks.bare_loop --dsn ADMIN_DSN NAME=CHECKOUT ...``

The limit a consumer of one PostgreSQL table can reach from Python, beside aiooutbox
drains in the same run: a bare asyncpg loop on ``--connections`` connections, each
claiming ``--batch`` rows with one ``UPDATE … RETURNING`` over ``FOR UPDATE SKIP
LOCKED`` and settling them with one ``UPDATE … WHERE id = ANY($1)``, no leases, no
order, no retries. Its table has only what that needs (a primary key, a status, a
partial index of the pending rows). Each round drains ``--events`` no-op events once
per side (the bare loop and each checkout, as `benchmarks.ab` drains them), in an order
that rotates by round, each in a fresh database and process; it prints the medians
(rate, client and server CPU per event) and each side's rate over the bare loop's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from .ab import drain
from .common import median, recreate_database, settings_argument

_BARE = r"""
import asyncio, json, resource, sys, time

import asyncpg
import psutil

DSN, N, CONNECTIONS, BATCH = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
CLAIM = (
    "UPDATE bare_jobs SET status = 'processing', locked_by = $1, attempts = attempts + 1"
    " WHERE id = ANY(ARRAY(SELECT id FROM bare_jobs WHERE status = 'pending'"
    " ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED)) RETURNING id, payload"
)
SETTLE = "UPDATE bare_jobs SET status = 'done' WHERE id = ANY($1::bigint[])"


async def main():
    conn = await asyncpg.connect(DSN)
    await conn.execute(
        "CREATE TABLE bare_jobs (id bigserial PRIMARY KEY, payload jsonb NOT NULL,"
        " status text NOT NULL DEFAULT 'pending', locked_by text, attempts int NOT NULL"
        " DEFAULT 0);"
        " CREATE INDEX bare_jobs_pending ON bare_jobs (id) WHERE status = 'pending'"
    )
    await conn.execute(
        "INSERT INTO bare_jobs (payload)"
        " SELECT jsonb_build_object('i', g) FROM generate_series(1, $1) g",
        N,
    )
    await conn.execute("VACUUM ANALYZE bare_jobs")
    mine = await conn.fetchval("SELECT pg_backend_pid()")
    handled = 0

    async def handler(row):
        nonlocal handled
        handled += 1

    async def loop(i, worker):
        while rows := await worker.fetch(CLAIM, f"bare-{i}", BATCH):
            for row in rows:
                await handler(row)
            await worker.execute(SETTLE, [r[0] for r in rows])

    # connected first, closed after the server's CPU is read (an exited backend's is gone)
    workers = [await asyncpg.connect(DSN) for _ in range(CONNECTIONS)]
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    await asyncio.gather(*(loop(i, w) for i, w in enumerate(workers)))
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
    for worker in workers:
        await worker.close()
    left = await conn.fetchval("SELECT count(*) FROM bare_jobs WHERE status <> 'done'")
    await conn.close()
    assert handled == N and left == 0, (handled, left)
    client = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    print(json.dumps({"rate": N / elapsed, "client_cpu_s": client, "server_cpu_s": server}))


asyncio.run(main())
"""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bare_loop", description=__doc__.split("\n")[0]
    )
    parser.add_argument("sides", nargs="*", metavar="NAME=CHECKOUT")
    parser.add_argument("--dsn", required=True, help="admin DSN (needs CREATE DATABASE)")
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--connections", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument(
        "--settings", default="{}", help="the checkouts' OutboxConsumer keywords (JSON)"
    )
    parser.add_argument("--database", default="bench_bare")
    parser.add_argument("--out", type=Path, help="write the rounds and medians here (JSON)")
    args = parser.parse_args(argv)
    sides: dict[str, Path] = {}
    for side in args.sides:
        name, sep, path = side.partition("=")
        checkout = Path(path)
        if not sep or not name or name in sides or name == "bare":
            parser.error(f"{side!r}: give each side as a distinct NAME=CHECKOUT (not 'bare')")
        if not (checkout / "aiooutbox" / "__init__.py").is_file():
            parser.error(f"{side!r}: {checkout} is not an aiooutbox checkout")
        sides[name] = checkout.resolve()
    if args.events < 1 or args.rounds < 1 or args.connections < 1 or args.batch < 1:
        parser.error("--events, --rounds, --connections and --batch must be positive")
    args.sides, args.settings = sides, settings_argument(parser, "--settings", args.settings)
    return args


async def bare_drain(args: argparse.Namespace) -> dict[str, float]:
    """One drain of the bare loop in a fresh database."""
    import asyncpg

    dsn = await recreate_database(args.dsn, args.database)
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _BARE,
        dsn,
        str(args.events),
        str(args.connections),
        str(args.batch),
        env=dict(os.environ),
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
        raise SystemExit(f"the bare loop failed:\n{err.decode()[-3000:]}")
    result: dict[str, float] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    names = ["bare", *args.sides]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if name == "bare":
                result = await bare_drain(args)
            else:
                result = await drain(args, args.sides[name])
            runs[name].append(result)
            print(
                f"round {r + 1}: {name:8} {result['rate']:>9,.0f}/s  client "
                f"{result['client_cpu_s'] / args.events * 1e6:5.1f} µs/event  server "
                f"{result['server_cpu_s'] / args.events * 1e6:5.1f} µs/event",
                flush=True,
            )
    medians = {
        name: {
            "rate": round(median([x["rate"] for x in rs]), 1),
            "client_us": round(median([x["client_cpu_s"] for x in rs]) / args.events * 1e6, 2),
            "server_us": round(median([x["server_cpu_s"] for x in rs]) / args.events * 1e6, 2),
        }
        for name, rs in runs.items()
    }
    # per round, each side's rate over the bare loop's in the same round
    ratios = {
        name: round(
            median([x["rate"] / b["rate"] for x, b in zip(runs[name], runs["bare"], strict=True)]),
            3,
        )
        for name in args.sides
    }
    for name, m in medians.items():
        print(
            f"median {name:8} {m['rate']:>9,.0f}/s  client {m['client_us']} µs/event"
            f"  server {m['server_us']} µs/event  ({args.rounds} rounds)"
        )
    for name, value in ratios.items():
        print(f"ratio {name}/bare (median of the rounds' ratios): {value}")
    summary = {"medians": medians, "ratios_to_bare": ratios}
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "events": args.events,
                    "connections": args.connections,
                    "batch": args.batch,
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
