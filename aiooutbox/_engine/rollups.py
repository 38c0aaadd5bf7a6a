"""Per-topic, per-minute counts for the dashboard's charts (migration 0017).

`Tallies` is what the hot path touches: a dict increment per event done or failed, and a
pass over each claim's rows for the lag at claim (how long each row had been due: the
claim returns ``available_at``, so this costs no query). `Rollups` writes them every 15
seconds, on the quarter-minutes of the database's clock, with one upsert into
``<table>_rollups`` (one row per topic and minute), and deletes minutes older than
``KEPT_DAYS`` (`aiooutbox._sql.rollups`) every ten minutes.

The counts only inform operators, so they never stop a consumer: a role without the
grant (or an outbox not migrated) gets one warning naming the fix and the consumer runs
on without them; a failed write keeps its counts for the next one (a bounded number).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from operator import itemgetter

import anyio
import asyncpg

from .._sql.db import TRANSIENT_ERRORS, bounded, check_permanent
from .._sql.rollups import rollup_queries
from .._values.text import exception_summary
from .options import ConsumerOptions
from .rows import ClaimedRow

__all__ = ["FLUSH_EVERY", "Rollups", "Tallies"]

logger = logging.getLogger("aiooutbox.consumer")

FLUSH_EVERY = 15.0  # seconds; a divisor of 60, so a flush's counts lie in one minute
_PURGE_EVERY = 600.0  # seconds between deletions of old minutes, per consumer
_KEPT_ROWS = 20_000  # (minute, topic) rows kept across failed writes, at most
_LAG_CEILING = 3.2e9  # seconds (a century): an `available_at` of -infinity has no lag
_TOPIC, _AVAILABLE = itemgetter(1), itemgetter(8)  # of a `ClaimedRow`


class Tallies:
    """Counts since the last flush, by topic. Touched once per event (a dict increment)
    and once per claim; never blocks, never fails."""

    def __init__(self) -> None:
        self.done: defaultdict[str, int] = defaultdict(int)
        self.retried: defaultdict[str, int] = defaultdict(int)
        self.dead: defaultdict[str, int] = defaultdict(int)
        self.claimed: defaultdict[str, int] = defaultdict(int)
        self.lag_sum: defaultdict[str, float] = defaultdict(float)
        self.lag_max: dict[str, float] = {}
        # the database's clock minus this process's (seconds), measured by each flush
        self.offset = 0.0

    def claims(self, rows: Sequence[ClaimedRow]) -> None:
        """A claim's rows: how long each had been due when it was claimed. A claim of
        one topic (the usual case) is summed by builtins, in C; others row by row."""
        if not rows:
            return
        now = time.time() + self.offset
        topics = set(map(_TOPIC, rows))
        if len(topics) == 1:
            ats = list(map(_AVAILABLE, rows))
            self._add(topics.pop(), len(ats), sum(ats), min(ats), now)
            return
        seen: dict[str, list[float]] = {}
        for row in rows:
            at = row[8]
            acc = seen.get(row[1])
            if acc is None:
                seen[row[1]] = [1.0, at, at]
            else:
                acc[0] += 1.0
                acc[1] += at
                if at < acc[2]:
                    acc[2] = at
        for topic, (n, total, oldest) in seen.items():
            self._add(topic, int(n), total, oldest, now)

    def _add(self, topic: str, n: int, total: float, oldest: float, now: float) -> None:
        lag_sum = n * now - total
        lag_max = now - oldest
        if not (lag_max < _LAG_CEILING and lag_sum == lag_sum):
            return  # an `available_at` of -infinity (or +infinity): no lag to speak of
        self.claimed[topic] += n
        self.lag_sum[topic] += max(lag_sum, 0.0)
        if lag_max > self.lag_max.get(topic, 0.0):
            self.lag_max[topic] = lag_max

    def failed(self, topic: str, dead: bool) -> None:
        (self.dead if dead else self.retried)[topic] += 1

    def take(self) -> dict[str, list[float]]:
        """The counts by topic (done, retried, dead, claimed, lag sum, lag max), reset."""
        topics = set(self.done) | set(self.retried) | set(self.dead) | set(self.claimed)
        out = {
            t: [
                self.done.get(t, 0),
                self.retried.get(t, 0),
                self.dead.get(t, 0),
                self.claimed.get(t, 0),
                self.lag_sum.get(t, 0.0),
                self.lag_max.get(t, 0.0),
            ]
            for t in topics
        }
        for counts in (self.done, self.retried, self.dead, self.claimed, self.lag_sum):
            counts.clear()
        self.lag_max.clear()
        return out


class Rollups:
    """Writes the `Tallies` of one consumer, on the quarter-minutes of the server's clock."""

    def __init__(self, pool: asyncpg.Pool, options: ConsumerOptions, tallies: Tallies) -> None:
        self._pool = pool
        self._o = options
        self._q = rollup_queries(options.queries.schema, options.queries.table)
        self.tallies = tallies
        self.disabled = False  # no grant (or no table): the counts are dropped
        self.flushes = 0  # flushes written (the tests wait on it)
        # (minute, topic) -> counts, waiting to be written
        self._unwritten: dict[tuple[float, str], list[float]] = {}
        self._since = time.time()  # by the server's clock: when the counts began
        self._next_purge = time.monotonic() + random.uniform(0, _PURGE_EVERY)
        self._failing = False
        # each consumer flushes a little after the quarter-minute, spreading the writes
        self._delay = random.uniform(0.2, 2.0)

    def _server_now(self) -> float:
        return time.time() + self.tallies.offset

    async def run(self) -> None:
        """Flush on every quarter-minute (of the server's clock) until cancelled."""
        with contextlib.suppress(*TRANSIENT_ERRORS):
            before = time.time()
            server = await bounded(
                self._pool, "fetchval", self._q.clock, timeout=self._o.statement_timeout
            )
            self.tallies.offset = server - (before + time.time()) / 2
        self._since = self._server_now()
        while True:
            now = self._server_now()
            boundary = (math.floor(now / FLUSH_EVERY) + 1) * FLUSH_EVERY
            await anyio.sleep(boundary - now + self._delay)
            await self.flush(upto=boundary)

    async def flush(self, upto: float | None = None) -> None:
        """Write what was counted since the last flush (``upto``: the quarter-minute it
        ends at; None: now, the last flush at a stop)."""
        counts = self.tallies.take()
        if self.disabled:
            return
        # the counts since `_since` lie in its minute (flushes come every quarter)
        minute = math.floor(self._since / 60.0) * 60.0
        self._since = upto if upto is not None else self._server_now()
        for topic, c in counts.items():
            kept = self._unwritten.get((minute, topic))
            if kept is None:
                self._unwritten[(minute, topic)] = c
            else:
                for i in range(5):
                    kept[i] += c[i]
                kept[5] = max(kept[5], c[5])
        if len(self._unwritten) > _KEPT_ROWS:  # the database is away: keep the latest
            for key in sorted(self._unwritten)[: len(self._unwritten) - _KEPT_ROWS]:
                del self._unwritten[key]
        if self._unwritten:
            await self._write()
        if not self.disabled and time.monotonic() >= self._next_purge:
            self._next_purge = time.monotonic() + _PURGE_EVERY
            await self._run("execute", self._q.purge_old)

    async def _write(self) -> None:
        rows = sorted(self._unwritten.items())
        columns: list[list[object]] = [[m for (m, _), _ in rows], [t for (_, t), _ in rows]]
        for i in range(6):
            columns.append([int(c[i]) if i < 4 else float(c[i]) for _, c in rows])
        before = time.time()
        result = await self._run("fetchrow", self._q.add, *columns)
        if not isinstance(result, asyncpg.Record):
            return
        self._unwritten.clear()
        self.flushes += 1
        # what the server's clock said halfway through the round trip
        self.tallies.offset = result[0] - (before + time.time()) / 2

    async def _run(self, method: str, query: str, *args: object) -> object:
        try:
            result = await bounded(
                self._pool, method, query, *args, timeout=self._o.statement_timeout
            )
        except TRANSIENT_ERRORS as exc:
            state = getattr(exc, "sqlstate", None)
            if isinstance(state, str) and state[:2] == "42":  # no grant, or no table
                await self._disable(exc)
                return None
            check_permanent(exc, "writing the per-minute counts")
            if not self._failing:
                logger.warning(
                    "per-minute counts not written (%s); kept for the next flush",
                    exception_summary(exc),
                )
            self._failing = True
            return None
        self._failing = False
        return result

    async def _disable(self, exc: BaseException) -> None:
        self.disabled = True
        self._unwritten.clear()
        role = "<the consumer's role>"
        with contextlib.suppress(*TRANSIENT_ERRORS):
            role = await bounded(
                self._pool,
                "fetchval",
                "SELECT quote_ident(current_user)",
                timeout=self._o.statement_timeout,
            )
        if getattr(exc, "sqlstate", None) == "42501":
            fix = f"run GRANT SELECT, INSERT, UPDATE, DELETE ON {self._q.table} TO {role};"
        else:
            fix = "run `python -m aiooutbox migrate`"
        logger.warning(
            "consumer %s does not report its per-minute counts (the dashboard's charts"
            " leave it out): %s; %s",
            self._o.worker_id,
            exception_summary(exc),
            fix,
            extra={"worker_id": self._o.worker_id},
        )
