"""Batch handlers' side of the hand-off: each batch topic's waiting events, the event
slots that `concurrency` counts (the workers that use them: `batch_run.batch_worker`).

A consumer without batch handlers uses none of this (its workers and hand-off are the
plain ones). With some, the claim's units of work (`runs_of`) for a batch topic wait
in that topic's `Pool`, which stands once in the hand-off's queue as a `Ticket`: the
worker that takes it makes a batch of what is waiting (up to the handler's ``batch``
and the free slots; after ``linger`` when one is set), puts the ticket back if events
remain, so another worker can make the next batch meanwhile, and runs its own.

`concurrency` still counts events: `Slots` holds one slot per event in a handler, a
per-event handler (or an ordered run, one event at a time) takes one, a batch as many
as it has events, in arrival order (a batch waiting for its slots is not overtaken by
single events), so no more than `concurrency` events are ever in handlers at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import anyio

from ..handlers import ALL_TOPICS, Handler
from .handoff import Handoff, Run, Ticket, Unit
from .rows import ClaimedRow, getter

__all__ = ["BatchHandoff", "Pool", "Slots"]

logger = logging.getLogger("aiooutbox.consumer")

_KINDS_CACHED = 10_000  # topics whose kind (batch or not) is remembered
_TOPIC = getter("topic")


class Slots:
    """Event slots, ``total`` of them, taken and given back by count; a taker that must
    wait waits in arrival order (first come, first served)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    def take_now(self, count: int) -> bool:
        """Take ``count`` slots if they are free and nobody waits; else take none."""
        if self.free >= count and not self._waiting:
            self.free -= count
            return True
        return False

    def take_up_to(self, count: int) -> int:
        """Take up to ``count`` slots among the free ones (none while someone waits)."""
        if self._waiting:
            return 0
        taken = min(count, self.free)
        self.free -= taken
        return taken

    async def take(self, count: int) -> None:
        """Take ``count`` slots (at most `total`), waiting for them in turn."""
        if self.take_now(count):
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append((count, waiter))
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.give(count)  # granted, then cancelled: pass them on
            else:
                self._waiting.remove((count, waiter))
                self._grant()  # the head of the queue may have changed
            raise

    def give(self, count: int) -> None:
        self.free += count
        if self._waiting:
            self._grant()

    def _grant(self) -> None:
        waiting = self._waiting
        while waiting and waiting[0][0] <= self.free:
            count, waiter = waiting.popleft()
            if not waiter.done():
                self.free -= count
                waiter.set_result(None)


class Pool(Ticket):
    """One batch topic's events waiting for a batch, in claim order; in the hand-off's
    queue as its own ticket while ``queued`` (or held by the worker making a batch)."""

    __slots__ = ("arrived", "cap", "handler", "keyed", "linger", "queued", "size", "topic", "units")

    def __init__(self, topic: str, handler: Handler, cap: int) -> None:
        self.topic = topic
        self.handler = handler
        self.cap = cap  # the most events a batch holds: ``batch``, at most `concurrency`
        self.linger = handler.linger
        self.units: list[Unit] = []
        self.size = 0  # events in ``units``
        self.keyed = 0  # runs in ``units`` (none: a batch is a slice of them)
        self.queued = False
        self.arrived: anyio.Event | None = None  # set when events come while lingering

    def add(self, unit: Unit, *, first: bool = False) -> None:
        if type(unit) is list:
            self.keyed += 1
            self.size += len(unit)
        else:
            self.size += 1
        if first:
            self.units.insert(0, unit)
        else:
            self.units.append(unit)

    def form(self, limit: int) -> tuple[list[ClaimedRow], list[list[ClaimedRow]]]:
        """Take up to ``limit`` events: the batch's rows, a key's run whole and in order,
        and the rest of a run too long for the batch (it goes on after this batch)."""
        units = self.units
        if not self.keyed:
            rows: list[ClaimedRow] = units[:limit]  # type: ignore[assignment]
            del units[:limit]
            self.size -= len(rows)
            return rows, []
        rows = []
        rests: list[list[ClaimedRow]] = []
        taken = 0
        for unit in units:
            room = limit - len(rows)
            if room <= 0:
                break
            if isinstance(unit, list):
                if len(unit) > room:
                    if rows:
                        break  # the run goes whole into the next batch
                    rows.extend(unit[:room])
                    rests.append(unit[room:])
                else:
                    rows.extend(unit)
                self.keyed -= 1
            else:
                rows.append(unit)
            taken += 1
        del units[:taken]
        self.size -= len(rows) + sum(map(len, rests))
        return rows, rests

    def take_all(self) -> list[Unit]:
        units, self.units = self.units, []
        self.size = self.keyed = 0
        return units


class BatchHandoff(Handoff[Run]):
    """The hand-off of a consumer with batch handlers: a batch topic's units wait in its
    `Pool`, whose ticket is queued once; every other unit is queued as it is."""

    def __init__(
        self,
        handlers: Mapping[str, Handler],
        concurrency: int,
        give_back: Callable[[list[ClaimedRow]], None],
    ) -> None:
        super().__init__()
        self._handlers = handlers
        self._give_back = give_back  # claimed rows back to waiting, attempt given back
        self._concurrency = concurrency
        self.pools: dict[str, Pool] = {}
        self._kinds: dict[str, Pool | None] = {}  # topic -> its pool, None: per event
        for topic, handler in handlers.items():
            if handler.batch is not None and handler.batch > concurrency:
                logger.warning(
                    "the batch handler for %r takes up to %d events, more than concurrency=%d: "
                    "its batches hold at most %d; raise concurrency (OutboxConsumer(concurrency"
                    "=...), --concurrency) to let them fill",
                    topic,
                    handler.batch,
                    concurrency,
                    concurrency,
                    extra={"topic": topic, "batch": handler.batch, "concurrency": concurrency},
                )

    def _pool(self, topic: str) -> Pool | None:
        handler = self._handlers.get(topic) or self._handlers.get(ALL_TOPICS)
        if handler is None or handler.batch is None:
            pool = None
        else:
            pool = self.pools.get(topic)
            if pool is None:
                cap = min(handler.batch, self._concurrency)
                pool = self.pools[topic] = Pool(topic, handler, cap)
        if len(self._kinds) < _KINDS_CACHED:
            self._kinds[topic] = pool
        return pool

    def _route(self, items: Sequence[Run], first: bool) -> list[Run]:
        """Put the batch topics' units in their pools; return what to queue: the other
        units, in order, and the tickets of pools that had none queued."""
        kinds = self._kinds
        if not first and items and set(map(type, items)) == {ClaimedRow}:
            rows = cast("Sequence[ClaimedRow]", items)
            topics = set(map(_TOPIC, rows))
            if len(topics) == 1:  # the usual claim: unordered rows of one topic, in C
                topic = topics.pop()
                pool = kinds[topic] if topic in kinds else self._pool(topic)
                if pool is None:
                    return list(items)
                pool.units += rows
                pool.size += len(rows)
                if not pool.queued:
                    pool.queued = True
                    return [pool]
                if pool.arrived is not None:
                    pool.arrived.set()
                return []
        queue: list[Run] = []
        for unit in items:
            if isinstance(unit, list):
                unit = self._one_handler(unit)
                topic = unit[0].topic
            elif isinstance(unit, ClaimedRow):
                topic = unit.topic
            else:  # pragma: no cover - tickets are queued by `put_back` alone
                queue.append(unit)
                continue
            pool = kinds[topic] if topic in kinds else self._pool(topic)
            if pool is None:
                queue.append(unit)
                continue
            if first or isinstance(unit, list):
                pool.add(unit, first=first)
            else:  # `Pool.add`, inlined: the usual unit
                pool.units.append(unit)
                pool.size += 1
            if not pool.queued:
                pool.queued = True
                queue.append(pool)
            elif pool.arrived is not None:
                pool.arrived.set()
        return queue

    def _one_handler(self, run: list[ClaimedRow]) -> list[ClaimedRow]:
        """The part of an ordered run that its head's handler takes. A key may span
        topics: from the first event another handler takes, where either of the two is
        a batch handler, the rest goes back to waiting, attempt given back; it is
        claimed again, in order, once the key's earlier events are done. (Per-event
        handlers of different topics share a run: each event finds its own.)"""
        handlers = self._handlers
        topic = run[0].topic
        first = handlers.get(topic) or handlers.get(ALL_TOPICS)
        for i in range(1, len(run)):
            if run[i].topic == topic:
                continue
            other = handlers.get(run[i].topic) or handlers.get(ALL_TOPICS)
            if other is not first and (
                first is None or other is None or first.batch is not None or other.batch is not None
            ):
                self._give_back(run[i:])
                return run[:i]
        return run

    def put_all(self, items: Sequence[Run]) -> None:
        queue = self._route(items, False)
        if queue:
            super().put_all(queue)

    def put_first_all(self, items: Sequence[Run]) -> None:
        queue = self._route(items, True)
        if queue:
            super().put_first_all(queue)

    def put_back(self, pool: Pool) -> None:
        """The worker that held ``pool``'s ticket made its batch: queue the ticket again
        if events remain, for another worker's batch."""
        if pool.units:
            super().put_all([pool])
        else:
            pool.queued = False

    def continue_run(self, pool: Pool, rest: list[ClaimedRow]) -> None:
        """The rest of a run that did not fit its batch: next, ahead of the others."""
        pool.add(rest, first=True)
        if not pool.queued:
            pool.queued = True
            super().put_first_all([pool])

    def close(self) -> None:
        super().close()
        for pool in self.pools.values():  # a lingering batch stops waiting
            if pool.arrived is not None:
                pool.arrived.set()

    def leftovers(self) -> list[Unit]:
        """Every unit still waiting in a pool (at shutdown: to release)."""
        units: list[Unit] = []
        for pool in self.pools.values():
            units += pool.take_all()
            pool.queued = False
        return units
