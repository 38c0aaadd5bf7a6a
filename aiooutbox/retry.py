"""Backoff for failed events: exponential, capped, with jitter."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ._values.limits import check_number, check_seconds

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
        # stored as floats, so a timedelta (accepted as everywhere else) computes too
        checked = {
            "base": check_seconds("RetryPolicy.base", self.base, maximum=math.inf),
            "max_delay": check_seconds("RetryPolicy.max_delay", self.max_delay),
            "factor": check_number("RetryPolicy.factor", self.factor, 1.0, math.inf),
            "jitter": check_number("RetryPolicy.jitter", self.jitter, 0.0, 1.0),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

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
