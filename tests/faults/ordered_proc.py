"""An ordered-delivery consumer process: ``python -m tests.faults.ordered_proc '<json>'``.

Config: ``{"dsn": ..., "worker_id": ..., "concurrency": 64, "fail_rate": 0.1,
"lease_timeout": 3, "handler_seconds": null}`` (``handler_seconds``: each run takes this
long; by default a few random milliseconds). Every handler run is recorded in ``runs``
(a row inserted when it starts, completed when it ends, both autocommitted), so the test
can check with SQL that no two runs of one key overlapped and each ran after its
predecessors. Prints READY once consuming; SIGTERM stops it gracefully.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import sys
from typing import Any

import asyncpg

import aiooutbox

RUNS_DDL = (
    "CREATE TABLE IF NOT EXISTS runs (run BIGSERIAL PRIMARY KEY, event_id BIGINT NOT NULL,"
    " okey TEXT NOT NULL, seq INT NOT NULL, worker TEXT NOT NULL, attempt INT NOT NULL,"
    " started TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(), ended TIMESTAMPTZ,"
    " outcome TEXT, src TEXT NOT NULL DEFAULT '')"
)


async def main(config: dict[str, Any]) -> None:
    rate = float(config.get("fail_rate", 0.1))
    seconds = config.get("handler_seconds")
    worker = config["worker_id"]
    async with asyncpg.create_pool(config["dsn"], min_size=2, max_size=12) as pool:

        async def handle(event: aiooutbox.Event) -> None:
            run = await pool.fetchval(
                "INSERT INTO runs (event_id, okey, seq, worker, attempt, src)"
                " VALUES ($1, $2, $3, $4, $5, $6) RETURNING run",
                event.id,
                event.ordering_key,
                event.payload["seq"],
                worker,
                event.attempts,
                event.payload.get("src", ""),  # which producer: order is per producer
            )
            await asyncio.sleep(random.random() * 0.004 if seconds is None else float(seconds))
            fail = event.attempts == 1 and random.random() < rate
            await pool.execute(
                "UPDATE runs SET ended = clock_timestamp(), outcome = $2 WHERE run = $1",
                run,
                "failed" if fail else "ok",
            )
            if fail:
                raise RuntimeError("first attempt fails")

        consumer = aiooutbox.OutboxConsumer(
            pool,
            worker_id=worker,
            concurrency=int(config.get("concurrency", 64)),
            lease_timeout=float(config.get("lease_timeout", 3)),
            poll_interval=0.5,
            retry=aiooutbox.RetryPolicy(base=0.02, max_delay=0.1),
        )
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, consumer.stop)
        task = asyncio.ensure_future(consumer.run({"t": handle}))
        await consumer.wait_started()
        print("READY", flush=True)
        await task


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
