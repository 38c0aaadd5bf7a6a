"""A machine without the system programs some tests start (Chromium, PgBouncer, the
private brokers): those tests skip with one line naming what to install, and under
``CI=true`` the same run fails. Real pytest runs in a subprocess, with every program
hidden by pointing its variable (``tests/programs.py``) at nothing."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests import programs
from tests.programs import PROGRAMS

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

#: one test per program, each marked ``needs(...)``: (node id, the program it lacks)
SELECTION = [
    ("tests/dashboard/test_browser.py::test_bulk_retry_by_filter_in_the_browser", "chromium"),
    (
        "tests/test_pgbouncer.py::test_a_consumer_on_a_pool_with_a_statement_cache_behind_pgbouncer_stops",
        "pgbouncer",
    ),
    ("tests/test_relay_outages.py::test_nats_outage_10s", "nats-server"),
    ("tests/test_relay_refusals.py::test_redis_out_of_memory_is_held_as_an_outage", "redis-server"),
    ("tests/test_relay_outages.py::test_rabbitmq_outage_10s", "rabbitmq-server"),
    ("tests/test_relay_read_back.py::test_kafka_bound_after_the_partitions_last_record", "tansu"),
]  # fmt: skip

#: what in a test's code starts a program: then the test must be marked ``needs``
STARTERS = {
    "browser_page(": "chromium",
    "bounced": "pgbouncer",
    "PrivateNats(": "nats-server",
    "NatsCluster(": "nats-server",
    "PrivateRedis(": "redis-server",
    "PrivateRabbit(": "rabbitmq-server",
    '"rabbitmqctl"': "rabbitmqctl",
    "tansu()": "tansu",
    "kafka: Tansu": "tansu",
}


def _pytest(tmp_path: Path, name: str, **env: str) -> tuple[int, str, ET.Element]:
    report = tmp_path / f"{name}.xml"
    hidden = {p.variable: f"/nonexistent/{p.name}" for p in PROGRAMS.values()}
    base = {k: v for k, v in os.environ.items() if k != "CI"}
    proc = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-q", "-rs",
            f"--junitxml={report}", *(node for node, _ in SELECTION),
        ],
        cwd=ROOT,
        env={**base, **hidden, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr, ET.parse(report).getroot()


def _outcomes(root: ET.Element, kind: str) -> dict[str, str]:
    """test name -> the message of its ``kind`` (skipped, error, failure) element."""
    found = {}
    for case in root.iter("testcase"):
        element = case.find(kind)
        if element is not None:
            found[case.attrib["name"]] = element.attrib.get("message", "")
    return found


@pytest.mark.timeout(240)
def test_missing_programs_skip_with_one_line_and_fail_under_ci(tmp_path: Path) -> None:
    rc, output, root = _pytest(tmp_path, "skips")
    assert rc == 0, output
    skipped = _outcomes(root, "skipped")
    assert len(skipped) == len(SELECTION), output
    for node, name in SELECTION:
        reason = skipped[node.rpartition("::")[2]]
        program = PROGRAMS[name]
        assert "\n" not in reason.strip(), reason
        assert reason.startswith(f"needs {name} ({program.variable}=/nonexistent/"), reason
        assert program.install in reason and f"set {program.variable}=" in reason, reason
    assert "apt-get install chromium (or set AIOOUTBOX_CHROMIUM=" in output, output

    rc, output, root = _pytest(tmp_path, "ci", CI="true")
    assert rc == 1, output
    errors = _outcomes(root, "error")
    assert len(errors) == len(SELECTION) and not _outcomes(root, "skipped"), output
    for node, name in SELECTION:
        message = errors[node.rpartition("::")[2]]
        assert PROGRAMS[name].install in message and "CI=true" in message, message


def test_a_program_is_found_on_path_or_in_debians_places(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without its variable: PATH, then /usr/sbin and /usr/bin (a user's PATH lacks
    /usr/sbin); found nowhere, the line says "not found" and what to install."""
    monkeypatch.delenv("AIOOUTBOX_TEST_PGBOUNCER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(programs, "DEBIAN_PLACES", ())
    assert programs.missing("pgbouncer") == (
        "needs pgbouncer (not found): apt-get install pgbouncer"
        " (or set AIOOUTBOX_TEST_PGBOUNCER=/path/to/pgbouncer)"
    )
    fake = tmp_path / "pgbouncer"
    fake.write_text("#!/bin/sh\n")
    assert programs.missing("pgbouncer") is not None  # not executable
    fake.chmod(0o755)
    assert programs.missing("pgbouncer") is None
    assert programs.program("pgbouncer") == str(fake)
    monkeypatch.setattr(programs, "DEBIAN_PLACES", (str(tmp_path),))
    monkeypatch.setenv("PATH", "/nonexistent")
    assert programs.find("pgbouncer") == str(fake)


def test_every_test_that_starts_a_program_is_marked_needs() -> None:
    """A new test that starts a program without ``needs(...)`` would fail on a machine
    without it instead of skipping; each such test names its programs."""
    unmarked = []
    for path in sorted(TESTS.rglob("test_*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        module_marks: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
            ):
                module_marks |= _needs(node.value)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if not node.name.startswith("test_"):
                continue
            code = ast.get_source_segment(source, node) or ""
            started = {program for token, program in STARTERS.items() if token in code}
            marked = module_marks.union(*(_needs(d) for d in node.decorator_list))
            if started - marked:
                where = f"{path.relative_to(ROOT)}::{node.name}"
                unmarked.append(f"{where} needs {sorted(started - marked)}")
    assert not unmarked, unmarked


def _needs(node: ast.expr) -> set[str]:
    """The programs of every ``needs(...)`` call inside an expression."""
    return {
        arg.value
        for call in ast.walk(node)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == "needs"
        for arg in call.args
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
    }
