"""A consumer process for flow-control tests: ``python -m tests.faults.flow_proc '<json>'``.

Configuration (JSON, all but ``dsn`` optional)::

    {"dsn": "...", "worker_id": "a", "topics": ["t"], "concurrency": 8, "sleep": 0.3,
     "sleep_topics": ["t"], "lease_timeout": 2, "poll_interval": 1, "prefetch": null}

Every handler run is recorded in ``runs(event_id, topic, worker_id, started, ended)``:
a row inserted (autocommitted, with the server's clock) before the handler's work and
its ``ended`` set after it, so a run cut short by SIGKILL has no end. The process
prints ``READY`` once its consumer runs and listens, and stops gracefully on SIGTERM.
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
    "CREATE TABLE IF NOT EXISTS runs (event_id BIGINT NOT NULL, topic TEXT NOT NULL,"
    " worker_id TEXT NOT NULL, started TIMESTAMPTZ NOT NULL, ended TIMESTAMPTZ)"
)


async def main(config: dict[str, Any]) -> None:
    worker_id = config.get("worker_id", "flow")
    sleep = float(config.get("sleep", 0.0))
    slow = set(config.get("sleep_topics", config.get("topics", ["t"])))  # topics that sleep
    async with asyncpg.create_pool(config["dsn"], min_size=2, max_size=8) as pool:

        async def handler(event: aiooutbox.Event) -> None:
            await pool.execute(
                "INSERT INTO runs (event_id, topic, worker_id, started)"
                " VALUES ($1, $2, $3, clock_timestamp())",
                event.id,
                event.topic,
                worker_id,
            )
            if sleep and event.topic in slow:
                await asyncio.sleep(sleep)
            await pool.execute(
                "UPDATE runs SET ended = clock_timestamp()"
                " WHERE event_id = $1 AND worker_id = $2 AND ended IS NULL",
                event.id,
                worker_id,
            )

        consumer = aiooutbox.OutboxConsumer(
            pool,
            worker_id=worker_id,
            concurrency=int(config.get("concurrency", 8)),
            prefetch=config.get("prefetch"),
            lease_timeout=float(config.get("lease_timeout", 2.0)),
            poll_interval=float(config.get("poll_interval", 1.0)),
            statement_timeout=float(config.get("statement_timeout", 5.0)),
        )
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, consumer.stop)

        async def announce() -> None:
            while not (consumer.running and consumer.listening):
                await asyncio.sleep(0.01)
            print("READY", flush=True)

        ready = asyncio.ensure_future(announce())
        try:
            async with consumer:
                await consumer.run(dict.fromkeys(config.get("topics", ["t"]), handler))
        finally:
            ready.cancel()
    print(json.dumps({"worker_id": worker_id}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
