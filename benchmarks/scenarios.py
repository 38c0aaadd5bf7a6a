"""The six measurements, run side by side on one server, rounds alternating between
systems; every consumer runs in its own child process.

1. drain: pre-enqueued no-op events at several backlog sizes;
2. steady state: paced producers at fractions of each system's sustained maximum (the
   highest producer rate it kept up with here, found by bisection), end-to-end latency
   (producer send → handler start) and whether the consumer keeps up, then the machine's
   floor under light-load latency: round trips after an idle pause (benchmarks/floor.py);
3. idle wake-up latency: NOTIFY vs poll-only;
4. producer cost: commit rate of one-event transactions with a consumer running, the
   wake-up trigger enabled vs disabled;
5. cost of history: drain with ``done`` rows in the table vs none, and the claim plan;
6. consumer RSS over the largest drain;
7. producer throughput per driver path (asyncpg, SQLAlchemy, psycopg, psycopg2, Django):
   one-event transactions on 8 connections, no consumer (benchmarks/drivers.py);
8. cost of observability: drain with Prometheus metrics on vs off, with tracing (SDK, a
   no-op exporter; every event sampled, or one in ten) vs off, and with opentelemetry-api
   but no SDK vs OpenTelemetry not importable; events carry a ``traceparent`` header in
   every variant; rates and consumer CPU per event;
9. ordered delivery and topic isolation (benchmarks/ordering_isolation.py);
10. flow control: fairness beside a paused or limited backlog, and the cost of limits
    that do not bind (benchmarks/flow.py);
11. references: the bare asyncpg loop, PgQueuer, awa-pg and procrastinate beside
    aiooutbox, CPU per event of client and server (benchmarks/references.py);
12. the producer's tax beside three baseline consumers, the trigger taken apart
    (benchmarks/producer_tax.py);
13. history at scale with the default retention (benchmarks/retention.py; only with
    --only retention: 10M rows by default).
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from aiooutbox import OutboxError

from . import (
    aiooutbox_runner,
    dashboard,
    floor,
    flow,
    ordering_isolation,
    pgqueuer_runner,
    producer_tax,
    references,
    retention,
)
from .common import BackendCpu, child_process, free_connections, median, ratio, summarize_ms

AIO = aiooutbox_runner.NAME
PGQ = pgqueuer_runner.NAME

Log = Callable[[str], None]


@dataclass
class Config:
    """Every size and duration of a run; `default`, `quick` and the smoke test differ."""

    drain_sizes: list[int] = field(default_factory=lambda: [50_000, 200_000, 1_000_000])
    drain_rounds: dict[int, int] = field(
        default_factory=lambda: {50_000: 5, 200_000: 2, 1_000_000: 1}
    )
    pgqueuer_max_drain: int = 200_000  # larger backlogs take PgQueuer minutes; --full runs them
    tune: bool = True
    tune_size: int = 50_000
    aiooutbox_candidates: list[dict[str, Any]] = field(
        default_factory=lambda: [
            {"concurrency": 200, "pool_size": 4},
            {"concurrency": 500, "pool_size": 6},
            {"concurrency": 500, "pool_size": 6, "prefetch": 1500},
            {"concurrency": 1000, "pool_size": 8},
        ]
    )
    pgqueuer_candidates: list[dict[str, Any]] = field(
        default_factory=lambda: [
            {"workers": 1, "batch_size": 100},
            {"workers": 5, "batch_size": 100},
            {"workers": 10, "batch_size": 50},
        ]
    )
    aiooutbox_settings: dict[str, Any] = field(
        default_factory=lambda: dict(aiooutbox_runner.DEFAULT_SETTINGS)
    )
    pgqueuer_settings: dict[str, Any] = field(
        default_factory=lambda: dict(pgqueuer_runner.DEFAULT_SETTINGS)
    )
    steady_fractions: list[float] = field(default_factory=lambda: [0.5, 0.9])
    # "sustained": fractions of the highest producer rate the system kept up with, with
    # the producers on the same machine (bisection between 0 and its drain rate);
    # "drain": fractions of its drain rate with nothing else running
    steady_max: str = "sustained"
    capacity_steps: int = 5
    capacity_seconds: float = 6.0
    # the same offered load for both systems, for a like-for-like latency comparison
    steady_rates: list[float] = field(default_factory=lambda: [4000.0])
    steady_seconds: float = 15.0
    steady_producers: int = 4
    steady_tick: float = 0.01
    # the machine's floor under light-load latency (benchmarks/floor.py): samples, and
    # the idle pause before each
    floor_samples: int = 40
    floor_gap: float = 0.2
    catch_up_timeout: float = 15.0
    wakeup_samples: int = 60
    wakeup_gap: tuple[float, float] = (0.15, 0.35)
    poll_only_interval: float = 1.0
    producer_levels: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    producer_seconds: float = 2.0
    producer_rounds: int = 4
    driver_connections: int = 8
    driver_seconds: float = 1.5
    history_rows: int = 1_000_000
    history_drain: int = 50_000
    history_rounds: int = 3
    observe_size: int = 50_000
    observe_rounds: int = 5
    # ordering (issue 12): keyed vs unordered, one key, one blocked key
    ordering_size: int = 50_000
    ordering_keys: int = 10_000
    ordering_one_key: int = 20_000
    ordering_rounds: int = 5
    blocked_backlog: int = 1_000_000
    blocked_others: int = 20_000
    blocked_keys: int = 4_000
    blocked_rounds: int = 5
    # isolation (issue 16): a backlog of a topic nobody consumes
    isolation_backlog: int = 1_000_000
    isolation_size: int = 20_000
    isolation_rounds: int = 5
    isolation_topics: int = 50
    isolation_per_topic: int = 10
    isolation_topic_rounds: int = 5
    multi_processes: int = 4
    multi_size: int = 50_000
    multi_rounds: int = 3
    # flow control (issue 26): beside a paused / limited backlog; limits not binding
    flow_backlog: int = 1_000_000
    flow_size: int = 20_000
    flow_rounds: int = 5
    # references (benchmarks/references.py): the bare loop, PgQueuer, awa-pg, procrastinate
    references_size: int = 50_000
    references_sizes: dict[str, int] = field(
        default_factory=lambda: {"awa": 20_000, "procrastinate": 3_000}
    )
    references_rounds: int = 5
    references_only: list[str] | None = None  # systems to run (None: every one)
    # the producer's tax (benchmarks/producer_tax.py)
    tax_levels: list[int] = field(default_factory=lambda: [32])
    tax_rounds: int = 6
    tax_probe_inserts: int = 3_000
    tax_probe_rounds: int = 6
    tax_probe_load_rounds: int = 6
    # history at scale and retention (benchmarks/retention.py)
    retention_rows: int = 10_000_000
    retention_drain: int = 50_000
    retention_rounds: int = 3
    retention_stats_repeat: int = 3
    retention_purge_batches: int = 50
    retention_purge_rounds: int = 5
    light_rates: list[float] = field(default_factory=lambda: [50.0, 5.0])
    light_seconds: float = 20.0
    sample_interval: float = 0.5
    settle: float = 0.5  # pause after a consumer starts, before producers do
    patch: str | None = None  # Python file each aiooutbox consumer child runs first
    sql_patch: str | None = None  # SQL run on aiooutbox's databases after migrating
    scenarios: list[str] = field(
        default_factory=lambda: [
            "drain",
            "history",
            "steady",
            "wakeup",
            "producers",
            "drivers",
            "observe",
            "ordering",
            "isolation",
            "flow",
            "references",
            "tax",
        ]
    )
    # the relay scenario (benchmarks/relay.py; needs the machine's NATS and RabbitMQ)
    relay_events: int = 20_000
    relay_rounds: int = 5
    relay_latency_rate: float = 2000.0
    relay_latency_seconds: float = 10.0
    # the dashboard scenario (benchmarks/dashboard.py; only with --only dashboard)
    dashboard_done: int = 9_000_000
    dashboard_pending: int = 1_000_000
    dashboard_repeat: int = 5
    dashboard_drain: int = 200_000
    dashboard_rounds: int = 8
    dashboard_browsers: int = 4

    @classmethod
    def quick(cls) -> Config:
        return cls(
            drain_sizes=[5_000, 20_000],
            drain_rounds={5_000: 2, 20_000: 1},
            tune=False,
            steady_seconds=4.0,
            floor_samples=10,
            capacity_steps=2,
            capacity_seconds=2.0,
            wakeup_samples=15,
            producer_levels=[1, 8, 32],
            producer_seconds=1.5,
            producer_rounds=1,
            driver_seconds=1.0,
            relay_events=5_000,
            relay_rounds=2,
            relay_latency_seconds=3.0,
            dashboard_done=200_000,
            dashboard_pending=20_000,
            dashboard_repeat=2,
            dashboard_drain=20_000,
            dashboard_rounds=2,
            references_size=5_000,
            references_sizes={"awa": 2_000, "procrastinate": 300},
            references_rounds=1,
            tax_rounds=2,
            tax_probe_inserts=1_000,
            tax_probe_rounds=2,
            tax_probe_load_rounds=1,
            retention_rows=200_000,
            retention_drain=5_000,
            retention_rounds=1,
            retention_purge_batches=10,
            history_rows=100_000,
            history_drain=5_000,
            history_rounds=1,
            observe_size=20_000,
            observe_rounds=3,
            ordering_size=10_000,
            ordering_keys=2_000,
            ordering_one_key=5_000,
            ordering_rounds=1,
            blocked_backlog=50_000,
            blocked_others=5_000,
            blocked_keys=1_000,
            blocked_rounds=1,
            isolation_backlog=50_000,
            isolation_size=5_000,
            isolation_rounds=1,
            isolation_topic_rounds=2,
            multi_size=10_000,
            multi_rounds=1,
            flow_backlog=50_000,
            flow_size=5_000,
            flow_rounds=1,
            light_seconds=4.0,
            sample_interval=0.2,
        )

    @classmethod
    def full(cls) -> Config:
        config = cls(pgqueuer_max_drain=10**9)
        config.drain_rounds = {50_000: 7, 200_000: 3, 1_000_000: 2}
        return config


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}s"


def _load(fraction: float | None) -> str:
    return f"{fraction:.0%} of max" if fraction is not None else "fixed rate"


def latency_grew(series: list[list[float]]) -> bool:
    """Whether the median latency in the last third of a run's 0.5 s windows is more
    than twice (plus 10 ms) that of the first third: a backlog building up."""
    p50s = [row[1] for row in series if row[3]]
    if len(p50s) < 3:
        return False
    third = len(p50s) // 3
    return median(p50s[-third:]) > 2 * median(p50s[:third]) + 10.0


def _git_state() -> str:
    """Where the aiooutbox under test came from: its git commit, and local edits."""
    import subprocess

    import aiooutbox

    package = Path(aiooutbox.__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=package, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "."], cwd=package, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit, dirty = "", ""
    if not commit:
        return f"aiooutbox from {package} (not a git checkout)"
    return f"{commit}{' + uncommitted changes in aiooutbox/' if dirty else ''}"


class Bench:
    """One benchmark run against one server; `run` returns the results document."""

    def __init__(self, admin_dsn: str, config: Config, *, prefix: str = "bench_", log: Log = print):
        self.admin_dsn = admin_dsn
        self.config = config
        self.prefix = prefix
        self.log = log
        sql_patch = config.sql_patch
        self.systems: dict[str, Any] = {
            AIO: aiooutbox_runner.System(admin_dsn, prefix + "aiooutbox", sql_patch=sql_patch),
            PGQ: pgqueuer_runner.System(admin_dsn, prefix + "pgqueuer"),
        }
        self.history = aiooutbox_runner.System(
            admin_dsn, prefix + "aiooutbox_history", sql_patch=sql_patch
        )
        self.settings: dict[str, dict[str, Any]] = {
            AIO: dict(config.aiooutbox_settings),
            PGQ: dict(config.pgqueuer_settings),
        }
        self.results: dict[str, Any] = {}
        # databases a scenario created for itself (fixtures kept across its rounds)
        self.extra_systems: list[Any] = []

    # -- helpers ---------------------------------------------------------------------
    def _spec(
        self, system: Any, mode: str, settings: dict[str, Any], **extra: Any
    ) -> dict[str, Any]:
        spec = {
            "system": system.name,
            "mode": mode,
            "dsn": system.dsn,
            "settings": settings,
            "sample_interval": self.config.sample_interval,
            **extra,
        }
        if self.config.patch and system.name == AIO:
            spec["patch"] = self.config.patch
        return spec

    async def drain_once(
        self,
        system: Any,
        n: int,
        settings: dict[str, Any] | None = None,
        *,
        label: str = "",
        traceparent: bool = False,
        loader: Callable[[], Awaitable[None]] | None = None,
    ) -> dict[str, Any]:
        """Reset, load ``n`` events (with ``loader``, if given), drain them in a child;
        verify every one finished."""
        settings = settings or self.settings[system.name]
        await system.reset()
        if loader is not None:
            await loader()
        elif traceparent:
            await system.load(n, traceparent=True)
        else:
            await system.load(n)
        spec = self._spec(system, "drain", settings, n=n)
        async with child_process(spec) as child, BackendCpu(self.admin_dsn, system.database) as cpu:
            await child.wait_ready()
            result = await child.result(timeout=max(120.0, n / 500))
        finished = await system.finished()
        rss = [s[2] for s in result["rss"]]
        run = {
            "system": system.name,
            "size": n,
            "settings": settings,
            "rate": round(result["rate"], 1),
            "elapsed_s": round(result["elapsed"], 3),
            "client_cpu_s": result["cpu_s"],
            # to the last handler and the CPU until then, startup and shutdown left out
            "to_last_s": round(result["t_last"] - result["t_start"], 4),
            "drain_cpu_s": result.get("drain_cpu_s"),
            "db_cpu_s": cpu.seconds,
            "finished": finished,
            "rss_max_mb": round(max(rss), 1),
            "rss": result["rss"],
        }
        if finished != n:
            run["error"] = f"{finished} of {n} events finished"
        self.log(
            f"  {label}{system.name:9} drain {n:>8,}: {run['rate']:>9,.0f}/s "
            f"({run['elapsed_s']:.2f}s, client cpu {run['client_cpu_s']:.2f}s, "
            f"db cpu {_seconds(run['db_cpu_s'])}){' ' + run['error'] if 'error' in run else ''}"
        )
        return run

    # -- the run ---------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        started = time.time()
        self.results["meta"] = await self.meta()
        self.results["config"] = asdict(self.config)
        self.log("setting up databases")
        for system in self.systems.values():
            await system.setup()
        scenarios = self.config.scenarios
        try:
            if self.config.tune and "drain" in scenarios:
                await self.tune()
            self.results["settings"] = {k: dict(v) for k, v in self.settings.items()}
            steps: dict[str, Callable[[], Awaitable[None]]] = {
                "drain": self.drain,
                "history": self.cost_of_history,
                "steady": self.steady_state,
                "wakeup": self.wakeup,
                "producers": self.producer_cost,
                "drivers": self.driver_throughput,
                "observe": self.cost_of_observing,
                "relay": self.relay,
                "dashboard": functools.partial(dashboard.run, self),
                "dashboard-drain": functools.partial(dashboard.drain_only, self),
                "ordering": functools.partial(ordering_isolation.ordering, self),
                "isolation": functools.partial(ordering_isolation.isolation, self),
                "flow": functools.partial(flow.flow, self),
                "references": functools.partial(references.run, self),
                "tax": functools.partial(producer_tax.run, self),
                "retention": functools.partial(retention.run, self),
            }
            for name in scenarios:
                await steps[name]()
            self.results["rss"] = self.rss_summary()
        finally:
            self.results["meta"]["duration_s"] = round(time.time() - started, 1)
            self.results["meta"]["loadavg_end"] = list(os.getloadavg())
        return self.results

    async def cleanup(self) -> None:
        from .common import drop_database

        for system in [*self.systems.values(), self.history, *self.extra_systems]:
            await drop_database(self.admin_dsn, system.database)

    async def meta(self) -> dict[str, Any]:
        import importlib.metadata as md

        import psutil

        conn = await asyncpg.connect(self.admin_dsn)
        try:
            version = await conn.fetchval("SELECT version()")
            names = [
                "shared_buffers", "synchronous_commit", "fsync", "wal_level", "max_wal_size",
                "checkpoint_timeout", "work_mem", "autovacuum", "max_connections", "jit",
                "random_page_cost", "effective_io_concurrency",
            ]  # fmt: skip
            rows = await conn.fetch(
                "SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY($1)",
                names,
            )
        finally:
            await conn.close()

        def version_of(name: str) -> str:
            try:
                return md.version(name)
            except md.PackageNotFoundError:
                return "?"

        return {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": " ".join(["python", "-m", "benchmarks", *sys.argv[1:]]),
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
                "python": platform.python_version(),
                "loadavg_start": list(os.getloadavg()),
            },
            "postgresql": {"version": version, "settings": {r[0]: r[1] for r in rows}},
            "packages": {
                name: version_of(name) for name in ("aiooutbox", "pgqueuer", "asyncpg", "orjson")
            },
            "source": _git_state(),
            "patch": self.config.patch,
            "sql_patch": self.config.sql_patch,
        }

    # -- 0. settings -----------------------------------------------------------------
    async def tune(self) -> None:
        """One drain per candidate setting at the tune size; keep each system's best."""
        n = self.config.tune_size
        self.log(f"tuning: one drain of {n:,} per candidate setting")
        tried: list[dict[str, Any]] = []
        candidates = {AIO: self.config.aiooutbox_candidates, PGQ: self.config.pgqueuer_candidates}
        best: dict[str, tuple[float, dict[str, Any]]] = {}
        for i in range(max(len(c) for c in candidates.values())):
            for name in (AIO, PGQ) if i % 2 == 0 else (PGQ, AIO):
                if i >= len(candidates[name]):
                    continue
                settings = candidates[name][i]
                run = await self.drain_once(self.systems[name], n, settings, label="tune ")
                tried.append({k: v for k, v in run.items() if k != "rss"})
                if "error" not in run and run["rate"] > best.get(name, (0.0, {}))[0]:
                    best[name] = (run["rate"], settings)
        for name, (_, settings) in best.items():
            self.settings[name] = dict(settings)
        self.results["tuning"] = tried
        self.log(f"  chosen: {self.settings}")

    # -- 1. drain --------------------------------------------------------------------
    async def drain(self) -> None:
        self.log("drain throughput")
        runs: list[dict[str, Any]] = []
        smallest = self.config.drain_sizes[0]
        for n in self.config.drain_sizes:
            for r in range(self.config.drain_rounds.get(n, 1)):
                # at the smallest size also aiooutbox at its defaults (OutboxConsumer(pool)
                # on asyncpg's default pool), the order rotating by round
                order: list[tuple[str, dict[str, Any] | None]] = [(AIO, None), (PGQ, None)]
                if n == smallest:
                    order.append((AIO, {"defaults": True}))
                shift = r % len(order)
                for name, settings in order[shift:] + order[:shift]:
                    if name == PGQ and n > self.config.pgqueuer_max_drain:
                        continue
                    label = f"r{r + 1} " + ("defaults " if settings else "")
                    run = await self.drain_once(self.systems[name], n, settings, label=label)
                    if settings:
                        run["variant"] = "defaults"
                    runs.append(run)
        summary: dict[str, Any] = {}
        for n in self.config.drain_sizes:
            row: dict[str, Any] = {}
            for name in (AIO, PGQ):
                rates = [
                    x["rate"]
                    for x in runs
                    if x["system"] == name and x["size"] == n and "variant" not in x
                ]
                row[name] = round(median(rates), 1) if rates else None
                row[f"{name}_rounds"] = len(rates)
            row["ratio"] = round(ratio(row[AIO], row[PGQ]), 3) if row[AIO] and row[PGQ] else None
            at_defaults = [x["rate"] for x in runs if x["size"] == n and "variant" in x]
            if at_defaults:
                row[f"{AIO}_defaults"] = round(median(at_defaults), 1)
                row["defaults_ratio"] = (
                    round(ratio(row[f"{AIO}_defaults"], row[PGQ]), 3) if row[PGQ] else None
                )
            summary[str(n)] = row
        self.results["drain"] = {"runs": runs, "summary": summary}

    def drain_rate(self, name: str) -> float:
        """Median drain rate of ``name`` at the smallest size (its measured max)."""
        summary = self.results.get("drain", {}).get("summary", {})
        if summary:
            first = summary[str(self.config.drain_sizes[0])]
            if first.get(name):
                return float(first[name])
        return 5000.0

    # -- 2. steady state ---------------------------------------------------------------
    async def steady_state(self) -> None:
        self.log("steady state: paced producers, end-to-end latency")
        out: list[dict[str, Any]] = []
        maxima = {name: self.drain_rate(name) for name in self.systems}
        if self.config.steady_fractions and self.config.steady_max == "sustained":
            maxima = await self.sustained_maxima()
        loads: list[tuple[float | None, float | None]] = [
            (fraction, None) for fraction in self.config.steady_fractions
        ]
        loads += [(None, rate) for rate in self.config.steady_rates]
        for i, (fraction, rate) in enumerate(loads):
            for name in (AIO, PGQ) if i % 2 == 0 else (PGQ, AIO):
                offered = rate if rate is not None else (fraction or 1.0) * maxima[name]
                run = await self.steady_once(self.systems[name], fraction, offered)
                if fraction is not None:
                    run["max_basis"] = self.config.steady_max
                    run["max_rate"] = round(maxima[name], 1)
                out.append(run)
        self.results["steady"] = out
        config = self.config
        self.results["floor"] = measured = await floor.measure(
            self.admin_dsn,
            self.prefix + "floor",
            samples=config.floor_samples,
            gap=config.floor_gap,
        )
        chain, idle, warm = (
            measured[key]["p50"] for key in ("chain_idle", "select1_idle", "select1_warm")
        )
        self.log(
            f"  floor after {config.floor_gap}s idle: COMMIT -> notification -> one-row write "
            f"p50 {chain} ms; SELECT 1 {idle} ms (back to back {warm} ms)"
        )

    async def sustained_maxima(self) -> dict[str, float]:
        """Bisect, per system, for the highest producer rate it keeps up with.

        "Max" as a drain rate assumes nothing else runs; in a steady state the producers
        share the machine (here: its two cores) with the consumer and the server, so the
        fractions of the steady-state scenario are taken of this measured maximum."""
        config = self.config
        self.log(
            f"  sustained maximum: {config.capacity_steps} bisection steps of "
            f"{config.capacity_seconds:g}s per system"
        )
        capacity: dict[str, Any] = {}
        maxima: dict[str, float] = {}
        for name in (AIO, PGQ):
            drain = self.drain_rate(name)
            low, high = 0.0, drain
            probes: list[dict[str, Any]] = []
            for _ in range(config.capacity_steps):
                rate = (low + high) / 2
                run = await self.steady_once(
                    self.systems[name],
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
            self.log(f"  {name:9} sustained maximum {maxima[name]:,.0f}/s (drain {drain:,.0f}/s)")
        self.results["capacity"] = capacity
        return maxima

    async def steady_once(
        self,
        system: Any,
        fraction: float | None,
        rate: float,
        *,
        seconds: float | None = None,
        catch_up_timeout: float | None = None,
    ) -> dict[str, Any]:
        """Producers at ``rate`` events/s (``fraction`` of the system's maximum, if set)."""
        config = self.config
        seconds = config.steady_seconds if seconds is None else seconds
        if catch_up_timeout is None:
            catch_up_timeout = config.catch_up_timeout
        await system.reset()
        spec = self._spec(system, "serve", self.settings[system.name], latency=True)
        async with child_process(spec) as child:
            await child.wait_ready()
            await asyncio.sleep(config.settle)
            async with BackendCpu(self.admin_dsn, system.database) as cpu:
                produced, statement, committing = await self.paced_producers(system, rate, seconds)
            t_stop = time.time()
            # a consumer that fell far behind gets a bounded time to catch up
            child.send(
                stop_after=produced,
                timeout=catch_up_timeout,
                committing=list(committing.items()),
            )
            result = await child.result(timeout=catch_up_timeout + 60)
        catch_up = max(0.0, result["t_last"] - t_stop) if result["handled"] else None
        run = {
            "system": system.name,
            "fraction": fraction,
            "offered_rate": round(rate, 1),
            "achieved_offered_rate": round(produced / seconds, 1),
            "produced": produced,
            "handled": result["handled"],
            # from the producer sending COMMIT to the handler starting
            "latency_ms": result.get("latency_from_commit", {}),
            # from before the producer's BEGIN: adds its BEGIN and INSERT round trips
            "latency_from_begin_ms": result.get("latency", {}),
            "producer_statement_ms": statement,
            "catch_up_s": round(catch_up, 3) if catch_up is not None else None,
            "keeps_up": bool(
                result["handled"] >= produced
                and catch_up is not None
                and catch_up <= 1.0
                and not result.get("timed_out")
            ),
            "client_cpu_s": result["cpu_s"],
            # producers' and consumer's backends together, while producers ran
            "db_cpu_s": cpu.seconds,
            "latency_series": result.get("latency_series", []),
        }
        if result["handled"] and not run["latency_ms"].get("n"):
            run["error"] = "the consumer reported no latencies from COMMIT"
        lat = run["latency_ms"]
        self.log(
            f"  {system.name:9} {_load(fraction)} = {rate:,.0f}/s: p50 {lat.get('p50')} ms, "
            f"p95 {lat.get('p95')} ms, p99 {lat.get('p99')} ms, catch-up {run['catch_up_s']}s, "
            f"keeps up: {run['keeps_up']}; db cpu {_seconds(run['db_cpu_s'])}"
        )
        return run

    async def paced_producers(
        self, system: Any, rate: float, seconds: float
    ) -> tuple[int, dict[str, float], dict[float, float]]:
        """Open-loop producers: each tick, insert what the schedule says is due, in one
        transaction through the system's own batch API. Returns the count, the
        transactions' durations, and when each batch's COMMIT was sent (by send time)."""
        producers = self.config.steady_producers
        tick = self.config.steady_tick
        per = rate / producers
        conns = [await system.connect() for _ in range(producers)]
        statement: list[float] = []
        committing: dict[float, float] = {}
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def produce(index: int, conn: asyncpg.Connection) -> int:
            sent = 0
            await asyncio.sleep(tick * index / producers)
            while True:
                elapsed = loop.time() - t0
                if elapsed >= seconds:
                    break
                due = int(per * elapsed) - sent
                if due > 0:
                    t = time.time()
                    committing[t] = await system.produce_many(conn, due, t)
                    statement.append(time.time() - t)
                    sent += due
                # to the next tick, or later when the next event is due later: at light
                # rates a producer that woke every tick for nothing (400 times a second
                # for 5 events) loaded the two cores it measures on
                now = loop.time() - t0
                next_due = (sent + 1) / per
                await asyncio.sleep(max(tick - now % tick, next_due - now))
            return sent

        try:
            counts = await asyncio.gather(*(produce(i, c) for i, c in enumerate(conns)))
        finally:
            for conn in conns:
                await conn.close()
        return sum(counts), summarize_ms(statement), committing

    # -- 3. idle wake-up -------------------------------------------------------------
    async def wakeup(self) -> None:
        self.log("idle wake-up latency")
        aio = self.systems[AIO]
        modes = [
            ("aiooutbox_notify", aio, self.settings[AIO]),
            (
                "aiooutbox_poll_only",
                aio,
                {
                    **self.settings[AIO],
                    "listen": False,
                    "poll_interval": self.config.poll_only_interval,
                },
            ),
            ("pgqueuer_notify", self.systems[PGQ], self.settings[PGQ]),
        ]
        out: dict[str, Any] = {}
        for label, system, settings in modes:
            out[label] = await self.wakeup_once(system, settings)
            lat = out[label]["latency_ms"]
            self.log(
                f"  {label:20} p50 {lat.get('p50')} ms, p95 {lat.get('p95')} ms, "
                f"p99 {lat.get('p99')} ms (n={lat.get('n')})"
            )
        self.results["wakeup"] = out

    async def wakeup_once(self, system: Any, settings: dict[str, Any]) -> dict[str, Any]:
        config = self.config
        await system.reset()
        spec = self._spec(system, "serve", settings, latency=True, raw=True)
        rng = random.Random(7)
        statement: list[float] = []
        committing: dict[float, float] = {}
        async with child_process(spec) as child:
            await child.wait_ready()
            await asyncio.sleep(config.settle)  # let it go idle
            conn = await system.connect()
            try:
                for _ in range(config.wakeup_samples):
                    await asyncio.sleep(rng.uniform(*config.wakeup_gap))
                    t = time.time()
                    committing[t] = await system.produce_one(conn, t)
                    statement.append(time.time() - t)
            finally:
                await conn.close()
            child.send(stop_after=config.wakeup_samples, timeout=config.poll_only_interval * 2 + 10)
            result = await child.result(timeout=60)
        from_commit = [began - committing[sent] for sent, began in result.get("raw", [])]
        return {
            "settings": settings,
            # from the producer sending COMMIT (the event becomes visible and NOTIFY
            # goes out during that COMMIT) to the handler starting: the target's measure
            "latency_ms": summarize_ms(from_commit),
            # from before the producer's BEGIN: adds its BEGIN and INSERT round trips
            "latency_from_begin_ms": result.get("latency", {}),
            "producer_transaction_ms": summarize_ms(statement),
            "handled": result["handled"],
            "gap_s": list(config.wakeup_gap),
        }

    # -- 4. producer cost ------------------------------------------------------------
    async def producer_cost(self) -> None:
        self.log("producer cost: one-event transactions with a consumer running")
        out: dict[str, Any] = {}
        for name in (AIO, PGQ):
            out[name] = await self.producer_cost_for(self.systems[name])
        self.results["producers"] = out

    async def producer_cost_for(self, system: Any) -> dict[str, Any]:
        config = self.config
        await system.reset()
        # A short fallback poll: with the trigger disabled nothing wakes an idle consumer,
        # and one that sleeps through the window leaves the producers the whole machine;
        # that would measure "consumer paused", not the trigger. (Under load neither
        # system idles, so the poll interval changes nothing else.)
        settings = {**self.settings[system.name], **system.short_poll}
        spec = self._spec(system, "serve", settings, latency=True)
        levels: dict[str, Any] = {}
        total = 0
        async with child_process(spec) as child:
            await child.wait_ready()
            try:
                for level in config.producer_levels:
                    free = await free_connections(self.admin_dsn)
                    if free < level + 3:
                        levels[str(level)] = {"skipped": f"only {free} free connections"}
                        self.log(f"  {system.name} x{level}: skipped, {free} free connections")
                        continue
                    runs: dict[str, list[float]] = {"on": [], "off": []}
                    notes: list[float] = []
                    backlog: dict[str, list[int]] = {"on": [], "off": []}
                    for r in range(config.producer_rounds):
                        for trigger in ("on", "off") if r % 2 == 0 else ("off", "on"):
                            await system.set_wakeup_trigger(trigger == "on")
                            commits, produced, notified = await self.commit_rate(system, level)
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
                    self.log(
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

    async def commit_rate(self, system: Any, level: int) -> tuple[float, int, float]:
        """Commits per second of ``level`` connections looping one-event transactions,
        and the notifications per second they caused (counted by a LISTEN connection)."""
        conns = await asyncio.gather(*(system.connect() for _ in range(level)))
        listener = await system.connect()
        notified = 0

        def count(*_: object) -> None:
            nonlocal notified
            notified += 1

        await listener.add_listener(system.channel, count)
        done = 0
        stop = asyncio.Event()

        async def producer(conn: asyncpg.Connection) -> None:
            nonlocal done
            while not stop.is_set():
                await system.produce_one(conn, time.time())
                done += 1

        tasks = [asyncio.ensure_future(producer(c)) for c in conns]
        try:
            await asyncio.sleep(0.3)  # warm-up
            start, first, t0 = done, notified, time.perf_counter()
            await asyncio.sleep(self.config.producer_seconds)
            counted, elapsed = done - start, time.perf_counter() - t0
            notes = notified - first
            stop.set()
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            for conn in [*conns, listener]:
                await conn.close()
        return counted / elapsed, done, notes / elapsed

    # -- 4b. producer throughput per driver --------------------------------------------
    async def driver_throughput(self) -> None:
        from .drivers import DRIVERS

        config, system = self.config, self.systems[AIO]
        n = config.driver_connections
        self.log(f"producer throughput per driver: one-event transactions, {n} connections")
        out: dict[str, Any] = {}
        for driver in DRIVERS:
            await system.reset()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "benchmarks.drivers", system.dsn, driver, str(n),
                str(config.driver_seconds),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            stdout, stderr = await asyncio.wait_for(proc.communicate(), config.driver_seconds + 120)
            if proc.returncode != 0:
                last = (stderr.decode().strip().splitlines() or ["no output"])[-1]
                out[driver] = {"error": last}
                self.log(f"  {driver:26} failed: {last}")
                continue
            out[driver] = json.loads(stdout.decode().strip().splitlines()[-1])
        base = out.get("asyncpg", {}).get("commits_per_s")
        for driver, row in out.items():
            if base and "commits_per_s" in row:
                row["ratio_to_asyncpg"] = round(row["commits_per_s"] / base, 3)
                self.log(
                    f"  {driver:26} {row['commits_per_s']:>8,.0f} commits/s "
                    f"({row['ratio_to_asyncpg']:.2f} x asyncpg)"
                )
        self.results["drivers"] = out

    # -- 4c. relays -------------------------------------------------------------------
    async def relay(self) -> None:
        from . import relay

        config = self.config
        self.results["relay"] = await relay.run(
            self.admin_dsn,
            prefix=self.prefix,
            events=config.relay_events,
            rounds=config.relay_rounds,
            latency_rate=config.relay_latency_rate,
            latency_seconds=config.relay_latency_seconds,
            log=self.log,
        )

    # -- 5. cost of history ----------------------------------------------------------
    async def cost_of_history(self) -> None:
        config = self.config
        self.log(f"cost of history: {config.history_rows:,} done rows vs an empty table")
        hist = self.history
        await hist.setup()
        t = time.perf_counter()
        await hist.load(config.history_rows, history=True)
        self.log(f"  loaded history in {time.perf_counter() - t:.1f}s")
        aio = self.systems[AIO]
        await hist.reset()
        await hist.load(config.history_drain)
        try:
            explain = await hist.explain_claim()
            explain["analyze"] = (await hist.explain_claim(analyze=True))["custom_plan"]
        except OutboxError as exc:  # reading the plans needs a superuser
            explain = {"error": str(exc), "uses_index": None, "generic_plan": f"({exc})"}
            self.log(f"  claim plan not read: {exc}")
        else:
            self.log(f"  claim plan uses {explain['index']}: {explain['uses_index']}")
        runs: list[dict[str, Any]] = []
        for r in range(config.history_rounds):
            for label, system in (("empty", aio), ("history", hist))[:: 1 if r % 2 == 0 else -1]:
                run = await self.drain_once(system, config.history_drain, label=f"{label:8} ")
                run["table"] = label
                runs.append(run)
        empty = median([x["rate"] for x in runs if x["table"] == "empty"])
        history = median([x["rate"] for x in runs if x["table"] == "history"])
        self.results["history"] = {
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
        self.log(f"  history/empty = {ratio(history, empty):.2f}")

    # -- 8. cost of observability -----------------------------------------------------
    async def cost_of_observing(self) -> None:
        """Drain rate and consumer CPU per observability setting, rounds rotating the
        order; medians.

        The variants (``observe`` in the child's settings, see aiooutbox_runner):
        ``off`` no observer; ``metrics`` OutboxMetrics + ConsumerHealth + the queue
        gauges; ``tracing`` TracingObserver on an SDK provider whose exporter drops
        spans (batched, as deployed), every event's traceparent sampled;
        ``tracing_sampled`` the same with one event in ten sampled (head sampling at
        10%: the SDK's default ParentBased sampler drops the other nine); ``otel_api``
        TracingObserver on the API's no-op provider; ``otel_absent`` no observer and
        opentelemetry made unimportable. ``off`` and ``otel_absent`` run the same code
        (nothing imports opentelemetry in ``off`` either): their ratio is the A/A spread.

        The rate is the drain's events over the time to its last handler (the child's
        startup and shutdown left out); the CPU is the consumer process's, all threads
        (the span processor's included), over the same stretch.
        """
        config = self.config
        n = config.observe_size
        variants = ["off", "metrics", "tracing", "tracing_sampled", "otel_api", "otel_absent"]
        self.log(f"cost of observability: drain of {n:,}, {config.observe_rounds} round(s)")
        aio = self.systems[AIO]

        async def one_in_ten_sampled() -> None:
            await aio.insert_series(
                n,
                "topic, payload, headers",
                "'bench', jsonb_build_object('i', g), jsonb_build_object('traceparent',"
                " '00-' || md5(g::text) || '-' || left(md5(g::text || 's'), 16)"
                " || CASE WHEN g % 10 = 0 THEN '-01' ELSE '-00' END)",
            )

        runs: list[dict[str, Any]] = []
        for r in range(config.observe_rounds):
            shift = r % len(variants)
            order = variants[shift:] + variants[:shift]
            if r % 2:  # reversed too: a rotation alone keeps every variant after the same one
                order.reverse()
            for variant in order:
                settings = {**self.settings[AIO], "observe": variant}
                run = await self.drain_once(
                    aio,
                    n,
                    settings,
                    label=f"{variant:15} ",
                    traceparent=True,
                    loader=one_in_ten_sampled if variant == "tracing_sampled" else None,
                )
                run["observe"] = variant
                run["round"] = r
                run["drain_rate"] = round(n / run["to_last_s"], 1) if run["to_last_s"] else 0.0
                if run.get("drain_cpu_s") is not None:
                    run["cpu_us_per_event"] = round(run["drain_cpu_s"] / n * 1e6, 2)
                runs.append({k: v for k, v in run.items() if k != "rss"})
        ok = [x for x in runs if "error" not in x]
        rates = {v: median([x["drain_rate"] for x in ok if x["observe"] == v]) for v in variants}
        cpu = {
            v: median([x.get("cpu_us_per_event", math.nan) for x in ok if x["observe"] == v])
            for v in variants
        }
        pairs = {
            "metrics_vs_off": ("metrics", "off"),
            "tracing_vs_off": ("tracing", "off"),
            "tracing_sampled_vs_off": ("tracing_sampled", "off"),
            "otel_api_vs_absent": ("otel_api", "otel_absent"),
            "absent_vs_off": ("otel_absent", "off"),  # the same code: the A/A spread
        }

        # each round's ratio, then the median over rounds: a pair drained minutes apart
        # on a shared machine differs by the load as much as by the variant
        def paired(a: str, b: str) -> float:
            by = {(x["observe"], x["round"]): x["drain_rate"] for x in ok}
            return median(
                [
                    ratio(by[a, r], by[b, r])
                    for r in range(config.observe_rounds)
                    if (a, r) in by and (b, r) in by
                ]
            )

        ratios = {k: paired(a, b) for k, (a, b) in pairs.items()}
        # off's CPU per event over the variant's: the drain ratio the consumer's own cost
        # implies were it the only bottleneck; far less disturbed by the other processes
        # of a shared machine than a rate
        cpu_ratios = {k: ratio(cpu[b], cpu[a]) for k, (a, b) in pairs.items()}
        # the same hooks timed in this process, per event, with no database or event loop
        # in the way
        hooks = {
            v: aiooutbox_runner.hook_cost_us(v)
            for v in ("metrics", "tracing", "tracing_sampled", "otel_api")
        }
        per_event_us = 1e6 / rates["off"] if rates["off"] else math.nan
        implied = {v: per_event_us / (per_event_us + us) for v, us in hooks.items()}
        bare = aiooutbox_runner.bare_span_us()
        self.results["observe"] = {
            "size": n,
            "rounds": config.observe_rounds,
            "runs": runs,
            "rates": {k: round(v, 1) for k, v in rates.items()},
            "ratios": {k: round(v, 3) for k, v in ratios.items()},
            "cpu_us_per_event": {k: round(v, 2) for k, v in cpu.items()},
            "cpu_ratios": {k: round(v, 3) for k, v in cpu_ratios.items()},
            "hook_us_per_event": {k: round(v, 2) for k, v in hooks.items()},
            "implied_ratios": {k: round(v, 3) for k, v in implied.items()},
            "sdk_bare_span_us": round(bare, 2),
        }
        self.log("  drain ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
        self.log(
            "  CPU per event: "
            + ", ".join(f"{k} {v:.1f} us" for k, v in cpu.items())
            + f"; the SDK's bare span {bare:.1f} us"
        )
        self.log(
            "  hooks per event: "
            + ", ".join(
                f"{v} {us:.1f} us (implied ratio {implied[v]:.3f})" for v, us in hooks.items()
            )
        )

    # -- 6. RSS ----------------------------------------------------------------------
    def rss_summary(self) -> dict[str, Any]:
        """RSS of aiooutbox's consumer over its largest drain (and PgQueuer's, for scale)."""
        out: dict[str, Any] = {}
        runs = self.results.get("drain", {}).get("runs", [])
        for name in (AIO, PGQ):
            mine = [r for r in runs if r["system"] == name and "error" not in r]
            if not mine:
                continue
            run = max(mine, key=lambda r: r["size"])
            samples = run["rss"]
            warm = [s for s in samples if s[1] >= 0.1 * run["size"]] or samples
            values = [s[2] for s in warm]
            out[name] = {
                "events": run["size"],
                "start_mb": round(samples[0][2], 1),
                "warm_mb": round(values[0], 1),
                "max_mb": round(max(s[2] for s in samples), 1),
                "end_mb": round(samples[-1][2], 1),
                # growth after the first 10% of events: the "flat" check
                "growth_mb": round(max(values) - values[0], 1),
                "samples": samples,
            }
        return out
