"""``producers``: the producers' cost. The commit rate of one-event transactions on
``producer_levels`` connections while a consumer runs, the wake-up trigger enabled
against disabled, rounds alternated, for both systems; and the notifications per second
the trigger sent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..harness.bench import AIO, PGQ, Bench
from ..harness.databases import free_connections
from ..harness.load import commit_rate, trigger_rounds
from ..harness.markdown import at_least, fmt, table
from ..harness.processes import child_process
from ..harness.scenario import Scenario, sizes_of
from ..harness.stats import median, ratio


@dataclass
class Sizes:
    producer_levels: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    producer_rounds: int = 4


async def run(bench: Bench) -> None:
    bench.log("producer cost: one-event transactions with a consumer running")
    out: dict[str, Any] = {}
    for name in (AIO, PGQ):
        out[name] = await cost_for(bench, bench.systems[name])
    bench.results["producers"] = out


async def cost_for(bench: Bench, system: Any) -> dict[str, Any]:
    config = sizes_of(bench.config, Sizes)
    await system.reset()
    # A short fallback poll: with the trigger disabled nothing wakes an idle consumer,
    # and one that sleeps through the window leaves the producers the whole machine;
    # that would measure "consumer paused", not the trigger. (Under load neither
    # system idles, so the poll interval changes nothing else.)
    settings = {**bench.settings[system.name], **system.short_poll}
    spec = bench.spec(system, "serve", settings, latency=True)
    levels: dict[str, Any] = {}
    total = 0
    async with child_process(spec) as child:
        await child.wait_ready()
        try:
            for level in config.producer_levels:
                free = await free_connections(bench.admin_dsn, level + 3, wait=30.0)
                if free < level + 3:
                    levels[str(level)] = {"skipped": f"only {free} free connections"}
                    bench.log(f"  {system.name} x{level}: skipped, {free} free connections")
                    continue
                runs: dict[str, list[float]] = {"on": [], "off": []}
                notes: list[float] = []
                backlog: dict[str, list[int]] = {"on": [], "off": []}
                async for trigger in trigger_rounds(system, config.producer_rounds):
                    commits, produced, notified = await commit_rate(bench, system, level)
                    total += produced
                    runs[trigger].append(round(commits, 1))
                    # did the consumer keep pace? (events left right after)
                    backlog[trigger].append(await system.backlog())
                    if trigger == "on":
                        notes.append(notified)
                on, off = median(runs["on"]), median(runs["off"])
                levels[str(level)] = {
                    "on": round(on, 1),
                    "off": round(off, 1),
                    "ratio": round(ratio(on, off), 3),
                    "notifications_per_s": round(median(notes), 1),
                    "runs": runs,
                    "backlog_after": backlog,
                }
                bench.log(
                    f"  {system.name:9} x{level:<3} trigger on {on:>8,.0f}/s, "
                    f"off {off:>8,.0f}/s, ratio {ratio(on, off):.2f}; "
                    f"{median(notes):,.0f} notifications/s with it on"
                )
        finally:
            await system.set_wakeup_trigger(True)
        child.send(stop_after=total, timeout=60)
        result = await child.result(timeout=120)
    return {
        "consumer_settings": settings,
        "levels": levels,
        "produced": total,
        "consumer_handled": result["handled"],
        "consumer_latency_ms": result.get("latency", {}),
    }


def section(results: dict[str, Any]) -> list[str]:
    producers = results.get("producers", {})
    if not producers:
        return []
    lines = table(
        "Producer cost (one-event transactions/s with the consumer running)",
        "| system | producers | trigger on | trigger off | on / off | NOTIFYs/s (on) |",
        "|---|---:|---:|---:|---:|---:|",
    )
    for name, data in producers.items():
        for level, row in data["levels"].items():
            if "skipped" in row:
                lines.append(f"| {name} | {level} | {row['skipped']} | | |")
                continue
            lines.append(
                f"| {name} | {level} | {fmt(row['on'])} | {fmt(row['off'])} "
                f"| {fmt(row['ratio'], 2)} | {fmt(row.get('notifications_per_s'))} |"
            )
    return lines


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    producers = results.get("producers", {}).get(AIO, {}).get("levels", {})
    level = producers.get("32") or (producers[max(producers, key=int)] if producers else None)
    if not level or "ratio" not in level:
        return []
    label = "32" if "32" in producers else max(producers, key=int)
    what = f"producer commits/s, {label} producers + consumer, trigger on / off"
    return [at_least(what, 0.9, level["ratio"])]


SCENARIO = Scenario(
    "producers",
    run,
    sizes=Sizes,
    quick={"producer_levels": [1, 8, 32], "producer_rounds": 1},
    sections=((60, section),),
    targets=((20, targets),),
)
