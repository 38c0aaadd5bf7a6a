"""What every part of results.md is written with: numbers that may be missing, the ✅/❌
of a target, and the rows of the Targets table."""

from __future__ import annotations

import math
from typing import Any


def num(value: Any) -> float | None:
    """``value`` as a float, or None if it is not a number (or is NaN)."""
    if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
        return float(value)
    return None


def fmt(value: Any, digits: int = 0) -> str:
    """A number with thousands separators, ``-`` for None, anything else as it is."""
    number = num(value)
    if number is None:
        return "-" if value is None else str(value)
    return f"{number:,.{digits}f}"


def loads(values: Any) -> str:
    """Load averages: ``1.0 / 0.8 / 0.5``."""
    return " / ".join(f"{v:.1f}" for v in values) if values else "?"


def mark(value: bool | None) -> str:
    return {True: "✅", False: "❌", None: "-"}[value]


def target(
    what: str, target: str, measured: float | None, ok: bool | None, note: str = ""
) -> dict[str, Any]:
    """One row of the Targets table: what was measured against which target, and whether
    it holds (None: no verdict)."""
    return {
        "what": what,
        "target": target,
        "measured": None if measured is None else round(measured, 3),
        "ok": ok,
        "note": note,
    }


def at_least(what: str, floor: float, measured: Any) -> dict[str, Any]:
    """A target row for a ratio that should stay at ``floor`` or above."""
    value = num(measured)
    return target(what, f">= {floor}", value, None if value is None else value >= floor)


def table(title: str, header: str, align: str) -> list[str]:
    """The lines that open a section with one table: a blank line, the title (a level-2
    heading), a blank line, the header row and its alignment row."""
    return ["", f"## {title}", "", header, align]
