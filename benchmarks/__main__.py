"""``python -m benchmarks --dsn postgresql://postgres@127.0.0.1:5432/postgres [--quick]``

Creates its own databases on that server (``<prefix>aiooutbox``, ``<prefix>pgqueuer``,
``<prefix>aiooutbox_history``; ordering and isolation add ``<prefix>aiooutbox_blocked`` and
``<prefix>aiooutbox_backlog``, flow control ``<prefix>aiooutbox_flow``, the references
``<prefix>ref_<system>``, the producer's tax ``<prefix>tax``, retention
``<prefix>ret_empty`` and ``<prefix>ret_history``), runs the scenarios
and writes results.json, results.md and PNG plots to ``--out``. The DSN needs the right to
CREATE DATABASE.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from . import report
from .common import settings_argument
from .scenarios import Bench, Config

SCENARIOS = (
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
    "relay",
    "references",  # the bare loop, PgQueuer, awa-pg and procrastinate side by side
    "tax",  # the producer's tax beside three baseline consumers, the trigger taken apart
    "retention",  # only with --only: 10M done rows by default (--retention-rows)
    "dashboard",  # only with --only: it builds a 10M-row database (minutes)
    "dashboard-drain",  # only with --only: the drain with a dashboard open, alone
)
DEFAULT_OUT = Path("benchmarks/results")


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
        "--only", nargs="+", choices=SCENARIOS, help="run only these scenarios (in this order)"
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
        "--retention-rows",
        type=int,
        metavar="N",
        help="done rows beside the retention scenario's drains (default 10000000)",
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
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    if args.references_rounds is not None and args.references_rounds < 1:
        parser.error("--references-rounds must be at least 1")
    if args.retention_rows is not None and args.retention_rows < 1:
        parser.error("--retention-rows must be at least 1")
    if args.backlog is not None and args.backlog < 1:
        parser.error("--backlog must be at least 1")
    if args.aiooutbox_settings is not None:
        args.aiooutbox_settings = settings_argument(
            parser, "--aiooutbox-settings", args.aiooutbox_settings
        )
    return args


def config_from(args: argparse.Namespace) -> Config:
    config = Config.quick() if args.quick else Config.full() if args.full else Config()
    if args.only:
        config.scenarios = list(args.only)
    else:  # not in Config's default: the smoke test's Bench has no brokers to spare
        config.scenarios.append("relay")
    if args.no_tune:
        config.tune = False
    if args.backlog is not None:
        config.blocked_backlog = config.isolation_backlog = config.flow_backlog = args.backlog
    if args.retention_rows is not None:
        config.retention_rows = args.retention_rows
    config.steady_max = args.steady_max
    if args.steady_fractions is not None:
        config.steady_fractions = args.steady_fractions
    if args.steady_rates is not None:
        config.steady_rates = args.steady_rates
    if args.aiooutbox_settings is not None:
        config.aiooutbox_settings = dict(args.aiooutbox_settings)
    if args.dashboard_rounds is not None:
        config.dashboard_rounds = args.dashboard_rounds
    if args.dashboard_drain is not None:
        config.dashboard_drain = args.dashboard_drain
    if args.references_systems is not None:
        config.references_only = list(args.references_systems)
    if args.references_rounds is not None:
        config.references_rounds = args.references_rounds
    if args.patch:
        config.patch = str(args.patch.resolve())
    if args.sql_patch:
        config.sql_patch = str(args.sql_patch.resolve())
    return config


def write(results: dict[str, Any], out: Path, *, plots: bool) -> dict[str, Path]:
    """`report.write`, with the relay's Kafka and Redis Streams tables added to
    results.md (`benchmarks.relay_streams`)."""
    paths = report.write(results, out, plots=plots)
    if "relay" in results:
        from .relay_streams import markdown

        extra = markdown(results["relay"])
        if extra:  # after the other relay tables, before the run's settings
            text = paths["markdown"].read_text()
            head, mark, tail = text.partition("\n## Settings\n")
            text = head + extra + mark + tail if mark else text + extra
            paths["markdown"].write_text(text)
    return paths


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
