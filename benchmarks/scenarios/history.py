"""``history``: the cost of history, a drain beside ``history_rows`` finished events
against the same drain on an empty table, rounds alternated; and the claim's plans with
that history (custom and generic: both on the claimable partial index).

Each layout of ``history_layouts`` is a database of its own:

- ``ring``: the history where migration 0022 keeps it, in the ring
  (``outbox_events_done``), spread evenly by id over its eight slots with the newest
  eighth in the current slot (7), which the drain's events are settled into; the
  outbox itself empty. Finished over the last six days, so the drain consumer's default
  retention (7 days) retires none of it.
- ``in-place``: ``done`` rows in the outbox itself, as before 0022 (and as events with a
  dedupe key still finish), finished an hour ago.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiooutbox import OutboxError

from ..harness.bench import AIO, Bench
from ..harness.markdown import at_least, fmt, table, target
from ..harness.rounds import make_fixture, rotated
from ..harness.scenario import Scenario, sizes_of
from ..harness.stats import median, ratio
from ..systems import aiooutbox_runner

LAYOUTS = ("ring", "in-place")
#: the issue's target for the ring: history costs the drain at most 10%
RING_FLOOR = 0.9
_CHUNK = 1_000_000
_NAMES = {
    "ring": "in the ring (8 slots, the newest eighth in the current one)",
    "in-place": "`done` rows in the outbox",
}


@dataclass
class Sizes:
    history_rows: int = 1_000_000
    history_drain: int = 50_000
    history_rounds: int = 3
    history_layouts: tuple[str, ...] = LAYOUTS


async def load_ring(system: aiooutbox_runner.System, n: int) -> None:
    """``n`` finished events straight into the ring's slots (ids 1..n, slot by id range,
    finished over the last six days, the newest eighth in slot 7, made current), the
    outbox's identity moved past them; then VACUUM ANALYZE and `keep_loaded`."""
    q = system.q
    conn = await system.connect()
    try:
        for start in range(0, n, _CHUNK):
            await conn.execute(
                f"INSERT INTO {q.done_table} (slot, id, topic, payload, headers, attempts,"
                " max_attempts, available_at, locked_by, created_at, finished_at)"
                " SELECT ((g - 1) * 8 / $3::bigint)::smallint, g, 'bench',"
                " jsonb_build_object('i', g),"
                " '{}'::jsonb, 1, 10, f - interval '1 second', 'history',"
                " f - interval '1 second', f"
                " FROM generate_series($1::bigint, $2::bigint) AS g,"
                " LATERAL (SELECT now() - interval '6 days'"
                " * (($3::bigint - g)::float8 / $3::bigint) AS f) AS t",
                start + 1,
                min(n, start + _CHUNK),
                n,
            )
        await conn.execute(f'UPDATE "{q.schema}"."{q.table}_done_ring" SET slot = 7, since = now()')
        await conn.execute(
            "SELECT setval(pg_get_serial_sequence($1, 'id'), greatest($2::bigint, 1))",
            q.qualified,
            n,
        )
        await conn.execute(f"VACUUM (ANALYZE) {q.qualified}, {q.done_table}")
    finally:
        await conn.close()
    await system.keep_loaded()


async def _left(system: aiooutbox_runner.System) -> int:
    """The history's events still there after the drains (none retired or purged)."""
    conn = await system.connect()
    try:
        n: int = await conn.fetchval(
            f"SELECT count(*) FROM {system.q.all_events} WHERE id <= $1", system.history_max_id
        )
    finally:
        await conn.close()
    return n


async def _fixture(bench: Bench, layout: str, n: int) -> aiooutbox_runner.System:
    if layout not in LAYOUTS:
        raise ValueError(f"history layout must be one of {LAYOUTS}, not {layout!r}")
    name = "aiooutbox_history" + ("_ring" if layout == "ring" else "")
    system = await make_fixture(bench, name)
    t = time.perf_counter()
    if layout == "ring":
        await load_ring(system, n)
    else:
        await system.load(n, history=True)
    bench.log(f"  loaded {layout} history in {time.perf_counter() - t:.1f}s")
    return system


async def run(bench: Bench) -> None:
    config = sizes_of(bench.config, Sizes)
    layouts = tuple(config.history_layouts)
    bench.log(
        f"cost of history: {config.history_rows:,} finished events ({', '.join(layouts)})"
        " vs an empty table"
    )
    fixtures = {layout: await _fixture(bench, layout, config.history_rows) for layout in layouts}
    aio = bench.systems[AIO]
    await aio.reset()
    first = fixtures[layouts[0]]
    await first.reset()
    await first.load(config.history_drain)
    try:
        explain = await first.explain_claim()
        explain["analyze"] = (await first.explain_claim(analyze=True))["custom_plan"]
    except OutboxError as exc:  # reading the plans needs a superuser
        explain = {"error": str(exc), "uses_index": None, "generic_plan": f"({exc})"}
        bench.log(f"  claim plan not read: {exc}")
    else:
        bench.log(f"  claim plan ({layouts[0]}) uses {explain['index']}: {explain['uses_index']}")
    explain["layout"] = layouts[0]
    runs: list[dict[str, Any]] = []
    systems = [("empty", aio), *fixtures.items()]
    for r in range(config.history_rounds):
        for label, system in rotated(systems, r, reverse_odd=True):
            run = await bench.drain_once(system, config.history_drain, label=f"{label:8} ")
            run["table"] = label
            runs.append(run)
    left = {layout: await _left(fixtures[layout]) for layout in layouts}
    rates = {
        label: median([x["rate"] for x in runs if x["table"] == label]) for label, _ in systems
    }
    per = {
        layout: {
            "left": left[layout],
            "rate": round(rates[layout], 1),
            "ratio": round(ratio(rates[layout], rates["empty"]), 3),
        }
        for layout in layouts
    }
    bench.results["history"] = {
        "rows": config.history_rows,
        "drain_size": config.history_drain,
        "explain": explain,
        "runs": runs,
        "summary": {
            "empty": round(rates["empty"], 1),
            # the first layout's (the ring's at the defaults), as before layouts
            "history": per[layouts[0]]["rate"],
            "ratio": per[layouts[0]]["ratio"],
            "layouts": per,
        },
    }
    bench.log(f"  history/empty: { ({k: v['ratio'] for k, v in per.items()}) }")


def section(results: dict[str, Any]) -> list[str]:
    history = results.get("history")
    if not history:
        return []
    s = history["summary"]
    title = (
        f"Cost of history ({history['rows']:,} finished events; drain of {history['drain_size']:,})"
    )
    rows = [
        f"| {_NAMES.get(layout, layout)} | {fmt(v['rate'])} | {fmt(v['ratio'], 3)} |"
        for layout, v in s.get("layouts", {}).items()
    ] or [f"| done rows in the outbox | {fmt(s['history'])} | {fmt(s['ratio'], 3)} |"]
    rounds = len([r for r in history["runs"] if r["table"] == "empty"])
    return [
        *table(title, "| history | drain/s (median) | / empty |", "|---|---:|---:|"),
        f"| none (empty) | {fmt(s['empty'])} | 1 |",
        *rows,
        "",
        f"{rounds} round(s), the order rotated each round; the history's events still there"
        " after the drains: "
        + (", ".join(f"{k} {fmt(v.get('left'))}" for k, v in s.get("layouts", {}).items()) or "-")
        + ". Claim plan with history"
        f" ({history['explain'].get('layout', 'in-place')}; generic plan, as a prepared"
        " statement may use):",
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
    rows = f"{results['history']['rows']:,}"
    layouts = history.get("layouts") or {"in-place": {"ratio": history.get("ratio")}}
    return [
        *(
            at_least(
                f"drain with {rows} finished events in the ring / empty table",
                RING_FLOOR,
                v["ratio"],
            )
            if layout == "ring"
            else at_least(
                f"drain with {rows} done rows in the outbox / empty table", 0.8, v["ratio"]
            )
            for layout, v in layouts.items()
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
