"""A consumer of every topic (``"*"``, as relays run) beside many held topics.

``python -m benchmarks.flow_wildcard``: the drain of ``size`` events of one topic by a
consumer of every topic, in three databases, rounds alternating the variants:

- ``none``: nothing else in the outbox, no controls;
- ``paused``: beside ``topics`` paused topics with ``backlog`` events each, older than
  the drained events;
- ``at_limit``: beside ``topics`` topics at their max_running (1, taken by a row
  another consumer holds for a day), with ``backlog`` events each.

The ratios are of the medians of each variant's rate (events/s), against ``none``:
flow control promises that held topics cost the other topics nothing (target >= 0.9).
The consumer runs in a child process of its own (this module with ``--child``), as
in the other drains. Self-contained: ``run()`` returns the results as a dict for a
harness to report, ``main()`` prints them (and writes them to ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

import aiooutbox
from aiooutbox.observe import Observer

__all__ = ["Config", "main", "run"]

TOPIC = "bench"
VARIANTS = ("none", "paused", "at_limit")
ROOT = Path(__file__).resolve().parents[1]
# this module, as the child drains run it (wherever a harness moves it)
_MODULE = __spec__.name if __spec__ is not None else "benchmarks.flow_wildcard"


@dataclass(frozen=True)
class Config:
    admin_dsn: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    prefix: str = "aiooutbox_bench_wildcard_"
    topics: int = 1000  # held topics
    backlog: int = 100  # events of each held topic
    size: int = 20_000  # events drained per run
    rounds: int = 5
    # the drain settings of the other benchmarks (benchmarks/systems/aiooutbox_runner.py)
    concurrency: int = 500
    prefetch: int = 1500
    pool_size: int = 6
    timeout: float = 300.0  # one drain


def _database(dsn: str, name: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path="/" + name))


async def _recreate(config: Config, name: str) -> str:
    conn = await asyncpg.connect(config.admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    dsn = _database(config.admin_dsn, name)
    conn = await asyncpg.connect(dsn)
    try:
        await aiooutbox.migrate(conn)
    finally:
        await conn.close()
    return dsn


async def _drop(config: Config, name: str) -> None:
    conn = await asyncpg.connect(config.admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def _held_fixture(dsn: str, config: Config, variant: str) -> None:
    """The held topics, their backlog (an hour old) and their controls; for
    ``at_limit`` also the row of each that another consumer holds (written past the
    insert check, as a restore would)."""
    conn = await asyncpg.connect(dsn)
    try:
        name = "'held' || lpad((g % $1)::text, 5, '0')"
        await conn.execute(
            "INSERT INTO outbox_events (topic, payload, available_at)"
            f" SELECT {name}, jsonb_build_object('i', g), now() - interval '1 hour'"
            " FROM generate_series(1, $2::int) AS g",
            config.topics,
            config.topics * config.backlog,
        )
        if variant == "at_limit":
            async with conn.transaction():
                await conn.execute("ALTER TABLE outbox_events DISABLE TRIGGER USER")
                await conn.execute(
                    "INSERT INTO outbox_events (topic, payload, status, attempts, locked_by,"
                    " locked_at, lease_expires_at, flow_counted)"
                    f" SELECT {name}, '{{}}', 'processing', 1, 'elsewhere', now(),"
                    " now() + interval '1 day', true FROM generate_series(1, $1::int) AS g",
                    config.topics,
                )
                await conn.execute("ALTER TABLE outbox_events ENABLE TRIGGER USER")
        paused, limit = ("true", "NULL") if variant == "paused" else ("false", "1")
        await conn.execute(
            "INSERT INTO outbox_events_flow (topic, paused, max_running, updated_by)"
            f" SELECT 'held' || lpad(g::text, 5, '0'), {paused}, {limit}, 'bench'"
            " FROM generate_series(0, $1::int - 1) AS g",
            config.topics,
        )
    finally:
        await conn.close()


async def _load(dsn: str, size: int, keep: int) -> None:
    """Back to the fixture (rows after ``keep`` removed), then ``size`` fresh events."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("DELETE FROM outbox_events WHERE id > $1", keep)
        await conn.execute("TRUNCATE outbox_events_idle")
        await conn.execute(
            "INSERT INTO outbox_events (topic, payload)"
            " SELECT $1, jsonb_build_object('i', g) FROM generate_series(1, $2::int) AS g",
            TOPIC,
            size,
        )
        await conn.execute("VACUUM (ANALYZE) outbox_events")
    finally:
        await conn.close()


def _drain(dsn: str, config: Config) -> dict[str, Any]:
    spec = {
        "dsn": dsn,
        "n": config.size,
        "concurrency": config.concurrency,
        "prefetch": config.prefetch,
        "pool_size": config.pool_size,
        "timeout": config.timeout,
    }
    done = subprocess.run(
        [sys.executable, "-m", _MODULE, "--child", json.dumps(spec)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=config.timeout + 60,
        check=False,
    )
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


async def run(config: Config, log: Any = print) -> dict[str, Any]:
    """Build the three databases, drain each variant once per round (the order rotating
    by round), drop them; return the runs, the median rates and the ratios."""
    dsns: dict[str, str] = {}
    keep: dict[str, int] = {}
    started = time.perf_counter()
    try:
        for variant in VARIANTS:
            dsns[variant] = await _recreate(config, config.prefix + variant)
            if variant != "none":
                await _held_fixture(dsns[variant], config, variant)
            conn = await asyncpg.connect(dsns[variant])
            try:
                keep[variant] = int(
                    await conn.fetchval("SELECT coalesce(max(id), 0) FROM outbox_events")
                )
            finally:
                await conn.close()
        log(
            f"flow_wildcard: {config.topics:,} held topics x {config.backlog:,} events;"
            f" built in {time.perf_counter() - started:.1f}s"
        )
        runs: list[dict[str, Any]] = []
        for r in range(config.rounds):
            shift = r % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                await _load(dsns[variant], config.size, keep[variant])
                result = await asyncio.to_thread(_drain, dsns[variant], config)
                runs.append({"round": r, "variant": variant, **result})
                if "error" in result:
                    log(f"  round {r} {variant:9} failed: {result['error'][-300:]}")
                else:
                    log(
                        f"  round {r} {variant:9} {result['rate']:9,.0f} events/s"
                        f" ({result['seconds']:.2f}s; {result['claims']} claims took"
                        f" {result['claim_seconds']:.2f}s)"
                    )
    finally:
        for variant in dsns:
            await _drop(config, config.prefix + variant)
    rates = {
        v: statistics.median([x["rate"] for x in runs if x["variant"] == v and "rate" in x] or [0])
        for v in VARIANTS
    }
    ratios = {
        f"{v}_vs_none": round(rates[v] / rates["none"], 3) if rates["none"] else 0.0
        for v in VARIANTS[1:]
    }
    # the same from each round's own drains (which ran within seconds of each other),
    # less sensitive to a machine whose load drifts over the run
    by_round = {(x["round"], x["variant"]): x["rate"] for x in runs if "rate" in x}
    paired = {
        f"{v}_vs_none": round(
            statistics.median(
                [
                    by_round[r, v] / by_round[r, "none"]
                    for r in range(config.rounds)
                    if (r, v) in by_round and (r, "none") in by_round
                ]
                or [0.0]
            ),
            3,
        )
        for v in VARIANTS[1:]
    }
    log(
        "  ratios of the medians: "
        + ", ".join(f"{k} = {v:.3f}" for k, v in ratios.items())
        + "; medians of each round's ratios: "
        + ", ".join(f"{k} = {v:.3f}" for k, v in paired.items())
        + " (target >= 0.9)"
    )
    return {
        "config": asdict(config),
        "runs": runs,
        "rates": {k: round(v, 1) for k, v in rates.items()},
        "ratios": ratios,
        "paired_ratios": paired,
    }


# -- the child: one drain --------------------------------------------------------------
class _ClaimTime(Observer):
    """The time the consumer's claims took (the claim loop waits for each)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def claimed(self, rows: int, seconds: float) -> None:
        self.seconds += seconds


async def _child(spec: dict[str, Any]) -> dict[str, Any]:
    n = int(spec["n"])
    handled = 0
    finished = asyncio.Event()
    claiming = _ClaimTime()

    async def handle(event: aiooutbox.Event) -> None:
        nonlocal handled
        handled += 1
        if handled >= n:
            finished.set()

    size = int(spec["pool_size"])
    async with asyncpg.create_pool(spec["dsn"], min_size=size, max_size=size) as pool:
        consumer = aiooutbox.OutboxConsumer(
            pool,
            concurrency=int(spec["concurrency"]),
            prefetch=int(spec["prefetch"]),
            poll_interval=0.1,
            observers=[claiming],
        )
        started = time.perf_counter()
        task = asyncio.ensure_future(consumer.run({"*": handle}))
        try:
            await asyncio.wait_for(finished.wait(), float(spec["timeout"]))
            seconds = time.perf_counter() - started
        finally:
            consumer.stop()
            await task
    return {
        "seconds": seconds,
        "rate": n / seconds,
        "claims": consumer.stats.claims,
        "claim_seconds": round(claiming.seconds, 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.flow_wildcard",
        description="The drain of one topic by a consumer of every topic, alone (none) and"
        " beside paused (paused) or full (at_limit) topics, in a database of its own each.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = Config()
    parser.add_argument("--dsn", default=defaults.admin_dsn, help="an admin DSN (CREATE DATABASE)")
    parser.add_argument("--prefix", default=defaults.prefix, help="of the databases made")
    parser.add_argument("--topics", type=int, default=defaults.topics, help="held topics")
    parser.add_argument(
        "--backlog", type=int, default=defaults.backlog, help="events of each held topic"
    )
    parser.add_argument("--size", type=int, default=defaults.size, help="events drained per run")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="runs of each variant")
    parser.add_argument(
        "--concurrency", type=int, default=defaults.concurrency, help="the consumer's"
    )
    parser.add_argument("--prefetch", type=int, default=defaults.prefetch, help="the consumer's")
    parser.add_argument(
        "--pool-size", type=int, default=defaults.pool_size, help="the consumer's pool"
    )
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(asyncio.run(_child(json.loads(args.child)))), flush=True)
        return None
    config = Config(
        admin_dsn=args.dsn,
        prefix=args.prefix,
        topics=args.topics,
        backlog=args.backlog,
        size=args.size,
        rounds=args.rounds,
        concurrency=args.concurrency,
        prefetch=args.prefetch,
        pool_size=args.pool_size,
    )
    results = asyncio.run(run(config))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


if __name__ == "__main__":
    main()
