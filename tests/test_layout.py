"""The package's layout: no import cycles, no private module at the top, modules of one
job (a size bound), and every import path the docs and examples use still imports.
The benchmarks (`benchmarks/`) keep the same two rules, cycles and sizes, and one
module per scenario, each registered."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import aiooutbox

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "aiooutbox"
BENCHMARKS = ROOT / "benchmarks"
MAX_MODULE_LINES = 480

# the public surface at the top of the package as it stands: it may grow, never shrink
PUBLIC_ALL = {
    "ConsumerStats", "Dead", "Event", "Handler", "HandlerFunc", "InvalidArgument",
    "NewEvent", "OutboxConsumer", "OutboxError", "Retry", "RetryPolicy", "Router",
    "SchemaNotReady", "SchemaTooNew", "__version__", "check_schema", "enqueue",
    "enqueue_many", "migrate", "migration_sql", "sync",
}  # fmt: skip
PUBLIC_MODULES = {
    "admin", "cli", "consumer", "embedded", "errors", "events", "handlers", "health",
    "inbox", "integrations", "metrics", "migrations", "observe", "producer", "relay", "retry",
    "sync", "tracing", "web",
}  # fmt: skip


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_of(folder: Path) -> dict[str, Path]:
    return {module_name(p): p for p in folder.rglob("*.py")}


MODULES = modules_of(PACKAGE)
# each room the layout rules hold in: its modules by dotted name
ROOMS = {"aiooutbox": MODULES, "benchmarks": modules_of(BENCHMARKS)}


def imports_of(name: str, path: Path, modules: dict[str, Path] = MODULES) -> set[str]:
    """Every module of ``modules`` (the package's, by default) that ``name`` imports,
    wherever the import stands: at the top, under ``TYPE_CHECKING`` or inside a function
    (a cycle hidden in a local import is still a cycle)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # `from . import x` names a module when x is one, else a name in `module`
            targets = [
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                for alias in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, as the list of modules around it, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_no_import_cycle(room: str) -> None:
    modules = ROOMS[room]
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_cycle() -> None:
    # the check above must be able to fail: a two-module cycle and a longer one
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_module_at_the_top_is_public() -> None:
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert top | (folders - {f for f in folders if f.startswith("_")}) == PUBLIC_MODULES
    assert all(f.startswith("_") or f in PUBLIC_MODULES for f in folders)


def test_the_import_scan_sees_type_only_and_local_imports(tmp_path: Path) -> None:
    # a cycle through a TYPE_CHECKING or a function-level import is still a cycle
    path = tmp_path / "a.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .b import B\n"
        "def f():\n    from . import c\n    import pkg.d\n",
        encoding="utf-8",
    )
    modules = dict.fromkeys(("pkg.a", "pkg.b", "pkg.c", "pkg.d"), path)
    assert imports_of("pkg.a", path, modules) == {"pkg.b", "pkg.c", "pkg.d"}


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_no_module_grows_past_one_job(room: str) -> None:
    sizes = {n: len(p.read_text(encoding="utf-8").splitlines()) for n, p in ROOMS[room].items()}
    big = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not big, f"modules past {MAX_MODULE_LINES} lines (split them by role): {big}"


def test_every_benchmark_scenario_is_one_registered_module() -> None:
    """`benchmarks/scenarios/`: a module per scenario, each registered in
    `benchmarks.scenarios.SCENARIOS`, named for what ``--only`` takes."""
    from benchmarks.scenarios import SCENARIOS, Config

    modules = {p.stem for p in (BENCHMARKS / "scenarios").glob("*.py")} - {"__init__"}
    registered = {s.run.__module__.rpartition(".")[2] for s in SCENARIOS}
    assert registered == modules, "register each scenario module in SCENARIOS"
    names = [s.name for s in SCENARIOS]
    assert len(set(names)) == len(names), names
    for scenario in SCENARIOS:
        assert scenario.name.split("-")[0] == scenario.run.__module__.rpartition(".")[2]
        assert scenario.sizes is None or issubclass(Config, scenario.sizes), scenario.name


def test_the_public_surface_is_unchanged_or_grew() -> None:
    assert set(aiooutbox.__all__) >= PUBLIC_ALL
    for name in aiooutbox.__all__:
        assert hasattr(aiooutbox, name), name


_IMPORT = re.compile(
    r"^\s*(?:from\s+(aiooutbox(?:\.[\w.]+)?)\s+import\s+([\w, ()]+)|import\s+(aiooutbox[\w.]*))",
    re.MULTILINE,
)


def documented_imports() -> set[tuple[str, str]]:
    """(module, name) for every ``from aiooutbox… import …``/``import aiooutbox…`` in the
    README, the docs and the examples; name is "" for a plain import."""
    sources = [
        ROOT / "README.md",
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "examples").rglob("*.py"),
    ]
    found: set[tuple[str, str]] = set()
    for source in sources:
        for match in _IMPORT.finditer(source.read_text(encoding="utf-8")):
            if match[3]:
                found.add((match[3], ""))
                continue
            for name in match[2].replace("(", "").replace(")", "").split(","):
                name = name.split(" as ")[0].strip()
                if name:
                    found.add((match[1], name))
    return found


def test_the_documented_imports_are_found() -> None:
    found = documented_imports()
    # the scan itself must see the imports the README is built on
    assert ("aiooutbox", "") in found
    assert ("aiooutbox.integrations.fastapi", "outbox_lifespan") in found
    assert len(found) > 10, found


@pytest.mark.parametrize(("module", "name"), sorted(documented_imports()))
def test_every_documented_import_path_imports(module: str, name: str) -> None:
    imported = importlib.import_module(module)
    if name and not hasattr(imported, name):
        importlib.import_module(f"{module}.{name}")  # a submodule


def test_the_suites_longest_files_first_still_name_test_files() -> None:
    """The scheduling order in conftest.py: each entry a test file that exists, once."""
    from tests.conftest import LONGEST_FIRST

    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST), LONGEST_FIRST
    for path in LONGEST_FIRST:
        assert (ROOT / path).is_file() and Path(path).name.startswith("test_"), path
