"""A consumer process with a batch handler: ``python -m tests.faults.batch_proc '<json>'``.

Config: ``{"dsn": ..., "worker_id": ..., "concurrency": 40, "batch": 20,
"lease_timeout": 2, "sleep": 0.05, "prefetch": null}``. Each call records its events,
in the order given, in ``runs`` (one autocommitted insert before the call's work: a
call cut short by SIGKILL is still counted), then sleeps ``sleep`` seconds and returns
None. Prints READY once consuming; SIGTERM stops it gracefully.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from typing import Any

import asyncpg

import aiooutbox

RUNS_DDL = (
    "CREATE TABLE IF NOT EXISTS runs (run BIGSERIAL PRIMARY KEY, event_id BIGINT NOT NULL,"
    " okey TEXT, seq INT NOT NULL, worker TEXT NOT NULL, attempt INT NOT NULL, call INT NOT NULL)"
)


async def main(config: dict[str, Any]) -> None:
    worker = config["worker_id"]
    sleep = float(config.get("sleep", 0.05))
    calls = 0
    async with asyncpg.create_pool(config["dsn"], min_size=2, max_size=8) as pool:

        async def publish(events: list[aiooutbox.Event]) -> None:
            nonlocal calls
            calls += 1
            await pool.execute(
                "INSERT INTO runs (event_id, okey, seq, worker, attempt, call)"
                " SELECT * FROM unnest($1::bigint[], $2::text[], $3::int[], $4::text[],"
                " $5::int[], $6::int[])",
                [e.id for e in events],
                [e.ordering_key for e in events],
                [e.payload["seq"] for e in events],
                [worker] * len(events),
                [e.attempts for e in events],
                [calls] * len(events),
            )
            await asyncio.sleep(sleep)

        consumer = aiooutbox.OutboxConsumer(
            pool,
            worker_id=worker,
            concurrency=int(config.get("concurrency", 40)),
            prefetch=config.get("prefetch"),
            lease_timeout=float(config.get("lease_timeout", 2.0)),
            poll_interval=0.5,
            statement_timeout=2.0,
        )
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, consumer.stop)
        handlers = {"t": aiooutbox.Handler(publish, batch=int(config.get("batch", 20)))}
        task = asyncio.ensure_future(consumer.run(handlers))
        await consumer.wait_started()
        print("READY", flush=True)
        await task
        print(json.dumps({"done": consumer.stats.done}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
