"""CPU seconds of the server backends that serve one database, read while it runs."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

import asyncpg


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
