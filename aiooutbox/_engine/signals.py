"""`Signals`: the events the consumer's parts wake each other with (a notification, a
freed slot, the listener back), each an `anyio.Event` re-armed after use, and the
bounded waits on them."""

from __future__ import annotations

import math
from collections.abc import Awaitable
from typing import Any, Protocol

import anyio

__all__ = ["Signals", "wait_any", "wait_for"]


class Signals:
    """Events shared by the consumer's parts; one primitive, `anyio.Event`, re-armed."""

    def __init__(self) -> None:
        self.wake = anyio.Event()  # a notification, a recovery, a stop, a retry written
        self.wakes = 0  # how many times `wake` was set (flow control's limited topics)
        self.slot_freed = anyio.Event()  # a handler finished (see `slot_finished`)
        # `slot_finished` sets `slot_freed` once this few rows or fewer are in flight: the
        # claim loop waits for enough free slots to claim, not for every single one (a
        # drain of no-op handlers woke it once per event)
        self.slots_at: float = math.inf
        self.stop = anyio.Event()
        self.listener_back = anyio.Event()  # the listener (re)connected: the server is back

    def set_wake(self) -> None:
        self.wakes += 1
        self.wake.set()

    def retry_written(self, _due_in: float) -> None:
        """A retry was written: an UPDATE notifies no one, so look again (the idle wait
        is then cut to when it becomes due)."""
        self.set_wake()

    def set_slot_freed(self) -> None:
        self.slot_freed.set()

    def slot_finished(self, in_flight: int) -> None:
        """A row's work ended, ``in_flight`` rows are left."""
        if in_flight <= self.slots_at:
            self.slot_freed.set()

    def set_listener_back(self) -> None:
        self.listener_back.set()

    def clear_listener_back(self) -> None:
        if self.listener_back.is_set():
            self.listener_back = anyio.Event()

    def clear_wake(self) -> None:
        if self.wake.is_set():
            self.wake = anyio.Event()

    def clear_slot_freed(self) -> None:
        if self.slot_freed.is_set():
            self.slot_freed = anyio.Event()


async def wait_for(awaitable: Awaitable[Any], timeout: float) -> None:
    """Until ``awaitable`` is done, at most ``timeout`` seconds."""
    with anyio.move_on_after(timeout):
        await awaitable


class Waitable(Protocol):
    async def wait(self) -> Any: ...


async def wait_any(events: tuple[Waitable, ...], timeout: float) -> None:
    """Until one of ``events`` is set, at most ``timeout`` seconds (off the hot path)."""
    with anyio.move_on_after(timeout):
        async with anyio.create_task_group() as group:

            async def one(event: Waitable) -> None:
                await event.wait()
                group.cancel_scope.cancel()

            for event in events:
                group.start_soon(one, event)
