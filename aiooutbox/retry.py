"""Backoff for failed events: exponential, capped, with jitter."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .errors import InvalidArgument

__all__ = ["RetryPolicy"]


@dataclass(frozen=True)
class RetryPolicy:
    """Delay before attempt ``n + 1`` after attempt ``n`` failed.

    The ceiling grows as ``base * factor ** (n - 1)`` up to ``max_delay``; the delay is
    drawn from ``[ceiling * (1 - jitter), ceiling]``. The default ``jitter=1.0`` is "full
    jitter": retries of events that failed together spread out instead of stampeding
    back at once. ``jitter=0`` gives exact exponential delays.
    """

    base: float = 1.0
    factor: float = 2.0
    max_delay: float = 3600.0
    jitter: float = 1.0

    def __post_init__(self) -> None:
        for name in ("base", "factor", "max_delay", "jitter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"RetryPolicy.{name} must be a number, not {value!r}")
            if not math.isfinite(value) or value < 0:
                raise InvalidArgument(f"RetryPolicy.{name} must be finite and >= 0, got {value}")
        if self.factor < 1:
            raise InvalidArgument(f"RetryPolicy.factor must be >= 1, got {self.factor}")
        if self.max_delay > 10 * 366 * 86400:
            raise InvalidArgument(
                f"RetryPolicy.max_delay must be at most 10 years, got {self.max_delay}"
            )
        if self.jitter > 1:
            raise InvalidArgument(f"RetryPolicy.jitter must be within [0, 1], got {self.jitter}")

    def ceiling(self, attempts: int) -> float:
        """The largest delay after the ``attempts``-th failure."""
        exponent = max(attempts - 1, 0)
        # avoid float overflow for huge attempt counts
        if self.factor > 1 and exponent > math.log(max(self.max_delay, 1) + 1, self.factor) + 1:
            return self.max_delay
        return min(self.max_delay, self.base * self.factor**exponent)

    def delay(self, attempts: int) -> float:
        """A jittered delay in seconds after the ``attempts``-th failure."""
        ceiling = self.ceiling(attempts)
        return ceiling * (1.0 - self.jitter * random.random())
