"""Lease upkeep that runs inside every consumer: heartbeats, recovery, retention, and
the orphan sweep.

Heartbeats extend the leases of this consumer's long-running handlers. Recovery returns
rows whose lease expired (a crashed or partitioned worker) to ``retry``, or to ``dead``
once their attempts are spent; it is safe with many consumers (``SKIP LOCKED``) and needs
no extra process. Retention purges old ``done`` rows in bounded batches. The orphan
sweep promotes the next event of ordered keys left without a head, whatever left them so.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import anyio
import asyncpg

from .._sql.db import TRANSIENT_ERRORS, bounded, check_permanent
from .._sql.statements import Queries
from .._values.text import exception_summary
from .leases import Leases
from .registry import Registry

__all__ = ["Maintenance"]

logger = logging.getLogger("aiooutbox.maintenance")

_RECOVER_BATCH = 1000
_PURGE_BATCH = 1000
_PURGE_BATCHES_PER_ROUND = 50  # at most 50k rows per round, so one round stays short
_PURGE_EVERY = 60.0
# the sweep's share of the time: it waits at least this many times its last duration
_SWEEP_DUTY = 50


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
        orphan_sweep_interval: float,
        registry: Registry | None = None,
    ) -> None:
        self._pool = pool
        self._q = queries
        self._worker_id = worker_id
        self._leases = leases
        self._on_recovered = on_recovered
        self._lease_timeout = lease_timeout
        self._retention = retention
        self._timeout = statement_timeout
        self._sweep_interval = orphan_sweep_interval
        self._registry = registry
        self.sweeps = 0  # orphan sweeps completed

    async def heartbeat_loop(self) -> None:
        """Extend the leases of handlers that run longer than a sixth of the lease;
        touch this consumer's row in the registry (one small statement a beat)."""
        interval = self._lease_timeout / 3
        while True:
            await anyio.sleep(interval * random.uniform(0.8, 1.0))
            # before the statement: the lease it sets ends no earlier than this + lease
            await self.renew_due(time.monotonic())
            if self._registry is not None:
                await self._registry.beat()

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
            logger.warning("lease heartbeat failed (%s)", exception_summary(exc))
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
        while True:
            try:
                recovered = await self._recover()
                if recovered:
                    self._on_recovered(recovered)
                if self._retention is not None and time.monotonic() >= next_purge:
                    next_purge = time.monotonic() + _PURGE_EVERY
                    await self._purge(self._retention)
            except TRANSIENT_ERRORS as exc:
                check_permanent(exc, "recovering expired leases")
                logger.warning("maintenance failed (%s)", exception_summary(exc))
            await anyio.sleep(interval * random.uniform(0.8, 1.2))

    async def sweep_loop(self) -> None:
        """At start, then every ``orphan_sweep_interval`` (jittered ±20%): ordered keys
        whose next event waits with no head left move on.

        Every statement that settles or removes a head promotes its key's next event,
        but one can leave a key without a head all the same: an operator's own
        ``DELETE`` or ``UPDATE`` of a head, a promotion a producer's lock deferred past
        the stop of the consumer that was to retry it (or made by lease recovery, which
        does not retry), a crash of a consumer older than ordered delivery. The sweep
        visits each key with unfinished events once; a sweep that takes longer than a
        fiftieth of the interval spaces the next ones out to fifty times its duration,
        so it never costs more than about 2% of one connection's time.
        """
        previous = 0.0
        while True:
            started = time.monotonic()
            try:
                took = await self._sweep()
                self.sweeps += 1
            except TRANSIENT_ERRORS as exc:
                check_permanent(exc, "promoting ordered keys left without a head")
                logger.warning("orphan sweep failed (%s: %s)", type(exc).__name__, exc)
                took = time.monotonic() - started  # a sweep past the statement timeout backs off
            # by the cheaper of the last two: a connection's first call compiles the
            # functions and loads its caches (~50 ms measured), which says nothing of cost
            wait = max(self._sweep_interval, _SWEEP_DUTY * min(took, previous))
            previous = took
            await anyio.sleep(wait * random.uniform(0.8, 1.2))

    async def _sweep(self) -> float:
        """One sweep; returns the seconds the server spent on it."""
        row = await bounded(self._pool, "fetchrow", self._q.orphan_sweep, timeout=self._timeout)
        if row is None:
            return 0.0
        if row["promoted"]:
            logger.warning(
                "promoted the next event of %d ordered key(s) left without a head",
                row["promoted"],
                extra={"promoted": row["promoted"]},
            )
            self._on_recovered(row["promoted"])
        if row["skipped"]:
            # a producer holds the key's lock: its commit ends that; the next sweep looks again
            logger.debug(
                "orphan sweep: %d key(s) held by producers, left for the next sweep",
                len(row["skipped"]),
            )
        seconds: float = row["seconds"]
        return seconds

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
