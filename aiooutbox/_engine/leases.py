"""`Leases`: the one owner of what this consumer holds.

The dispatcher adds rows as it claims them, the executor removes them as their
outcomes are recorded, and the heartbeat asks which leases are due for renewal and
marks lost ones; nobody else touches the map.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from .rows import ClaimedRow

__all__ = ["Leases"]


class Leases:
    def __init__(self) -> None:
        self._held: dict[int, tuple[int, float]] = {}  # id -> (attempts, extended at)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, event_id: object) -> bool:
        return event_id in self._held

    def ids(self) -> list[int]:
        return list(self._held)

    def hold_all(self, rows: Iterable[ClaimedRow], now: float) -> None:
        """Hold every row of a claim, each lease extended at ``now``."""
        self._held.update({row.id: (row.attempts, now) for row in rows})

    def finish(self, event_id: int, attempts: int) -> None:
        """Forget a row whose outcome is recorded (unless it was re-claimed since)."""
        held = self._held.get(event_id)
        # if this consumer re-claimed the row after losing its lease, keep the newer claim
        if held is not None and held[0] == attempts:
            del self._held[event_id]

    def holds(self, event_id: int, attempts: int) -> bool:
        held = self._held.get(event_id)
        return held is not None and held[0] == attempts

    def due(self, interval: float) -> list[int]:
        """Rows whose lease was last extended at least ``interval`` seconds ago."""
        now = time.monotonic()
        return [i for i, (_, extended) in self._held.items() if now - extended >= interval]

    def renewed(self, event_id: int, at: float) -> None:
        held = self._held.get(event_id)
        if held is not None:
            self._held[event_id] = (held[0], at)

    def lost(self, event_id: int) -> None:
        """The row's lease is gone: never renew it again (its outcome will be fenced)."""
        held = self._held.get(event_id)
        if held is not None:
            self._held[event_id] = (held[0], math.inf)
