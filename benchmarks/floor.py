"""The machine's floor under light-load latency, measured beside the steady state.

At a few events a second the two cores sleep between events, and every hop of the
chain from a producer's COMMIT to a handler wakes a sleeping process: the producer's
backend flushes the WAL and signals the listening backend, which wakes the consumer,
whose claim wakes another backend and flushes the WAL again. How much a hop costs
after an idle pause is a fact of the machine (a virtual CPU that halted, cold caches),
not of any queue, so this measures it in the same run as the latencies it bounds:

- ``select1_warm``: ``SELECT 1`` back to back (a round trip on a busy machine);
- ``select1_idle``: ``SELECT 1`` after ``gap`` seconds with nothing to do;
- ``write_idle``: a one-row ``INSERT`` committed on its own (WAL flush) after the gap;
- ``chain_idle``: the shortest LISTEN-woken queue, after the gap: a producer inserts a
  row and calls ``pg_notify`` in one transaction; from sending its COMMIT, until a third
  connection, which sent its one-row ``INSERT`` as soon as the listening connection
  heard the notification, has that insert's reply. ``heard_idle`` is its first part,
  from the COMMIT to the notification.

``chain_idle`` at the median is the floor for a queue's light-load latency from the
producer's COMMIT to a handler: hear the notification, then one round trip that records
the claim, with the queue's own code costing nothing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg

from .common import drop_database, recreate_database, summarize_ms

_CHANNEL = "bench_floor"


async def measure(admin_dsn: str, database: str, *, samples: int, gap: float) -> dict[str, Any]:
    """Each quantity ``samples`` times, in a scratch database dropped afterwards."""
    dsn = await recreate_database(admin_dsn, database)
    try:
        return await _measure(dsn, samples, gap)
    finally:
        await drop_database(admin_dsn, database)


async def _measure(dsn: str, samples: int, gap: float) -> dict[str, Any]:
    times: dict[str, list[float]] = {
        "select1_warm": [],
        "select1_idle": [],
        "write_idle": [],
        "heard_idle": [],
        "chain_idle": [],
    }
    conn = await asyncpg.connect(dsn)
    listener = await asyncpg.connect(dsn)
    worker = await asyncpg.connect(dsn)
    heard: asyncio.Queue[float] = asyncio.Queue()
    written: asyncio.Queue[tuple[float, float]] = asyncio.Queue()

    async def write_when_heard() -> None:
        while True:
            at = await heard.get()
            await worker.execute("INSERT INTO floor_rows DEFAULT VALUES")
            written.put_nowait((at, time.perf_counter()))

    writer = asyncio.create_task(write_when_heard())
    try:
        await conn.execute("CREATE TABLE floor_rows (id bigint GENERATED ALWAYS AS IDENTITY)")
        await listener.add_listener(_CHANNEL, lambda *_: heard.put_nowait(time.perf_counter()))
        for _ in range(samples):
            await conn.fetchval("SELECT 1")  # back to back: the first is only warm-up
            started = time.perf_counter()
            await conn.fetchval("SELECT 1")
            times["select1_warm"].append(time.perf_counter() - started)

            await asyncio.sleep(gap)
            started = time.perf_counter()
            await conn.fetchval("SELECT 1")
            times["select1_idle"].append(time.perf_counter() - started)

            await asyncio.sleep(gap)
            started = time.perf_counter()
            await conn.execute("INSERT INTO floor_rows DEFAULT VALUES")
            times["write_idle"].append(time.perf_counter() - started)

            await asyncio.sleep(gap)
            async with conn.transaction():
                await conn.execute("INSERT INTO floor_rows DEFAULT VALUES")
                await conn.execute("SELECT pg_notify($1, '')", _CHANNEL)
                committing = time.perf_counter()
            at, done = await asyncio.wait_for(written.get(), 10)
            times["heard_idle"].append(at - committing)
            times["chain_idle"].append(done - committing)
    finally:
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        for c in (worker, listener, conn):
            await c.close()
    out: dict[str, Any] = {"samples": samples, "gap_s": gap}
    out.update({name: summarize_ms(values) for name, values in times.items()})
    return out
