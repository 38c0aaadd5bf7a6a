"""A consumer process for fault tests: ``python -m tests.faults.consumer_proc '<json>'``.

Configuration (JSON, all but ``dsn`` optional)::

    {"dsn": "...", "worker_id": "a", "concurrency": 8, "lease_timeout": 2,
     "poll_interval": 1, "statement_timeout": 2, "sleep": 0.05, "crash_topics": ["x"],
     "record": "each" | "batch", "max_attempts_hint": 3}

Every handler invocation is recorded in the table ``handled(event_id, worker_id,
attempt)``: with ``record="each"`` by one autocommitted insert before the handler's work
(so an invocation cut short by SIGKILL is still counted), with ``"batch"`` by a
background flush (for throughput runs without crashes). A handler for a topic in
``crash_topics`` ends the process at once with ``os._exit(3)``, as a segfault or an
OOM kill would. The process prints ``READY`` when its consumer is running (and
listening), stops gracefully on SIGTERM and prints its stats as JSON at exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from dataclasses import asdict
from typing import Any

import asyncpg

import aiooutbox

HANDLED_DDL = (
    "CREATE TABLE IF NOT EXISTS handled (event_id BIGINT NOT NULL, worker_id TEXT NOT NULL,"
    " attempt INT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())"
)


async def main(config: dict[str, Any]) -> None:
    worker_id = config.get("worker_id", f"proc-{os.getpid()}")
    sleep = float(config.get("sleep", 0.0))
    crash_topics = set(config.get("crash_topics", ()))
    topics = config.get("topics", ["t"])
    batched = config.get("record", "each") == "batch"
    pending: list[tuple[int, int]] = []

    async with asyncpg.create_pool(
        config["dsn"], min_size=1, max_size=int(config.get("max_pool", 6))
    ) as pool:

        async def record(rows: list[tuple[int, int]]) -> None:
            await pool.execute(
                "INSERT INTO handled (event_id, worker_id, attempt)"
                " SELECT i, $2, a FROM unnest($1::bigint[], $3::int[]) AS u(i, a)",
                [r[0] for r in rows],
                worker_id,
                [r[1] for r in rows],
            )

        async def handler(event: aiooutbox.Event) -> None:
            if event.topic in crash_topics:
                os._exit(3)
            if batched:
                pending.append((event.id, event.attempts))
            else:
                await record([(event.id, event.attempts)])
            if sleep:
                await asyncio.sleep(sleep)

        async def flusher() -> None:
            while True:
                await asyncio.sleep(0.05)
                if pending:
                    rows = pending[:]
                    del pending[: len(rows)]
                    await record(rows)

        consumer = aiooutbox.OutboxConsumer(
            pool,
            worker_id=worker_id,
            concurrency=int(config.get("concurrency", 8)),
            lease_timeout=float(config.get("lease_timeout", 2.0)),
            poll_interval=float(config.get("poll_interval", 1.0)),
            statement_timeout=float(config.get("statement_timeout", 2.0)),
            shutdown_grace=float(config.get("shutdown_grace", 5.0)),
            retry=aiooutbox.RetryPolicy(base=0.05, max_delay=0.5),
        )
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, consumer.stop)

        async def announce() -> None:
            while not (consumer.running and consumer.listening):
                await asyncio.sleep(0.01)
            print("READY", flush=True)

        flush_task = asyncio.ensure_future(flusher()) if batched else None
        ready = asyncio.ensure_future(announce())
        try:
            async with consumer:
                await consumer.run(dict.fromkeys(topics, handler))
        finally:
            ready.cancel()
            if flush_task is not None:
                flush_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await flush_task
            if pending:
                await record(pending)
    print(json.dumps({"worker_id": worker_id, **asdict(consumer.stats)}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
