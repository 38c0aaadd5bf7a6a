"""Every Python and SQL snippet in README.md runs against a real database."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
CLI_DOC = README.parent / "docs" / "cli.md"


def _blocks(language: str, path: Path = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)


SNIPPETS = [
    (path.name, index)
    for path in (README, CLI_DOC)
    for index in range(len(_blocks("python", path)))
]


@pytest.mark.parametrize(("doc", "index"), SNIPPETS)
async def test_python_snippet_runs(doc: str, index: int, dsn: str, tmp_path: Path) -> None:
    path = README if doc == README.name else CLI_DOC
    script = tmp_path / f"snippet_{index}.py"
    script.write_text(_blocks("python", path)[index])
    env = {**os.environ, "AIOOUTBOX_DSN": dsn}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out, "each snippet prints what it did"


async def test_sql_snippet_is_an_idempotent_producer(conn: asyncpg.Connection) -> None:
    (sql,) = _blocks("sql")
    await conn.execute(sql)
    await conn.execute(sql)
    rows = await conn.fetch("SELECT topic, payload::text, status::text FROM outbox_events")
    assert [tuple(r) for r in rows] == [("orders.created", '{"order_id": 42}', "pending")]


def test_readme_commands_match_ci() -> None:
    text = README.read_text()
    assert "pip install -e '.[test]' && pytest" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "pip install --quiet -e '.[test]'" in ci
    assert "pytest -q" in ci
    # the fast lane the contributor section documents is the marker CI knows about
    assert 'pytest -m "not slow"' in text
    assert "mypy tests benchmarks" in ci and "--durations=15" in ci
