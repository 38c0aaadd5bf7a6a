"""`DatabasesHealth`: ``/healthz`` of one process serving several databases.

Each database's consumer has its own `ConsumerHealth`; this one answers for all of them:

- 503 while any consumer is not running (start-up, shutdown, or one that stopped on an
  error: the process needs attention), or while no database is healthy;
- 200 while at least one is healthy, with ``"degraded"`` and the unhealthy ones named
  when some are not. One database down must not get the process restarted: a restart
  would stop the others (and start-up refuses an unreachable database). Watch each
  database's ``aiooutbox_queue_lag_seconds`` and ``_queue_stats_timestamp_seconds``
  (``database`` label) for that database's own trouble.

The JSON body holds every database's own answer under ``databases``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..health import ConsumerHealth, HealthStatus

__all__ = ["DatabasesHealth"]


class DatabasesHealth:
    """The health of several consumers, one per named database (`add`)."""

    def __init__(self) -> None:
        self._members: dict[str, ConsumerHealth] = {}

    def add(self, name: str) -> ConsumerHealth:
        """A new `ConsumerHealth` for the consumer of database ``name``."""
        if name in self._members:
            raise ValueError(f"database {name!r} is watched already")
        health = self._members[name] = ConsumerHealth()
        return health

    async def check(self) -> HealthStatus:
        names = list(self._members)
        if not names:
            return HealthStatus(False, "no database to serve yet")
        found = await asyncio.gather(*(self._members[n].check() for n in names))
        answers = dict(zip(names, found, strict=True))
        details: dict[str, Any] = {"databases": {n: a.as_dict() for n, a in answers.items()}}
        stopped = [
            n for n, h in self._members.items() if h.consumer is None or not h.consumer.running
        ]
        if stopped:
            return HealthStatus(False, f"not running for {', '.join(stopped)}", details)
        unhealthy = [n for n, a in answers.items() if not a.ok]
        if len(unhealthy) == len(names):
            return HealthStatus(False, "no database is healthy", details)
        if unhealthy:
            details["degraded"] = unhealthy
            return HealthStatus(
                True,
                f"serving {len(names) - len(unhealthy)} of {len(names)} databases; "
                f"unhealthy: {', '.join(unhealthy)}",
                details,
            )
        return HealthStatus(True, f"serving {len(names)} databases", details)
