"""Charts drawn on the server as SVG geometry: numbers only, laid out here, drawn by a
template (``_macros.html``), so no chart code runs in the browser."""

from __future__ import annotations

from dataclasses import dataclass

from ._counts import Count

__all__ = ["Bar", "Chart", "bars"]


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    label: str


@dataclass(frozen=True)
class Chart:
    width: int
    height: int
    bars: list[Bar]
    peak: str
    exact: bool


def bars(values: list[Count], labels: list[str], *, width: int = 480, height: int = 80) -> Chart:
    """A bar per value, scaled to the largest; each bar's label is its tooltip."""
    peak = max((v.value for v in values), default=0)
    n = max(len(values), 1)
    slot = width / n
    out = []
    for i, (value, label) in enumerate(zip(values, labels, strict=True)):
        h = 0.0 if peak == 0 else max(value.value / peak * (height - 2), 1.0 if value else 0.0)
        out.append(
            Bar(
                x=round(i * slot + 1, 2),
                y=round(height - h, 2),
                width=round(max(slot - 2, 1), 2),
                height=round(h, 2),
                label=f"{label}: {value.text}",
            )
        )
    return Chart(
        width=width,
        height=height,
        bars=out,
        peak=Count(peak, all(v.exact for v in values)).text,
        exact=all(v.exact for v in values),
    )
