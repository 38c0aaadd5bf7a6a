"""`python -m benchmarks.flow_wildcard` at a tiny size, so it cannot rot: every variant
drains, the results have their shape. No timing."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from benchmarks import flow_wildcard


@pytest.mark.slow  # benchmark child processes
async def test_the_wildcard_benchmark_runs_at_a_tiny_size(pg_server: str) -> None:
    config = flow_wildcard.Config(
        admin_dsn=pg_server,
        prefix=f"aiooutbox_wildcard_{uuid.uuid4().hex[:8]}_",
        topics=20,
        backlog=5,
        size=300,
        rounds=2,
        concurrency=16,
        prefetch=32,
        pool_size=3,
        timeout=60.0,
    )
    lines: list[str] = []
    results = await flow_wildcard.run(config, log=lines.append)
    runs = results["runs"]
    assert [(r["round"], r["variant"]) for r in runs] == [
        (0, "none"),
        (0, "paused"),
        (0, "at_limit"),
        (1, "paused"),
        (1, "at_limit"),
        (1, "none"),
    ]
    for run in runs:
        assert "error" not in run, run
        assert run["rate"] > 0 and run["claims"] >= 1, run
    assert set(results["ratios"]) == set(results["paired_ratios"])
    assert set(results["ratios"]) == {"paused_vs_none", "at_limit_vs_none"}
    assert all(v > 0 for v in results["ratios"].values()), results["ratios"]
    assert "target >= 0.9" in lines[-1]
    # the databases it made are gone
    conn = await asyncpg.connect(pg_server)
    try:
        left = await conn.fetchval(
            "SELECT count(*) FROM pg_database WHERE datname LIKE $1", config.prefix + "%"
        )
    finally:
        await conn.close()
    assert left == 0
