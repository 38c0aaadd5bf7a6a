"""Charts drawn on the server as SVG geometry: numbers only, laid out here, drawn by a
template (``_macros.html``), so no chart code runs in the browser and the page's
Content-Security-Policy stays as strict as it is. Labels are text: the template
escapes them like any other value."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ._counts import Count

__all__ = ["Bar", "Chart", "Tick", "bars", "minute_chart"]

PLOT_TOP = 14  # room above the plot for the peak's label
PLOT_BOTTOM = 16  # room below it for the time axis


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    label: str  # the tooltip
    kind: str = "bar"  # the CSS class: bar, failed, lag, or hit (an invisible tooltip area)


@dataclass(frozen=True)
class Tick:
    x: float
    label: str


@dataclass
class Chart:
    width: int
    height: int
    bars: list[Bar]
    peak: str
    exact: bool
    ticks: list[Tick] = field(default_factory=list)
    path: str = ""  # an area, for a day of minutes (one element, not 1,440)
    path_kind: str = "bar"
    empty: bool = False

    @property
    def bottom(self) -> int:
        return self.height - PLOT_BOTTOM


def bars(
    values: list[Count],
    labels: list[str],
    *,
    width: int = 480,
    height: int = 80,
    failed: Sequence[int] | None = None,
    ticks: Sequence[tuple[int, str]] = (),
) -> Chart:
    """A bar per value, scaled to the largest; each bar's label is its tooltip.
    ``failed``: a second, red bar stacked on each (its count in the tooltip too);
    ``ticks``: (bar index, label) under the axis."""
    totals = [v.value + (failed[i] if failed else 0) for i, v in enumerate(values)]
    peak = max(totals, default=0)
    n = max(len(values), 1)
    plot = height - PLOT_TOP - PLOT_BOTTOM
    slot = width / n
    bottom = height - PLOT_BOTTOM
    out = []
    for i, (value, label) in enumerate(zip(values, labels, strict=True)):
        bad = failed[i] if failed else 0
        h = _height(value.value, peak, plot)
        hb = _height(bad, peak, plot)
        text = f"{label}: {value.text}" + (f" done, {bad:,} failed" if failed is not None else "")
        x, w = round(i * slot + 1, 2), round(max(slot - 2, 1), 2)
        out.append(Bar(x, round(bottom - h, 2), w, round(h, 2), text))
        if hb:
            out.append(Bar(x, round(bottom - h - hb, 2), w, round(hb, 2), text, "failed"))
        out.append(Bar(x, PLOT_TOP, w, plot, text, "hit"))
    exact = all(v.exact for v in values)
    return Chart(
        width=width,
        height=height,
        bars=out,
        peak=Count(peak, exact).text,
        exact=exact,
        ticks=[Tick(round((i + 0.5) * slot, 2), t) for i, t in ticks],
        empty=peak == 0,
    )


def _height(value: float, peak: float, plot: float) -> float:
    if peak <= 0 or value <= 0:
        return 0.0
    return max(value / peak * plot, 1.0)


def minute_chart(
    values: Sequence[float | None],
    *,
    what: str,
    fmt: Callable[[float], str] = lambda v: f"{v:,.0f}",
    kind: str = "bar",
    width: int = 720,
    height: int = 90,
    ticks: Sequence[tuple[int, str]] = (),
    hover: int = 1,
) -> Chart:
    """One value per minute, oldest first (None: nothing was counted that minute).

    Up to 120 minutes are drawn as bars with a tooltip each; more (a day) as one area,
    with a tooltip per ``hover`` minutes (their largest value)."""
    numbers = [v or 0.0 for v in values]
    peak = max(numbers, default=0.0)
    n = max(len(numbers), 1)
    plot = height - PLOT_TOP - PLOT_BOTTOM
    bottom = height - PLOT_BOTTOM
    slot = width / n
    shown: list[Bar] = []
    path = ""

    if n <= 120:
        for i, v in enumerate(numbers):
            label = f"{_ago(n - 1 - i)}: {fmt(v)} {what}"
            h = _height(v, peak, plot)
            x, w = round(i * slot + 0.5, 2), round(max(slot - 1, 0.5), 2)
            if h:
                shown.append(Bar(x, round(bottom - h, 2), w, round(h, 2), label, kind))
            shown.append(Bar(x, PLOT_TOP, w, plot, label, "hit"))
    else:
        points = [f"M0,{bottom}"]
        for i, v in enumerate(numbers):
            y = round(bottom - _height(v, peak, plot), 2)
            points.append(f"L{round(i * slot, 2)},{y}L{round((i + 1) * slot, 2)},{y}")
        points.append(f"L{width},{bottom}Z")
        path = "".join(points)
        step = max(hover, 1)
        for start in range(0, n, step):
            group = numbers[start : start + step]
            oldest, newest = _ago(n - 1 - start), _ago(n - start - len(group))
            label = f"{oldest} to {newest}: {fmt(max(group))} {what}"
            x = round(start * slot, 2)
            shown.append(Bar(x, PLOT_TOP, round(len(group) * slot, 2), plot, label, "hit"))
    return Chart(
        width=width,
        height=height,
        bars=shown,
        peak=fmt(peak),
        exact=True,
        ticks=[Tick(round(i * slot, 2), t) for i, t in ticks],
        path=path,
        path_kind=kind,
        empty=peak == 0,
    )


def _ago(minutes: int) -> str:
    if minutes <= 0:
        return "this minute"
    if minutes < 60:
        return f"{minutes}m ago"
    hours, rest = divmod(minutes, 60)
    return f"{hours}h {rest:02d}m ago" if rest else f"{hours}h ago"
