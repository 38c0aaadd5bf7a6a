"""The dashboard's numbers that say whether they are exact: shared with ``stats``, they
live in `aiooutbox._admin.counts`."""

from __future__ import annotations

from .._admin.counts import BOUND, Count, bounded, estimate_rows, estimated, exact

__all__ = ["BOUND", "Count", "bounded", "estimate_rows", "estimated", "exact"]
