"""One benchmark run against one server: `Bench` sets up aiooutbox's and PgQueuer's
databases, searches each system's best settings, runs the scenarios its config names
(each in its own module, `benchmarks.scenarios`) and returns the results document.

A scenario is given the Bench: its systems and settings, `drain_once` (a drain in a
consumer child, the rate and CPU of client and server), `spec` (a child's spec), and
the results it writes into. The shared measurements with producers are in `load`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from ..systems import aiooutbox_runner, pgqueuer_runner
from .config import HarnessConfig
from .cpu import BackendCpu
from .databases import drop_database
from .meta import describe
from .processes import child_process

AIO = aiooutbox_runner.NAME
PGQ = pgqueuer_runner.NAME

Log = Callable[[str], None]


def fmt_seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}s"


class Bench:
    """One benchmark run against one server; `run` returns the results document."""

    def __init__(
        self, admin_dsn: str, config: HarnessConfig, *, prefix: str = "bench_", log: Log = print
    ):
        self.admin_dsn = admin_dsn
        self.config = config
        self.prefix = prefix
        self.log = log
        sql_patch = config.sql_patch
        self.systems: dict[str, Any] = {
            AIO: aiooutbox_runner.System(admin_dsn, prefix + "aiooutbox", sql_patch=sql_patch),
            PGQ: pgqueuer_runner.System(admin_dsn, prefix + "pgqueuer"),
        }
        self.settings: dict[str, dict[str, Any]] = {
            AIO: dict(config.aiooutbox_settings),
            PGQ: dict(config.pgqueuer_settings),
        }
        self.results: dict[str, Any] = {}
        # databases a scenario created for itself (fixtures kept across its rounds)
        self.extra_systems: list[Any] = []

    def spec(
        self, system: Any, mode: str, settings: dict[str, Any], **extra: Any
    ) -> dict[str, Any]:
        """What a consumer child for ``system`` runs (`benchmarks.harness.child`)."""
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
        spec = self.spec(system, "drain", settings, n=n)
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
            f"db cpu {fmt_seconds(run['db_cpu_s'])}){' ' + run['error'] if 'error' in run else ''}"
        )
        return run

    # -- the run ---------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        started = time.time()
        self.results["meta"] = await describe(self.admin_dsn, self.config)
        self.results["config"] = asdict(self.config)
        self.log("setting up databases")
        for system in self.systems.values():
            await system.setup()
        scenarios, registry = self.config.scenarios, self.config.registry()
        try:
            if self.config.tune and "drain" in scenarios:
                await self.tune()
            self.results["settings"] = {k: dict(v) for k, v in self.settings.items()}
            for name in scenarios:
                await registry[name].run(self)
            self.results["rss"] = self.rss_summary()
        finally:
            self.results["meta"]["duration_s"] = round(time.time() - started, 1)
            self.results["meta"]["loadavg_end"] = list(os.getloadavg())
        return self.results

    async def cleanup(self) -> None:
        for system in [*self.systems.values(), *self.extra_systems]:
            await drop_database(self.admin_dsn, system.database)

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
