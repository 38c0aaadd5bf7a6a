"""Statistics of a run: quantiles, latency summaries, medians and ratios that survive
missing values."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of already sorted values (q in [0, 1])."""
    if not sorted_values:
        return math.nan
    index = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[index]


def summarize_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99/max/mean of latencies given in seconds, reported in milliseconds."""
    values = sorted(seconds)
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50": round(quantile(values, 0.50) * 1000, 3),
        "p95": round(quantile(values, 0.95) * 1000, 3),
        "p99": round(quantile(values, 0.99) * 1000, 3),
        "max": round(values[-1] * 1000, 3),
        "mean": round(statistics.fmean(values) * 1000, 3),
    }


def median(values: Sequence[float]) -> float:
    clean = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(clean) if clean else math.nan


def ratio(a: float, b: float) -> float:
    if not b or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b
