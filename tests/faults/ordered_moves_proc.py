"""An ordered consumer process for the SIGKILL ordering test, with a freezing event loop:
``python -m tests.faults.ordered_moves_proc '<json>'``.

Config: ``{"dsn": ..., "worker_id": ..., "concurrency": 64, "fail_rate": 0.1,
"lease_timeout": 3, "freeze_every": null, "freeze_seconds": 6}``. It consumes two
topics: ``t``, and ``d`` whose handler blocks its key when an event dies
(``on_dead="block"``); an event whose payload says ``"die": true`` raises
`aiooutbox.Dead` on every run. With ``freeze_every`` set, a handler blocks the whole
event loop with ``time.sleep(freeze_seconds)`` (past the lease) once that many seconds
have passed since the last freeze.

Every handler run is recorded in ``runs`` (`RUNS_DDL`, with `MOVES_DDL`'s columns):
started (this machine's clock at the handler's first line), ended, outcome (``ok``,
``failed`` or ``dead``), and ``held``: whether the database showed the row as this
worker's and ``processing`` when the run was recorded (``seen``: what it showed). Every
freeze, and every other stall of the loop longer than half the lease (the least that
can cost a lease), is recorded in ``stalls``: a handler running across one may run again
elsewhere meanwhile (the one repeat docs/guarantees.md allows). Prints READY once
consuming; SIGTERM stops it gracefully, and it then prints one JSON line of counts
(freezes, other stalls, and the consumer's warnings about lapsed leases).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import sys
import time
from typing import Any

import asyncpg

import aiooutbox

# beside tests.faults.ordered_proc.RUNS_DDL
MOVES_DDL = (
    "ALTER TABLE runs ADD COLUMN IF NOT EXISTS held BOOLEAN,"
    " ADD COLUMN IF NOT EXISTS seen TEXT;"
    " CREATE INDEX IF NOT EXISTS runs_key_idx ON runs (okey, src, seq);"
    " CREATE INDEX IF NOT EXISTS runs_event_idx ON runs (event_id);"
    " CREATE TABLE IF NOT EXISTS stalls (worker TEXT NOT NULL, started TIMESTAMPTZ NOT NULL,"
    " ended TIMESTAMPTZ NOT NULL, deliberate BOOLEAN NOT NULL)"
)
START = (
    "INSERT INTO runs (event_id, okey, seq, worker, attempt, src, started, held, seen)"
    " SELECT $1, $2, $3, $4, $5, $6, to_timestamp($7),"
    "  coalesce(e.status = 'processing' AND e.locked_by = $4, false),"
    "  coalesce(e.status::text || ' ' || e.locked_by || ' attempt ' || e.attempts"
    "   || ' lease ' || round(extract(epoch FROM e.lease_expires_at - clock_timestamp()), 3),"
    "   e.status::text, 'gone')"
    "  || ', recorded '"
    "  || round((extract(epoch FROM clock_timestamp()) - $7)::numeric, 3) || ' s in'"
    " FROM (SELECT 1) one LEFT JOIN outbox_events e ON e.id = $1"
    " RETURNING run"
)
END = "UPDATE runs SET ended = to_timestamp($2), outcome = $3 WHERE run = $1"
STALL = "INSERT INTO stalls VALUES ($1, to_timestamp($2), to_timestamp($3), $4)"
# the consumer's warnings when a lease lapsed, by what it did about it, and when it could
# not write
LAPSES = {
    "not started": "not started, its lease lapsed",
    "lease lost": "lease lost",
    "outcome not written": "not written: its lease lapsed",
    # (a heartbeat or a flush that failed, e.g. on a deadlock, is tried again)
    "heartbeat failed": "lease heartbeat failed",
    "flush failed": "settlement flush failed",
}


class Counting(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts = dict.fromkeys(LAPSES, 0)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for name, text in LAPSES.items():
            if text in message:
                self.counts[name] += 1


class Loop:
    """Freezes this process's event loop on schedule, and records every stall."""

    def __init__(self, pool: asyncpg.Pool, worker: str, lease: float, config: dict[str, Any]):
        self.pool = pool
        self.worker = worker
        self.every = config.get("freeze_every")
        self.seconds = float(config.get("freeze_seconds", 2 * lease))
        self.threshold = lease / 2
        self.last = time.monotonic()
        self.freezes = 0
        self.stalls = 0

    async def maybe_freeze(self) -> None:
        if self.every is None or time.monotonic() - self.last < float(self.every):
            return
        started = time.time()
        time.sleep(self.seconds)  # the point: no heartbeat, no recovery, nothing runs
        ended = time.time()
        self.freezes += 1
        self.last = time.monotonic()
        await self.pool.execute(STALL, self.worker, started, ended, True)

    async def watch(self) -> None:
        """Record the loop's other stalls (a loaded machine): their handlers may repeat."""
        while True:
            freezes, started = self.freezes, time.time()
            await asyncio.sleep(0.05)
            ended = time.time()
            if ended - started > self.threshold and freezes == self.freezes:
                self.stalls += 1
                await self.pool.execute(STALL, self.worker, started, ended, False)


async def main(config: dict[str, Any]) -> None:
    rate = float(config.get("fail_rate", 0.1))
    worker = config["worker_id"]
    lease = float(config.get("lease_timeout", 3))
    counting = Counting()
    logging.getLogger("aiooutbox").addHandler(counting)
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setLevel(logging.WARNING)
    stderr.setFormatter(logging.Formatter(f"[{worker}] %(message)s"))
    logging.getLogger("aiooutbox").addHandler(stderr)
    async with asyncpg.create_pool(config["dsn"], min_size=2, max_size=12) as pool:
        loop_ = Loop(pool, worker, lease, config)

        async def handle(event: aiooutbox.Event) -> None:
            started = time.time()
            run = await pool.fetchval(
                START,
                event.id,
                event.ordering_key,
                event.payload["seq"],
                worker,
                event.attempts,
                event.payload.get("src", ""),  # which producer: order is per producer
                started,
            )
            await loop_.maybe_freeze()
            await asyncio.sleep(random.random() * 0.004)
            if event.payload.get("die"):
                await pool.execute(END, run, time.time(), "dead")
                raise aiooutbox.Dead("this event dies")
            fail = event.attempts == 1 and random.random() < rate
            await pool.execute(END, run, time.time(), "failed" if fail else "ok")
            if fail:
                raise RuntimeError("first attempt fails")

        consumer = aiooutbox.OutboxConsumer(
            pool,
            worker_id=worker,
            concurrency=int(config.get("concurrency", 64)),
            lease_timeout=lease,
            poll_interval=0.5,
            retry=aiooutbox.RetryPolicy(base=0.02, max_delay=0.1),
        )
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, consumer.stop)
        watch = asyncio.ensure_future(loop_.watch())
        blocking = aiooutbox.Handler(handle, on_dead="block")
        handlers: dict[str, aiooutbox.HandlerFunc | aiooutbox.Handler] = {
            "t": handle,
            "d": blocking,
        }
        task = asyncio.ensure_future(consumer.run(handlers))
        await consumer.wait_started()
        print("READY", flush=True)
        try:
            await task
        finally:
            watch.cancel()
        counts = {"freezes": loop_.freezes, "stalls": loop_.stalls, **counting.counts}
        print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
