"""``run`` as its operator reads it: stored text in its log lines, and ``--metrics-port``
beside a handlers module that set up aiooutbox's metrics itself."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import asyncpg

import aiooutbox
from tests.clirunner import Runner, clean_env, cli
from tests.helpers import wait_until
from tests.test_health_server_runs import free_port, get

FORGED = "2026-01-01 00:00:00,000 CRITICAL aiooutbox.cli: forged line"


async def test_a_stored_topic_cannot_forge_log_lines_or_send_terminal_escapes(
    dsn: str, pool: asyncpg.Pool
) -> None:
    # a raw SQL producer's topic, as the table accepts it
    await pool.execute(
        "INSERT INTO outbox_events (topic, payload) VALUES ($1, '{}')",
        f"evil\x1b[2J\n{FORGED}",
    )
    async with Runner("tests.cli_handlers:handlers", "--dsn", dsn, "--topics", "quick") as runner:
        await runner.wait_for_line("no handler for")
        runner.signal()
        assert await runner.wait() == 0, runner.stderr
    warning = next(line for line in runner.lines if "no handler for" in line)
    assert "evil\\x1b[2J\\x0a2026-01-01" in warning, warning
    assert "\x1b" not in runner.stderr
    assert not any(line.startswith(FORGED) for line in runner.lines), runner.stderr


def handlers_module(where: Path, name: str, source: str) -> dict[str, str]:
    """Write module ``name`` into ``where``; the environment that imports it."""
    (where / f"{name}.py").write_text(textwrap.dedent(source))
    path = os.pathsep.join(filter(None, [str(where), os.environ.get("PYTHONPATH")]))
    return clean_env(PYTHONPATH=path)


async def test_run_reuses_the_outbox_metrics_a_handlers_module_made(
    dsn: str, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    env = handlers_module(
        tmp_path,
        "own_metrics",
        """
        from aiooutbox.metrics import OutboxMetrics

        metrics = OutboxMetrics()  # docs/observability.md, "In your own process"

        async def quick(event):
            pass

        handlers = {"quick": quick}
        """,
    )
    await aiooutbox.enqueue(pool, "quick", {})
    port = free_port()
    args = ["own_metrics:handlers", "--dsn", dsn, "--metrics-port", str(port)]
    async with Runner(*args, env=env) as runner:
        await runner.wait_for_line("consuming")
        scraped: list[str] = []

        async def counted() -> bool:
            status, body = await get(port, "/metrics")
            scraped.append(body)
            return (
                status == 200
                and 'aiooutbox_events_total{outcome="done",topic="quick"} 1.0' in body
                and "aiooutbox_queue_stats_timestamp_seconds " in body
            )

        try:
            await wait_until(counted, timeout=20, interval=0.1)
        except AssertionError:
            raise AssertionError(f"{runner.stderr}\nlast scrape:\n{scraped[-1]}") from None
        assert (await get(port, "/healthz"))[0] == 200
        runner.signal()
        assert await runner.wait() == 0, runner.stderr
    assert "Traceback" not in runner.stderr, runner.stderr


async def test_names_taken_by_something_else_are_one_line_and_exit_2(
    dsn: str, tmp_path: Path
) -> None:
    env = handlers_module(
        tmp_path,
        "taken_names",
        """
        from prometheus_client import Counter

        events = Counter("aiooutbox_events", "not aiooutbox's")

        async def quick(event):
            pass

        handlers = {"quick": quick}
        """,
    )
    result = await cli(
        "run", "taken_names:handlers", "--dsn", dsn, "--metrics-port", str(free_port()), env=env
    )
    assert result.rc == 2, result
    assert len(result.err_lines) == 1, result.err
    assert "--metrics-port" in result.err and "aiooutbox_events" in result.err, result.err
