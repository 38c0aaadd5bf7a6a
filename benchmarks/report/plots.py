"""The PNG plots beside results.json: drain throughput, steady-state latency over time,
idle wake-up, producer commit rates, and the consumer's RSS over the largest drain.
Needs matplotlib (the ``bench`` extra), imported only when plotting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..harness.bench import AIO, PGQ


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    """Write PNG plots next to the JSON; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    colors = {AIO: "tab:blue", PGQ: "tab:orange"}

    def save(fig: Any, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    drain = results.get("drain", {}).get("summary", {})
    if drain:
        sizes = sorted(drain, key=int)
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.38
        for i, name in enumerate((AIO, PGQ)):
            values = [drain[s][name] or 0 for s in sizes]
            xs = [j + (i - 0.5) * width for j in range(len(sizes))]
            ax.bar(xs, values, width, label=name, color=colors[name])
        ax.set_xticks(range(len(sizes)), [f"{int(s):,}" for s in sizes])
        ax.set_xlabel("pre-enqueued no-op events")
        ax.set_ylabel("events/s (median)")
        ax.set_title("Drain throughput")
        ax.legend()
        save(fig, "drain.png")

    steady = results.get("steady", [])
    if steady:
        cols = min(3, len(steady))
        rows = -(-len(steady) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.3 * rows), squeeze=False)
        for ax in axes.flat[len(steady) :]:
            ax.set_visible(False)
        for ax, run in zip(axes.flat, steady, strict=False):
            series = run["latency_series"]
            if series:
                ax.plot([s[0] for s in series], [s[1] for s in series], label="p50")
                ax.plot([s[0] for s in series], [s[2] for s in series], label="p99")
            ax.set_yscale("log")
            load = "" if run["fraction"] is None else f"{run['fraction']:.0%} "
            ax.set_title(f"{run['system']} {load}({run['offered_rate']:,.0f}/s)")
            ax.set_xlabel("s (by send time; handled events only)")
            ax.set_ylabel("ms from producer BEGIN")
            ax.legend()
        save(fig, "steady_latency.png")

    wake = results.get("wakeup", {})
    if wake:
        fig, ax = plt.subplots(figsize=(7, 4))
        modes = list(wake)
        for i, q in enumerate(("p50", "p95", "p99")):
            values = [wake[m]["latency_ms"].get(q) or 0 for m in modes]
            ax.bar([j + (i - 1) * 0.27 for j in range(len(modes))], values, 0.27, label=q)
        ax.set_xticks(range(len(modes)), modes)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title("Idle wake-up latency")
        ax.legend()
        save(fig, "wakeup.png")

    producers = results.get("producers", {})
    if producers:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, data in producers.items():
            levels = [k for k, v in data["levels"].items() if "on" in v]
            for trigger, style in (("on", "-"), ("off", "--")):
                ax.plot(
                    [int(k) for k in levels],
                    [data["levels"][k][trigger] for k in levels],
                    style,
                    marker="o",
                    color=colors.get(name),
                    label=f"{name}, trigger {trigger}",
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent producers")
        ax.set_ylabel("commits/s")
        ax.set_title("Producer commit rate, consumer running")
        ax.legend()
        save(fig, "producers.png")

    rss = results.get("rss", {})
    if rss:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, row in rss.items():
            ax.plot(
                [s[1] for s in row["samples"]],
                [s[2] for s in row["samples"]],
                color=colors.get(name),
                label=f"{name} ({row['events']:,} events)",
            )
        ax.set_xlabel("events handled")
        ax.set_ylabel("RSS MB")
        ax.set_title("Consumer RSS during the largest drain")
        ax.legend()
        save(fig, "rss.png")
    return written
