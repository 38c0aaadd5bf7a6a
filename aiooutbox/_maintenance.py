"""Lease upkeep that runs inside every consumer: heartbeats, recovery, retention.

Heartbeats extend the leases of this consumer's long-running handlers. Recovery returns
rows whose lease expired (a crashed or partitioned worker) to ``retry``, or to ``dead``
once their attempts are spent; it is safe with many consumers (``SKIP LOCKED``) and needs
no extra process. Retention purges old ``done`` rows in bounded batches.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import anyio
import asyncpg

from ._db import TRANSIENT_ERRORS, bounded, check_permanent
from ._leases import Leases
from ._sql import Queries

__all__ = ["Maintenance"]

logger = logging.getLogger("aiooutbox.maintenance")

_RECOVER_BATCH = 1000
_PURGE_BATCH = 1000
_PURGE_BATCHES_PER_ROUND = 50  # at most 50k rows per round, so one round stays short
_PURGE_EVERY = 60.0


class Maintenance:
    def __init__(
        self,
        pool: asyncpg.Pool,
        queries: Queries,
        worker_id: str,
        *,
        leases: Leases,
        on_recovered: Callable[[int], None],
        lease_timeout: float,
        retention: float | None,
        statement_timeout: float,
    ) -> None:
        self._pool = pool
        self._q = queries
        self._worker_id = worker_id
        self._leases = leases
        self._on_recovered = on_recovered
        self._lease_timeout = lease_timeout
        self._retention = retention
        self._timeout = statement_timeout

    async def heartbeat_loop(self) -> None:
        """Extend the leases of handlers that run longer than a sixth of the lease."""
        interval = self._lease_timeout / 3
        while True:
            await anyio.sleep(interval * random.uniform(0.8, 1.0))
            # before the statement: the lease it sets ends no earlier than this + lease
            await self.renew_due(time.monotonic())

    async def renew_due(self, now: float) -> None:
        """One heartbeat at ``now`` (monotonic): extend the leases extended at least a
        sixth of the lease ago; record which are renewed and which are lost.

        Beats come every third of the lease, so a lease keeps about half of it at worst
        (less the beat's own delay): a handler starts only with a sixth to spare (see
        `Executor`), and a busy loop must not make the workers give claims up."""
        due = self._leases.due(now + self._lease_timeout * 5 / 6)
        if not due:
            return
        try:
            kept = await bounded(
                self._pool,
                "fetch",
                self._q.extend_leases,
                [row.id for row in due],
                self._worker_id,
                self._lease_timeout,
                timeout=self._timeout,
            )
        except TRANSIENT_ERRORS as exc:
            check_permanent(exc, "extending leases")
            logger.warning("lease heartbeat failed (%s: %s)", type(exc).__name__, exc)
            return
        alive = {(r[0], r[1]) for r in kept}
        ends = now + self._lease_timeout
        for row in due:
            if (row.id, row.attempts) in alive:
                self._leases.renewed(row, ends)
            elif self._leases.lost(row):
                logger.warning(
                    "event %d: lease lost (it expired and the event was recovered); a "
                    "handler still running for it has its outcome ignored, none will start",
                    row.id,
                    extra={"event_id": row.id},
                )

    async def recovery_loop(self) -> None:
        """Recover expired leases; purge old ``done`` rows and stale idle adverts."""
        interval = min(self._lease_timeout / 2, 10.0)
        next_purge = 0.0
        orphans_promoted = False
        while True:
            try:
                if not orphans_promoted:
                    await self._promote_orphans()
                    orphans_promoted = True
                recovered = await self._recover()
                if recovered:
                    self._on_recovered(recovered)
                if self._retention is not None and time.monotonic() >= next_purge:
                    next_purge = time.monotonic() + _PURGE_EVERY
                    await self._purge(self._retention)
            except TRANSIENT_ERRORS as exc:
                check_permanent(exc, "recovering expired leases")
                logger.warning("maintenance failed (%s: %s)", type(exc).__name__, exc)
            await anyio.sleep(interval * random.uniform(0.8, 1.2))

    async def _promote_orphans(self) -> None:
        """Once at start: keys whose next event waits with no head left (a promotion
        lost with a crashed consumer) move on."""
        row = await bounded(self._pool, "fetchrow", self._q.promote_orphans, timeout=self._timeout)
        if row is not None and row["promoted"]:
            logger.warning(
                "promoted the next event of %d ordered key(s) left without a head",
                row["promoted"],
            )
            self._on_recovered(row["promoted"])

    async def _recover(self) -> int:
        total = 0
        while True:
            rows = await bounded(
                self._pool,
                "fetch",
                self._q.recover_expired,
                _RECOVER_BATCH,
                timeout=self._timeout,
            )
            for event_id, topic, status, worker in rows:
                logger.warning(
                    "event %d (%s): lease of %s expired; now %s",
                    event_id,
                    topic,
                    worker,
                    status,
                    extra={"event_id": event_id, "topic": topic},
                )
            total += len(rows)
            if len(rows) < _RECOVER_BATCH:
                return total

    async def _purge(self, retention: float) -> None:
        for _ in range(_PURGE_BATCHES_PER_ROUND):
            status = await bounded(
                self._pool,
                "execute",
                self._q.purge_done,
                retention,
                _PURGE_BATCH,
                timeout=self._timeout,
            )
            if int(status.rsplit(" ", 1)[-1]) < _PURGE_BATCH:
                break
        await bounded(self._pool, "execute", self._q.purge_expired_idle, timeout=self._timeout)
