"""``steady``: the steady state. Paced producers at fractions of each system's sustained
maximum (the highest producer rate it kept up with here, found by bisection) and at
fixed rates, the same for both systems; the latency from the producer's COMMIT to the
handler's start, and whether the consumer keeps up. Then the machine's floor under
light-load latency (`floor`).

The floor: at a few events a second the two cores sleep between events, and every hop of
the chain from a producer's COMMIT to a handler wakes a sleeping process: the producer's
backend flushes the WAL and signals the listening backend, which wakes the consumer,
whose claim wakes another backend and flushes the WAL again. How much a hop costs
after an idle pause is a fact of the machine (a virtual CPU that halted, cold caches),
not of any queue, so this measures it in the same run as the latencies it bounds:

- ``select1_warm``: ``SELECT 1`` back to back (a round trip on a busy machine);
- ``select1_idle``: ``SELECT 1`` after ``gap`` seconds with nothing to do;
- ``write_idle``: a one-row ``INSERT`` committed on its own (WAL flush) after the gap;
- ``chain_idle``: the shortest LISTEN-woken queue, after the gap: a producer inserts a
  row and calls ``pg_notify`` in one transaction; from sending its COMMIT, until a third
  connection, which sent its one-row ``INSERT`` as soon as the listening connection
  heard the notification, has that insert's reply. ``heard_idle`` is its first part,
  from the COMMIT to the notification.

``chain_idle`` at the median is the floor for a queue's light-load latency from the
producer's COMMIT to a handler: hear the notification, then one round trip that records
the claim, with the queue's own code costing nothing.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from ..harness.bench import AIO, PGQ, Bench
from ..harness.databases import drop_database, recreate_database
from ..harness.load import steady_once
from ..harness.markdown import fmt, mark, table, target
from ..harness.rounds import alternated
from ..harness.scenario import Scenario, sizes_of
from ..harness.stats import median, summarize_ms
from .drain import drain_rate

_CHANNEL = "bench_floor"


@dataclass
class Sizes:
    steady_fractions: list[float] = field(default_factory=lambda: [0.5, 0.9])
    # "sustained": fractions of the highest producer rate the system kept up with, with
    # the producers on the same machine (bisection between 0 and its drain rate);
    # "drain": fractions of its drain rate with nothing else running
    steady_max: str = "sustained"
    capacity_steps: int = 5
    capacity_seconds: float = 6.0
    # the same offered load for both systems, for a like-for-like latency comparison
    steady_rates: list[float] = field(default_factory=lambda: [4000.0])
    # the machine's floor under light-load latency: samples, and the idle pause before each
    floor_samples: int = 40
    floor_gap: float = 0.2


def latency_grew(series: list[list[float]]) -> bool:
    """Whether the median latency in the last third of a run's 0.5 s windows is more
    than twice (plus 10 ms) that of the first third: a backlog building up."""
    p50s = [row[1] for row in series if row[3]]
    if len(p50s) < 3:
        return False
    third = len(p50s) // 3
    return median(p50s[-third:]) > 2 * median(p50s[:third]) + 10.0


async def run(bench: Bench) -> None:
    config = sizes_of(bench.config, Sizes)
    bench.log("steady state: paced producers, end-to-end latency")
    out: list[dict[str, Any]] = []
    maxima = {name: drain_rate(bench, name) for name in bench.systems}
    if config.steady_fractions and config.steady_max == "sustained":
        maxima = await sustained_maxima(bench)
    loads: list[tuple[float | None, float | None]] = [
        (fraction, None) for fraction in config.steady_fractions
    ]
    loads += [(None, rate) for rate in config.steady_rates]
    for i, (fraction, rate) in enumerate(loads):
        for name in alternated((AIO, PGQ), i):
            offered = rate if rate is not None else (fraction or 1.0) * maxima[name]
            run = await steady_once(bench, bench.systems[name], fraction, offered)
            if fraction is not None:
                run["max_basis"] = config.steady_max
                run["max_rate"] = round(maxima[name], 1)
            out.append(run)
    bench.results["steady"] = out
    bench.results["floor"] = measured = await floor(
        bench.admin_dsn,
        bench.prefix + "floor",
        samples=config.floor_samples,
        gap=config.floor_gap,
    )
    chain, idle, warm = (
        measured[key]["p50"] for key in ("chain_idle", "select1_idle", "select1_warm")
    )
    bench.log(
        f"  floor after {config.floor_gap}s idle: COMMIT -> notification -> one-row write "
        f"p50 {chain} ms; SELECT 1 {idle} ms (back to back {warm} ms)"
    )


async def sustained_maxima(bench: Bench) -> dict[str, float]:
    """Bisect, per system, for the highest producer rate it keeps up with.

    "Max" as a drain rate assumes nothing else runs; in a steady state the producers
    share the machine (here: its two cores) with the consumer and the server, so the
    fractions of the steady-state scenario are taken of this measured maximum."""
    config = sizes_of(bench.config, Sizes)
    bench.log(
        f"  sustained maximum: {config.capacity_steps} bisection steps of "
        f"{config.capacity_seconds:g}s per system"
    )
    capacity: dict[str, Any] = {}
    maxima: dict[str, float] = {}
    for name in (AIO, PGQ):
        drain = drain_rate(bench, name)
        low, high = 0.0, drain
        probes: list[dict[str, Any]] = []
        for _ in range(config.capacity_steps):
            rate = (low + high) / 2
            run = await steady_once(
                bench,
                bench.systems[name],
                None,
                rate,
                seconds=config.capacity_seconds,
                catch_up_timeout=2.0,  # more than the 1 s "keeps up" allows
            )
            # the producers share the machine: a rate they could not offer is not
            # a rate the system sustained; nor is one whose backlog (so latency) grew
            # through the window, even if it caught up within a second at the end
            sustained = (
                run["keeps_up"]
                and run["achieved_offered_rate"] >= 0.95 * rate
                and not latency_grew(run["latency_series"])
            )
            probes.append(
                {
                    "offered_rate": run["offered_rate"],
                    "achieved_offered_rate": run["achieved_offered_rate"],
                    "keeps_up": run["keeps_up"],
                    "sustained": sustained,
                    "p50_ms": run["latency_ms"].get("p50"),
                    "p99_ms": run["latency_ms"].get("p99"),
                }
            )
            if sustained:
                low = rate
            else:
                high = rate
        # nothing kept up: fall back to the lowest rate tried rather than zero
        maxima[name] = low or min(p["offered_rate"] for p in probes)
        capacity[name] = {
            "drain_max": round(drain, 1),
            "sustained_max": round(maxima[name], 1),
            "probes": probes,
        }
        bench.log(f"  {name:9} sustained maximum {maxima[name]:,.0f}/s (drain {drain:,.0f}/s)")
    bench.results["capacity"] = capacity
    return maxima


async def floor(admin_dsn: str, database: str, *, samples: int, gap: float) -> dict[str, Any]:
    """Each quantity ``samples`` times, in a scratch database dropped afterwards."""
    dsn = await recreate_database(admin_dsn, database)
    try:
        return await _measure(dsn, samples, gap)
    finally:
        await drop_database(admin_dsn, database)


async def _measure(dsn: str, samples: int, gap: float) -> dict[str, Any]:
    times: dict[str, list[float]] = {
        "select1_warm": [],
        "select1_idle": [],
        "write_idle": [],
        "heard_idle": [],
        "chain_idle": [],
    }
    conn = await asyncpg.connect(dsn)
    listener = await asyncpg.connect(dsn)
    worker = await asyncpg.connect(dsn)
    heard: asyncio.Queue[float] = asyncio.Queue()
    written: asyncio.Queue[tuple[float, float]] = asyncio.Queue()

    async def write_when_heard() -> None:
        while True:
            at = await heard.get()
            await worker.execute("INSERT INTO floor_rows DEFAULT VALUES")
            written.put_nowait((at, time.perf_counter()))

    writer = asyncio.create_task(write_when_heard())
    try:
        await conn.execute("CREATE TABLE floor_rows (id bigint GENERATED ALWAYS AS IDENTITY)")
        await listener.add_listener(_CHANNEL, lambda *_: heard.put_nowait(time.perf_counter()))
        for _ in range(samples):
            await conn.fetchval("SELECT 1")  # back to back: the first is only warm-up
            started = time.perf_counter()
            await conn.fetchval("SELECT 1")
            times["select1_warm"].append(time.perf_counter() - started)

            await asyncio.sleep(gap)
            started = time.perf_counter()
            await conn.fetchval("SELECT 1")
            times["select1_idle"].append(time.perf_counter() - started)

            await asyncio.sleep(gap)
            started = time.perf_counter()
            await conn.execute("INSERT INTO floor_rows DEFAULT VALUES")
            times["write_idle"].append(time.perf_counter() - started)

            await asyncio.sleep(gap)
            async with conn.transaction():
                await conn.execute("INSERT INTO floor_rows DEFAULT VALUES")
                await conn.execute("SELECT pg_notify($1, '')", _CHANNEL)
                committing = time.perf_counter()
            at, done = await asyncio.wait_for(written.get(), 10)
            times["heard_idle"].append(at - committing)
            times["chain_idle"].append(done - committing)
    finally:
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        for c in (worker, listener, conn):
            await c.close()
    out: dict[str, Any] = {"samples": samples, "gap_s": gap}
    out.update({name: summarize_ms(values) for name, values in times.items()})
    return out


def capacity_section(results: dict[str, Any]) -> list[str]:
    capacity = results.get("capacity", {})
    if not capacity:
        return []
    lines = table(
        "Sustained maximum (producers on the same machine; bisection per system)",
        "| system | drain max/s | sustained max/s "
        "| probes: offered/s (achieved) → sustained, p50/p99 ms |",
        "|---|---:|---:|---|",
    )
    for name, cap in capacity.items():
        probes = "; ".join(
            f"{fmt(p['offered_rate'])} ({fmt(p['achieved_offered_rate'])}) → "
            f"{mark(p['sustained'])} {fmt(p.get('p50_ms'), 1)}/{fmt(p['p99_ms'], 1)}"
            for p in cap["probes"]
        )
        lines.append(
            f"| {name} | {fmt(cap['drain_max'])} | {fmt(cap['sustained_max'])} | {probes} |"
        )
    return lines


def section(results: dict[str, Any]) -> list[str]:
    steady = results.get("steady", [])
    if not steady:
        return []
    lines = table(
        "Steady state (paced producers; ms from the producer's COMMIT to handler start)",
        "| system | load | offered/s | p50 | p95 | p99 | p99 from BEGIN | producer tx p50 "
        "| catch-up s | keeps up |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    )
    for run in steady:
        lat = run["latency_ms"]
        load = (
            "fixed"
            if run["fraction"] is None
            else f"{run['fraction']:.0%} of {run.get('max_basis', 'drain')} max"
        )
        lines.append(
            f"| {run['system']} | {load} | {fmt(run['achieved_offered_rate'])} "
            f"| {fmt(lat.get('p50'), 1)} | {fmt(lat.get('p95'), 1)} "
            f"| {fmt(lat.get('p99'), 1)} "
            f"| {fmt(run.get('latency_from_begin_ms', {}).get('p99'), 1)} "
            f"| {fmt(run['producer_statement_ms'].get('p50'), 1)} "
            f"| {fmt(run['catch_up_s'], 2)} | {mark(run['keeps_up'])} |"
        )
    return lines


def floor_section(results: dict[str, Any]) -> list[str]:
    measured = results.get("floor")
    if not measured:
        return []
    lines = [
        "",
        f"Floor of this machine after {measured['gap_s']} s idle, {measured['samples']} samples "
        "(benchmarks/scenarios/steady.py; ms, p50 / p99): what any LISTEN-woken queue pays "
        "from a producer's COMMIT before its handler could start.",
        "",
        "| round trip | p50 | p99 |",
        "|---|---:|---:|",
    ]
    for key, what in (
        ("select1_warm", "`SELECT 1`, back to back"),
        ("select1_idle", "`SELECT 1` after the pause"),
        ("write_idle", "one-row `INSERT`, committed, after the pause"),
        ("heard_idle", "COMMIT (insert + `pg_notify`) to the notification heard"),
        ("chain_idle", "COMMIT to heard, then a one-row write on a third connection"),
    ):
        p50, p99 = measured[key].get("p50"), measured[key].get("p99")
        lines.append(f"| {what} | {fmt(p50, 2)} | {fmt(p99, 2)} |")
    return lines


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for run in results.get("steady", []):
        if run["system"] == AIO and run["fraction"] == 0.5 and run["latency_ms"].get("n"):
            p99 = run["latency_ms"]["p99"]
            basis = run.get("max_basis", "drain")
            out.append(
                target(f"steady state at 50% of {basis} max, e2e p99 (ms)", "<= 20", p99, p99 <= 20)
            )
    return out


SCENARIO = Scenario(
    "steady",
    run,
    sizes=Sizes,
    quick={"floor_samples": 10, "capacity_steps": 2, "capacity_seconds": 2.0},
    sections=((20, capacity_section), (30, section), (40, floor_section)),
    targets=((40, targets),),
)
