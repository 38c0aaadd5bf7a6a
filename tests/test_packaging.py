"""The wheel built from this tree ships the SQL migrations and the typing marker.

The numbered SQL files live in the repository's top-level ``schema/``; the wheel carries
them as ``aiooutbox/schema/`` (hatch ``force-include``), and `aiooutbox.migrations`
finds them in both places.
"""

from __future__ import annotations

import email
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import aiooutbox

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "aiooutbox"
SCHEMA = ROOT / "schema"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"building the wheel failed:\n{proc.stdout}\n{proc.stderr}"
    [built] = out.glob("aiooutbox-*.whl")
    return built


def names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_the_wheel_ships_every_migration_byte_for_byte(wheel: Path) -> None:
    sql_files = sorted(SCHEMA.glob("*.sql"))
    assert [p.name for p in sql_files][:1] == ["0001_outbox.sql"]
    with zipfile.ZipFile(wheel) as zf:
        for path in sql_files:
            assert zf.read(f"aiooutbox/schema/{path.name}") == path.read_bytes()
        shipped = {n for n in zf.namelist() if n.startswith("aiooutbox/schema/")}
    assert shipped == {f"aiooutbox/schema/{p.name}" for p in sql_files}


def test_the_wheel_is_typed_and_complete(wheel: Path) -> None:
    inside = names(wheel)
    assert "aiooutbox/py.typed" in inside
    modules = {
        p.relative_to(ROOT).as_posix()
        for p in PACKAGE.rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert modules <= inside, f"missing from the wheel: {sorted(modules - inside)}"
    # the dashboard's templates and static files are package data
    web = PACKAGE / "web"
    data = {
        p.relative_to(ROOT).as_posix()
        for folder in ("templates", "static")
        for p in (web / folder).iterdir()
    }
    assert data and data <= inside, f"missing from the wheel: {sorted(data - inside)}"
    assert not [n for n in inside if n.startswith("tests/") or "__pycache__" in n]


def test_the_wheel_metadata(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        [meta_name] = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(zf.read(meta_name))
    assert meta["Name"] == "aiooutbox"
    assert meta["Version"] == aiooutbox.__version__
    assert meta["Requires-Python"] == ">=3.11"
    core = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    core_names = {r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip() for r in core}
    assert {"asyncpg", "anyio"} <= core_names
    # anything else in the core set may only be a backport for old Pythons
    for req in core:
        if not req.startswith(("asyncpg", "anyio")):
            assert "python_version" in req, f"unexpected core dependency: {req}"
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"test", "embedded"} <= extras


def test_every_migration_is_in_the_top_level_schema_directory() -> None:
    # a file left in (or added to) aiooutbox/schema/ would shadow the top-level ones in
    # a checkout and be missing from the wheel: `git mv` it to schema/
    assert not (PACKAGE / "schema").exists(), sorted(p.name for p in (PACKAGE / "schema").iterdir())
    stray = [p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.sql")]
    assert stray == []
    names = [p.name for p in sorted(SCHEMA.glob("*.sql"))]
    assert names[0] == "0001_outbox.sql"
    assert [int(n[:4]) for n in names] == list(range(1, len(names) + 1))


def test_a_checkout_reads_the_top_level_schema_directory() -> None:
    # what `pip install -e .` (the test run itself) imports: the package of this tree
    from aiooutbox.migrations import _schema_dir, migrations

    assert Path(aiooutbox.__file__).resolve().is_relative_to(ROOT)
    assert Path(str(_schema_dir())).resolve() == SCHEMA
    assert [m.template for m in migrations()] == [
        p.read_text(encoding="utf-8") for p in sorted(SCHEMA.glob("*.sql"))
    ]


def _run_installed(wheel: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python *args`` with the wheel's files (unpacked, as pip installs them) first on
    the path, from a directory outside the checkout; the interpreter fails the test
    unless aiooutbox was imported from the unpacked wheel."""
    site = tmp_path / "site"
    if not site.exists():
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("AIOOUTBOX_DSN", None)
    here = str(site.resolve())
    check = (
        "import aiooutbox, pathlib, runpy, sys\n"
        f"assert pathlib.Path(aiooutbox.__file__).resolve().is_relative_to({here!r})\n"
    )
    if args[0] == "-c":
        code = check + args[1]
    else:  # -m MODULE ARGS...: as `python -m` runs it
        argv, module = list(args[1:]), args[1]
        code = check + f"sys.argv = {argv!r}\nrunpy.run_module({module!r}, run_name='__main__')"
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
        check=False,
    )


def test_the_installed_wheel_finds_its_migrations(wheel: Path, tmp_path: Path) -> None:
    script = (
        "import json, aiooutbox\n"
        "from aiooutbox.migrations import migrations\n"
        "print(json.dumps({"
        " 'migrations': [[m.version, m.name, len(m.template)] for m in migrations()],"
        " 'sql': aiooutbox.migration_sql(schema='s', table='t')}))\n"
    )
    proc = _run_installed(wheel, tmp_path, "-c", script)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    expected = [
        [int(p.name[:4]), p.name[5:-4], len(p.read_text(encoding="utf-8"))]
        for p in sorted(SCHEMA.glob("*.sql"))
    ]
    assert found["migrations"] == expected
    assert found["sql"] == aiooutbox.migration_sql(schema="s", table="t")


def test_the_installed_wheel_migrates_a_real_database(
    wheel: Path, tmp_path: Path, empty_dsn: str
) -> None:
    proc = _run_installed(wheel, tmp_path, "-m", "aiooutbox", "migrate", "--dsn", empty_dsn)
    assert proc.returncode == 0, proc.stderr
    versions = [int(p.name[:4]) for p in sorted(SCHEMA.glob("*.sql"))]
    assert f"applied migration(s) {versions}" in proc.stdout, proc.stdout
