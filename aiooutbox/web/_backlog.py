"""The backlog by topic, exact: pending (due now), scheduled (not due yet), retrying,
due, and dead events, each counted over one partial index, index-only.

Three statements: the claim's index (pending and retrying events, and when each is
due), the retry index (0017) and the dead index (0011). Counting every entry costs
about a tenth of a microsecond each, so a backlog of millions is counted in a fraction
of a second; the pages share the result through the dashboard's count cache, read again
only after the pulse moved (something was written) and at most every 25 times what
reading it took. Past `COUNT_TIME` (tens of millions of rows) the counts are the
planner's per status, shared among topics as the page sample shares them, and say so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from ._counts import Count, estimate_rows, estimated, exact
from ._sql import WebQueries

__all__ = ["COUNT_TIME", "Backlog", "TopicBacklog", "read_backlog"]

# how long the exact counts may take before the backlog is estimated (seconds)
COUNT_TIME = 5.0


@dataclass
class TopicBacklog:
    pending: Count = field(default_factory=lambda: exact(0))  # due now, never failed
    scheduled: Count = field(default_factory=lambda: exact(0))  # pending, not due yet
    retry: Count = field(default_factory=lambda: exact(0))  # failed, waiting to run again
    due: Count = field(default_factory=lambda: exact(0))  # pending or retrying, due now
    dead: Count = field(default_factory=lambda: exact(0))


@dataclass
class Backlog:
    topics: dict[str, TopicBacklog]
    exact: bool
    seconds: float  # what reading it took
    at: float  # when (time.time())

    def of(self, topic: str) -> TopicBacklog:
        return self.topics.get(topic) or TopicBacklog()


async def read_backlog(conn: Any, w: WebQueries) -> Backlog:
    started = time.monotonic()
    try:
        async with conn.transaction():
            await conn.execute(f"SET LOCAL statement_timeout = {int(COUNT_TIME * 1000)}")
            claimable = await conn.fetch(w.claimable_counts)
            retrying = {t: (int(n), int(due)) for t, n, due in await conn.fetch(w.retry_counts)}
            dead = {t: int(n) for t, n in await conn.fetch(w.dead_counts)}
    except asyncpg.QueryCanceledError:
        guessed = await _estimated(conn, w)
        return Backlog(guessed, False, time.monotonic() - started, time.time())
    topics: dict[str, TopicBacklog] = {}
    for topic, total, due in claimable:
        retry, retry_due = retrying.get(topic, (0, 0))
        topics[topic] = TopicBacklog(
            pending=exact(due - retry_due),
            scheduled=exact(total - due - (retry - retry_due)),
            retry=exact(retry),
            due=exact(due),
        )
    for topic, n in dead.items():
        topics.setdefault(topic, TopicBacklog()).dead = exact(n)
    return Backlog(topics, True, time.monotonic() - started, time.time())


async def _estimated(conn: Any, w: WebQueries) -> dict[str, TopicBacklog]:
    """Past `COUNT_TIME`: the planner's rows of each status, shared among the topics
    the way the claim index's first entries of each are (the topics with due events
    count as due)."""
    totals = {
        s: await estimate_rows(conn, w.explain_status(s)) for s in ("pending", "retry", "dead")
    }
    lags = await conn.fetch(w.topic_lags)
    names = [r[0] for r in lags] or [""]
    share = 1.0 / len(names)
    topics: dict[str, TopicBacklog] = {}
    for topic, lag, _ in lags:
        due = lag is not None and lag >= 0
        topics[topic] = TopicBacklog(
            pending=estimated(totals["pending"] * share) if due else exact(0),
            scheduled=exact(0) if due else estimated(totals["pending"] * share),
            retry=estimated(totals["retry"] * share),
            due=estimated((totals["pending"] + totals["retry"]) * share) if due else exact(0),
            dead=estimated(totals["dead"] * share),
        )
    return topics
