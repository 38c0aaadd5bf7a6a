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
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from .rows import ClaimedRow, getter

__all__ = ["Handoff", "Run", "Ticket", "Unit", "runs_of"]

T = TypeVar("T")
_KEY = getter("ordering_key")


class Ticket:
    """A batch handler's topic in the queue: the worker that takes it makes a batch of
    the events of that topic waiting (`_engine/batches.py`). Only a consumer with batch
    handlers queues one."""

    __slots__ = ()


# what a claim's rows become: an unordered row alone, or an ordered key's run (its head
# first); a unit of work is one of these or a batch topic's ticket
Unit = ClaimedRow | list[ClaimedRow]
Run = Unit | Ticket


def runs_of(rows: list[ClaimedRow]) -> list[Unit]:
    """Claimed rows as units of work: an unordered row as itself (no list per event: a
    drain hands out tens of thousands a second), an ordered key's head followed by the
    waiting events claimed behind it, in id order, as a list."""
    if list(map(_KEY, rows)).count(None) == len(rows):  # none is ordered: in C
        return list(rows)
    runs: list[Unit] = []
    keyed: dict[str, list[ClaimedRow]] | None = None
    for row in rows:
        if (key := row.ordering_key) is None:
            runs.append(row)
        elif keyed is None:
            keyed = {key: [row]}
        elif key in keyed:
            keyed[key].append(row)
        else:
            keyed[key] = [row]
    if keyed is not None:
        for members in keyed.values():
            members.sort(key=lambda r: (not r.is_head, r.id))
            runs.append(members)
    return runs


class Handoff(Generic[T]):
    """Items wake waiting workers one at a time, as a relay: at most one woken worker
    is on its way at any moment, and each worker that takes an item while more wait
    wakes the next one before it runs its own. Waking one worker per item instead (64
    at the defaults for every claim) cost about 4 µs each, and in a drain of no-op
    handlers the first worker took every item while the others woke to an empty queue.
    Invariant: while items and waiting workers are both there, a woken one is on its way.

    Workers are started as they are needed (`staff`): an item that finds no worker
    waiting starts one, up to the limit, the same relay (a started worker is a woken
    one until it `joins`). Starting all ``concurrency`` workers up front cost ~37 µs of
    CPU each (anyio's task start), 37 ms at 1,000, while a drain of no-op handlers kept
    a few of them busy.
    """

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._waking = False  # a woken (or started) worker has not taken its item yet
        self._closed = False
        self._start: Callable[[], object] | None = None
        self._room = 0  # workers that may still be started

    def staff(self, start: Callable[[], object], limit: int) -> None:
        """Start workers with ``start`` (a worker calls `joins` first), at most
        ``limit`` of them, each when an item finds no worker waiting."""
        self._start, self._room = start, limit
        if self._items and not self._waking:
            self._wake_one()

    def joins(self) -> None:
        """A started worker's first step: it is the one on its way."""
        self._waking = False

    def put_all(self, items: Sequence[T]) -> None:
        """Queue ``items`` in order (a claim's runs)."""
        self._items.extend(items)
        if not self._waking:
            self._wake_one()

    def put_first_all(self, items: Sequence[T]) -> None:
        """Queue ``items``, in order, ahead of every item waiting."""
        self._items.extendleft(reversed(items))
        if not self._waking:
            self._wake_one()

    def close(self) -> None:
        """No more items: waiting workers return ``None`` once the queue is empty."""
        self._closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _wake_one(self) -> None:
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._waking = True
                return
        if self._room and not self._closed and self._start is not None:
            self._room -= 1
            self._waking = True
            self._start()

    def take_nowait(self) -> T | None:
        """The next item if one is queued: a worker's fast path (no coroutine when an
        item waits), and what no worker took is released with it."""
        items = self._items
        if not items:
            return None
        item = items.popleft()
        if items and not self._waking:
            self._wake_one()  # the relay: someone takes the rest if our handler waits
        return item

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
                if waiter.done() and not waiter.cancelled():
                    # cancelled after being woken: pass the wake-up on to another worker
                    self._waking = False
                    if self._items:
                        self._wake_one()
                raise
            self._waking = False
        return self.take_nowait()
