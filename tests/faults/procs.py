"""Start `consumer_proc` processes and talk to them; shared assertions from the database."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg

ROOT = Path(__file__).resolve().parents[2]


class ConsumerProcess:
    """One ``python -m tests.faults.consumer_proc`` child."""

    def __init__(self, config: dict[str, Any], module: str = "tests.faults.consumer_proc") -> None:
        self.config = config
        # stderr to a file, not a pipe: a chatty child must never block on a full pipe
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, json.dumps(config)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    async def ready(self, timeout: float = 30.0) -> None:
        """Wait for the child's READY line (its consumer runs and listens)."""
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
        if line.strip() != "READY":
            raise AssertionError(f"consumer process did not start: {line!r}\n{self.stderr()}")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-4000:]

    async def stop(self, timeout: float = 30.0) -> dict[str, Any]:
        """SIGTERM, wait, return the stats line it printed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.to_thread(self.proc.communicate, timeout=timeout)
        assert self.proc.returncode == 0, (
            f"consumer exited {self.proc.returncode}:\n{self.stderr()}"
        )
        return dict(json.loads(out.strip().splitlines()[-1]))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], timeout: float, what: str, interval: float = 0.05
) -> float:
    """Poll ``predicate`` until true; return the seconds it took, or fail after ``timeout``."""
    started = time.monotonic()
    while True:
        if await predicate():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


async def status_counts(conn: asyncpg.Connection) -> dict[str, int]:
    rows = await conn.fetch("SELECT status::text, count(*) FROM outbox_events_all GROUP BY 1")
    return {r[0]: r[1] for r in rows}


async def all_finished(conn: asyncpg.Connection, total: int | None = None) -> bool:
    counts = await status_counts(conn)
    unfinished = sum(v for k, v in counts.items() if k not in ("done", "dead"))
    return unfinished == 0 and (total is None or sum(counts.values()) == total)


HANDLED_DDL = (
    "CREATE TABLE handled (event_id BIGINT NOT NULL, worker_id TEXT NOT NULL,"
    " attempt INT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())"
)


async def check_outcome(conn: asyncpg.Connection) -> dict[str, int]:
    """The assertions every fault test makes from the database; returns the numbers.

    Every row is ``done`` or ``dead``; every ``done`` row was handled at least once; no
    row was handled more often than it was claimed (``attempts``); the same attempt was
    never handled twice (no double claim).
    """
    counts = await status_counts(conn)
    assert set(counts) <= {"done", "dead"}, f"unfinished rows remain: {counts}"
    rows = await conn.fetch(
        "SELECT e.id, e.status::text, e.attempts, count(h.event_id) AS runs,"
        " count(DISTINCT h.attempt) AS distinct_attempts"
        " FROM outbox_events_all e LEFT JOIN handled h ON h.event_id = e.id"
        " GROUP BY e.id, e.status, e.attempts"
    )
    never = [r["id"] for r in rows if r["status"] == "done" and r["runs"] == 0]
    assert not never, f"done without a handler run: {never[:10]}"
    over = [dict(r) for r in rows if r["runs"] > r["attempts"]]
    assert not over, f"handled more often than claimed: {over[:10]}"
    doubled = [dict(r) for r in rows if r["runs"] != r["distinct_attempts"]]
    assert not doubled, f"one attempt handled twice (double claim): {doubled[:10]}"
    return {
        "events": len(rows),
        "done": counts.get("done", 0),
        "dead": counts.get("dead", 0),
        "runs": sum(r["runs"] for r in rows),
        "duplicated_events": sum(1 for r in rows if r["runs"] > 1),
        "extra_runs": sum(max(r["runs"] - 1, 0) for r in rows),
    }


def dump_tasks() -> None:
    """Print where every task of the running loop waits: the first thing to look at on a hang."""
    for task in asyncio.all_tasks():
        print("task", task.get_name())
        coro: Any = task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is None:
                break
            where = frame.f_code.co_filename.split("site-packages/")[-1]
            print(f"    {where}:{frame.f_lineno} {frame.f_code.co_name}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
