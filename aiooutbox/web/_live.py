"""Live updates: one shared pulse query per interval, pushed to every open page.

Server-sent events rather than polling from each browser: the server runs one cheap
statement per interval (the newest id, the table's write counters, the newest audit
entry, consumers registered or gone) while at least one page is open, however many
are, and pushes the result only when it changed. A page whose pulse moved fetches its
own content again; those reads go through `Cache`, so browsers showing the same view
share one set of queries per interval. Nothing here touches a consumer, and no query runs per event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ._sql import WebQueries

__all__ = ["Cache", "LiveHub"]

logger = logging.getLogger("aiooutbox.web")

KEEPALIVE = 15.0


class LiveHub:
    def __init__(self, acquire: Callable[[], Any], queries: WebQueries, interval: float) -> None:
        self._acquire = acquire
        self._w = queries
        self.interval = interval
        self._subscribers: set[asyncio.Queue[str]] = set()
        self._task: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()
        self._ending = asyncio.Event()  # the server is stopping: streams end now
        self.pulse = ""
        self.polls = 0  # pulse queries run (the tests count them)

    async def read_pulse(self) -> str:
        """Run the pulse statement once; a page embeds its result."""
        q = self._w.outbox
        async with self._acquire() as conn:
            row = await conn.fetchrow(self._w.pulse, q.schema, q.table)
        self.polls += 1
        return ".".join(str(v or 0) for v in row)

    async def subscribe(self) -> AsyncIterator[str]:
        """Server-sent event lines for one page, until it goes away or we close."""
        queue: asyncio.Queue[str] = asyncio.Queue(maxsize=1)
        self._subscribers.add(queue)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="aiooutbox-dashboard-pulse")
        try:
            yield f"retry: {int(self.interval * 2000)}\n\n"
            if self.pulse:
                yield f"data: {self.pulse}\n\n"
            while not self._closed.is_set() and not self._ending.is_set():
                try:
                    pulse = await asyncio.wait_for(queue.get(), KEEPALIVE)
                except TimeoutError:
                    yield ": keepalive\n\n"
                    continue
                if not pulse:  # `end_streams`
                    break
                yield f"data: {pulse}\n\n"
        finally:
            self._subscribers.discard(queue)

    def end_streams(self) -> None:
        """End every open stream now, and any opened later: the server is stopping, and
        it waits for open responses to end before it runs the app's shutdown (a
        browser's page reconnects to the next server on its own)."""
        self._ending.set()
        for queue in list(self._subscribers):
            with contextlib.suppress(asyncio.QueueEmpty):
                queue.get_nowait()
            queue.put_nowait("")

    async def _run(self) -> None:
        """Poll while anyone listens; stop when the last page closes."""
        while self._subscribers and not self._closed.is_set() and not self._ending.is_set():
            started = time.monotonic()
            try:
                pulse = await self.read_pulse()
            except Exception as exc:  # a failed read is retried next interval
                logger.warning("dashboard pulse failed (%s: %s)", type(exc).__name__, exc)
            else:
                if pulse != self.pulse:
                    self.pulse = pulse
                    for queue in list(self._subscribers):
                        with contextlib.suppress(asyncio.QueueEmpty):
                            queue.get_nowait()  # only the latest matters
                        queue.put_nowait(pulse)
            elapsed = time.monotonic() - started
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closed.wait(), max(self.interval - elapsed, 0.05))

    @property
    def listeners(self) -> int:
        return len(self._subscribers)

    async def close(self) -> None:
        self._closed.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class Cache:
    """Page data shared by the browsers that show the same view, for one interval, or
    longer for a view that is slow to read: at least `COST_FACTOR` times what reading
    it took, so an open dashboard never spends more than a few percent of the
    database's time (a 300 ms overview is read again at most every 7.5 s)."""

    COST_FACTOR = 25

    def __init__(self, ttl: float, pulse: Callable[[], Awaitable[str]]) -> None:
        self._ttl = ttl
        self._pulse = pulse
        self._entries: dict[tuple[Any, ...], tuple[float, tuple[Any, str]]] = {}
        self._locks: dict[tuple[Any, ...], asyncio.Lock] = {}
        self._refreshing: dict[tuple[Any, ...], asyncio.Task[None]] = {}

    async def get(
        self, key: tuple[Any, ...], load: Callable[[], Awaitable[Any]], *, stale: bool = False
    ) -> tuple[Any, str]:
        """The view's data and the pulse read just before it (what it is current to).

        ``stale``: once read, an expired entry is returned as it is while a task reads
        it again (the page does not wait; it asks again when its pulse is behind)."""
        hit = self._entries.get(key)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        if hit is not None and stale:
            task = self._refreshing.get(key)
            if task is None or task.done():
                self._refreshing[key] = asyncio.create_task(self._refresh(key, load))
            return hit[1]
        return await self._load(key, load)

    async def _refresh(self, key: tuple[Any, ...], load: Callable[[], Awaitable[Any]]) -> None:
        try:
            await self._load(key, load)
        except Exception as exc:  # the stale value stays; the next page tries again
            logger.warning("dashboard view %s not read (%s: %s)", key[0], type(exc).__name__, exc)

    async def _load(
        self, key: tuple[Any, ...], load: Callable[[], Awaitable[Any]]
    ) -> tuple[Any, str]:
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            hit = self._entries.get(key)
            if hit is not None and hit[0] > time.monotonic():
                return hit[1]
            started = time.monotonic()
            pulse = await self._pulse()
            value = (await load(), pulse)
            now = time.monotonic()
            self._entries[key] = (now + max(self._ttl, (now - started) * self.COST_FACTOR), value)
        if len(self._entries) > 256:  # drop expired views
            now = time.monotonic()
            for k in [k for k, (exp, _) in self._entries.items() if exp <= now]:
                self._entries.pop(k, None)
                self._locks.pop(k, None)
        return value

    def clear(self) -> None:
        self._entries.clear()

    async def close(self) -> None:
        """Stop the reads under way in the background."""
        tasks = [t for t in self._refreshing.values() if not t.done()]
        self._refreshing.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
