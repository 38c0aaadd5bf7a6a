"""Every Python and SQL snippet in README.md runs against a real database, and so do those
of the user docs that no other test runs (docs/cli.md, consuming.md, ordering.md,
batches.md, and the idempotent handler of guarantees.md)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

import aiooutbox

README = Path(__file__).resolve().parent.parent / "README.md"
DOCS = README.parent / "docs"
# the pages whose whole-program snippets run here (the others' have tests of their own:
# web.md in test_examples.py, producers.md in test_examples_adapters.py, relay.md in
# test_relay_examples.py, cloudevents.md in test_cloudevents_docs.py, deployment.md in
# test_production.py, dashboard.md in tests/dashboard/test_mount.py)
SCRIPTED = {
    path.name: path
    for path in (
        README,
        *(DOCS / n for n in ("cli.md", "consuming.md", "ordering.md", "batches.md")),
    )
}


def _blocks(language: str, path: Path = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)


SNIPPETS = [
    (name, index)
    for name, path in SCRIPTED.items()
    for index in range(len(_blocks("python", path)))
]


def test_every_python_snippet_in_the_docs_has_a_test() -> None:
    """A page with a Python snippet is run here or by the test named above for it."""
    assert {name for name, _ in SNIPPETS} == set(SCRIPTED)
    elsewhere = {
        "web.md",
        "producers.md",
        "relay.md",
        "cloudevents.md",
        "deployment.md",
        "guarantees.md",
        "dashboard.md",
        "flow-control.md",
    }
    tested = {f"docs/{name}" for name in elsewhere | set(SCRIPTED)} | {"README.md"}
    pages = [README, README.parent / "examples" / "README.md", *DOCS.rglob("*.md")]
    with_snippets = {
        p.relative_to(README.parent).as_posix()
        for p in pages
        if re.search(r"^```python", p.read_text(), re.M)
    }
    assert with_snippets <= tested, sorted(with_snippets - tested)


@pytest.mark.parametrize(("doc", "index"), SNIPPETS)
async def test_python_snippet_runs(doc: str, index: int, dsn: str, tmp_path: Path) -> None:
    path = SCRIPTED[doc]
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
    rows = await conn.fetch("SELECT topic, payload::text, status::text FROM outbox_events_all")
    assert [tuple(r) for r in rows] == [("orders.created", '{"order_id": 42}', "pending")]


async def test_idempotent_handler_snippet_applies_once(dsn: str) -> None:
    """guarantees.md's inbox-table handler: run twice for one event, it applies once."""
    (code,) = _blocks("python", DOCS / "guarantees.md")
    async with asyncpg.create_pool(dsn, min_size=1, max_size=2) as pool:
        await pool.execute(
            "CREATE TABLE processed_events (event_id bigint PRIMARY KEY);"
            "CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL);"
            "INSERT INTO accounts VALUES (7, 100)"
        )
        namespace = {"aiooutbox": aiooutbox, "app_pool": pool}
        exec(compile(code, "docs/guarantees.md", "exec"), namespace)
        apply_payment = namespace["apply_payment"]
        event = aiooutbox.Event(
            id=41, topic="payments.apply", payload={"amount": 5, "account_id": 7}, dedupe_key=None
        )
        await apply_payment(event)
        await apply_payment(event)  # a repeated run: the inbox row says it was applied
        assert await pool.fetchval("SELECT balance FROM accounts WHERE id = 7") == 105
        assert await pool.fetchval("SELECT count(*) FROM processed_events") == 1


def test_readme_commands_match_ci() -> None:
    text = README.read_text()
    assert "pip install -e '.[test]' && pytest" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "pip install --quiet -e '.[test,docs]'" in ci
    assert "pytest -q" in ci
    # the fast lane the contributor section documents is the marker CI knows about
    assert 'pytest -m "not slow"' in text
    assert "mypy tests benchmarks" in ci and "--durations=15" in ci
    # CI installs the programs some tests start, checks them, and fails (never skips)
    # a test whose program is missing (tests/programs.py)
    assert "\nexport CI=true\n" in ci and "python -m tests.programs" in ci
