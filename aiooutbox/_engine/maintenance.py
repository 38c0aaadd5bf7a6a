"""Lease upkeep that runs inside every consumer: heartbeats, recovery, retention, and
the orphan sweep.

Heartbeats extend the leases of this consumer's long-running handlers. Recovery returns
rows whose lease expired (a crashed or partitioned worker) to ``retry``, or to ``dead``
once their attempts are spent; it is safe with many consumers (``SKIP LOCKED``) and needs
no extra process. Retention empties the slots of finished events that are past it
with TRUNCATE, and purges the ``done`` rows kept in the outbox (events with a dedupe
key) in bounded batches, as fast as they come due within a share of one connection's
time. The orphan sweep promotes the
next event of ordered keys left without a head, whatever left them so.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime

import anyio
import asyncpg

from .._sql.db import TRANSIENT_ERRORS, bounded, check_permanent
from .._sql.statements import Queries
from .._values.text import exception_summary
from .leases import Leases
from .registry import Registry
from .rollups import Tallies

__all__ = ["Maintenance"]

logger = logging.getLogger("aiooutbox.maintenance")

_RECOVER_BATCH = 1000
_PURGE_BATCH = 1000
# a round of purging runs full batches back to back for at most this long (each batch
# its own statement and transaction, so no lock is held past one batch) ...
_PURGE_ROUND = 0.25
# ... then, if the last batch came back full (more rows are due), waits this many times
# the round's duration before the next: a tenth of one connection's time at most (a
# quarter measured 0.59x the empty-table drain beside 10M due rows; the purge's CPU and
# WAL are taken from the claims' on a small server)
_PURGE_DUTY_WAIT = 9.0
# a round that caught up (a batch came back partial) waits this long
_PURGE_EVERY = 60.0
# lease recovery's mark stays this far behind now(): leases written by a claim or a
# heartbeat that has not committed yet lie after it (they are now() + lease_timeout)
_LEASE_MARGIN = 5.0  # seconds
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
        tallies: Tallies | None = None,
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
        self._tallies = tallies
        self.sweeps = 0  # orphan sweeps completed
        # no row being processed has a lease before it (see `_recover`)
        self._lease_mark = datetime.min.replace(tzinfo=UTC)
        self._server_started = self._lease_mark  # the start time of the mark's server

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
        """Recover expired leases."""
        interval = min(self._lease_timeout / 2, 10.0)
        while True:
            try:
                recovered = await self._recover()
                if recovered:
                    self._on_recovered(recovered)
            except TRANSIENT_ERRORS as exc:
                check_permanent(exc, "recovering expired leases")
                logger.warning("maintenance failed (%s)", exception_summary(exc))
            await anyio.sleep(interval * random.uniform(0.8, 1.2))

    async def retention_loop(self) -> None:
        """Purge ``done`` rows past the retention, and stale idle adverts: at start, then
        every minute while it keeps up (jittered ±20%).

        A round purges batches back to back while they come back full, for at most
        `_PURGE_ROUND` seconds; a round that stopped with rows still due waits nine times
        its own duration before the next instead of a minute. Purging thus keeps up with
        any inflow of finished rows up to about a tenth of what one connection deletes
        (5,000-11,000 rows/s where a batch takes 18-9 ms, measured at 10M rows), and
        takes no more than a tenth of one connection's time, so claims are not starved.
        Consumers purging at once pick the same oldest rows: the one that comes second
        finds its batch gone (a partial batch) and waits its minute, so the ceiling is
        per outbox rather than per consumer.
        """
        if self._retention is None:
            return
        while True:
            try:
                _, behind, took = await self.purge_round(self._retention)
            except TRANSIENT_ERRORS as exc:
                check_permanent(exc, "purging finished rows")
                logger.warning("retention failed (%s)", exception_summary(exc))
                behind, took = False, 0.0
            wait = _PURGE_DUTY_WAIT * took if behind else _PURGE_EVERY
            await anyio.sleep(wait * random.uniform(0.8, 1.2))

    async def purge_round(self, retention: float) -> tuple[int, bool, float]:
        """One round of retention: the rows it deleted, whether rows are still due (its
        last batch came back full), and the seconds it took."""
        started = time.monotonic()
        deleted = 0
        # the ring of finished events first: whole slots, by TRUNCATE (0022)
        retired = await bounded(
            self._pool, "fetchrow", self._q.retire_done, retention, timeout=self._timeout
        )
        if retired is not None and retired["truncated"]:
            logger.debug("retention: emptied %d slot(s) of finished events", retired["truncated"])
        while True:
            status = await bounded(
                self._pool,
                "execute",
                self._q.purge_done,
                retention,
                _PURGE_BATCH,
                timeout=self._timeout,
            )
            count = int(status.rsplit(" ", 1)[-1])
            deleted += count
            behind = count >= _PURGE_BATCH
            if not behind or time.monotonic() - started >= _PURGE_ROUND:
                break
        await bounded(self._pool, "execute", self._q.purge_expired_idle, timeout=self._timeout)
        took = time.monotonic() - started
        if behind:
            logger.debug("retention: purged %d rows in %.2fs, more are due", deleted, took)
        return deleted, behind, took

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
        """Recover expired leases from the lease mark: the lease of the first row being
        processed that this consumer's last look found, never later than
        `_LEASE_MARGIN` before now (a claim or heartbeat still running writes leases
        later than that), so no run walks the lease index's dead entries from its start
        again (docs/internals.md, "The hot path"). The first run starts at the start,
        and so does the first on a server that started since the last look (a promoted
        standby can hold rows whose leases the mark has passed)."""
        total = 0
        while True:
            mark, started = await bounded(
                self._pool,
                "fetchrow",
                self._q.lease_mark,
                self._lease_mark,
                _LEASE_MARGIN,
                self._server_started,
                timeout=self._timeout,
            )
            rows = await bounded(
                self._pool,
                "fetch",
                self._q.recover_after,
                _RECOVER_BATCH,
                mark,
                timeout=self._timeout,
            )
            self._lease_mark, self._server_started = mark, started
            for event_id, topic, status, worker in rows:
                if self._tallies is not None and status in ("retry", "dead"):
                    self._tallies.failed(topic, status == "dead")  # an attempt cut short
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
