"""Reading a broker back before publishing an event again, for exactly once across a crash.

An event whose attempt is not its first (``attempts > 1``: its lease was recovered from
a relay that died, its own claim was released after a restart, or an earlier attempt
failed) may already be in the broker. A sink that can read its broker back (Kafka,
Redis Streams) looks for the event's message id there first, from a time bound before
the event could have been published (its ``created_at`` less ``clock_skew``) to the
end, and returns without publishing when it is found: the row is settled done with no
second copy. First attempts never look.

What was read is kept per place (a Kafka partition, a Redis stream): the ids found
since the bound (rounded down to a minute) and where the read stopped. Later look-ups
in the same place read only what was appended since, and one read serves every look-up
waiting for it, so the few hundred repeats after a crash cost one scan of each place
from the bound plus a short read each. A place not looked up for ``_FORGET`` seconds is forgotten.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidArgument

__all__ = ["Lookup", "Seen", "check_skew"]

#: seconds after which the ids read from a place are dropped
_FORGET = 60.0
#: a place's ids kept at most; past it the place is read again from the next bound
_MAX_IDS = 2_000_000
#: bounds are rounded down to this: the repeats after a crash, created over a few
#: seconds, share one scan of each place instead of each earlier one starting another
_GRAIN_MS = 60_000


def check_skew(value: object) -> float:
    """``clock_skew``: seconds, at least 0 (a float, int or timedelta)."""
    seconds = value.total_seconds() if hasattr(value, "total_seconds") else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"clock_skew must be seconds or a timedelta, not {value!r}")
    if not 0 <= seconds <= 86_400 * 7:
        raise InvalidArgument(f"clock_skew must be between 0 and 7 days, not {seconds!r}")
    return float(seconds)


@dataclass(slots=True)
class Seen:
    """The message ids of one place from ``since_ms`` up to ``position``."""

    since_ms: int
    ids: set[str] = field(default_factory=set)
    #: where the next read starts (broker-specific; None: at ``since_ms``)
    position: Any = None
    #: when the last read of this place started (monotonic)
    read_at: float = -1.0
    used_at: float = 0.0


#: reads ``seen``'s place from its position (or its bound) to the end, adding the ids
Reader = Callable[[Hashable, Seen], Awaitable[None]]


class Lookup:
    """The ids already read from each place, and the reads that extend them."""

    def __init__(self, read: Reader) -> None:
        self._read = read
        self._seen: dict[Hashable, Seen] = {}
        self._lock = asyncio.Lock()
        #: look-ups made, places scanned from a bound, entries read, seconds spent
        self.lookups = 0
        self.scans = 0
        self.entries = 0
        self.seconds = 0.0

    async def contains(
        self, places: list[Hashable], message_id: str, since_ms: int, asked: float | None = None
    ) -> bool:
        """True when ``message_id`` is in one of ``places`` from ``since_ms`` to their end.

        ``asked`` (monotonic; default now) is when the message could last have been
        published: a read begun after it serves the look-up, so the look-ups of one
        batch, asked together, share one read of each place."""
        if asked is None:
            asked = time.monotonic()
        since_ms -= since_ms % _GRAIN_MS
        async with self._lock:
            self.lookups += 1
            self._forget(asked)
            for place in places:
                seen = self._seen.get(place)
                if seen is None or since_ms < seen.since_ms or len(seen.ids) > _MAX_IDS:
                    seen = self._seen[place] = Seen(since_ms)
                    self.scans += 1
                seen.used_at = asked
                if message_id in seen.ids:
                    return True
                if seen.read_at < asked:  # no read began after we asked: read the rest
                    last, seen.read_at = seen.read_at, time.monotonic()
                    began, before = seen.read_at, len(seen.ids)
                    try:
                        await self._read(place, seen)
                    except BaseException:
                        # what was read stays (a read moves the position only past ids
                        # it added), but the look-ups waiting for this read must read
                        seen.read_at = last
                        raise
                    finally:
                        self.seconds += time.monotonic() - began
                    self.entries += len(seen.ids) - before
                    if message_id in seen.ids:
                        return True
            return False

    def summary(self) -> str:
        """What the look-ups cost, for the relay's last log line."""
        return (
            f"{self.lookups} look-ups, {self.scans} scans, {self.entries} ids read "
            f"in {self.seconds:.2f}s"
        )

    def _forget(self, now: float) -> None:
        stale = [p for p, s in self._seen.items() if now - s.used_at > _FORGET]
        for place in stale:
            del self._seen[place]
