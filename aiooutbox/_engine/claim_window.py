"""The dispatcher's pure parts: where the next claim starts (`ClaimWindow`) and whether
traffic is dense (`Arrivals`). No I/O, so unit tests drive them with made-up clocks."""

from __future__ import annotations

import math
from collections import deque
from datetime import UTC, datetime

__all__ = ["Arrivals", "ClaimWindow"]

# Full claims run at least every _FULL_CLAIM_EVERY[1] s, and more often (down to
# [0] s) while they are cheap: at most _FULL_CLAIM_SHARE of the time goes to them.
_FULL_CLAIM_EVERY = (0.02, 0.25)
_FULL_CLAIM_SHARE = 0.05
# trail the oldest claimed row: producers commit out of their now() order (see
# docs/benchmarks.md, "watermark lag")
_WATERMARK_LAG = 0.010  # seconds


class ClaimWindow:
    """Where the next claim starts, and how many rows it may take.

    Every row that leaves 'pending' leaves a dead entry at the head of the claimable
    index until VACUUM, so a claim that always starts from the oldest entry walks more
    of them with every event handled. Most claims therefore start just before the
    ``available_at`` of the oldest row the previous claim returned; a full claim
    catches rows the watermark hides (a producer that committed late with an older
    ``now()``, rows another consumer skipped or released), so their extra delay is
    bounded by the full claims' interval: at most 250 ms, and as little as 20 ms while
    full claims are cheap.

    After a claim times out, the next ones ask for a quarter as many rows (down to
    one), then double back towards the full size with each claim that succeeds.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = limit  # rows the next claim may take, shrunk after timeouts
        self.watermark: tuple[datetime, int] | None = None
        self._full_every = _FULL_CLAIM_EVERY[1]
        self._full_at = -math.inf

    def next_is_full(self, now: float) -> bool:
        return self.watermark is None or now - self._full_at >= self._full_every

    def force_full(self) -> None:
        """The next claim starts from the oldest entry (before going idle, after trouble)."""
        self._full_at = -math.inf

    def claimed(
        self, available_ats: list[float], *, full: bool, started: float, ended: float
    ) -> None:
        """A claim ended; ``available_ats``: its rows' as epoch seconds (±inf allowed)."""
        if full:
            self._full_at = started
            low, high = _FULL_CLAIM_EVERY
            self._full_every = min(high, max(low, (ended - started) / _FULL_CLAIM_SHARE))
        self.size = min(self.limit, self.size * 2)
        if not available_ats:
            return
        first = min(available_ats)
        if not math.isfinite(first):  # a row at ±infinity: the oldest finite one, if any
            finite = [a for a in available_ats if math.isfinite(a)]
            if not finite:
                return
            first = min(finite)
        try:
            oldest = (datetime.fromtimestamp(first - _WATERMARK_LAG, UTC), 0)
        except (OverflowError, OSError, ValueError):  # a row scheduled at the dawn of time
            return
        if full or self.watermark is None or oldest > self.watermark:
            self.watermark = oldest

    def timed_out(self) -> int:
        """Shrink after a claim timeout; returns the new size."""
        self.size = max(1, self.size // 4)
        self.force_full()
        return self.size


class Arrivals:
    """Recent claimed rows per second: is traffic dense enough to linger?

    Lingering after an empty claim (looking again after 2, 4, ... 32 ms) spares
    producers NOTIFY's commit-time lock under steady load, but events that arrive while
    nobody is advertised idle wait for the next look: at 50 events/s that made wake-up
    p99 25 ms. Below `_DENSE` rows per second the consumer advertises itself idle at once
    and is woken by the notification instead.
    """

    _WINDOW = 1.0
    _DENSE = 200.0

    def __init__(self) -> None:
        self._seen: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, now: float, rows: int) -> None:
        self._seen.append((now, rows))
        self._total += rows
        self._trim(now)

    def dense(self, now: float) -> bool:
        return self.rate(now) >= self._DENSE

    def rate(self, now: float) -> float:
        """Rows claimed per second over the last second."""
        self._trim(now)
        return self._total / self._WINDOW

    def _trim(self, now: float) -> None:
        while self._seen and now - self._seen[0][0] > self._WINDOW:
            self._total -= self._seen.popleft()[1]
