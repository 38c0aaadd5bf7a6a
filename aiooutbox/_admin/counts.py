"""Numbers that say whether they are exact: bounded counts, planner estimates.

A count over an index is exact and cheap up to a bound (``LIMIT`` inside the count);
past the bound the dashboard and ``stats`` show the planner's estimate instead
(``EXPLAIN``), or a sample's, marked ``≈``. Nothing here ever counts an unbounded number
of rows. Shared by `aiooutbox.admin` and the dashboard (`aiooutbox.web`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BOUND",
    "SAMPLE_PAGES",
    "Count",
    "estimate_rows",
    "exact",
    "estimated",
    "sample_percent",
]

# rows a count may visit before the dashboard or ``stats`` settles for an estimate
BOUND = 50_000
# pages of the table read at random (TABLESAMPLE SYSTEM) for the numbers no index gives
# cheaply (about 30 rows a page: ~12 MB, 30-100 ms here); a table this small is read whole
SAMPLE_PAGES = 1500


@dataclass(frozen=True)
class Count:
    """A number of rows; ``exact`` False means an estimate (shown with ``≈``)."""

    value: int
    exact: bool = True

    def __add__(self, other: Count) -> Count:
        return Count(self.value + other.value, self.exact and other.exact)

    def __bool__(self) -> bool:
        return self.value != 0

    @property
    def text(self) -> str:
        shown = f"{self.value:,}"
        return shown if self.exact else f"≈{shown}"


def exact(value: int) -> Count:
    return Count(int(value), True)


def estimated(value: float) -> Count:
    return Count(max(0, round(value)), False)


def bounded(value: int, bound: int, fallback: float) -> Count:
    """A bounded count: exact below ``bound``, else the estimate (at least the bound)."""
    if value < bound:
        return exact(value)
    return estimated(max(fallback, bound))


async def estimate_rows(conn: Any, explain_sql: str, *args: object) -> float:
    """The planner's row estimate of an ``EXPLAIN (FORMAT JSON)`` statement."""
    raw = await conn.fetchval(explain_sql, *args)
    plan = json.loads(raw) if isinstance(raw, str) else raw
    return float(plan[0]["Plan"]["Plan Rows"])


def sample_percent(pages: float) -> float:
    """The ``TABLESAMPLE SYSTEM`` percent that reads about `SAMPLE_PAGES` of ``pages``
    (100: the whole table, whose numbers are then exact)."""
    if pages <= SAMPLE_PAGES:
        return 100.0
    return max(SAMPLE_PAGES / pages * 100.0, 0.01)
