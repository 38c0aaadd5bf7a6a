"""A minimal many-consumer channel from the dispatcher to the worker tasks.

anyio's memory object streams cost several allocations and a checkpoint per item; in a
no-op drain half the consumer's CPU went there. The dispatcher never sends more than the
free slots, so the channel needs no bound: a deque, and a future per *waiting* worker. A
worker whose handler did not suspend takes the next event without a trip through the
event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

__all__ = ["Handoff"]

T = TypeVar("T")


class Handoff(Generic[T]):
    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    def put_all(self, items: list[T]) -> None:
        """Queue ``items`` in order (a claim's runs), waking a worker for each."""
        self._items.extend(items)
        self._wake(len(items))

    def put_first_all(self, items: list[T]) -> None:
        """Queue ``items``, in order, ahead of every item waiting."""
        self._items.extendleft(reversed(items))
        self._wake(len(items))

    def close(self) -> None:
        """No more items: waiting workers return ``None`` once the queue is empty."""
        self._closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _wake_one(self) -> None:
        self._wake(1)

    def _wake(self, count: int) -> None:
        waiters = self._waiters
        while count and waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                count -= 1

    def take_nowait(self) -> T | None:
        """The next item if one is queued: a worker's fast path (no coroutine when an
        item waits), and what no worker took is released with it."""
        return self._items.popleft() if self._items else None

    async def get(self) -> T | None:
        """The next item, or ``None`` once the channel is closed and drained."""
        while not self._items:
            if self._closed:
                return None
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                # cancelled after being woken: pass the wake-up on to another worker
                if waiter.done() and not waiter.cancelled() and self._items:
                    self._wake_one()
                raise
        item = self._items.popleft()
        if self._items:
            self._wake_one()
        return item
