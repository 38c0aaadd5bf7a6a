"""`ConsumerHealth`: is this process's consumer alive and in touch with its database?

Pass it as an observer, ``OutboxConsumer(pool, observers=[health])``, then ask
``await health.check()`` from a ``/healthz`` route (or let `aiooutbox.metrics.serve`
answer it). Exactly what is checked, in order:

1. the consumer's ``run()`` is in progress (not yet started, returned or failed: 503);
2. its claim loop completed a claim (empty or not) within ``max_silence`` seconds
   (default ``3 x poll_interval + statement_timeout``: an idle consumer claims at least
   once per jittered poll interval, and a claim may take up to ``statement_timeout``);
3. only when no claim was due because every handler slot is busy: one ``SELECT 1``
   through the consumer's pool answered within 3 s (or ``statement_timeout``, if
   shorter), so ``/healthz`` answers 503 in time when the database stalls. One probe
   runs at a time and its answer is cached for a second: a probe storm costs one query.

So a dead database, a closed pool, a stuck claim loop or a consumer that gave up all
answer 503, while a busy consumer running long handlers answers 200. The LISTEN
connection is not part of it: a consumer whose listener is down still polls (watch
``aiooutbox_listener_connected`` for that).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from ._sql.db import TRANSIENT_ERRORS
from ._values.text import describe_exception
from .errors import InvalidArgument
from .observe import ObservedConsumer, Observer

__all__ = ["ConsumerHealth", "HealthStatus"]

logger = logging.getLogger("aiooutbox.health")

_PROBE_CACHE = 1.0
#: the longest the ``SELECT 1`` probe waits (or ``statement_timeout``, if shorter)
PROBE_TIMEOUT = 3.0


@dataclass(frozen=True)
class HealthStatus:
    """The answer of one check: ``ok``, why not, and what was seen."""

    ok: bool
    reason: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def http_status(self) -> int:
        return 200 if self.ok else 503

    def as_dict(self) -> dict[str, Any]:
        return {"status": "ok" if self.ok else "unavailable", "reason": self.reason, **self.details}


class ConsumerHealth(Observer):
    """The health of one consumer; see the module docstring for what is checked."""

    def __init__(self, *, max_silence: float | None = None) -> None:
        if max_silence is not None and (
            isinstance(max_silence, bool)
            or not isinstance(max_silence, (int, float))
            or not max_silence > 0
        ):
            raise InvalidArgument(
                f"max_silence must be a positive number of seconds, not {max_silence!r}"
            )
        self._max_silence = None if max_silence is None else float(max_silence)
        self._consumer: ObservedConsumer | None = None
        self._last_claim: float | None = None
        self._seen_running: float | None = None
        self._probe: tuple[float, bool, str] | None = None  # (when, answered, error)
        self._probing: anyio.Event | None = None  # set when the probe in flight ends

    # -- Observer ------------------------------------------------------------------
    def attached(self, consumer: ObservedConsumer) -> None:
        if self._consumer is not None and self._consumer is not consumer:
            raise RuntimeError("a ConsumerHealth watches one consumer; make one per consumer")
        self._consumer = consumer

    def claimed(self, rows: int, seconds: float) -> None:
        self._last_claim = time.monotonic()

    # -- the check -----------------------------------------------------------------
    @property
    def consumer(self) -> ObservedConsumer | None:
        """The consumer watched, once attached."""
        return self._consumer

    @property
    def max_silence(self) -> float:
        if self._max_silence is not None:
            return self._max_silence
        consumer = self._consumer
        if consumer is None:
            return 30.0
        o = consumer.options
        return 3 * o.poll_interval + o.statement_timeout

    async def check(self) -> HealthStatus:
        """Run the checks; never raises for an unhealthy consumer (``ok`` is False)."""
        consumer = self._consumer
        if consumer is None:
            return HealthStatus(
                False, "no consumer: pass this object in OutboxConsumer(observers=[...])"
            )
        now = time.monotonic()
        if not consumer.running:
            self._seen_running = None
            return HealthStatus(
                False, "the consumer is not running", {"worker_id": consumer.worker_id}
            )
        if self._seen_running is None:
            self._seen_running = now
        limit = self.max_silence
        # before its first claim, the consumer is given max_silence from when a check
        # first saw it running
        since = self._last_claim if self._last_claim is not None else self._seen_running
        silence = max(0.0, now - since)
        details: dict[str, Any] = {
            "worker_id": consumer.worker_id,
            "in_flight": consumer.stats.in_flight,
            "listening": consumer.listening,
            "last_claim_seconds_ago": None
            if self._last_claim is None
            else round(now - self._last_claim, 3),
            "max_silence": limit,
        }
        if silence <= limit:
            return HealthStatus(True, "claiming", details)
        o = consumer.options
        free = o.concurrency - consumer.stats.in_flight
        if free >= max(1, o.claim_size // 4):
            return HealthStatus(
                False,
                f"no successful claim for {silence:.1f}s (limit {limit:g}s): the database is "
                "unreachable or the claim loop is stuck",
                details,
            )
        answered, error = await self._probe_database(consumer)
        details["probe"] = "answered" if answered else error
        if answered:
            return HealthStatus(True, "every handler slot busy; the database answered", details)
        return HealthStatus(
            False, f"every handler slot busy and the database probe failed: {error}", details
        )

    async def _probe_database(self, consumer: ObservedConsumer) -> tuple[bool, str]:
        """One ``SELECT 1`` at a time: concurrent checks wait for the one in flight and
        share its (cached) answer, so a probe storm on a slow database costs one query."""
        while True:
            cached = self._probe
            if cached is not None and time.monotonic() - cached[0] < _PROBE_CACHE:
                return cached[1], cached[2]
            if self._probing is None:
                break
            await self._probing.wait()  # its result is cached, unless it was cancelled
        self._probing = done = anyio.Event()
        try:
            result = await self._select_one(consumer)
            self._probe = (time.monotonic(), *result)
        finally:
            self._probing = None
            done.set()
        return result

    async def _select_one(self, consumer: ObservedConsumer) -> tuple[bool, str]:
        # A few seconds, not statement_timeout: /healthz must answer before its
        # connection is given up on (MetricsServer allows 5 s, a kubelet often less).
        timeout = min(PROBE_TIMEOUT, consumer.options.statement_timeout)
        pool = consumer.pool  # the consumer's own pool: the one its claims go through
        try:
            with anyio.fail_after(timeout):
                await pool.fetchval("SELECT 1", timeout=timeout)
        except TimeoutError:
            return False, f"the database did not answer within {timeout:g}s"
        except TRANSIENT_ERRORS as exc:
            return False, describe_exception(exc)
        return True, ""
