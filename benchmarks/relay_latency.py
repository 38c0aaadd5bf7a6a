"""``python -m benchmarks.relay_latency --dsn ... [--rounds R] [--rate N] [--seconds S]``

The ``relay`` scenario's latency into RabbitMQ alone: commit → broker ack of the relay at
its defaults (`brokers.bare.steady`: a durable queue, publisher confirms) and, as its
reference, RabbitMQ's own client at the same rate (`brokers.nats_rabbitmq.client_latency`),
in alternated rounds on a database of its own; each round's p50/p99 and load average,
then the medians (``--out``: also as JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg

import aiooutbox
from aiooutbox.relay import RabbitMQSink

from .brokers.bare import Log, timed_latency
from .brokers.nats_rabbitmq import AMQP_URL, client_latency
from .harness.databases import drop_database, recreate_database
from .harness.rounds import alternated


async def measure(
    admin_dsn: str, rounds: int, rate: float, seconds: float, log: Log
) -> dict[str, Any]:
    """Alternated rounds of the relay's and the client's latency; the results document."""
    import aio_pika

    name = "bench_relay_latency"
    dsn = await recreate_database(admin_dsn, name)
    queue = f"bench-lat-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(AMQP_URL)
    rows: dict[str, list[dict[str, Any]]] = {"relay": [], "client": []}
    try:
        channel = await connection.channel()
        q = await channel.declare_queue(queue, durable=True)
        async with asyncpg.create_pool(dsn, min_size=2, max_size=8) as pool:
            await aiooutbox.migrate(pool)

            async def relay() -> None:
                async with RabbitMQSink(AMQP_URL, destination=queue) as sink:
                    row = await timed_latency(pool, sink, rate, seconds, "rabbitmq", log)
                rows["relay"].append({**row, "load_average": round(os.getloadavg()[0], 2)})

            async def client() -> None:
                row = await client_latency(queue, rate, seconds, log)
                rows["client"].append({**row, "load_average": round(os.getloadavg()[0], 2)})

            for r in range(rounds):
                for step in alternated([relay, client], r):
                    await step()
                    await q.purge()
        await q.delete(if_unused=False, if_empty=False)
    finally:
        await connection.close()
        await drop_database(admin_dsn, name)
    medians = {
        what: {p: statistics.median(row[p] for row in found) for p in ("p50", "p99")}
        for what, found in rows.items()
    }
    return {"rate": rate, "seconds": seconds, "rounds": rows, "medians": medians}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.relay_latency")
    parser.add_argument("--dsn", required=True, help="admin DSN (CREATE DATABASE)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=2000.0, help="events/s")
    parser.add_argument("--seconds", type=float, default=10.0, help="of each measurement")
    parser.add_argument("--out", type=Path, help="the JSON written (default: none)")
    args = parser.parse_args()
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {message}", flush=True)

    results = asyncio.run(measure(args.dsn, args.rounds, args.rate, args.seconds, log))
    for what, row in results["medians"].items():
        loads = [r["load_average"] for r in results["rounds"][what]]
        log(f"{what}: median p50 {row['p50']:.1f} ms, p99 {row['p99']:.1f} ms; loads {loads}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
