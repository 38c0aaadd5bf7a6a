"""Shared plumbing: databases, statistics, and the subprocess consumer protocol.

Consumers always run in a child process (``python -m benchmarks.child``) so that their
CPU time, event loop and RSS are their own; the parent loads data, runs producers and
reads the child's JSON report from its stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

TOPIC = "bench"


def with_database(dsn: str, database: str) -> str:
    """The same DSN pointed at another database."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + database))


async def recreate_database(admin_dsn: str, name: str) -> str:
    """Drop and create ``name``; return its DSN."""
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return with_database(admin_dsn, name)


async def drop_database(admin_dsn: str, name: str) -> None:
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def free_connections(admin_dsn: str) -> int:
    """How many more client connections the server accepts right now (approximately)."""
    conn = await asyncpg.connect(admin_dsn)
    try:
        limit = int(await conn.fetchval("SHOW max_connections"))
        reserved = int(await conn.fetchval("SHOW superuser_reserved_connections"))
        used = int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = $1", "client backend"
            )
        )
    finally:
        await conn.close()
    return limit - reserved - used


# -- statistics ------------------------------------------------------------------------
def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of already sorted values (q in [0, 1])."""
    if not sorted_values:
        return math.nan
    index = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[index]


def summarize_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99/max/mean of latencies given in seconds, reported in milliseconds."""
    values = sorted(seconds)
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50": round(quantile(values, 0.50) * 1000, 3),
        "p95": round(quantile(values, 0.95) * 1000, 3),
        "p99": round(quantile(values, 0.99) * 1000, 3),
        "max": round(values[-1] * 1000, 3),
        "mean": round(statistics.fmean(values) * 1000, 3),
    }


def median(values: Sequence[float]) -> float:
    clean = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(clean) if clean else math.nan


def ratio(a: float, b: float) -> float:
    if not b or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


# -- child processes ---------------------------------------------------------------------
class ChildError(RuntimeError):
    pass


@dataclass
class Child:
    """A consumer running in ``python -m benchmarks.child``; talk to it with JSON lines."""

    process: asyncio.subprocess.Process
    spec: dict[str, Any]
    stderr_tail: list[str] = field(default_factory=list)
    _stderr_task: asyncio.Task[None] | None = None

    async def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        while True:
            line = await self.process.stdout.readline()
            if not line:
                await self.process.wait()
                raise ChildError(
                    f"child {self.spec.get('system')}/{self.spec.get('mode')} exited "
                    f"with {self.process.returncode}:\n" + "".join(self.stderr_tail[-30:])
                )
            text = line.decode().strip()
            if text.startswith("{"):
                message: dict[str, Any] = json.loads(text)
                return message

    async def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        message = await asyncio.wait_for(self._read(), timeout)
        if message.get("type") != "ready":
            raise ChildError(f"expected ready, got {message}")
        return message

    def send(self, **message: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(message) + "\n").encode())

    async def result(self, timeout: float) -> dict[str, Any]:
        message = await asyncio.wait_for(self._read(), timeout)
        if message.get("type") != "result":
            raise ChildError(f"expected result, got {message}")
        await asyncio.wait_for(self.process.wait(), 30)
        return message

    async def _pump_stderr(self) -> None:
        assert self.process.stderr is not None
        async for line in self.process.stderr:
            self.stderr_tail.append(line.decode(errors="replace"))
            del self.stderr_tail[:-200]

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


@contextlib.asynccontextmanager
async def child_process(spec: dict[str, Any]) -> AsyncIterator[Child]:
    """Start a consumer child for ``spec``; kill it if the caller fails."""
    env = dict(os.environ)
    env.setdefault("PYTHONHASHSEED", "0")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "benchmarks.child",
        json.dumps(spec),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        limit=64 * 1024 * 1024,
    )
    child = Child(process, spec)
    child._stderr_task = asyncio.ensure_future(child._pump_stderr())
    try:
        yield child
    finally:
        child.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(process.wait(), 10)
        child._stderr_task.cancel()


def now() -> float:
    return time.time()


class BackendCpu:
    """CPU seconds used by the server backends connected to one database while it runs.

    Polls ``pg_stat_activity`` for the database's backend pids and reads their CPU times
    from ``/proc/<pid>/schedstat`` (psutil's where there is none), so it only works
    when the server runs on this machine (else reports
    None). Backends that come and go between two polls are missed.
    """

    def __init__(
        self,
        admin_dsn: str,
        database: str,
        interval: float = 0.2,
        *,
        application: str | None = None,
    ) -> None:
        self.admin_dsn = admin_dsn
        self.database = database
        self.application = application  # only the backends of this application_name
        self.interval = interval
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._conn: asyncpg.Connection | None = None
        self._lock = asyncio.Lock()
        self.available = True

    @staticmethod
    def _cpu(pid: int) -> float | None:
        import psutil

        try:  # the scheduler's on-CPU nanoseconds: /proc/<pid>/stat ticks at 10 ms
            with open(f"/proc/{pid}/schedstat", "rb") as f:
                return int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass
        try:
            times = psutil.Process(pid).cpu_times()
        except (psutil.Error, OSError):
            return None
        return float(times.user + times.system)

    async def _sample(self, conn: asyncpg.Connection) -> None:
        async with self._lock:
            pids = await conn.fetch(
                "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()"
                " AND ($2::text IS NULL OR application_name = $2)",
                self.database,
                self.application,
            )
            for (pid,) in pids:
                cpu = self._cpu(pid)
                if cpu is None:
                    continue
                self._first.setdefault(pid, cpu)
                self._last[pid] = cpu

    async def _poll(self, conn: asyncpg.Connection) -> None:
        while True:
            await self._sample(conn)
            await asyncio.sleep(self.interval)

    async def sample_now(self) -> None:
        """One more sample now, then no more: the end of the measured stretch (while the
        measured backends are still connected, so that none of their CPU is missed)."""
        assert self._task is not None and self._conn is not None
        async with self._lock:  # not in the middle of a poll's query
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        conn = await asyncpg.connect(self.admin_dsn)
        try:
            await self._sample(conn)
        finally:
            await conn.close()

    async def __aenter__(self) -> BackendCpu:
        conn = self._conn = await asyncpg.connect(self.admin_dsn)
        host = urlsplit(self.admin_dsn).hostname or "localhost"
        self.available = host in ("localhost", "127.0.0.1", "::1") or host.startswith("/")

        async def run() -> None:
            try:
                await self._poll(conn)
            finally:
                await conn.close()

        self._task = asyncio.ensure_future(run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task

    @property
    def seconds(self) -> float | None:
        if not self.available or not self._last:
            return None
        # a backend first seen mid-run counts from its first sample: a small undercount
        return round(sum(self._last[p] - self._first[p] for p in self._last), 3)


def settings_argument(parser: argparse.ArgumentParser, flag: str, text: str) -> dict[str, Any]:
    """A command-line JSON object of consumer settings, or a parser error that says why."""
    try:
        settings = json.loads(text)
    except json.JSONDecodeError as exc:
        parser.error(f"{flag} is not JSON: {exc}")
    if not isinstance(settings, dict):
        parser.error(f"{flag} must be a JSON object")
    return settings
