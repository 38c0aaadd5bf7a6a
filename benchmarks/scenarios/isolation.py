"""``isolation``: the speed targets of topic isolation. (a) A drain of topic A with a
large pending backlog of a topic B that no consumer handles (older than A's events)
against without; (b) idle wake-up of an A event with that backlog; (c) a consumer of many
topics with a few rows each, the backlog in a topic it does not handle, against without;
(d) several consumer processes draining one table against one, with double claims
counted from the ids each process handled; (e) COMMIT -> handler latency at light loads,
aiooutbox and PgQueuer.

Every ratio is of medians over rounds that alternate the variants in one run. The B
backlog lives in a database of its own, built once and kept across the rounds
(`System.keep_loaded`). results.md shows its rates beside ordering's (`section`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from ..harness.bench import AIO, PGQ, Bench
from ..harness.cpu import BackendCpu
from ..harness.load import steady_once, wakeup_once
from ..harness.markdown import at_least, fmt, table, target
from ..harness.processes import child_process
from ..harness.rounds import alternated, drain_rounds, make_fixture, median_rate
from ..harness.scenario import Scenario, sizes_of
from ..harness.stats import median, ratio
from ..systems import aiooutbox_runner
from . import ordering

OTHER_TOPIC = "unconsumed"  # the topic with the backlog no consumer handles


@dataclass
class Sizes:
    # a backlog of a topic nobody consumes
    isolation_backlog: int = 1_000_000
    isolation_size: int = 20_000
    isolation_rounds: int = 5
    isolation_topics: int = 50
    isolation_per_topic: int = 10
    isolation_topic_rounds: int = 5
    multi_processes: int = 4
    multi_size: int = 50_000
    multi_rounds: int = 3
    # COMMIT -> handler at light loads
    light_rates: list[float] = field(default_factory=lambda: [50.0, 5.0])
    light_seconds: float = 20.0


async def run(bench: Bench) -> None:
    config, aio = sizes_of(bench.config, Sizes), bench.systems[AIO]
    settings = bench.settings[AIO]
    backlog, n = config.isolation_backlog, config.isolation_size
    bench.log(f"isolation: {backlog:,} pending events of a topic nobody consumes")
    fixture = await make_fixture(bench, "aiooutbox_backlog")
    t = time.perf_counter()
    await fixture.insert_series(
        backlog, "topic, payload", f"'{OTHER_TOPIC}', jsonb_build_object('i', g)"
    )
    await fixture.keep_loaded()
    build_s = time.perf_counter() - t
    bench.log(f"  built in {build_s:.1f}s")
    out: dict[str, Any] = {"backlog": backlog, "build_s": round(build_s, 1)}

    # (a) drain A with and without the B backlog (older than A's events)
    runs = await drain_rounds(
        bench,
        config.isolation_rounds,
        [("no_backlog", (aio, n, None, settings)), ("backlog", (fixture, n, None, settings))],
    )
    rates = {v: median_rate(runs, v) for v in ("no_backlog", "backlog")}
    out["drain"] = {
        "size": n,
        "runs": runs,
        "rates": {k: round(v, 1) for k, v in rates.items()},
        "ratio": round(ratio(rates["backlog"], rates["no_backlog"]), 3),
    }
    bench.log(f"  drain A with/without the backlog = {out['drain']['ratio']:.3f}")

    # (b) idle wake-up of an A event, with and without the backlog
    out["wakeup"] = {}
    for label, system in (("backlog", fixture), ("no_backlog", aio)):
        out["wakeup"][label] = await wakeup_once(bench, system, settings)
        lat = out["wakeup"][label]["latency_ms"]
        bench.log(
            f"  wake-up {label:10} p50 {lat.get('p50')} ms, p99 {lat.get('p99')} ms "
            f"(n={lat.get('n')})"
        )

    # (c) a consumer of many topics with a few rows each; the backlog in one more
    topics = [f"t{i:02d}" for i in range(config.isolation_topics)]
    per = config.isolation_per_topic
    many = {**settings, "topics": topics}

    def load_topics(system: aiooutbox_runner.System) -> Any:
        async def load() -> None:
            await system.insert_series(
                len(topics) * per,
                "topic, payload",
                f"'t' || lpad(((g - 1) % {len(topics)})::text, 2, '0'), jsonb_build_object('i', g)",
            )

        return load

    count = len(topics) * per
    topic_runs = await drain_rounds(
        bench,
        config.isolation_topic_rounds,
        [
            ("no_backlog", (aio, count, load_topics(aio), many)),
            ("backlog", (fixture, count, load_topics(fixture), many)),
        ],
    )
    topic_rates = {v: median_rate(topic_runs, v) for v in ("no_backlog", "backlog")}
    elapsed = {
        v: median([r["elapsed_s"] for r in topic_runs if r["variant"] == v])
        for v in ("no_backlog", "backlog")
    }
    out["topics"] = {
        "topics": len(topics),
        "per_topic": per,
        "runs": topic_runs,
        "rates": {k: round(v, 1) for k, v in topic_rates.items()},
        "elapsed_s": {k: round(v, 3) for k, v in elapsed.items()},
        "ratio": round(ratio(topic_rates["backlog"], topic_rates["no_backlog"]), 3),
    }
    bench.log(f"  {len(topics)} topics x {per}, with/without = {out['topics']['ratio']:.3f}")

    # (d) several consumer processes on one table vs one
    out["processes"] = await processes(bench)

    # (e) COMMIT -> handler at light loads, both systems
    light: list[dict[str, Any]] = []
    for i, rate in enumerate(config.light_rates):
        for name in alternated((AIO, PGQ), i):
            run = await steady_once(
                bench, bench.systems[name], None, rate, seconds=config.light_seconds
            )
            light.append({k: v for k, v in run.items() if k != "latency_series"})
    out["light"] = light
    bench.results["isolation"] = out


async def processes(bench: Bench) -> dict[str, Any]:
    """Drain one table with 1 and with ``multi_processes`` consumer processes, rounds
    alternating; rate = events / (last handler start - first), over all processes."""
    config, aio = sizes_of(bench.config, Sizes), bench.systems[AIO]
    n, many = config.multi_size, config.multi_processes
    bench.log(f"  {many} consumer processes vs 1, draining {n:,}")
    await aio.execute(
        f"CREATE TABLE IF NOT EXISTS {aiooutbox_runner.HANDLED_TABLE} (id bigint, pid int)"
    )
    runs: list[dict[str, Any]] = []
    for r in range(config.multi_rounds):
        for count in alternated((1, many), r):
            runs.append(await drain_by(bench, count, n))
    rates = {c: median([x["rate"] for x in runs if x["processes"] == c]) for c in (1, many)}
    return {
        "size": n,
        "processes": many,
        "runs": runs,
        "rates": {str(k): round(v, 1) for k, v in rates.items()},
        "ratio": round(ratio(rates[many], rates[1]), 3),
        "double_claims": sum(x["double_handled"] for x in runs),
        "reclaimed": sum(x["reclaimed"] for x in runs),
    }


async def drain_by(bench: Bench, count: int, n: int) -> dict[str, Any]:
    """One drain of ``n`` events by ``count`` consumer processes, each recording the ids
    it handled (`aiooutbox_runner.HANDLED_TABLE`)."""
    aio = bench.systems[AIO]
    await aio.reset()
    await aio.execute(f"TRUNCATE {aiooutbox_runner.HANDLED_TABLE}")
    await aio.load(n)
    settings = {**bench.settings[AIO], "record_ids": True}
    spec = bench.spec(aio, "serve", settings, times=True)
    q = aio.q
    async with (
        BackendCpu(bench.admin_dsn, aio.database) as cpu,
        contextlib.AsyncExitStack() as stack,
    ):
        entered = [await stack.enter_async_context(child_process(spec)) for _ in range(count)]
        await asyncio.gather(*(c.wait_ready() for c in entered))
        deadline = time.monotonic() + max(120.0, n / 500)
        conn = await aio.connect()
        try:
            while time.monotonic() < deadline:
                left = await conn.fetchval(
                    f"SELECT EXISTS (SELECT 1 FROM {q.qualified}"
                    "  WHERE status IN ('pending', 'retry'))"
                    f" OR EXISTS (SELECT 1 FROM {q.qualified} WHERE status = 'processing')"
                )
                if not left:
                    break
                await asyncio.sleep(0.05)
        finally:
            await conn.close()
        for c in entered:
            c.send(stop_after=0, timeout=5)
        results = [await c.result(timeout=60) for c in entered]
    conn = await aio.connect()
    try:
        double = await conn.fetchval(
            f"SELECT count(*) FROM (SELECT id FROM {aiooutbox_runner.HANDLED_TABLE}"
            " GROUP BY id HAVING count(*) > 1) AS d"
        )
        distinct = await conn.fetchval(
            f"SELECT count(DISTINCT id) FROM {aiooutbox_runner.HANDLED_TABLE}"
        )
        reclaimed = await conn.fetchval(f"SELECT count(*) FROM {q.qualified} WHERE attempts > 1")
    finally:
        await conn.close()
    handled = [r["handled"] for r in results]
    first = min(r["t_first"] for r in results if r["handled"])
    last = max(r["t_last"] for r in results)
    run = {
        "processes": count,
        "size": n,
        "handled": handled,
        "distinct_handled": distinct,
        "double_handled": double,
        "reclaimed": reclaimed,
        "finished": await aio.finished(),
        "elapsed_s": round(last - first, 3),
        "rate": round(sum(handled) / (last - first), 1) if last > first else 0.0,
        "client_cpu_s": round(sum(r["cpu_s"] for r in results), 3),
        "db_cpu_s": cpu.seconds,
    }
    if run["finished"] != n or distinct != n:
        run["error"] = f"{run['finished']} finished, {distinct} distinct handled, of {n}"
    bench.log(
        f"    {count} process(es): {run['rate']:>9,.0f}/s ({run['elapsed_s']:.2f}s, "
        f"handled {handled}, double {double}, re-claimed {reclaimed})"
        + (f" {run['error']}" if "error" in run else "")
    )
    return run


def section(results: dict[str, Any]) -> list[str]:
    """The rates behind the ordering and isolation ratios (medians of rounds)."""
    isolation = results.get("isolation")
    if not results.get("ordering") and not isolation:
        return []
    lines = table(
        "Ordered delivery and topic isolation (events/s, median of rounds)",
        "| case | variant | rate | rounds |",
        "|---|---|---:|---:|",
    )
    lines += ordering.rows(results)
    if not isolation:
        return lines
    b = isolation["backlog"]
    lines += ordering.variant_rows(
        f"{isolation['drain']['size']:,} of A, {b:,} pending B",
        isolation["drain"]["runs"],
        isolation["drain"]["rates"],
    )
    topics = isolation["topics"]
    lines += ordering.variant_rows(
        f"{topics['topics']} topics x {topics['per_topic']}, {b:,} pending in another",
        topics["runs"],
        topics["rates"],
    )
    procs = isolation["processes"]
    for count, rate in procs["rates"].items():
        rounds = sum(1 for r in procs["runs"] if str(r["processes"]) == count)
        lines.append(
            f"| {procs['size']:,} by {count} process(es) | double claims "
            f"{procs['double_claims']}, re-claimed {procs['reclaimed']} | {fmt(rate)} "
            f"| {rounds} |"
        )
    lines += [
        "",
        "| latency, COMMIT -> handler start (ms) | p50 | p95 | p99 | max | n |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    latencies = [
        (f"idle wake-up, {label} ({b:,} pending B)", run["latency_ms"])
        for label, run in isolation["wakeup"].items()
    ]
    latencies += [
        (f"{run['system']} at {run['offered_rate']:g}/s", run["latency_ms"])
        for run in isolation.get("light", [])
    ]
    for what, lat in latencies:
        lines.append(
            f"| {what} | {fmt(lat.get('p50'), 2)} | {fmt(lat.get('p95'), 2)} "
            f"| {fmt(lat.get('p99'), 2)} | {fmt(lat.get('max'), 2)} | {lat.get('n')} |"
        )
    return lines


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    isolation = results.get("isolation")
    if not isolation:
        return []
    b = isolation["backlog"]
    out = [
        at_least(
            f"drain {isolation['drain']['size']:,} of A with {b:,} pending of unconsumed B "
            "/ without",
            0.8,
            isolation["drain"]["ratio"],
        )
    ]
    wake = isolation["wakeup"]["backlog"]["latency_ms"]
    if wake.get("n"):
        out += [
            target(
                f"idle wake-up p50 with {b:,} pending B (ms)", "<= 3", wake["p50"], wake["p50"] <= 3
            ),
            target(
                f"idle wake-up p99 with {b:,} pending B (ms)",
                "<= 15",
                wake["p99"],
                wake["p99"] <= 15,
            ),
        ]
    topics, procs = isolation["topics"], isolation["processes"]
    out += [
        at_least(
            f"consumer of {topics['topics']} topics x {topics['per_topic']} rows, {b:,} pending "
            "in another topic / without",
            0.8,
            topics["ratio"],
        ),
        at_least(
            f"{procs['processes']} consumer processes / 1, draining {procs['size']:,}",
            0.9,
            procs["ratio"],
        ),
        target(
            f"double claims with {procs['processes']} processes",
            "0",
            procs["double_claims"],
            procs["double_claims"] == 0,
        ),
    ]
    light = isolation.get("light", [])
    for rate in sorted({run["offered_rate"] for run in light}, reverse=True):
        mine = {run["system"]: run["latency_ms"] for run in light if run["offered_rate"] == rate}
        lat, theirs = mine.get(AIO, {}), mine.get(PGQ, {})
        if not lat.get("n"):
            continue
        out += [
            target(
                f"COMMIT -> handler p50 at {rate:g}/s (ms)", "<= 3", lat["p50"], lat["p50"] <= 3
            ),
            target(
                f"COMMIT -> handler p99 at {rate:g}/s (ms)", "<= 10", lat["p99"], lat["p99"] <= 10
            ),
        ]
        if theirs.get("n"):
            out.append(
                target(
                    f"COMMIT -> handler p99 at {rate:g}/s, aiooutbox / PgQueuer",
                    "<= 1",
                    lat["p99"] / theirs["p99"] if theirs["p99"] else None,
                    lat["p99"] <= theirs["p99"],
                )
            )
    return out


SCENARIO = Scenario(
    "isolation",
    run,
    sizes=Sizes,
    quick={
        "isolation_backlog": 50_000,
        "isolation_size": 5_000,
        "isolation_rounds": 1,
        "isolation_topic_rounds": 2,
        "multi_size": 10_000,
        "multi_rounds": 1,
        "light_seconds": 4.0,
    },
    sections=((140, section),),
    targets=((80, targets),),
)
