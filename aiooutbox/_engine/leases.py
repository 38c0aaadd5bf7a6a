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
from operator import is_

from .rows import ClaimedRow, getter

__all__ = ["Leases"]

_LOST = -math.inf
_ID = getter("id")


class Leases:
    def __init__(self) -> None:
        # id -> the claim held; id -> when its lease ends by time.monotonic() (-inf once
        # lost). Two maps, not one of (claim, end) pairs: a claim's rows share one end,
        # and a pair per claimed row was one more object for the collector to track
        self._held: dict[int, ClaimedRow] = {}
        self._ends: dict[int, float] = {}
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
        rows = rows if isinstance(rows, list) else list(rows)
        before = len(self._held)
        claimed = dict(zip(map(_ID, rows), rows, strict=True))
        self._held.update(claimed)
        self._ends.update(dict.fromkeys(claimed, ends))
        if len(self._held) != before + len(claimed):
            self.replaced += 1

    def finish(self, row: ClaimedRow) -> None:
        """Forget a claim whose outcome is recorded (unless the row was re-claimed since)."""
        # if this consumer re-claimed the row after losing its lease, keep the newer claim
        if self._held.get(row.id) is row:
            del self._held[row.id]
            del self._ends[row.id]

    def finish_all(self, rows: Iterable[ClaimedRow]) -> None:
        """`finish` of each of ``rows`` (a batch handler's events), in one call."""
        held, ends = self._held, self._ends
        for row in rows:
            if held.get(row_id := row.id) is row:
                del held[row_id]
                del ends[row_id]

    def holds(self, row: ClaimedRow) -> bool:
        """True while this claim is the one held for its row (lost or not)."""
        return self._held.get(row.id) is row

    def startable(self, row: ClaimedRow, until: float) -> bool:
        """True if this claim is still held and its lease lasts past ``until``: a
        handler may start. False once the lease is lost, ends before ``until``, or the
        row was claimed again since (a lease that lapsed while the loop was blocked)."""
        return self._held.get(row.id) is row and self._ends[row.id] > until

    def unstartable(self, rows: list[ClaimedRow], until: float) -> list[ClaimedRow]:
        """Those of ``rows`` that may not start (see `startable`); usually none. A batch
        handler's events are checked in one call (in C when every one may start)."""
        held, ends = self._held, self._ends
        ids = list(map(_ID, rows))
        if (
            all(map(is_, map(held.get, ids), rows))
            and min(map(ends.__getitem__, ids), default=math.inf) > until
        ):
            return []
        return [row for row in rows if held.get(row.id) is not row or ends[row.id] <= until]

    def due(self, until: float) -> list[ClaimedRow]:
        """The claims whose lease ends at or before ``until`` (lost ones excluded)."""
        held = self._held
        return [held[i] for i, ends in self._ends.items() if _LOST < ends <= until]

    def renewed(self, row: ClaimedRow, ends: float) -> None:
        """The database extended this claim's lease to at least ``ends``."""
        if self._held.get(row.id) is row:
            was = self._ends[row.id]
            if was != _LOST:
                self._ends[row.id] = max(was, ends)

    def lost(self, row: ClaimedRow) -> bool:
        """The claim's lease is gone: never renew it, never start its handler (a running
        one's outcome will be fenced). False if the claim is no longer held."""
        if self._held.get(row.id) is not row:
            return False
        self._ends[row.id] = _LOST
        return True
