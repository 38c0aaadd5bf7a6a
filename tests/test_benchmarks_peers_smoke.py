"""The references, the producer's tax and retention at scale, at tiny sizes: structure and
sanity only, no timing (the rest of the scenarios are in test_benchmarks_smoke.py; two
files so they run on two workers)."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest

from benchmarks.scenarios import Config
from tests.benchmark_smoke import LIMIT, positive, run_tiny

pytestmark = pytest.mark.timeout(LIMIT + 120)


@pytest.mark.slow  # a child process per reference
async def test_references_scenario_drains_every_installed_peer(
    pg_server: str, tmp_path: Path
) -> None:
    config = Config(
        scenarios=["references"],
        tune=False,
        references_size=300,
        references_sizes={"awa": 200, "procrastinate": 30},
        references_rounds=1,
    )
    loaded, paths = await run_tiny(pg_server, config, tmp_path)
    rows = loaded["references"]["rows"]
    assert [r["system"] for r in rows] == [
        "aiooutbox", "aiooutbox", "aiooutbox", "bare", "bare", "pgqueuer", "awa", "procrastinate"
    ]  # fmt: skip
    for row in rows:
        if row.get("not_installed"):  # an optional peer: said so, and no numbers
            assert row["system"] in ("awa", "procrastinate") and not row["runs"], row
            continue
        (run,) = row["runs"]
        assert "error" not in run and run["handled"] >= run["n"], run
        assert run["finished"] in (None, run["n"]), run
        assert positive(row["rate"]) and positive(row["client_us"]), row
        assert row["server_us"] is None or row["server_us"] >= 0, row
    assert rows[0]["vs_defaults"] == 1.0
    text = paths["markdown"].read_text()
    assert "## References" in text and "bare asyncpg loop, 2 connections" in text


async def test_references_scenario_says_when_a_peer_is_not_installed(
    pg_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks.systems import peers

    monkeypatch.setitem(peers._PACKAGES, "awa", ("no_such_module_for_awa", "awa-pg"))
    config = Config(scenarios=["references"], tune=False, references_only=["awa"])
    loaded, paths = await run_tiny(pg_server, config, tmp_path)
    (row,) = loaded["references"]["rows"]
    assert row["not_installed"] == "pip install awa-pg" and not row["runs"]
    assert "rate" not in row
    assert "not installed (`pip install awa-pg`)" in paths["markdown"].read_text()


@pytest.mark.slow  # consumer child processes
async def test_producer_tax_scenario_runs_at_tiny_sizes(pg_server: str, tmp_path: Path) -> None:
    config = Config(
        scenarios=["tax"],
        tune=False,
        producer_seconds=0.2,
        tax_levels=[2],
        tax_rounds=1,
        tax_probe_inserts=100,
        tax_probe_rounds=1,
        tax_probe_load_rounds=1,
    )
    loaded, paths = await run_tiny(pg_server, config, tmp_path)
    tax = loaded["tax"]
    assert list(tax["baselines"]) == ["none", "poll", "listen"]
    for name, base in tax["baselines"].items():
        row = base["levels"]["2"]
        assert positive(row["on"]) and positive(row["off"]) and positive(row["ratio"]), row
        # every event the producers wrote was handled by the consumer, if there was one
        assert base["handled"] == (None if name == "none" else base["produced"]), base
    from benchmarks.scenarios.tax import PROBES

    assert set(tax["probes"]["us_per_insert"]) == set(PROBES)
    assert all(positive(v) for v in tax["probes"]["us_per_insert"].values())
    assert all(positive(v) for v in tax["probes"]["commits_per_s"].values())
    # an idle consumer advertised: every commit notifies; none otherwise
    assert tax["probes"]["notifications_per_s"]["on_idle_advertised"] > 0
    assert tax["probes"]["notifications_per_s"]["on"] == 0
    assert "## Producer tax" in paths["markdown"].read_text()


@pytest.mark.slow  # consumer child processes
async def test_retention_scenario_runs_at_tiny_sizes(pg_server: str, tmp_path: Path) -> None:
    config = Config(
        scenarios=["retention"],
        tune=False,
        retention_rows=3_000,
        retention_drain=200,
        retention_rounds=1,
        retention_stats_repeat=1,
        retention_purge_batches=2,
    )
    loaded, paths = await run_tiny(pg_server, config, tmp_path)
    section = loaded["retention"]
    assert section["sizes"]["after_load"]["live_rows"] == 3_000
    # the consumer's purge statement, two batches of 1,000 rows 8 days old
    assert section["purge"]["rows"] == 2_000 and positive(section["purge"]["rows_per_s"])
    variants = [r["variant"] for r in section["runs"]]
    assert variants == ["empty", "history_no_retention", "history_retention_default"]
    for run in section["runs"]:
        assert "error" not in run and run["finished"] == 200, run
    # retention off: the 1,000 history rows left and the 200 drained ones are all there
    assert section["runs"][1]["sizes_after"]["live_rows"] == 1_200
    assert all(positive(v) for v in section["rates"].values()), section["rates"]
    assert all(positive(v) for v in section["stats_ms"].values())
    assert set(section["stats_ms"]) == {"history", "empty", "history_full_count"}
    assert section["stats_done_estimated"] is False  # 3,000 rows: counted exactly
    # after the drains the consumer's own retention rounds purged what was left, if any
    rounds = section["rounds"]
    assert rounds["rounds"] and rounds["rounds"][-1]["behind"] is False, rounds
    assert rounds["rows"] == sum(r["rows"] for r in rounds["rounds"])
    assert positive(section["purge"]["schedule_ceiling_rows_per_s"])
    text = paths["markdown"].read_text()
    assert "## History at scale and retention" in text and "Retention rounds" in text


@pytest.mark.slow  # a child process per aiooutbox reference
async def test_references_scenario_applies_the_sql_patch(
    pg_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--sql-patch`` reaches the references' aiooutbox databases, as every other
    scenario's: a schema change is measured against the bare loop in the same run."""
    from benchmarks.systems import aiooutbox_runner

    patch = tmp_path / "marker.sql"
    patch.write_text('CREATE TABLE "{{schema}}"."{{table}}_patched" ();\n', encoding="utf-8")
    found: list[tuple[str, bool]] = []
    setup = aiooutbox_runner.System.setup

    async def setup_then_look(self: aiooutbox_runner.System) -> None:
        await setup(self)
        conn = await asyncpg.connect(self.dsn)
        try:
            marker = await conn.fetchval("SELECT to_regclass('outbox_events_patched') IS NOT NULL")
        finally:
            await conn.close()
        found.append((self.database, marker))

    monkeypatch.setattr(aiooutbox_runner.System, "setup", setup_then_look)
    config = Config(
        scenarios=["references"],
        tune=False,
        references_size=300,
        references_rounds=1,
        references_only=["aiooutbox"],
        sql_patch=str(patch),
    )
    loaded, _ = await run_tiny(pg_server, config, tmp_path)
    rows = loaded["references"]["rows"]
    assert [r["system"] for r in rows] == ["aiooutbox"] * 3
    for row in rows:
        (run,) = row["runs"]
        assert "error" not in run and run["handled"] >= run["n"], run
    # each reference drains in a fresh, patched database
    refs = [marker for database, marker in found if "ref_" in database]
    assert len(refs) == 3 and all(refs), found
