"""The MVCC watchdog: warn when something elsewhere keeps vacuum from cleaning the queue.

Every claimed and settled row leaves a dead tuple. VACUUM removes them only below the
xmin horizon, so one transaction that stays open anywhere on the server (idle in
transaction, a long report, a prepared transaction, a replication slot nobody reads)
lets them pile up and every claim walks more of them. The watchdog names the holder:
pid, application name, state and age, so an operator can end it.

Cheap by design: a few catalog reads every ``watchdog_interval`` (jittered ±50%), and
one consumer per outbox at a time (a transaction-scoped advisory lock; the others skip
that round). A warning for the same holder repeats at most every ten intervals. It
never stops the consumer: a failed check is logged and retried next round. The last
report is also what the metrics serve (`Watchdog.latest`, read at scrape time), so a
scrape costs no query.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import anyio
import asyncpg

from .._sql.db import TRANSIENT_ERRORS, pooled
from .._sql.statements import Queries
from .._values.text import exception_summary
from .options import ConsumerOptions

__all__ = ["HorizonHolder", "MvccReport", "Watchdog", "inspect_mvcc"]

logger = logging.getLogger("aiooutbox.watchdog")

_HOLDERS_SHOWN = 5


@dataclass(frozen=True)
class HorizonHolder:
    """One thing that holds back the xmin horizon.

    ``kind`` is ``backend`` (a session with a snapshot or a transaction id),
    ``replication slot`` (``name`` is the slot) or ``prepared transaction``
    (``name`` is its gid). ``age`` is seconds open (``None`` for a slot), ``xid_age``
    how many transaction ids old its horizon is.
    """

    kind: str
    pid: int | None
    name: str
    state: str | None
    age: float | None
    xid_age: int | None
    detail: str

    def describe(self) -> str:
        age = "?" if self.age is None else f"{self.age:.0f}s"
        return (
            f"{self.kind} pid={self.pid if self.pid is not None else '-'}"
            f" application_name={self.name!r} state={self.state or '?'} age={age}"
            f" xid_age={self.xid_age if self.xid_age is not None else '?'} ({self.detail})"
        )

    def pins(self, horizon_warning: float) -> bool:
        """True when this holder is past the threshold and worth a warning."""
        if self.kind == "replication slot":
            return self.state == "inactive"  # a slot nobody reads pins forever
        return self.age is not None and self.age >= horizon_warning

    def remedy(self) -> str:
        """The statement that ends this holder."""
        quoted = "'" + self.name.replace("'", "''") + "'"
        if self.kind == "replication slot":
            return f"SELECT pg_drop_replication_slot({quoted})"
        if self.kind == "prepared transaction":
            return f"ROLLBACK PREPARED {quoted}"
        return f"SELECT pg_terminate_backend({self.pid})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "pid": self.pid,
            "application_name": self.name,
            "state": self.state,
            "age_seconds": self.age,
            "xid_age": self.xid_age,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class MvccReport:
    """What pins the horizon (oldest first) and the outbox table's dead tuples.

    ``checked_at`` is the Unix time the reading started (not part of `as_dict`).
    """

    holders: list[HorizonHolder] = field(default_factory=list)
    dead_tuples: int | None = None
    live_tuples: int | None = None
    last_vacuum: datetime | None = None
    checked_at: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "horizon_holders": [h.as_dict() for h in self.holders],
            "dead_tuples": self.dead_tuples,
            "live_tuples": self.live_tuples,
            "last_vacuum": self.last_vacuum.isoformat() if self.last_vacuum else None,
        }


async def inspect_mvcc(conn: asyncpg.Connection, q: Queries) -> MvccReport:
    """Read the horizon's holders and the table's dead tuples (what `stats` shows)."""
    checked_at = time.time()
    rows = await conn.fetch(q.horizon_holders, _HOLDERS_SHOWN)
    vacuum = await conn.fetchrow(q.table_vacuum_stats, q.schema, q.table)
    return MvccReport(
        holders=[HorizonHolder(*r) for r in rows],
        dead_tuples=None if vacuum is None else vacuum[0],
        live_tuples=None if vacuum is None else vacuum[1],
        last_vacuum=None if vacuum is None else vacuum[2],
        checked_at=checked_at,
    )


class Watchdog:
    def __init__(self, pool: asyncpg.Pool, options: ConsumerOptions) -> None:
        assert options.watchdog_interval is not None
        self._pool = pool
        self._q = options.queries
        self._interval = options.watchdog_interval
        self._timeout = options.statement_timeout
        self._horizon_warning = options.horizon_warning
        self._dead_warning = options.dead_tuples_warning
        self._warned: dict[tuple[object, ...], float] = {}
        self.checks = 0
        self.last: MvccReport | None = None
        self._fresh_until = 0.0

    @property
    def latest(self) -> MvccReport | None:
        """The last report while it is fresh, else ``None``.

        Fresh means younger than three intervals: rounds are jittered up to 1.5
        intervals apart and one may be skipped (another consumer was checking), and a
        reading older than that, after failed checks, should vanish rather than look
        current.
        """
        if self.last is None or time.monotonic() > self._fresh_until:
            return None
        return self.last

    async def run(self) -> None:
        """Check until cancelled; the first check comes soon after start."""
        await anyio.sleep(random.uniform(0.2, min(self._interval, 10.0)))
        while True:
            try:
                report = await self.check()
            except TRANSIENT_ERRORS as exc:
                logger.info("watchdog check failed (%s)", exception_summary(exc))
            else:
                if report is not None:
                    self._warn(report)
            await anyio.sleep(self._interval * (0.5 + random.random()))

    async def check(self) -> MvccReport | None:
        """One round, or ``None`` when another consumer is checking right now."""
        with anyio.fail_after(3 * self._timeout):
            async with pooled(self._pool, self._timeout) as conn:
                try:
                    async with conn.transaction():
                        if not await conn.fetchval(
                            self._q.watchdog_lock, self._q.qualified, timeout=self._timeout
                        ):
                            return None
                        report = await inspect_mvcc(conn, self._q)
                except BaseException:
                    # cancelled inside the transaction (a stop, the deadline): the
                    # rollback's await is cancelled too, and a connection given back
                    # inside a transaction is reported as an error by asyncpg's reset;
                    # close it instead (the server rolls back)
                    if conn.is_in_transaction():
                        conn.terminate()
                    raise
        self.checks += 1
        self.last = report
        self._fresh_until = time.monotonic() + 3 * self._interval
        return report

    def _warn(self, report: MvccReport) -> None:
        now = time.monotonic()
        repeat = 10 * self._interval
        seen: set[tuple[object, ...]] = set()
        pinning = [h for h in report.holders if h.pins(self._horizon_warning)]
        for holder in pinning:
            key: tuple[object, ...] = (holder.kind, holder.pid, holder.name)
            seen.add(key)
            if now - self._warned.get(key, -repeat) < repeat:
                continue
            self._warned[key] = now
            logger.warning(
                "the xmin horizon is held by %s: vacuum cannot remove the outbox's dead rows"
                " while it lasts and claims slow down; if it is forgotten: %s",
                holder.describe(),
                holder.remedy(),
                extra={"holder": holder.as_dict()},
            )
        dead = report.dead_tuples
        if dead is not None and dead >= self._dead_warning:
            key = ("dead tuples",)
            seen.add(key)
            if now - self._warned.get(key, -repeat) >= repeat:
                self._warned[key] = now
                oldest = report.holders[0].describe() if report.holders else "none"
                logger.warning(
                    "the outbox table %s has %d dead tuples (%s live, last vacuum %s);"
                    " oldest horizon holder: %s; see docs/deployment.md (autovacuum)",
                    self._q.qualified,
                    dead,
                    report.live_tuples,
                    report.last_vacuum.isoformat() if report.last_vacuum else "never",
                    oldest,
                )
        for old in list(self._warned):
            if old not in seen:
                del self._warned[old]
