"""`Leases`: the one owner of what this consumer holds.

The dispatcher adds rows as it claims them, the executor asks before each handler
starts whether the row's lease is still good and removes rows as their outcomes are
recorded, and the heartbeat asks which leases are due for renewal and records what the
database answered; nobody else touches the map.

Each held row carries when its lease ends by this process's monotonic clock, counted
from a moment *before* the statement that set it was sent (the claim, a heartbeat), so
the local estimate never ends later than the lease in the database. A claim is
identified by its `ClaimedRow` object, not by ``(id, attempts)``: a run member given
back to ``waiting`` has its attempt given back too, so this consumer may claim the same
row at the same attempt again, and an answer about the old claim must never be taken
for the new one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .rows import ClaimedRow

__all__ = ["Leases"]

_LOST = -math.inf


class Leases:
    def __init__(self) -> None:
        # id -> (the claim, when its lease ends by time.monotonic(); -inf once lost)
        self._held: dict[int, tuple[ClaimedRow, float]] = {}
        # claims that replaced a claim of the same row still held here (after a lapsed
        # lease): while none has, every claim recorded here is the one held
        self.replaced = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, event_id: object) -> bool:
        return event_id in self._held

    def ids(self) -> list[int]:
        return list(self._held)

    def hold_all(self, rows: Iterable[ClaimedRow], ends: float) -> None:
        """Hold every row of a claim, each lease ending at ``ends`` (monotonic)."""
        before = len(self._held)
        claimed = {row.id: (row, ends) for row in rows}
        self._held.update(claimed)
        if len(self._held) != before + len(claimed):
            self.replaced += 1

    def finish(self, row: ClaimedRow) -> None:
        """Forget a claim whose outcome is recorded (unless the row was re-claimed since)."""
        held = self._held.get(row.id)
        # if this consumer re-claimed the row after losing its lease, keep the newer claim
        if held is not None and held[0] is row:
            del self._held[row.id]

    def finish_all(self, rows: Iterable[ClaimedRow]) -> None:
        """`finish` of each of ``rows`` (a batch handler's events), in one call."""
        held = self._held
        for row in rows:
            found = held.get(row.id)
            if found is not None and found[0] is row:
                del held[row.id]

    def holds(self, row: ClaimedRow) -> bool:
        """True while this claim is the one held for its row (lost or not)."""
        held = self._held.get(row.id)
        return held is not None and held[0] is row

    def startable(self, row: ClaimedRow, until: float) -> bool:
        """True if this claim is still held and its lease lasts past ``until``: a
        handler may start. False once the lease is lost, ends before ``until``, or the
        row was claimed again since (a lease that lapsed while the loop was blocked)."""
        held = self._held.get(row.id)
        return held is not None and held[0] is row and held[1] > until

    def unstartable(self, rows: Iterable[ClaimedRow], until: float) -> list[ClaimedRow]:
        """Those of ``rows`` that may not start (see `startable`); usually none. A batch
        handler's events are checked in one call."""
        held = self._held
        return [
            row
            for row in rows
            if (found := held.get(row.id)) is None or found[0] is not row or found[1] <= until
        ]

    def due(self, until: float) -> list[ClaimedRow]:
        """The claims whose lease ends at or before ``until`` (lost ones excluded)."""
        return [row for row, ends in self._held.values() if _LOST < ends <= until]

    def renewed(self, row: ClaimedRow, ends: float) -> None:
        """The database extended this claim's lease to at least ``ends``."""
        held = self._held.get(row.id)
        if held is not None and held[0] is row and held[1] != _LOST:
            self._held[row.id] = (row, max(held[1], ends))

    def lost(self, row: ClaimedRow) -> bool:
        """The claim's lease is gone: never renew it, never start its handler (a running
        one's outcome will be fenced). False if the claim is no longer held."""
        held = self._held.get(row.id)
        if held is None or held[0] is not row:
            return False
        self._held[row.id] = (row, _LOST)
        return True
