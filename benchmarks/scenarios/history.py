"""``history``: the cost of history, a drain with ``history_rows`` ``done`` rows in the
table against the same drain on an empty table, rounds alternated; and the claim's plans
with that history (custom and generic: both on the claimable partial index)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiooutbox import OutboxError

from ..harness.bench import AIO, Bench
from ..harness.markdown import at_least, fmt, table, target
from ..harness.rounds import alternated, make_fixture
from ..harness.scenario import Scenario, sizes_of
from ..harness.stats import median, ratio


@dataclass
class Sizes:
    history_rows: int = 1_000_000
    history_drain: int = 50_000
    history_rounds: int = 3


async def run(bench: Bench) -> None:
    config = sizes_of(bench.config, Sizes)
    bench.log(f"cost of history: {config.history_rows:,} done rows vs an empty table")
    hist = await make_fixture(bench, "aiooutbox_history")
    t = time.perf_counter()
    await hist.load(config.history_rows, history=True)
    bench.log(f"  loaded history in {time.perf_counter() - t:.1f}s")
    aio = bench.systems[AIO]
    await hist.reset()
    await hist.load(config.history_drain)
    try:
        explain = await hist.explain_claim()
        explain["analyze"] = (await hist.explain_claim(analyze=True))["custom_plan"]
    except OutboxError as exc:  # reading the plans needs a superuser
        explain = {"error": str(exc), "uses_index": None, "generic_plan": f"({exc})"}
        bench.log(f"  claim plan not read: {exc}")
    else:
        bench.log(f"  claim plan uses {explain['index']}: {explain['uses_index']}")
    runs: list[dict[str, Any]] = []
    for r in range(config.history_rounds):
        for label, system in alternated((("empty", aio), ("history", hist)), r):
            run = await bench.drain_once(system, config.history_drain, label=f"{label:8} ")
            run["table"] = label
            runs.append(run)
    empty = median([x["rate"] for x in runs if x["table"] == "empty"])
    history = median([x["rate"] for x in runs if x["table"] == "history"])
    bench.results["history"] = {
        "rows": config.history_rows,
        "drain_size": config.history_drain,
        "explain": explain,
        "runs": runs,
        "summary": {
            "empty": round(empty, 1),
            "history": round(history, 1),
            "ratio": round(ratio(history, empty), 3),
        },
    }
    bench.log(f"  history/empty = {ratio(history, empty):.2f}")


def section(results: dict[str, Any]) -> list[str]:
    history = results.get("history")
    if not history:
        return []
    s = history["summary"]
    title = f"Cost of history ({history['rows']:,} done rows; drain of {history['drain_size']:,})"
    return [
        *table(title, "| table | drain/s (median) |", "|---|---:|"),
        f"| empty | {fmt(s['empty'])} |",
        f"| with history | {fmt(s['history'])} |",
        f"| ratio | {fmt(s['ratio'], 2)} |",
        "",
        "Claim plan with history (generic plan, as a prepared statement may use):",
        "",
        "```",
        history["explain"]["generic_plan"],
        "```",
    ]


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    history = results.get("history", {}).get("summary")
    if not history:
        return []
    plan = results["history"]["explain"]
    return [
        at_least(
            f"drain with {results['history']['rows']:,} done rows / empty table",
            0.8,
            history.get("ratio"),
        ),
        target(
            "claim plan (custom and generic) on the claimable partial index",
            "yes",
            None,
            plan.get("uses_index"),
        ),
    ]


SCENARIO = Scenario(
    "history",
    run,
    sizes=Sizes,
    quick={"history_rows": 100_000, "history_drain": 5_000, "history_rounds": 1},
    sections=((110, section),),
    targets=((50, targets),),
)
