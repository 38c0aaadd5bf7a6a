"""How the docs and the messages say to install aiooutbox: from a clone (or a wheel built
from it), since it is on no package index; ``pip install "aiooutbox[web]"`` fails for a
new user."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import aiooutbox
from aiooutbox._values.extras import install_hint

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: the pages a user reads (the changelog is history)
PAGES = [README, ROOT / "examples" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: the code a user runs, reads the messages and docstrings of, or copies from
SOURCES = sorted(
    p for d in ("aiooutbox", "examples", "benchmarks") for p in (ROOT / d).rglob("*.py")
)
#: an extra named as if aiooutbox were on an index (``aiooutbox[web]``, ``pip install
#: aiooutbox``); a wheel's file name, ``aiooutbox-….whl[web]``, is how a wheel installs
FROM_AN_INDEX = re.compile(r"aiooutbox\[|pip install\s+['\"]?aiooutbox(?![\w.-])")
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_no_page_installs_aiooutbox_from_a_package_index() -> None:
    """Neither ``pip install "aiooutbox[web]"`` nor ``aiooutbox[web]`` as the name of an
    extra: each extra is named as installed from the clone, ``pip install -e '.[web]'``."""
    found = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
        for page in PAGES
        for number, line in enumerate(page.read_text().splitlines(), start=1)
        if re.search(r"aiooutbox\[|pip install\s+['\"]?aiooutbox\b", line)
    ]
    assert not found, "\n".join(found)


def test_no_message_or_docstring_installs_aiooutbox_from_a_package_index() -> None:
    """The package's error messages, help texts and docstrings, the examples' and the
    benchmarks' say the same as the pages: the extra from a clone, or from a wheel."""
    assert FROM_AN_INDEX.search('pip install "aiooutbox[web]"')
    assert FROM_AN_INDEX.search("Needs ``aiooutbox[kafka]``.")
    assert FROM_AN_INDEX.search("pip install aiooutbox")
    assert not FROM_AN_INDEX.search(install_hint("web"))
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in SOURCES
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if FROM_AN_INDEX.search(line)
    ]
    assert len(SOURCES) > 100 and ROOT / "examples" / "relay_kafka.py" in SOURCES
    assert not found, "\n".join(found)


def extras_the_messages_name() -> set[str]:
    """The extra of every ``install_hint("x")`` in the package, and of every relay sink's
    ``require("module", "x")``."""
    named: set[str] = set()
    for path in (ROOT / "aiooutbox").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            constants = [a.value for a in node.args if isinstance(a, ast.Constant)]
            args = [value for value in constants if isinstance(value, str)]
            if node.func.id == "install_hint" and len(args) == 1:
                named.add(args[0])
            elif node.func.id == "require" and len(args) == 2:
                named.add(args[1])
    return named


def test_every_extra_a_message_names_exists() -> None:
    named = extras_the_messages_name()
    assert {"web", "otel", "prometheus", "embedded", "kafka", "nats", "webhook"} <= named
    assert named <= set(EXTRAS), named - set(EXTRAS)


def test_a_missing_extra_is_named_in_one_line_with_how_to_install_it(tmp_path: Path) -> None:
    """Without their libraries: the dashboard and ``run --metrics-port`` commands, the
    metrics module and a relay sink each say, in one line, which extra installs them."""
    (tmp_path / "hint_handlers.py").write_text(
        "async def handle(event):\n    pass\n\nhandlers = {'t': handle}\n"
    )
    script = """
import sys
for name in ("starlette", "prometheus_client", "aiokafka"):
    sys.modules[name] = None  # as if not installed
from aiooutbox.cli import main
dsn = "postgresql://nobody@127.0.0.1:1/none"
print("rc", main(["dashboard", "--dsn", dsn], prog="aiooutbox"))
print("rc", main(["run", "--dsn", dsn, "--metrics-port", "0", "hint_handlers:handlers"]))
try:
    import aiooutbox.metrics
except ImportError as exc:
    print("metrics:", exc)
from aiooutbox.relay import KafkaSink
try:
    KafkaSink("127.0.0.1:1")
except ImportError as exc:
    print("sink:", exc)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[:2] == ["rc 1", "rc 2"], proc.stdout
    errors = proc.stderr.strip().splitlines()
    assert errors == [
        f"aiooutbox: error: the dashboard needs starlette: {install_hint('web')}",
        f"aiooutbox: error: --metrics-port needs prometheus_client: {install_hint('prometheus')}",
    ], proc.stderr
    out = proc.stdout.splitlines()[2:]
    assert (
        out[0]
        == f"metrics: aiooutbox.metrics needs prometheus_client: {install_hint('prometheus')}"
    )
    assert out[1].startswith(f"sink: this sink needs 'aiokafka': {install_hint('kafka')} ("), out
    assert len(out) == 2, out


def test_every_extra_the_pages_install_exists() -> None:
    named = {
        extra.strip()
        for page in PAGES
        for group in re.findall(r"pip install -e '\.\[([\w,]+)\]'", page.read_text())
        for extra in group.split(",")
    }
    assert {"web", "fastapi", "prometheus", "embedded", "test"} <= named
    assert named <= set(EXTRAS), named - set(EXTRAS)


def test_the_readme_installs_from_a_clone_or_a_wheel(tmp_path: Path) -> None:
    """The README's wheel commands as written: the wheel they build has the name they
    install, and pip accepts it with the extras given (resolved offline, from what this
    environment has)."""
    text = README.read_text()
    section = text[text.index("## Installing") : text.index("## Two commands")]
    assert "pip install -e '.[web,kafka]'" in section
    (build,) = re.findall(r"^(pip wheel --no-deps -w dist \.)$", section, re.M)
    (wheel,) = re.findall(r"^pip install '(dist/[^'\[]+\.whl)\[web,kafka\]'$", section, re.M)
    assert wheel == f"dist/aiooutbox-{aiooutbox.__version__}-py3-none-any.whl"
    command = [*build.split()[:-2], str(tmp_path / "dist"), str(ROOT)]
    subprocess.run([sys.executable, "-m", *command], check=True, capture_output=True, timeout=120)
    built = tmp_path / wheel
    assert built.is_file(), sorted(p.name for p in (tmp_path / "dist").iterdir())
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", f"{built}[web,kafka]"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Would install aiooutbox-{aiooutbox.__version__}" in proc.stdout, proc.stdout
    assert "does not provide the extra" not in proc.stdout + proc.stderr


def test_the_inbox_page_says_first_that_it_needs_the_outbox_migration() -> None:
    text = (ROOT / "docs" / "inbox.md").read_text()
    before_details = text[: text.index("\n## ")]
    assert "python -m aiooutbox migrate --dsn" in before_details
    assert "no inbox-only migration" in before_details
