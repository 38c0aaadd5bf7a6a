"""``drain``: pre-enqueued no-op events drained at several backlog sizes, aiooutbox beside
PgQueuer, rounds rotating the order; at the smallest size also aiooutbox at its
defaults (``OutboxConsumer(pool)`` on asyncpg's default pool). Its runs also give the
consumer's RSS over the largest drain (`Bench.rss_summary`), rendered here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..harness.bench import AIO, PGQ, Bench
from ..harness.markdown import at_least, fmt, num, table, target
from ..harness.rounds import rotated
from ..harness.scenario import Scenario, sizes_of
from ..harness.stats import median, ratio


@dataclass
class Sizes:
    drain_sizes: list[int] = field(default_factory=lambda: [50_000, 200_000, 1_000_000])
    drain_rounds: dict[int, int] = field(
        default_factory=lambda: {50_000: 5, 200_000: 2, 1_000_000: 1}
    )
    pgqueuer_max_drain: int = 200_000  # larger backlogs take PgQueuer minutes; --full runs them


async def run(bench: Bench) -> None:
    config = sizes_of(bench.config, Sizes)
    bench.log("drain throughput")
    runs: list[dict[str, Any]] = []
    smallest = config.drain_sizes[0]
    for n in config.drain_sizes:
        for r in range(config.drain_rounds.get(n, 1)):
            # at the smallest size also aiooutbox at its defaults (OutboxConsumer(pool)
            # on asyncpg's default pool), the order rotating by round
            order: list[tuple[str, dict[str, Any] | None]] = [(AIO, None), (PGQ, None)]
            if n == smallest:
                order.append((AIO, {"defaults": True}))
            for name, settings in rotated(order, r):
                if name == PGQ and n > config.pgqueuer_max_drain:
                    continue
                label = f"r{r + 1} " + ("defaults " if settings else "")
                run = await bench.drain_once(bench.systems[name], n, settings, label=label)
                if settings:
                    run["variant"] = "defaults"
                runs.append(run)
    summary: dict[str, Any] = {}
    for n in config.drain_sizes:
        row: dict[str, Any] = {}
        for name in (AIO, PGQ):
            rates = [
                x["rate"]
                for x in runs
                if x["system"] == name and x["size"] == n and "variant" not in x
            ]
            row[name] = round(median(rates), 1) if rates else None
            row[f"{name}_rounds"] = len(rates)
        row["ratio"] = round(ratio(row[AIO], row[PGQ]), 3) if row[AIO] and row[PGQ] else None
        at_defaults = [x["rate"] for x in runs if x["size"] == n and "variant" in x]
        if at_defaults:
            row[f"{AIO}_defaults"] = round(median(at_defaults), 1)
            row["defaults_ratio"] = (
                round(ratio(row[f"{AIO}_defaults"], row[PGQ]), 3) if row[PGQ] else None
            )
        summary[str(n)] = row
    bench.results["drain"] = {"runs": runs, "summary": summary}


def drain_rate(bench: Bench, name: str) -> float:
    """Median drain rate of ``name`` at the smallest size (its measured max)."""
    summary = bench.results.get("drain", {}).get("summary", {})
    if summary:
        first = summary[str(sizes_of(bench.config, Sizes).drain_sizes[0])]
        if first.get(name):
            return float(first[name])
    return 5000.0


def section(results: dict[str, Any]) -> list[str]:
    drain = results.get("drain", {}).get("summary", {})
    if not drain:
        return []
    lines = table(
        "Drain throughput (events/s, median of rounds)",
        "| backlog | aiooutbox | PgQueuer | aiooutbox / PgQueuer | rounds |",
        "|---:|---:|---:|---:|---|",
    )
    for size, row in sorted(drain.items(), key=lambda kv: int(kv[0])):
        lines.append(
            f"| {int(size):,} | {fmt(row[AIO])} | {fmt(row[PGQ])} "
            f"| {fmt(row['ratio'], 2) + 'x' if row['ratio'] else '-'} "
            f"| {row[f'{AIO}_rounds']} / {row[f'{PGQ}_rounds']} |"
        )
    for size, row in sorted(drain.items(), key=lambda kv: int(kv[0])):
        if row.get(f"{AIO}_defaults"):
            lines.append(
                f"\naiooutbox at its defaults (`OutboxConsumer(pool)`, concurrency 64, on"
                f" `asyncpg.create_pool(dsn)`), {int(size):,} events:"
                f" {fmt(row[f'{AIO}_defaults'])}/s,"
                f" {fmt(row.get('defaults_ratio'), 2)}x PgQueuer tuned."
            )
    runs = results["drain"]["runs"]
    lines += [
        "",
        "CPU per event in the drains (median of all sizes; client = the consumer process,"
        " db = the server backends of its database):",
        "",
        "| system | client CPU µs / event | db CPU µs / event |",
        "|---|---:|---:|",
    ]
    for name in (AIO, PGQ):
        mine = [r for r in runs if r["system"] == name]
        if not mine:
            continue
        client = sorted(1e6 * r["client_cpu_s"] / r["size"] for r in mine)
        db = sorted(1e6 * r["db_cpu_s"] / r["size"] for r in mine if r["db_cpu_s"])
        lines.append(
            f"| {name} | {fmt(client[len(client) // 2], 1)} | "
            f"{fmt(db[len(db) // 2] if db else None, 1)} |"
        )
    return lines


def rss_section(results: dict[str, Any]) -> list[str]:
    rss = results.get("rss", {})
    if not rss:
        return []
    lines = table(
        "Consumer RSS over the largest drain (MB)",
        "| system | events | start | after 10% | max | end | growth after 10% |",
        "|---|---:|---:|---:|---:|---:|---:|",
    )
    for name, row in rss.items():
        lines.append(
            f"| {name} | {row['events']:,} | {fmt(row['start_mb'], 1)} "
            f"| {fmt(row['warm_mb'], 1)} | {fmt(row['max_mb'], 1)} "
            f"| {fmt(row['end_mb'], 1)} | {fmt(row['growth_mb'], 1)} |"
        )
    return lines


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    drain = results.get("drain", {}).get("summary", {})
    if not drain:
        return []
    sizes = sorted(int(s) for s in drain)
    small, large = str(sizes[0]), str(sizes[-1])
    out = [
        at_least(
            f"drain {int(small):,} no-op events, aiooutbox / PgQueuer",
            3.0,
            drain[small].get("ratio"),
        )
    ]
    r = num(drain[small].get("defaults_ratio"))
    if r is not None:
        out.append(
            target(
                f"drain {int(small):,} at the defaults (OutboxConsumer(pool), asyncpg's"
                " default pool) / PgQueuer tuned",
                ">= 2.5",
                r,
                r >= 2.5,
                f"{fmt(drain[small].get(AIO + '_defaults'))} events/s",
            )
        )
    a_small, a_large = num(drain[small].get(AIO)), num(drain[large].get(AIO))
    out.append(
        at_least(
            f"drain rate at {int(large):,} vs {int(small):,} backlog (aiooutbox)",
            0.8,
            a_large / a_small if a_small and a_large else None,
        )
    )
    mid = [s for s in sizes if drain[str(s)].get(PGQ)]
    if len(mid) > 1:
        p_small, p_large = drain[str(mid[0])][PGQ], drain[str(mid[-1])][PGQ]
        out.append(
            target(
                f"(for scale) PgQueuer at {mid[-1]:,} vs {mid[0]:,}", "-", p_large / p_small, None
            )
        )
    return out


def rss_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    rss = results.get("rss", {}).get(AIO)
    if not rss:
        return []
    growth = rss["growth_mb"]
    what = f"consumer RSS growth over {rss['events']:,} events (MB)"
    return [target(what, "<= 20", growth, growth <= 20)]


SCENARIO = Scenario(
    "drain",
    run,
    sizes=Sizes,
    quick={"drain_sizes": [5_000, 20_000], "drain_rounds": {5_000: 2, 20_000: 1}},
    full={"pgqueuer_max_drain": 10**9, "drain_rounds": {50_000: 7, 200_000: 3, 1_000_000: 2}},
    sections=((10, section), (130, rss_section)),
    targets=((10, targets), (100, rss_targets)),
)
