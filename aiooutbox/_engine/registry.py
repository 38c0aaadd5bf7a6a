"""`Registry`: this consumer's row in the consumer registry (migration 0014).

Written once at start, touched by the lease heartbeat (one small statement per beat,
a third of ``lease_timeout`` apart: nothing per event or per claim), deleted on a clean
stop. A consumer that stops beating leaves a row that expires after ``lease_timeout``;
the dashboard shows it as gone, and some consumer purges it an hour later.

The registry only informs operators, so it never stops a consumer: a role without the
grant (a least-privilege role set up for an older release) gets one warning naming the
GRANT and the consumer runs unregistered; a failed write is retried at the next beat.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import socket
import time

import asyncpg

from .._sql.db import TRANSIENT_ERRORS, bounded, check_permanent
from .._sql.registry import registry_queries
from .._values.text import exception_summary
from .options import ConsumerOptions

__all__ = ["Registry"]

logger = logging.getLogger("aiooutbox.consumer")

_PURGE_EVERY = 600.0  # seconds between purges of long-gone rows, per consumer


class Registry:
    def __init__(self, pool: asyncpg.Pool, options: ConsumerOptions, topics: list[str] | None):
        self._pool = pool
        self._o = options
        self._topics = topics
        self._q = registry_queries(options.queries.schema, options.queries.table)
        self.registered = False
        self.disabled = False  # no grant (or no table): the consumer runs unregistered
        self._next_purge = 0.0
        self._stopping = False

    @property
    def _expires_in(self) -> float:
        # three missed beats (a beat every third of the lease)
        return self._o.lease_timeout

    async def register(self) -> None:
        """Write this consumer's row (at start, and again when a touch finds none)."""
        o = self._o
        await self._run(
            "execute",
            self._q.register,
            o.worker_id,
            socket.gethostname()[:255],
            os.getpid(),
            o.concurrency,
            o.ahead,
            self._topics,
            o.lease_timeout,
            _version(),
            self._expires_in,
        )
        self.registered = not self.disabled

    async def beat(self) -> None:
        """The heartbeat's touch; purges long-gone rows every `_PURGE_EVERY` seconds."""
        if self.disabled or self._stopping:
            return
        if not self.registered:
            await self.register()
            return
        status = await self._run("execute", self._q.touch, self._o.worker_id, self._expires_in)
        if status == "UPDATE 0":  # purged after a long stall, or a server crash truncated it
            await self.register()
        if not self.disabled and time.monotonic() >= self._next_purge:
            self._next_purge = time.monotonic() + _PURGE_EVERY
            await self._run("execute", self._q.purge_gone)

    async def remove(self) -> None:
        """A clean stop: the row goes at once (the dashboard no longer lists it)."""
        self._stopping = True  # a beat still running must not write the row again
        if not self.disabled:
            await self._run("execute", self._q.remove, self._o.worker_id, quiet=True)
            self.registered = False

    async def _run(self, method: str, query: str, *args: object, quiet: bool = False) -> object:
        try:
            return await bounded(
                self._pool, method, query, *args, timeout=self._o.statement_timeout
            )
        except TRANSIENT_ERRORS as exc:
            state = getattr(exc, "sqlstate", None)
            if quiet:  # at shutdown: the row expires by itself
                logger.debug("consumer registry: %s", exception_summary(exc))
                return None
            if isinstance(state, str) and state[:2] == "42":  # no grant, or no table
                await self._disable(exc)
                return None
            check_permanent(exc, "writing the consumer registry")
            self.registered = False  # written again at the next beat
            logger.warning("consumer registry write failed (%s)", exception_summary(exc))
            return None

    async def _disable(self, exc: BaseException) -> None:
        self.disabled = True
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
            "consumer %s runs unregistered (the dashboard cannot show its concurrency): %s; %s",
            self._o.worker_id,
            exception_summary(exc),
            fix,
            extra={"worker_id": self._o.worker_id},
        )


def _version() -> str:
    """This distribution's version ("unknown" from a checkout never installed)."""
    try:
        return importlib.metadata.version("aiooutbox")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
