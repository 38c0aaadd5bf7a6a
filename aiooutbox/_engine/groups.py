"""Where a consumer's next claim resumes among a topic's groups (`GroupCursor`).

The claim (`<table>_claim_v7`, migration 0018) visits the groups after the cursor in
code point order, then, wrapping around, the ungrouped rows and the groups up to the
cursor; the cursor then moves to the last group the claim served. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["GROUPS_PER_CLAIM", "PROBE_GROUPS", "GroupCursor"]

# the groups a claim visits (two index descents each) in a batch: it visits at least
# this many groups with work (or all), and more batches while it has found fewer rows
# than it asked for, up to as many groups as rows (migration 0020: with 10,000 groups of
# a few events each, a claim of 128 groups took a third of its size); so a claim's cost
# follows its rows, and every group with work is served within ceil(groups with work /
# GROUPS_PER_CLAIM) claims at worst
GROUPS_PER_CLAIM = 128

# the most groups of a topic one claim from marks probes for their first row (migration
# 0020): the probe goes on from there at the next reading of the marks, and the mark
# moves once every group was probed; so a reading of the marks costs at most this many
# groups' descents, however many groups there are
PROBE_GROUPS = 512

# the cursor's value once the ungrouped rows had the last turn (no group is empty)
_UNGROUPED = ""


class GroupCursor:
    """The group a consumer's claims served last: ``None`` before any (the next claim
    starts with the ungrouped rows), ``""`` after the ungrouped rows, else a group."""

    def __init__(self) -> None:
        self.value: str | None = None

    def served(self, groups: Iterable[str | None]) -> None:
        """A claim returned rows of ``groups`` (None: ungrouped): move to the last of
        them in the order the claim visited them."""
        last: tuple[int, str] | None = None
        for group in set(groups):  # a claim's rows share few groups (often only None)
            place = self._place(group)
            if last is None or place > last:
                last = place
        if last is not None:
            self.value = last[1]

    def _place(self, group: str | None) -> tuple[int, str]:
        """Where ``group`` came in the claim's turn, from the cursor it started at."""
        cursor = self.value
        name = _UNGROUPED if group is None else group
        if cursor is None:  # the ungrouped rows first, then the groups in order
            return (0, name) if group is None else (1, name)
        if group is None:  # after the groups past the cursor
            return (1, name)
        if group > cursor:
            return (0, name)
        return (2, name)  # wrapped around, after the ungrouped rows
