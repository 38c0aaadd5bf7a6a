"""``horizon`` and ``horizon-retention`` (only with ``--only``): soaks on a private
cluster of their own (`benchmarks.harness.private_server`: PostgreSQL's defaults,
autovacuum on, ``pg_stat_statements`` when the binaries have it), ``--dsn``'s server
untouched by them.

``horizon``: 3,000 events/s committed in batches of 60 every 20 ms by one producer
process, one consumer process at its defaults with a no-op handler, for
``horizon_seconds`` (30 minutes; ``--quick`` 2) in each of two modes: ``free``, and
``pinned``, where a REPEATABLE READ snapshot taken before the consumer starts is held
to the end (`benchmarks.harness.soak`: what it reads). Per minute: commit -> handler
p50 and p99 of the events handled in it, how many, the backlog at its end, the dead row
versions and the size of every outbox relation. More than one round alternates the
modes; the table shows each minute's medians.

``horizon-retention``: the same with retention on and short (consumers with
``retention=60`` seconds; 2,000 events/s), free and pinned, one row per simulated hour.
A simulated hour is ``horizon_retention_hour_rows`` events of inflow (default 10M a
day / 24 = 416,667), so at 2,000/s it lasts 208 s of real time; eight of them take 28
minutes a mode. Whether the sizes level off: the last hour's total against the
mid-run hour's.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..harness.bench import Bench
from ..harness.markdown import fmt, loads, num, target
from ..harness.private_server import private_server
from ..harness.rounds import alternated
from ..harness.scenario import Scenario, sizes_of
from ..harness.soak import Plan, describe_server, soak_once
from ..harness.stats import median, ratio

#: the targets (issue: a hot path a long transaction cannot slow)
P99_RATIO = 1.5  # last minute's pinned p99 within 1.5x of the free run's
BACKLOG_S = 1.0  # the backlog under one second of inflow
LEVEL_OFF = 1.1  # retention: last hour's total size within 10% of the mid-run hour's


@dataclass
class Sizes:
    horizon_seconds: float = 1800.0  # per mode
    horizon_period: float = 60.0  # one row
    horizon_rate: float = 3000.0
    horizon_batch: int = 60  # 3,000/s in 60-event batches: one every 20 ms
    horizon_rounds: int = 1
    horizon_holder: str = "catalog"  # what the pinned snapshot reads: catalog | outbox
    # the consumer's OutboxConsumer options ({}: its defaults)
    horizon_settings: dict[str, Any] = field(default_factory=dict)
    horizon_postgres: str | None = None  # a bin directory; default: the newest found
    horizon_pg_settings: dict[str, str] = field(default_factory=dict)  # -c name=value
    horizon_catch_up: float = 60.0  # after the producer stops
    horizon_retention_rate: float = 2000.0
    horizon_retention_batch: int = 40
    horizon_retention_keep: float = 60.0  # the consumer's retention, seconds
    horizon_retention_hours: int = 8
    horizon_retention_hour_rows: int = 416_667


def _plan(bench: Bench, config: Sizes, *, retention: bool) -> Plan:
    if retention:
        period = config.horizon_retention_hour_rows / config.horizon_retention_rate
        return Plan(
            rate=config.horizon_retention_rate,
            batch=config.horizon_retention_batch,
            seconds=period * config.horizon_retention_hours,
            period=period,
            options={**config.horizon_settings, "retention": config.horizon_retention_keep},
            catch_up=config.horizon_catch_up,
            patch=bench.config.patch,
            sql_patch=bench.config.sql_patch,
        )
    return Plan(
        rate=config.horizon_rate,
        batch=config.horizon_batch,
        seconds=config.horizon_seconds,
        period=config.horizon_period,
        options=dict(config.horizon_settings),
        catch_up=config.horizon_catch_up,
        patch=bench.config.patch,
        sql_patch=bench.config.sql_patch,
    )


async def _soak(bench: Bench, plan: Plan, rounds: int, label: str) -> dict[str, Any]:
    config = sizes_of(bench.config, Sizes)
    out: dict[str, Any] = {
        "plan": {**asdict(plan), "periods": plan.periods},
        "holder": config.horizon_holder,
        "runs": [],
    }
    async with private_server(config.horizon_postgres, config.horizon_pg_settings) as server:
        out["server"] = await describe_server(server)
        bench.log(
            f"{label}: private {out['server']['version'].split(' on ')[0]} on port "
            f"{server.port}; {plan.rate:,.0f}/s in batches of {plan.batch}, {plan.periods} "
            f"x {plan.period:.0f} s per mode, free and pinned ({config.horizon_holder})"
        )
        for r in range(rounds):
            for mode in alternated(("free", "pinned"), r):
                holder = config.horizon_holder if mode == "pinned" else None
                run = await soak_once(
                    server, f"{label.replace('-', '_')}_{mode}", plan, holder=holder, log=bench.log
                )
                run["round"] = r
                out["runs"].append(run)
    out["medians"] = {mode: medians(out["runs"], mode) for mode in ("free", "pinned")}
    return out


def medians(runs: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """Each period's medians over the mode's rounds."""
    mine = [r["periods"] for r in runs if r["mode"] == mode]
    rows = []
    for i in range(min((len(p) for p in mine), default=0)):
        at = [p[i] for p in mine]
        row: dict[str, Any] = {"minute": at[0]["minute"]}
        for key in (
            "p50",
            "p99",
            "max",
            "handled",
            "backlog",
            "dead",
            "bytes",
            "index_bytes",
            "loadavg",
        ):
            row[key] = median([a[key] for a in at if a.get(key) is not None])
        row["relations"] = {
            name: median([a["relations"].get(name, {}).get("bytes") or 0 for a in at])
            for name in at[-1]["relations"]
        }
        for part, total in (("hot", "bytes"), ("ring", "bytes"), ("hot", "dead"), ("ring", "dead")):
            key = f"{part}_{total}"
            row[key] = median(
                [v for a in at if (v := grouped(a["relations"], total)[part]) is not None]
            )
        rows.append(row)
    return rows


#: the ring of finished events (migration 0022): ``<table>_done`` and its partitions
RING = "outbox_events_done"


def grouped(rels: dict[str, dict[str, Any]], key: str) -> dict[str, int | None]:
    """``key`` (``bytes`` or ``dead``) summed over the hot table (``outbox_events``), the
    ring (``outbox_events_done`` and its slots ``_0`` to ``_7``; the one-row
    ``outbox_events_done_ring`` counts as other) and the other outbox relations; None
    when a relation's size could not be read."""
    out: dict[str, int | None] = {"hot": 0, "ring": 0, "other": 0}
    for name, rel in rels.items():
        part = (
            "hot"
            if name == "outbox_events"
            else "ring"
            if re.fullmatch(rf"{RING}(_\d+)?", name)
            else "other"
        )
        value, have = rel.get(key), out[part]
        out[part] = None if value is None or have is None else have + value
    return out


async def run(bench: Bench) -> None:
    config = sizes_of(bench.config, Sizes)
    plan = _plan(bench, config, retention=False)
    out = await _soak(bench, plan, config.horizon_rounds, "horizon")
    last = {m: (out["medians"][m] or [{}])[-1].get("p99") for m in ("free", "pinned")}
    out["summary"] = {
        "last_p99": last,
        "pinned_over_free": round(ratio(last["pinned"] or 0.0, last["free"] or 0.0), 3),
        "backlog_max_s": {
            m: round(max((r["backlog"] for r in rows), default=0) / plan.rate, 3)
            for m, rows in out["medians"].items()
        },
    }
    bench.log(f"  horizon: {out['summary']}")
    bench.results["horizon"] = out


async def run_retention(bench: Bench) -> None:
    config = sizes_of(bench.config, Sizes)
    plan = _plan(bench, config, retention=True)
    out = await _soak(bench, plan, 1, "horizon-retention")
    out["level"] = {m: level(rows) for m, rows in out["medians"].items()}
    bench.log(f"  horizon-retention: last hour / mid-run hour {out['level']}")
    bench.results["horizon_retention"] = out


def level(rows: list[dict[str, Any]]) -> float | None:
    """The last row's total size over the mid-run row's (1.0: level)."""
    if len(rows) < 2:
        return None
    return round(ratio(rows[-1]["bytes"], rows[(len(rows) - 1) // 2]["bytes"]), 3)


def _mb(value: Any) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


_CALL = re.compile(r'(?:FROM|INTO) (?:"\w+"\.)?"(\w+)"\s*(\([^)]*\))?')


def label(query: str) -> str:
    """A statement as its table or function and its number of parameters (the claim's
    variants differ only there), else its start."""
    found = _CALL.search(query)
    if found is None:
        return query[:70].replace("|", "/")
    verb = query.split(None, 1)[0].upper()
    if found[2] is not None and verb != "INSERT":  # an INSERT's are its columns
        return f"{verb} … {found[1]}({found[2].count('$')} parameters)"
    return f"{verb} … {found[1]}"


def _statements(run: dict[str, Any]) -> list[str]:
    if not run.get("statements"):
        return []
    out = [
        "",
        f"Server time by statement, {run['mode']} (round {run['round'] + 1}, pg_stat_statements):",
        "",
        "| calls | mean ms | total s | statement |",
        "|---:|---:|---:|---|",
    ]
    for s in run["statements"][:6]:
        out.append(
            f"| {s['calls']:,} | {s['mean_ms']:.2f} | {s['total_ms'] / 1000:,.1f} |"
            f" `{label(s['query'])}` |"
        )
    return out


def _run_lines(section: dict[str, Any]) -> list[str]:
    plan, server, runs = section["plan"], section["server"], section["runs"]
    reads = "the catalog" if section["holder"] == "catalog" else "every outbox table"
    catch = ", ".join(
        f"{r['mode']} r{r['round'] + 1} {r['catch_up_s']} s" + ("" if r["caught_up"] else " (not)")
        for r in runs
    )
    load = "; ".join(
        f"{r['mode']} r{r['round'] + 1} {loads(r['loadavg_start'])} -> {loads(r['loadavg_end'])}"
        for r in runs
    )
    return [
        "",
        f"- inflow {plan['rate']:,.0f} events/s in batches of {plan['batch']},"
        f" {plan['periods']} x {plan['period']:.0f} s per mode, {len(runs) // 2} round(s);"
        f" the pinned snapshot reads {reads}; consumer options"
        f" `{json.dumps(plan['options']) if plan['options'] else 'defaults'}`",
        f"- server: {server['version'].split(',')[0]}, private, `{json.dumps(server['settings'])}`",
        f"- catch-up after the producer stopped: {catch}",
        f"- load average (1/5/15 min) at each mode's start and end: {load} (a shared machine)",
    ]


def section(results: dict[str, Any]) -> list[str]:
    soak = results.get("horizon")
    if not soak:
        return []
    s = soak["summary"]
    out = [
        "",
        "## A pinned xmin horizon, minute by minute",
        "",
        f"Commit -> handler latency of the events handled in each minute (medians over "
        f"rounds), the backlog at its end, the outbox relations' dead row versions and "
        f"size. Last minute's p99: free {s['last_p99']['free']} ms, pinned "
        f"{s['last_p99']['pinned']} ms ({s['pinned_over_free']}x).",
    ]
    for mode in ("free", "pinned"):
        out += [
            "",
            f"### {mode}",
            "",
            "| minute | p50 ms | p99 ms | handled | backlog | dead versions | MB | load |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in soak["medians"][mode]:
            out.append(
                f"| {row['minute']:g} | {fmt(row['p50'], 1)} | {fmt(row['p99'], 1)} |"
                f" {fmt(row['handled'])} | {fmt(row['backlog'])} | {fmt(row['dead'])} |"
                f" {_mb(row['bytes'])} | {fmt(row['loadavg'], 1)} |"
            )
    out += _run_lines(soak)
    for mode in ("free", "pinned"):
        last = [r for r in soak["runs"] if r["mode"] == mode][-1:]
        out += _statements(last[0]) if last else []
    return out


def retention_section(results: dict[str, Any]) -> list[str]:
    soak = results.get("horizon_retention")
    if not soak:
        return []
    plan = soak["plan"]
    out = [
        "",
        "## Sizes under retention, per simulated hour",
        "",
        f"Retention {plan['options'].get('retention')} s; a simulated hour is "
        f"{plan['period'] * plan['rate']:,.0f} events ({plan['period']:.0f} s real). "
        f"Last hour's total / mid-run hour's: "
        + ", ".join(f"{m} {fmt(v, 2)}" for m, v in soak["level"].items())
        + ".",
    ]
    for mode in ("free", "pinned"):
        out += [
            "",
            f"### {mode}",
            "",
            "| hour | real min | total MB | indexes MB | hot table MB | ring MB |"
            " dead versions (hot / ring) | backlog | p99 ms | max ms |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for i, row in enumerate(soak["medians"][mode]):
            out.append(
                f"| {i + 1} | {row['minute']:g} | {_mb(row['bytes'])} |"
                f" {_mb(row.get('index_bytes'))} | {_mb(row.get('hot_bytes'))} |"
                f" {_mb(row.get('ring_bytes'))} | {fmt(row['dead'])}"
                f" ({fmt(row.get('hot_dead'))} / {fmt(row.get('ring_dead'))}) |"
                f" {fmt(row['backlog'])} | {fmt(row['p99'], 1)} | {fmt(row.get('max'), 1)} |"
            )
    out += _run_lines(soak)
    for mode in ("free", "pinned"):
        last = [r for r in soak["runs"] if r["mode"] == mode][-1:]
        out += _statements(last[0]) if last else []
    return out


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    soak = results.get("horizon")
    if soak:
        s = soak["summary"]
        value = num(s["pinned_over_free"])
        rows.append(
            target(
                f"pinned horizon: last minute's commit -> handler p99 / free run's"
                f" ({soak['plan']['seconds'] / 60:g} min a mode)",
                f"<= {P99_RATIO}",
                value,
                None if value is None else value <= P99_RATIO,
            )
        )
        for mode, seconds in s["backlog_max_s"].items():
            rows.append(
                target(
                    f"horizon soak, {mode}: largest backlog at a minute's end, in seconds"
                    " of inflow",
                    f"< {BACKLOG_S}",
                    seconds,
                    seconds < BACKLOG_S,
                )
            )
    kept = results.get("horizon_retention")
    if kept:
        for mode, level_value in kept["level"].items():
            value = num(level_value)
            rows.append(
                target(
                    f"retention soak, {mode}: total size, last simulated hour / mid-run hour",
                    f"<= {LEVEL_OFF}",
                    value,
                    None if value is None else value <= LEVEL_OFF,
                )
            )
    return rows


SCENARIO = Scenario(
    "horizon",
    run,
    sizes=Sizes,
    quick={"horizon_seconds": 120.0, "horizon_retention_hour_rows": 60_000},
    default=False,  # an hour of soaks at its defaults
    sections=((190, section),),
    targets=((190, targets),),
)
RETENTION = Scenario(
    "horizon-retention",
    run_retention,
    sizes=Sizes,
    quick={"horizon_retention_hours": 4},
    default=False,  # about an hour at its defaults
    sections=((195, retention_section),),
    targets=((190, targets),),
)
