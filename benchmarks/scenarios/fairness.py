"""``fairness``: the targets of fair groups.

(a) Starvation: ``fairness_flood`` events of one group, then one event of another; one
consumer at concurrency 8 with 5 ms handlers (in this process). The lone event's start,
after the first handler's start: target <= 1 s (measured before groups: 13.8 s, behind
all 20,000). Repeated ``fairness_lone_rounds`` times; the worst counts.

(b) Cost: a drain of ``fairness_size`` events spread over ``fairness_groups`` groups,
against the same drain in one group and in none (rounds alternate; ratios of medians):
targets >= 0.9 (10,000 groups / one group), and, for a table with no groups at all,
nothing to pay (compare with main through ``python -m benchmarks.ab``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import asyncpg

import aiooutbox

from ..harness.bench import AIO, Bench
from ..harness.databases import TOPIC
from ..harness.markdown import at_least, target
from ..harness.rounds import drain_rounds, median_rate
from ..harness.scenario import Scenario, sizes_of
from ..harness.stats import ratio
from ..systems import aiooutbox_runner

FLOOD, LONE = "flood", "lone"


@dataclass
class Sizes:
    fairness_flood: int = 20_000
    fairness_lone_rounds: int = 3
    fairness_concurrency: int = 8
    fairness_handler_ms: float = 5.0
    fairness_size: int = 50_000
    fairness_groups: int = 10_000
    fairness_rounds: int = 3


async def lone_start(system: aiooutbox_runner.System, config: Sizes) -> dict[str, Any]:
    """One run of (a): seconds from the first handler's start to the lone event's."""
    await system.reset()
    await system.insert_series(
        config.fairness_flood, "topic, payload, grp", f"'{TOPIC}', '{{}}', '{FLOOD}'"
    )
    await system.execute(
        f"INSERT INTO {system.q.qualified} (topic, payload, grp) VALUES ($1, '{{}}', $2)",
        TOPIC,
        LONE,
    )
    started: dict[str, float] = {}
    handled = 0
    seen = asyncio.Event()
    pause = config.fairness_handler_ms / 1000

    async def handle(event: aiooutbox.Event) -> None:
        nonlocal handled
        started.setdefault(event.group or "", time.perf_counter())
        handled += 1
        if event.group == LONE:
            seen.set()
        await asyncio.sleep(pause)

    async with asyncpg.create_pool(system.dsn, min_size=2, max_size=4) as pool:
        consumer = aiooutbox.OutboxConsumer(pool, concurrency=config.fairness_concurrency)
        task = asyncio.ensure_future(consumer.run({TOPIC: handle}))
        try:
            await asyncio.wait_for(seen.wait(), timeout=120)
        finally:
            consumer.stop()
            await asyncio.wait_for(task, 60)
    return {
        "lone_after_s": round(started[LONE] - started[FLOOD], 4),
        "handled_before": handled - 1,
    }


async def run(bench: Bench) -> None:
    config, aio = sizes_of(bench.config, Sizes), bench.systems[AIO]
    settings = bench.settings[AIO]
    n, groups = config.fairness_size, config.fairness_groups
    bench.log(
        f"fairness: a lone event behind {config.fairness_flood:,} of another group; "
        f"a drain over {groups:,} groups / one / none"
    )
    lone = [await lone_start(aio, config) for _ in range(config.fairness_lone_rounds)]
    worst = max(r["lone_after_s"] for r in lone)
    bench.log(f"  lone event started after {worst:.3f}s (worst of {len(lone)})")

    def spread(grp: str) -> Any:
        async def load() -> None:
            await aio.insert_series(n, "topic, payload, grp", f"'{TOPIC}', '{{}}', {grp}")

        return load

    runs = await drain_rounds(
        bench,
        config.fairness_rounds,
        [
            ("groups", (aio, n, spread(f"'g' || (g % {groups})"), settings)),
            ("one_group", (aio, n, spread("'g'"), settings)),
            ("no_groups", (aio, n, spread("NULL"), settings)),
        ],
    )
    rates = {v: median_rate(runs, v) for v in ("groups", "one_group", "no_groups")}
    out: dict[str, Any] = {
        "flood": config.fairness_flood,
        "concurrency": config.fairness_concurrency,
        "handler_ms": config.fairness_handler_ms,
        "lone": lone,
        "lone_after_s": worst,
        "size": n,
        "groups": groups,
        "runs": runs,
        "rates": {k: round(v, 1) for k, v in rates.items()},
        "ratios": {
            "groups_vs_one": round(ratio(rates["groups"], rates["one_group"]), 3),
            "one_vs_none": round(ratio(rates["one_group"], rates["no_groups"]), 3),
        },
    }
    bench.results["fairness"] = out
    bench.log(
        "  drain over {g:,} groups / one group = {groups_vs_one:.3f}; one group / none = "
        "{one_vs_none:.3f}".format(g=groups, **out["ratios"])
    )


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    fair = results.get("fairness")
    if not fair:
        return []
    lone = fair["lone_after_s"]
    return [
        target(
            f"a lone event behind {fair['flood']:,} of another group starts within (s)",
            "<= 1.0",
            lone,
            lone <= 1.0,
        ),
        at_least(
            f"drain {fair['size']:,} over {fair['groups']:,} groups / one group",
            0.9,
            fair["ratios"].get("groups_vs_one"),
        ),
    ]


SCENARIO = Scenario(
    "fairness",
    run,
    sizes=Sizes,
    quick={"fairness_size": 10_000, "fairness_groups": 1_000, "fairness_rounds": 1},
    targets=((95, targets),),
)
