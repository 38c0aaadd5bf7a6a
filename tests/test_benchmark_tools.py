"""benchmarks/README.md's "standalone tools" row: every module at the top of benchmarks/
that runs as ``python -m benchmarks.<name>`` is listed there, and its ``--help`` works."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def listed_tools() -> list[str]:
    (row,) = [
        line
        for line in (BENCHMARKS / "README.md").read_text().splitlines()
        if "standalone tools" in line
    ]
    return re.findall(r"`(\w+)\.py`", row.split("|")[1])


def runnable_modules() -> set[str]:
    return {
        path.stem
        for path in BENCHMARKS.glob("*.py")
        if path.stem not in {"__init__", "__main__"}
        and 'if __name__ == "__main__":' in path.read_text()
    }


def test_every_standalone_tool_is_in_the_readme() -> None:
    listed = listed_tools()
    assert {"ab", "flow_wildcard"} <= set(listed), listed
    assert set(listed) == runnable_modules()


@pytest.mark.parametrize("name", listed_tools())
def test_a_standalone_tool_answers_help(name: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--help"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: python -m benchmarks.{name}"), proc.stdout
