"""Batched, fenced settlement of handler outcomes.

Outcomes are buffered and written with one statement per (kind, attempt) group: ``done``
rows as ``WHERE id = ANY($1)`` (through the primary key, whatever the backlog), failures
with their delays and errors. A flush that fails is retried with backoff; nothing is
dropped while the process lives, and the last flush on stop is shielded from
cancellation.
"""

from __future__ import annotations

import logging
import random
from collections import defaultdict
from dataclasses import dataclass, field

import anyio
import asyncpg

from ._db import TRANSIENT_ERRORS
from ._sql import Queries

__all__ = ["Failure", "Settler"]

logger = logging.getLogger("aiooutbox.settler")


@dataclass(frozen=True, slots=True)
class Failure:
    id: int
    attempts: int
    delay: float
    error: str
    force_dead: bool
    released: bool = False


@dataclass
class _Batch:
    done: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    failed: dict[int, list[Failure]] = field(default_factory=lambda: defaultdict(list))
    size: int = 0

    def __bool__(self) -> bool:
        return self.size > 0


class Settler:
    """Collects outcomes and flushes them on size, on a short timer, and on close."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        queries: Queries,
        worker_id: str,
        *,
        flush_interval: float,
        flush_size: int,
        statement_timeout: float,
    ) -> None:
        self._pool = pool
        self._q = queries
        self._worker_id = worker_id
        self._flush_interval = flush_interval
        self._flush_size = flush_size
        self._timeout = statement_timeout
        self._pending = _Batch()
        self._has_work = anyio.Event()
        self._flushed = anyio.Event()
        self._flush_lock = anyio.Lock()
        self.fenced = 0  # outcomes ignored because the lease had moved on

    # -- recording (synchronous, never fails) --------------------------------------
    def done(self, event_id: int, attempts: int) -> None:
        self._pending.done[attempts].append(event_id)
        self._added()

    def failed(self, failure: Failure) -> None:
        self._pending.failed[failure.attempts].append(failure)
        self._added()

    def _added(self) -> None:
        self._pending.size += 1
        if self._pending.size == 1 or self._pending.size >= self._flush_size:
            self._has_work.set()

    @property
    def backlog(self) -> int:
        return self._pending.size

    async def wait_flushed(self) -> None:
        """Wait until the next flush completes (used for back-pressure)."""
        await self._flushed.wait()

    # -- flushing ------------------------------------------------------------------
    async def run(self) -> None:
        """Flush forever; cancel to stop, then call `close` for the final flush."""
        while True:
            await self._has_work.wait()
            self._has_work = anyio.Event()
            if self._pending.size < self._flush_size:
                # let a few more outcomes join this batch
                with anyio.move_on_after(self._flush_interval):
                    while self._pending.size < self._flush_size:
                        await self._has_work.wait()
                        self._has_work = anyio.Event()
            await self._flush_with_retry(deadline=None)

    async def close(self, timeout: float) -> None:
        """Final flush, shielded from cancellation, bounded by ``timeout`` seconds."""
        with anyio.CancelScope(shield=True):
            await self._flush_with_retry(deadline=anyio.current_time() + timeout)

    async def _flush_with_retry(self, deadline: float | None) -> None:
        # one flusher at a time, so the final flush waits for a write already under way
        async with self._flush_lock:
            await self._flush_locked(deadline)

    async def _flush_locked(self, deadline: float | None) -> None:
        delay = 0.05
        while self._pending:
            batch, self._pending = self._pending, _Batch()
            try:
                # a write under way finishes even if we are cancelled: its rows are settled
                with anyio.CancelScope(shield=True):
                    await self._write(batch)
            except TRANSIENT_ERRORS as exc:
                self._merge_back(batch)
                if deadline is not None and anyio.current_time() + delay > deadline:
                    logger.error(
                        "gave up flushing %d outcomes at shutdown (%s); their leases will "
                        "expire and the events will be retried",
                        batch.size,
                        exc,
                        extra={"outcomes": batch.size},
                    )
                    self._pending = _Batch()
                    return
                logger.warning(
                    "settlement flush failed (%s: %s); retrying in %.2fs",
                    type(exc).__name__,
                    exc,
                    delay,
                    extra={"outcomes": batch.size},
                )
                await anyio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 5.0)
        flushed, self._flushed = self._flushed, anyio.Event()
        flushed.set()

    def _merge_back(self, batch: _Batch) -> None:
        for attempts, ids in batch.done.items():
            self._pending.done[attempts].extend(ids)
        for attempts, failures in batch.failed.items():
            self._pending.failed[attempts].extend(failures)
        self._pending.size += batch.size

    async def _write(self, batch: _Batch) -> None:
        statements: list[tuple[str, tuple[object, ...], int]] = [
            (self._q.settle_done, (ids, self._worker_id, attempts), len(ids))
            for attempts, ids in batch.done.items()
        ]
        statements += [
            (
                self._q.settle_failed,
                (
                    [f.id for f in failures],
                    [f.delay for f in failures],
                    [f.error for f in failures],
                    [f.force_dead for f in failures],
                    [f.released for f in failures],
                    self._worker_id,
                    attempts,
                ),
                len(failures),
            )
            for attempts, failures in batch.failed.items()
        ]
        async with self._pool.acquire(timeout=self._timeout) as conn:
            # one statement needs no explicit transaction (and saves two round trips);
            # several are applied together so a retried flush never half-repeats
            if len(statements) == 1:
                results = [
                    await conn.fetchval(statements[0][0], *statements[0][1], timeout=self._timeout)
                ]
            else:
                async with conn.transaction():
                    results = [
                        await conn.fetchval(sql, *args, timeout=self._timeout)
                        for sql, args, _ in statements
                    ]
        for (_, _, expected), updated in zip(statements, results, strict=True):
            self._count_fenced(updated, expected)

    def _count_fenced(self, updated: int, expected: int) -> None:
        if updated < expected:
            self.fenced += expected - updated
            logger.warning(
                "%d outcome(s) ignored: the row was no longer held by this worker on this "
                "attempt (its lease expired and it was recovered or re-claimed, or an earlier "
                "try of this flush committed before its connection dropped)",
                expected - updated,
                extra={"fenced": expected - updated},
            )
