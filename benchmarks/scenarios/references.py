"""``references``: aiooutbox beside the bare asyncpg loop (the limit), PgQueuer,
awa-pg and procrastinate, each in a fresh database and its own child process, rounds
rotated, medians.

Per drain, measured stretch = from the consumer's start (``run()`` / the worker's start)
to its last handler:

- *events/s*: the drain's events over that stretch;
- *client CPU*: the child process's CPU time (all its threads: awa's Rust runtime is in
  the process) over that stretch;
- *server CPU*: the summed utime + stime (``/proc/<pid>/stat`` via psutil) of every server
  backend connected to the system's database, polled every 20 ms from
  ``pg_stat_activity``; the child holds its connections open after the last handler until
  the parent has taken a final sample, so no backend's CPU is lost with its exit. Missed:
  a backend's CPU before its first sample (its connection start-up, < 20 ms) and work done
  outside the database's backends (WAL writer, checkpointer; the same for every system).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..harness.bench import Bench
from ..harness.cpu import BackendCpu
from ..harness.processes import child_process
from ..harness.rounds import rotated
from ..harness.scenario import Scenario, sizes_of
from ..harness.stats import median, ratio
from ..systems import aiooutbox_runner, peers, pgqueuer_runner

# label, system, settings; the first is the ratio's base
REFERENCES: list[tuple[str, str, dict[str, Any]]] = [
    ("aiooutbox, defaults", "aiooutbox", {"defaults": True}),
    ("aiooutbox, concurrency 500 / prefetch 1500 / pool 6", "aiooutbox",
     dict(aiooutbox_runner.DEFAULT_SETTINGS)),
    ("aiooutbox, batch handler of 500, concurrency 1000 / pool 6", "aiooutbox",
     {"handler_batch": 500, "concurrency": 1000, "pool_size": 6}),
    ("bare asyncpg loop, 2 connections x batch 1000", peers.BARE,
     {"connections": 2, "batch": 1000}),
    ("bare asyncpg loop, 1 connection x batch 1000", peers.BARE,
     {"connections": 1, "batch": 1000}),
    ("PgQueuer, 5 x batch 100", "pgqueuer", dict(pgqueuer_runner.DEFAULT_SETTINGS)),
    ("awa-pg, 1024 workers", peers.AWA, {"workers": 1024}),
    ("procrastinate, concurrency 100", peers.PROCRASTINATE, {"concurrency": 100}),
]  # fmt: skip


@dataclass
class Sizes:
    references_size: int = 50_000
    references_sizes: dict[str, int] = field(
        default_factory=lambda: {"awa": 20_000, "procrastinate": 3_000}
    )
    references_rounds: int = 5
    references_only: list[str] | None = None  # systems to run (None: every one)


def _system(bench: Bench, name: str) -> Any:
    database = f"{bench.prefix}ref_{name}"
    if name == "aiooutbox":
        # --sql-patch applies here too: a schema change measured against the references
        return aiooutbox_runner.System(bench.admin_dsn, database, sql_patch=bench.config.sql_patch)
    if name == "pgqueuer":
        return pgqueuer_runner.System(bench.admin_dsn, database)
    return peers.System(name, bench.admin_dsn, database)


async def drain(bench: Bench, system: Any, settings: dict[str, Any], n: int) -> dict[str, Any]:
    """Fresh database, ``n`` jobs, one drain in a child; rate and CPU per event."""
    await system.setup()
    await system.load(n)
    spec = {
        "system": system.name,
        "mode": "drain",
        "dsn": system.dsn,
        "settings": settings,
        "n": n,
        "hold": True,
        "sample_interval": 1.0,
    }
    async with child_process(spec) as child:
        async with BackendCpu(bench.admin_dsn, system.database, interval=0.02) as cpu:
            await child.wait_ready(timeout=120)
            message = await child.read()  # "reached" (or the child's error)
            if message.get("type") != "reached":
                raise RuntimeError(f"expected reached, got {message}")
            await cpu.sample_now()
        child.send(go=True)
        result = await child.result(timeout=120)
    stretch = result["t_last"] - result["t_start"]
    run: dict[str, Any] = {
        "system": system.name,
        "n": n,
        "handled": result["handled"],
        "finished": await system.finished(),
        "rate": round(n / stretch, 1) if stretch > 0 else 0.0,
        "client_us": round(result["drain_cpu_s"] / n * 1e6, 2),
        "server_us": round(cpu.seconds / n * 1e6, 2) if cpu.seconds is not None else None,
    }
    if run["finished"] is not None and run["finished"] < n:
        run["error"] = f"{run['finished']} of {n} settled"
    return run


async def run(bench: Bench) -> None:
    config = sizes_of(bench.config, Sizes)
    rows: list[dict[str, Any]] = []
    active: list[tuple[str, str, dict[str, Any]]] = []
    chosen = config.references_only
    for label, name, settings in REFERENCES:
        if chosen is not None and name not in chosen:
            continue
        absent = peers.missing(name)
        row: dict[str, Any] = {"label": label, "system": name, "settings": settings,
               "version": peers.version(name) if name in (peers.AWA, peers.PROCRASTINATE)
               else None, "runs": []}  # fmt: skip
        if absent:
            row["not_installed"] = f"pip install {absent}"
            bench.log(f"  {label}: not installed (pip install {absent}); no numbers")
        else:
            active.append((label, name, settings))
        rows.append(row)
    by_label = {row["label"]: row for row in rows}
    systems = {name: _system(bench, name) for _, name, _ in active}
    bench.extra_systems.extend(systems.values())
    bench.log(
        f"references: {config.references_size:,} events, {config.references_rounds} rounds"
        f" (smaller for the slow peers: {config.references_sizes})"
    )
    started = time.time()
    for r in range(config.references_rounds if active else 0):
        for label, name, settings in rotated(active, r, reverse_odd=True):
            n = config.references_sizes.get(name, config.references_size)
            result = await drain(bench, systems[name], settings, n)
            result["round"] = r
            by_label[label]["runs"].append(result)
            bench.log(
                f"  r{r + 1} {label:52} {result['rate']:>9,.0f}/s client "
                f"{result['client_us']:7.1f} us server {result['server_us'] or 0:7.1f} us/event"
                + (f" {result['error']}" if "error" in result else "")
            )
    base = None
    for row in rows:
        ok = [x for x in row["runs"] if "error" not in x]
        if not ok:
            continue
        row["n"] = ok[0]["n"]
        row["rate"] = round(median([x["rate"] for x in ok]), 1)
        row["rate_range"] = [min(x["rate"] for x in ok), max(x["rate"] for x in ok)]
        row["client_us"] = round(median([x["client_us"] for x in ok]), 2)
        server = [x["server_us"] for x in ok if x["server_us"] is not None]
        row["server_us"] = round(median(server), 2) if server else None
        if base is None:
            base = row["rate"]
        row["vs_defaults"] = round(ratio(row["rate"], base), 3) if base else None
    bench.results["references"] = {
        "size": config.references_size,
        "sizes": config.references_sizes,
        "rounds": config.references_rounds,
        "duration_s": round(time.time() - started, 1),
        "rows": rows,
    }


def render(section: dict[str, Any]) -> list[str]:
    out = [
        "## References",
        "",
        f"{section['size']:,} no-op events (slow peers: {section['sizes']}), each system in a"
        f" fresh database and its own process, {section['rounds']} rounds rotated, medians;"
        " rate to the last handler; CPU per event over the same stretch (client: the"
        " process, server: the database's backends).",
        "",
        "| system | events/s | range | vs aiooutbox defaults | client CPU µs/event |"
        " server CPU µs/event |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for row in section["rows"]:
        label = row["label"] + (f" ({row['version']})" if row.get("version") else "")
        if row.get("not_installed"):
            out.append(f"| {label} | not installed (`{row['not_installed']}`) | | | | |")
            continue
        if "rate" not in row:
            out.append(f"| {label} | failed | | | | |")
            continue
        low, high = row["rate_range"]
        server = f"{row['server_us']:.1f}" if row.get("server_us") is not None else "n/a"
        out.append(
            f"| {label} | {row['rate']:,.0f} | {low:,.0f}-{high:,.0f} |"
            f" {row['vs_defaults']:.2f}x | {row['client_us']:.1f} | {server} |"
        )
    out.append("")
    return out


def section(results: dict[str, Any]) -> list[str]:
    return ["", *render(results["references"])] if results.get("references") else []


SCENARIO = Scenario(
    "references",
    run,
    sizes=Sizes,
    quick={
        "references_size": 5_000,
        "references_sizes": {"awa": 2_000, "procrastinate": 300},
        "references_rounds": 1,
    },
    sections=((150, section),),
)
