"""The producer and the consumer of a soak (`benchmarks.harness.soak`), each in a process
of its own so that their CPU is theirs: ``python -m benchmarks.harness.soak_child SPEC``.

spec (JSON): ``role`` (producer | consumer), ``dsn``, ``board`` and ``batches`` (the
commit-time board below); the producer's ``rate``, ``batch`` and ``seconds``; the
consumer's ``options`` (`OutboxConsumer` keyword arguments, ``{}``: what a user who sets
nothing runs, ``OutboxConsumer(pool)`` on ``asyncpg.create_pool(dsn)``) and ``patch``
(a Python file run first, to measure an experimental engine change).

The board is a file of one float per producer batch, mapped by both processes: the
producer writes a batch's time into it just before it sends the batch's COMMIT, and
each event's payload is ``{"b": batch}``, so the handler reads when its event was
committed, with nothing sent between the processes while they run.

Protocol, one JSON object per line: the child prints ``{"type": "ready"}``; the parent
writes ``{"t0": wall time, "period": s, "periods": n}``; at ``t0 + k * period``
(k = 1..n) the child prints ``{"type": "period", "i": k - 1, ...}``: the producer what
it committed so far, the consumer what it handled so far and the commit -> handler
latencies of the events it handled within the period. The producer stops by itself
after ``seconds`` and prints ``{"type": "result", ...}``; the consumer runs until the
parent writes ``{"stop_after": N, "timeout": s}`` and reports once it handled N events
(or the time is up).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
import runpy
import sys
import time
from array import array
from pathlib import Path
from typing import Any

import asyncpg
import psutil

import aiooutbox

from .databases import TOPIC
from .stats import summarize_ms


class Board:
    """Commit times by batch number, in a file both processes map."""

    def __init__(self, path: str, batches: int, *, write: bool = False) -> None:
        self.size = batches
        with open(path, "r+b" if write else "rb") as file:
            access = mmap.ACCESS_WRITE if write else mmap.ACCESS_READ
            self._map = mmap.mmap(file.fileno(), batches * 8, access=access)
        self.times = memoryview(self._map).cast("d")

    @staticmethod
    def create(path: Path, batches: int) -> None:
        path.write_bytes(bytes(batches * 8))


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def _lines() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def _command(reader: asyncio.StreamReader) -> dict[str, Any]:
    line = await reader.readline()
    if not line:
        raise SystemExit("the parent closed stdin")
    command: dict[str, Any] = json.loads(line)
    return command


async def _periods(start: dict[str, Any], report: Any) -> None:
    """``report(i)``'s message at the end of each period."""
    for i in range(int(start["periods"])):
        await asyncio.sleep(max(0.0, start["t0"] + (i + 1) * start["period"] - time.time()))
        _emit({"type": "period", "i": i, "at": time.time(), **report()})


def _cpu() -> float:
    return round(float(sum(psutil.Process().cpu_times()[:2])), 2)


async def produce(spec: dict[str, Any], reader: asyncio.StreamReader) -> None:
    """One connection; batch k committed at ``t0 + k * batch / rate``, through
    `enqueue_many`; a batch that is late goes at once (the rate holds on average)."""
    board = Board(spec["board"], int(spec["batches"]), write=True)
    batch, interval = int(spec["batch"]), int(spec["batch"]) / float(spec["rate"])
    conn = await asyncpg.connect(spec["dsn"])
    committed, late = 0, 0.0
    took = array("d")

    def report() -> dict[str, Any]:
        nonlocal late
        out: dict[str, Any] = {"committed": committed, "late_ms": round(late * 1000, 1)}
        out["transaction_ms"] = summarize_ms(took)
        del took[:]
        late = 0.0
        return out

    try:
        _emit({"type": "ready"})
        start = await _command(reader)
        t0 = float(start["t0"])
        end = t0 + float(spec["seconds"])
        periods = asyncio.ensure_future(_periods(start, report))
        k = 0
        while k < board.size and t0 + k * interval < end:
            delay = t0 + k * interval - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                late = max(late, -delay)
            events = [aiooutbox.NewEvent(TOPIC, {"b": k})] * batch
            began = time.time()
            async with conn.transaction():
                await aiooutbox.enqueue_many(conn, events)
                board.times[k] = time.time()  # before COMMIT is sent: visible to handlers
            took.append(time.time() - began)
            committed += batch
            k += 1
        await periods
    finally:
        await conn.close()
    _emit({"type": "result", "committed": committed, "batches": k, "cpu_s": _cpu()})


async def consume(spec: dict[str, Any], reader: asyncio.StreamReader) -> None:
    """One `OutboxConsumer` with a no-op handler that records commit -> handler times."""
    if spec.get("patch"):
        runpy.run_path(spec["patch"], run_name="benchmark_patch")
    board = Board(spec["board"], int(spec["batches"]))
    latencies = array("d")
    handled = 0
    reached = asyncio.Event()
    target: int | None = None
    last = 0.0

    async def handler(event: aiooutbox.Event) -> None:
        nonlocal handled, last
        last = time.time()
        latencies.append(last - board.times[event.payload["b"]])
        handled += 1
        if target is not None and handled >= target:
            reached.set()

    def report() -> dict[str, Any]:
        out = {"handled": handled, "latency_ms": summarize_ms(latencies)}
        del latencies[:]
        return out

    options = dict(spec.get("options") or {})
    async with (
        asyncpg.create_pool(spec["dsn"], **dict(spec.get("pool") or {})) as pool,
        aiooutbox.OutboxConsumer(pool, **options) as consumer,
    ):
        running = asyncio.ensure_future(consumer.run({TOPIC: handler}))
        await consumer.wait_started()
        _emit({"type": "ready"})
        start = await _command(reader)
        periods = asyncio.ensure_future(_periods(start, report))
        stop = await _command(reader)
        target = int(stop["stop_after"])
        if handled >= target:
            reached.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reached.wait(), float(stop.get("timeout", 60)))
        periods.cancel()
        consumer.stop()
        await running
        stats = {k: v for k, v in vars(consumer.stats).items() if isinstance(v, int | float)}
    _emit(
        {
            "type": "result",
            "handled": handled,
            "t_last": last,
            "caught_up": handled >= target,
            "cpu_s": _cpu(),
            "stats": stats,
        }
    )


async def main(spec: dict[str, Any]) -> None:
    reader = await _lines()
    await (produce if spec["role"] == "producer" else consume)(spec, reader)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
