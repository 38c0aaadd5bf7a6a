"""Who consumes: each consumer as the database knows it.

Three sources, merged by worker id: the consumer registry (migration 0014: host, pid,
concurrency, prefetch, topics, started, last heartbeat; written at start, touched by
each heartbeat, deleted on a clean stop), the leases held (rows `processing` under the
worker id) and the idle adverts (consumers waiting on LISTEN). A consumer of an older
release, or one whose role may not write the registry, shows from the other two only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import asyncpg

from .._sql.registry import registry_queries
from ._sql import WebQueries

__all__ = ["Worker", "read_workers"]


@dataclass
class Worker:
    worker_id: str
    held: int = 0
    oldest_claim: float | None = None
    lease_left: float | None = None  # seconds until its latest lease expires
    topics: list[str] = field(default_factory=list)
    idle_topics: list[str] | None = None
    idle_left: float | None = None
    # from the registry (None: not registered)
    host: str | None = None
    pid: int | None = None
    concurrency: int | None = None
    prefetch: int | None = None
    registered_topics: list[str] | None = None  # None with `registered`: every topic
    lease_timeout: float | None = None
    version: str | None = None
    started_ago: float | None = None
    seen_ago: float | None = None  # seconds since its last heartbeat
    expires_in: float | None = None  # negative: its heartbeat stopped, it is gone
    registered: bool = False

    @property
    def relay(self) -> bool:
        return self.worker_id.startswith("relay ") and " @" in self.worker_id

    @property
    def destination(self) -> str:
        """``SINK:DESTINATION`` of a relay (see `aiooutbox.relay`'s worker ids)."""
        return self.worker_id[len("relay ") :].rsplit(" @", 1)[0] if self.relay else ""

    @property
    def state(self) -> str:
        """``alive`` (heartbeat current, or holding live leases), ``gone`` (heartbeat
        stopped and nothing held), or ``unregistered`` (seen through leases or adverts only)."""
        if self.registered and self.expires_in is not None and self.expires_in > 0:
            return "alive"
        if self.registered and not self.held:
            return "gone"
        return "alive" if self.registered else "unregistered"

    @property
    def shown_topics(self) -> list[str]:
        if self.registered:
            return self.registered_topics if self.registered_topics is not None else ["*"]
        return self.topics or self.idle_topics or []


async def read_workers(conn: Any, w: WebQueries) -> tuple[list[Worker], str | None]:
    """Every consumer seen; and why the registry could not be read, if it could not."""
    found: dict[str, Worker] = {}
    for worker_id, held, oldest, left, topics in await conn.fetch(w.workers):
        found[worker_id or "?"] = Worker(worker_id or "?", held, oldest, left, list(topics))
    for worker_id, topics, left in await conn.fetch(w.idle_workers):
        if left is not None and left < -60:
            continue  # an advert long expired: its consumer is gone
        worker = found.setdefault(worker_id, Worker(worker_id))
        worker.idle_topics, worker.idle_left = list(topics), left
    rq = registry_queries(w.outbox.schema, w.outbox.table)
    unreadable = None
    try:
        registered = await conn.fetch(rq.listing)
    except (asyncpg.InsufficientPrivilegeError, asyncpg.UndefinedTableError) as exc:
        registered = []
        if isinstance(exc, asyncpg.InsufficientPrivilegeError):
            unreadable = (
                f"this dashboard's database role may not read {w.outbox.table}_consumers:"
                " GRANT SELECT on it to show each consumer's concurrency, host and heartbeat"
            )
        else:
            unreadable = (
                f"{w.outbox.table}_consumers is missing: run `python -m aiooutbox migrate`"
                " to show each consumer's concurrency, host and heartbeat"
            )
    for r in registered:
        worker = found.setdefault(r[0], Worker(r[0]))
        worker.registered = True
        worker.host, worker.pid, worker.concurrency, worker.prefetch = r[1], r[2], r[3], r[4]
        worker.registered_topics = None if r[5] is None else list(r[5])
        worker.lease_timeout, worker.version = r[6], r[7]
        worker.started_ago, worker.seen_ago, worker.expires_in = r[8], r[9], r[10]
    return sorted(found.values(), key=lambda x: (x.state == "gone", x.worker_id)), unreadable
