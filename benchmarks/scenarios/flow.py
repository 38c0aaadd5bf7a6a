"""``flow``: the speed targets of flow control: fair and cheap.

``flow``: (a) fairness: a drain of topic A by a consumer of A and of a held topic B
whose large backlog (older than A's events) is paused, or at its max_running (B's
limit is taken by rows another consumer holds), vs the same drain with neither backlog
nor controls; target >= 0.9. (b) cost: a drain spread over four topics, two of them
with limits that do not bind (max_running 1,000,000 on one, a rate of 1,000,000/s on
the other), vs no limits at all; target >= 0.95.

Every ratio is of medians over rounds that alternate the variants in one run. The B
backlog lives in a database of its own, built once and kept across the rounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..harness.bench import AIO, Bench
from ..harness.databases import TOPIC
from ..harness.markdown import at_least
from ..harness.rounds import drain_rounds, make_fixture, median_rate
from ..harness.scenario import Scenario, sizes_of
from ..harness.stats import ratio
from ..systems import aiooutbox_runner

HELD = "held"  # the topic whose backlog is paused or at its limit
RUNNING_ELSEWHERE = 8  # B's rows another consumer holds: B's max_running
TOPICS = ["t0", "t1", "t2", "t3"]


@dataclass
class Sizes:
    # beside a paused / limited backlog; limits not binding
    flow_backlog: int = 1_000_000
    flow_size: int = 20_000
    flow_rounds: int = 5


async def _controls(system: aiooutbox_runner.System, *statements: str) -> None:
    """Replace the table's flow controls (written directly: no notification needed,
    the consumer starts after)."""
    await system.execute(f'DELETE FROM "{system.q.schema}"."{system.q.table}_flow"')
    for sql in statements:
        await system.execute(
            f'INSERT INTO "{system.q.schema}"."{system.q.table}_flow"'
            f" (topic, paused, max_running, rate, rate_text, burst, tokens, updated_by) {sql}"
        )


async def run(bench: Bench) -> None:
    config, aio = sizes_of(bench.config, Sizes), bench.systems[AIO]
    settings = {**bench.settings[AIO], "topics": [TOPIC, HELD]}
    backlog, n = config.flow_backlog, config.flow_size
    bench.log(f"flow: {backlog:,} events of a paused or limited topic; limits that do not bind")
    fixture = await make_fixture(bench, "aiooutbox_flow")
    t = time.perf_counter()
    await fixture.insert_series(
        backlog,
        "topic, payload, available_at",
        f"'{HELD}', jsonb_build_object('i', g), now() - interval '1 hour' - g * interval '1 ms'",
    )
    # B's limit taken by another consumer: its rows run there for a day
    await fixture.insert_series(
        RUNNING_ELSEWHERE,
        "topic, payload, status, attempts, locked_by, locked_at, lease_expires_at, flow_counted",
        f"'{HELD}', '{{}}', 'processing', 1, 'elsewhere', now(), now() + interval '1 day', true",
    )
    await fixture.keep_loaded()
    build_s = time.perf_counter() - t
    bench.log(f"  built in {build_s:.1f}s")

    async def plain() -> None:
        await _controls(aio)
        await aio.load(n)

    async def paused() -> None:
        await _controls(fixture, f"VALUES ('{HELD}', true, NULL, NULL, NULL, NULL, 0, 'bench')")
        await fixture.load(n)

    async def at_limit() -> None:
        await _controls(
            fixture,
            f"VALUES ('{HELD}', false, {RUNNING_ELSEWHERE}, NULL, NULL, NULL, 0, 'bench')",
        )
        await fixture.load(n)

    runs = await drain_rounds(
        bench,
        config.flow_rounds,
        [
            ("none", (aio, n, plain, settings)),
            ("paused", (fixture, n, paused, settings)),
            ("at_limit", (fixture, n, at_limit, settings)),
        ],
    )
    rates = {v: median_rate(runs, v) for v in ("none", "paused", "at_limit")}
    await _controls(fixture)

    # (b) limits configured, not binding
    spread = {**bench.settings[AIO], "topics": TOPICS}

    async def four_topics(*controls: str) -> None:
        await _controls(aio, *controls)
        await aio.insert_series(n, "topic, payload", "'t' || (g % 4), jsonb_build_object('i', g)")

    async def unlimited() -> None:
        await four_topics()

    async def limited() -> None:
        await four_topics(
            "VALUES ('t0', false, 1000000, NULL, NULL, NULL, 0, 'bench'),"
            " ('t1', false, NULL, 1e6, '1000000/s', 100000, 100000, 'bench')"
        )

    cost_runs = await drain_rounds(
        bench,
        config.flow_rounds,
        [("no_limits", (aio, n, unlimited, spread)), ("limits", (aio, n, limited, spread))],
    )
    cost_rates = {v: median_rate(cost_runs, v) for v in ("no_limits", "limits")}
    await _controls(aio)
    out: dict[str, Any] = {
        "backlog": backlog,
        "size": n,
        "build_s": round(build_s, 1),
        "runs": runs,
        "rates": {k: round(v, 1) for k, v in rates.items()},
        "cost_runs": cost_runs,
        "cost_rates": {k: round(v, 1) for k, v in cost_rates.items()},
        "ratios": {
            "paused_vs_none": round(ratio(rates["paused"], rates["none"]), 3),
            "at_limit_vs_none": round(ratio(rates["at_limit"], rates["none"]), 3),
            "limits_vs_none": round(ratio(cost_rates["limits"], cost_rates["no_limits"]), 3),
        },
    }
    bench.results["flow"] = out
    bench.log(
        "  drain beside a paused backlog/none = {paused_vs_none:.3f}, beside one at its"
        " limit/none = {at_limit_vs_none:.3f}; limits not binding/none = {limits_vs_none:.3f}"
        "".format(**out["ratios"])
    )


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    flowed = results.get("flow")
    if not flowed:
        return []
    size, backlog = f"{flowed['size']:,}", f"{flowed['backlog']:,}"
    return [
        at_least(what, floor, flowed["ratios"].get(key))
        for key, what, floor in (
            ("paused_vs_none", f"drain {size} of A beside {backlog} of a paused topic / none", 0.9),
            (
                "at_limit_vs_none",
                f"drain {size} of A beside {backlog} of a topic at its max_running / none",
                0.9,
            ),
            (
                "limits_vs_none",
                f"drain {size} over 4 topics, 2 with limits that do not bind / no limits",
                0.95,
            ),
        )
    ]


SCENARIO = Scenario(
    "flow",
    run,
    sizes=Sizes,
    quick={"flow_backlog": 50_000, "flow_size": 5_000, "flow_rounds": 1},
    targets=((90, targets),),
)
