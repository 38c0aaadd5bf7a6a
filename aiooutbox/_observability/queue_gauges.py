"""`QueueGauges`: the one periodic query behind ``aiooutbox_queue_depth`` and ``_lag_seconds``.

The table-level gauges come from ONE query per interval per process
(`Queries.queue_gauges`), never per scrape; `collectors.QueueCollector` serves the
last snapshot while it is fresh. Import it from `aiooutbox.metrics`.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import anyio
import asyncpg
from anyio.abc import TaskStatus

from .._sql.db import TRANSIENT_ERRORS, bounded
from .._sql.flow import flow_queries
from .._sql.groups import TOP_GROUPS, top_groups
from .._sql.statements import DEFAULT_SCHEMA, DEFAULT_TABLE, queries
from .._values.text import exception_summary
from ..errors import InvalidArgument

__all__ = ["QueueGauges", "QueueSnapshot"]

logger = logging.getLogger("aiooutbox.metrics")

# the queue query may take at most this share of the wall time (it slows with the backlog)
_QUEUE_QUERY_SHARE = 0.05


class QueueSnapshot:
    """One refresh: rows per (topic, status), lag per topic, the topics' flow controls
    (topic -> (paused, max_running, rate per second); ``"*"``: every topic), and its
    wall time."""

    __slots__ = ("at", "controls", "depth", "groups", "lag")

    def __init__(
        self,
        rows: list[Any],
        at: float,
        controls: list[Any] | None = None,
        groups: list[Any] | None = None,
    ) -> None:
        self.at = at
        # (topic, group, 'due' or 'running') -> events, for the top groups only
        self.groups: dict[tuple[str, str, str], float] = {
            (r[0], r[1], r[2]): float(r[3]) for r in groups or ()
        }
        self.controls: dict[str, tuple[bool, int | None, float | None]] = {
            r["topic"] or "*": (r["paused"], r["max_running"], r["rate"]) for r in controls or ()
        }
        self.depth: dict[tuple[str, str], float] = {}
        self.lag: dict[str, float] = {}
        for topic, status, count, age in rows:
            self.depth[(topic, status)] = float(count)
            oldest = self.lag.get(topic, 0.0)
            self.lag[topic] = max(oldest, float(age)) if age is not None else oldest


class QueueGauges:
    """The periodic query behind the table-level gauges, one loop per process.

    Refreshes every ``interval`` seconds (jittered ±10%), and less often when the query
    gets slow (it reads every unfinished row): never more than 5% of the wall time. A
    failed refresh is logged; gauges older than three intervals are no longer served,
    so a stale number never looks current.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        schema: str = DEFAULT_SCHEMA,
        table: str = DEFAULT_TABLE,
        interval: float = 15.0,
        timeout: float = 10.0,
    ) -> None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise TypeError(f"interval must be seconds, not {type(interval).__name__}")
        if not 0.05 <= interval <= 3600:
            raise InvalidArgument(f"interval must be between 0.05 and 3600 seconds, got {interval}")
        self._pool = pool
        self._sql = queries(schema, table).queue_gauges
        self._controls_sql = flow_queries(schema, table).all_controls
        self._groups_sql = top_groups(queries(schema, table).qualified)
        self.interval = float(interval)
        self._timeout = timeout
        self._snapshot: QueueSnapshot | None = None
        self._fresh_until = 0.0
        self.refreshes = 0

    @property
    def snapshot(self) -> QueueSnapshot | None:
        if self._snapshot is None or time.monotonic() > self._fresh_until:
            return None
        return self._snapshot

    async def refresh(self) -> float:
        """Run the query once; return how long it took. Raises on database errors."""
        started = time.monotonic()
        rows = await bounded(self._pool, "fetch", self._sql, timeout=self._timeout)
        try:
            controls = await bounded(self._pool, "fetch", self._controls_sql, timeout=self._timeout)
        except asyncpg.UndefinedTableError:  # a schema from before flow control
            controls = []
        try:
            groups = await bounded(
                self._pool, "fetch", self._groups_sql, TOP_GROUPS, timeout=self._timeout
            )
        except asyncpg.UndefinedColumnError:  # a schema from before groups
            groups = []
        took = time.monotonic() - started
        self._snapshot = QueueSnapshot(list(rows), time.time(), list(controls), list(groups))
        self._fresh_until = time.monotonic() + 3 * max(self.interval, took / _QUEUE_QUERY_SHARE)
        self.refreshes += 1
        return took

    async def attempt(self) -> float:
        """Refresh once, logging a failure; return the pause before the next one."""
        took = 0.0
        try:
            took = await self.refresh()
        except TRANSIENT_ERRORS as exc:
            logger.warning("queue gauges not refreshed (%s)", exception_summary(exc))
        return max(self.interval, took / _QUEUE_QUERY_SHARE)

    async def run(
        self,
        *,
        pause: float | None = None,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Refresh until cancelled (``await task_group.start(gauges.run)`` returns after
        the first attempt, successful or not). ``pause``: wait that long first."""
        if pause is None:
            pause = await self.attempt()
        task_status.started()
        while True:
            await anyio.sleep(pause * random.uniform(0.9, 1.1))
            pause = await self.attempt()
