"""``retention`` (only with ``--only``): history at scale, a drain beside
``retention_rows`` ``done`` rows, with the consumer's retention as configured by
default, against the same drain on an empty table.

The history rows finished 8 days ago, so the default retention (7 days) finds them all
due: every consumer purges at its start, in rounds of back-to-back batches of 1,000
rows while they come back full (aiooutbox/_engine/maintenance.py). Drains at the
defaults (``OutboxConsumer(pool)``): on the empty table; beside the history with
retention off (``retention=None``: the history's own cost); beside it with the default
retention, which purges while the drain runs. Rounds alternate; between drains the
table is reset as autovacuum would leave it (``VACUUM (ANALYZE)``; autovacuum is off on
our server).

Also: table and index sizes after the load, after every drain and at the end; the time
of ``aiooutbox.admin.stats`` beside the history and on the empty table, and of the full
count by topic and status it replaced; the purge statement itself on the full history,
before the drains, timed from this process (batches of the consumer's own ``DELETE``,
rows/s); and, after the drains, rounds of the consumer's own retention code
(`Maintenance.purge_round`) with the pause its schedule puts after each: the rate one
consumer purges at while rows are due (its ceiling).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import asyncpg

from aiooutbox._engine.leases import Leases
from aiooutbox._engine.maintenance import _PURGE_BATCH, _PURGE_DUTY_WAIT, Maintenance

from ..harness.bench import Bench
from ..harness.rounds import alternated, make_fixture
from ..harness.scenario import Scenario, sizes_of
from ..harness.stats import median, ratio

_RETENTION = 7 * 86400.0


@dataclass
class Sizes:
    retention_rows: int = 10_000_000
    retention_drain: int = 50_000
    retention_rounds: int = 3
    retention_stats_repeat: int = 3
    retention_purge_batches: int = 50
    retention_purge_rounds: int = 5


async def sizes(system: Any) -> dict[str, int]:
    conn = await system.connect()
    try:
        # the outbox and the ring of finished events (migration 0022), together
        row = await conn.fetchrow(
            "SELECT sum(pg_relation_size(r))::bigint AS heap,"
            " sum(pg_indexes_size(r))::bigint AS indexes,"
            " sum(pg_total_relation_size(r))::bigint AS total,"
            " (SELECT count(*) FROM " + system.q.all_events + ") AS live_rows"
            " FROM (SELECT $1::regclass AS r UNION ALL"
            "  SELECT relid FROM pg_partition_tree($2::regclass) WHERE isleaf) AS t",
            system.q.qualified,
            system.q.done_table,
        )
    finally:
        await conn.close()
    return dict(row)


async def stats_ms(system: Any, repeat: int, *, full_count: bool = False) -> float:
    """The median time of ``aiooutbox.admin.stats`` (``full_count``: of the full count
    by topic and status that stats ran before it estimated ``done``)."""
    from aiooutbox.admin import stats

    sql = f"SELECT topic, status, count(*) FROM {system.q.qualified} GROUP BY topic, status"
    conn = await system.connect()
    try:
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            if full_count:
                await conn.fetch(sql)
            else:
                await stats(conn)
            times.append((time.perf_counter() - t) * 1000)
    finally:
        await conn.close()
    return round(median(times), 1)


async def done_estimated(system: Any) -> bool:
    from aiooutbox.admin import stats

    conn = await system.connect()
    try:
        return (await stats(conn)).done_estimated
    finally:
        await conn.close()


async def retention_rounds(system: Any, rounds: int) -> dict[str, Any]:
    """``rounds`` of the consumer's retention round on the history; the rate with the
    pause the schedule puts after a round that left rows due."""
    pool = await asyncpg.create_pool(system.dsn, min_size=1, max_size=2)
    try:
        m = Maintenance(
            pool,
            system.q,
            "bench-retention",
            leases=Leases(),
            on_recovered=lambda n: None,
            lease_timeout=30.0,
            retention=_RETENTION,
            statement_timeout=60.0,
            orphan_sweep_interval=60.0,
        )
        done = []
        for _ in range(rounds):
            deleted, behind, took = await m.purge_round(_RETENTION)
            done.append({"rows": deleted, "behind": behind, "seconds": round(took, 3)})
            if not behind:
                break
    finally:
        await pool.close()
    rows = sum(r["rows"] for r in done)
    # a round that left rows due is followed by a pause of _PURGE_DUTY_WAIT times it
    spent = sum(r["seconds"] * (1 + (_PURGE_DUTY_WAIT if r["behind"] else 0)) for r in done)
    return {
        "rounds": done,
        "rows": rows,
        "scheduled_rows_per_s": round(rows / spent, 1) if spent else None,
    }


async def purge_speed(system: Any, batches: int) -> dict[str, Any]:
    """``batches`` of the consumer's purge statement, back to back, as one round runs."""
    conn = await system.connect()
    try:
        deleted, times = 0, []
        for _ in range(batches):
            t = time.perf_counter()
            status = await conn.execute(system.q.purge_done, _RETENTION, _PURGE_BATCH)
            times.append(time.perf_counter() - t)
            deleted += int(status.rsplit(" ", 1)[-1])
    finally:
        await conn.close()
    total = sum(times)
    return {
        "batches": batches,
        "rows": deleted,
        "seconds": round(total, 3),
        "rows_per_s": round(deleted / total, 1) if total else None,
        "batch_ms_median": round(median(times) * 1000, 2),
        "batch_ms_max": round(max(times) * 1000, 2),
        # the schedule's ceiling at this statement speed: a quarter of the time
        "schedule_ceiling_rows_per_s": round(deleted / total / (1 + _PURGE_DUTY_WAIT), 1)
        if total
        else None,
    }


async def run(bench: Bench) -> None:
    config = sizes_of(bench.config, Sizes)
    rows, n = config.retention_rows, config.retention_drain
    empty = await make_fixture(bench, "ret_empty", patched=False)
    hist = await make_fixture(bench, "ret_history", patched=False)
    bench.log(f"retention: {rows:,} done rows 8 days old vs an empty table, drains of {n:,}")
    t = time.perf_counter()
    await hist.insert_series(
        rows,
        "topic, payload, status, attempts, locked_by, finished_at",
        "'bench', jsonb_build_object('i', g), 'done', 1, 'history',"
        " now() - interval '8 days' + g * interval '1 millisecond'",
    )
    await hist.keep_loaded()
    load_s = round(time.perf_counter() - t, 1)
    bench.log(f"  loaded in {load_s}s")
    out: dict[str, Any] = {"rows": rows, "drain_size": n, "load_s": load_s, "sizes": {}}
    out["sizes"]["after_load"] = await sizes(hist)
    out["stats_ms"] = {
        "history": await stats_ms(hist, config.retention_stats_repeat),
        "empty": await stats_ms(empty, config.retention_stats_repeat),
        "history_full_count": await stats_ms(hist, config.retention_stats_repeat, full_count=True),
    }
    out["stats_done_estimated"] = await done_estimated(hist)
    bench.log(f"  stats: {out['stats_ms']} ms")
    # the purge at full scale, before the drains: the consumer's DELETE, batch after batch
    out["purge"] = await purge_speed(hist, config.retention_purge_batches)
    bench.log(f"  purge: {out['purge']}")
    variants: list[tuple[str, Any, dict[str, Any]]] = [
        ("empty", empty, {"defaults": True}),
        ("history_no_retention", hist, {"defaults": True, "retention": None}),
        ("history_retention_default", hist, {"defaults": True}),
    ]
    runs: list[dict[str, Any]] = []
    for r in range(config.retention_rounds):
        for label, system, settings in alternated(variants, r):
            t = time.perf_counter()
            await system.reset()  # VACUUM (ANALYZE), as autovacuum would have
            reset_s = round(time.perf_counter() - t, 2)
            run = await bench.drain_once(system, n, settings, label=f"{label:26} ")
            run = {k: v for k, v in run.items() if k != "rss"}
            run.update(variant=label, round=r, reset_s=reset_s)
            run["drain_rate"] = round(n / run["to_last_s"], 1) if run["to_last_s"] else 0.0
            if system is hist:
                run["sizes_after"] = await sizes(hist)
            runs.append(run)
    rates = {
        label: round(median([x["drain_rate"] for x in runs if x["variant"] == label]), 1)
        for label, _, _ in variants
    }
    out["runs"] = runs
    out["rates"] = rates
    out["ratios"] = {
        "history_no_retention_vs_empty": round(
            ratio(rates["history_no_retention"], rates["empty"]), 3
        ),
        "history_retention_default_vs_empty": round(
            ratio(rates["history_retention_default"], rates["empty"]), 3
        ),
    }
    bench.log(f"  drain/s {rates}; {out['ratios']}")
    out["rounds"] = await retention_rounds(hist, config.retention_purge_rounds)
    bench.log(f"  retention rounds: {out['rounds']}")
    await hist.reset()
    out["sizes"]["end"] = await sizes(hist)
    bench.results["retention"] = out


def _mb(value: int) -> str:
    return f"{value / 2**20:,.0f}"


def _rounds_line(section: dict[str, Any]) -> list[str]:
    if "rounds" not in section:  # an earlier run's results
        return []
    r = section["rounds"]
    return [
        f"Retention rounds after the drains (the consumer's own code): {r['rows']:,} rows in"
        f" {len(r['rounds'])} round(s), {r['scheduled_rows_per_s'] or 0:,.0f} rows/s with"
        " the schedule's pauses."
    ]


def render(section: dict[str, Any]) -> list[str]:
    rates, ratios, purge = section["rates"], section["ratios"], section["purge"]
    out = [
        "## History at scale and retention",
        "",
        f"{section['rows']:,} `done` rows (loaded in {section['load_s']} s), drains of"
        f" {section['drain_size']:,} at the defaults, medians:",
        "",
        "| table | drain/s | vs empty |",
        "|---|---:|---:|",
        f"| empty | {rates['empty']:,.0f} | |",
        f"| history, retention off | {rates['history_no_retention']:,.0f} |"
        f" {ratios['history_no_retention_vs_empty']:.3f} |",
        f"| history, default retention purging during the drain |"
        f" {rates['history_retention_default']:,.0f} |"
        f" {ratios['history_retention_default_vs_empty']:.3f} |",
        "",
        f"`stats`: {section['stats_ms']['history']} ms beside the history"
        f"{' (done estimated)' if section.get('stats_done_estimated') else ''},"
        f" {section['stats_ms']['empty']} ms on the empty table; the full count by topic and"
        f" status it no longer runs: {section['stats_ms'].get('history_full_count', '-')} ms.",
        f"Purge: {purge['rows']:,} rows in {purge['batches']} batches, {purge['seconds']} s"
        f" = {purge['rows_per_s']:,.0f} rows/s (batch median {purge['batch_ms_median']} ms,"
        f" max {purge['batch_ms_max']} ms); the schedule's ceiling at that speed"
        f" {purge.get('schedule_ceiling_rows_per_s') or 0:,.0f} rows/s.",
        *_rounds_line(section),
        "",
        "| when | heap MB | indexes MB | total MB | rows |",
        "|---|---:|---:|---:|---:|",
    ]
    points = [("after load", section["sizes"]["after_load"])]
    points += [
        (f"after r{x['round'] + 1} {x['variant']}", x["sizes_after"])
        for x in section["runs"]
        if "sizes_after" in x
    ]
    points.append(("end (VACUUM)", section["sizes"]["end"]))
    for label, s in points:
        out.append(
            f"| {label} | {_mb(s['heap'])} | {_mb(s['indexes'])} | {_mb(s['total'])} |"
            f" {s['live_rows']:,} |"
        )
    out.append("")
    return out


def section(results: dict[str, Any]) -> list[str]:
    return ["", *render(results["retention"])] if results.get("retention") else []


SCENARIO = Scenario(
    "retention",
    run,
    sizes=Sizes,
    quick={
        "retention_rows": 200_000,
        "retention_drain": 5_000,
        "retention_rounds": 1,
        "retention_purge_batches": 10,
    },
    default=False,  # 10M rows by default (--retention-rows)
    sections=((170, section),),
)
