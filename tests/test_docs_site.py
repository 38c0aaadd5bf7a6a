"""The documentation site builds with `mkdocs build --strict` (as .ci/run does), from the
repository's own pages: a broken link, anchor or API reference fails this test."""

from __future__ import annotations

import ast
import html
import importlib
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def _config() -> dict[str, object]:
    # mkdocs.yml's toc slugify is a python/object tag: read the rest without running it
    text = re.sub(r"!!python/\S+", "", (ROOT / "mkdocs.yml").read_text())
    config: dict[str, object] = yaml.safe_load(text)
    return config


def test_the_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the home page is the README, its links into docs/ pointing at the site's pages
    home = (site / "index.html").read_text()
    assert "A durable transactional outbox and work queue" in home
    assert 'href="guarantees/"' in home and 'href="docs/guarantees.md"' not in home
    # the benchmark plots outside docs/ are in the site, where the page shows them
    bench = (site / "benchmarks" / "index.html").read_text()
    assert 'src="../repo/benchmarks/results/drain.png"' in bench
    assert (site / "repo" / "benchmarks" / "results" / "drain.png").is_file()
    # the API reference is generated from the docstrings
    api = (site / "api" / "consumer" / "index.html").read_text()
    assert 'id="aiooutbox.consumer.OutboxConsumer"' in api
    assert "handlers running at once" in api
    _check_api_reference(site)


def _check_api_reference(site: Path) -> None:
    """Each page shows its module's public names (``__all__``) and nothing else, in the
    order its stub lists them (what a user calls first); the text above them is for a
    user, not about internals; signatures are formatted over lines."""
    for name, members in _api_members().items():
        page = (site / "api" / name / "index.html").read_text()
        prefix = f"aiooutbox.{name}."
        shown = [
            found[len(prefix) :]
            for found in re.findall(r'id="(aiooutbox\.[\w.]+)"', page)
            if found.startswith(prefix) and "." not in found[len(prefix) :]
        ]
        assert shown, name
        assert shown == [m for m in members if m in shown], (name, shown)
        public = importlib.import_module(f"aiooutbox.{name}").__all__
        assert set(shown) <= set(public), (name, set(shown) - set(public))
        intro = page[page.index("<h1") : page.index(f'id="{prefix}{shown[0]}"')]
        text = html.unescape(re.sub(r"<[^>]+>", "", intro))
        assert not re.search(r"\b_(engine|sql|values|observability|admin)\b", text), (name, text)
    producer = (site / "api" / "producer" / "index.html").read_text()
    signature = producer[producer.index('id="aiooutbox.producer.enqueue"') :]
    signature = html.unescape(re.sub(r"<[^>]+>", "", signature))
    assert re.search(r"enqueue\(\n    conn: Any,\n    topic: str,", signature), signature[:800]


def _api_members() -> dict[str, list[str]]:
    """Each API page's module and the members its stub lists (``options: members:``)."""
    found = {}
    for stub in sorted((ROOT / "docs" / "api").glob("*.md")):
        if stub.stem == "index":
            continue
        match = re.search(r"^      members:\n((?:        - \w+\n)+)", stub.read_text(), re.M)
        assert match, f"{stub.name} lists no members"
        found[stub.stem] = re.findall(r"- (\w+)", match.group(1))
    return found


def test_every_doc_is_in_the_nav_and_the_api_reference_is_complete() -> None:
    pages = set(_nav_pages(_config()["nav"]))
    docs = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert docs - pages == set(), "add them to mkdocs.yml's nav"
    package = ROOT / "aiooutbox"
    public = (
        {  # every public module but the command line, which docs/cli.md describes
            p.stem for p in package.glob("*.py") if not p.stem.startswith("_")
        }
        | {"relay", "web"}
        | {f"integrations.{p.stem}" for p in (package / "integrations").glob("[!_]*.py")}
    )
    public -= {"cli"}
    assert {"consumer", "inbox", "relay", "integrations.fastapi"} <= public
    for name in public:
        stub = (ROOT / "docs" / "api" / f"{name}.md").read_text()
        assert f"::: aiooutbox.{name}\n" in stub, name
    assert "::: aiooutbox\n" in (ROOT / "docs" / "api" / "index.md").read_text()
    # each page lists its module's public names, each once: a name added to __all__
    # goes into its page's list, where the user would look for it
    members = _api_members()
    assert set(members) == public
    for name, listed in members.items():
        public_names = importlib.import_module(f"aiooutbox.{name}").__all__
        assert sorted(listed) == sorted(public_names), f"docs/api/{name}.md: {public_names}"


#: a private module, as a reader of the API reference would meet it: they do not import it
PRIVATE_MODULE = re.compile(r"aiooutbox\._|\b_(?:engine|sql|values|observability)\b")
Definition = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def private_names_in_public_docstrings() -> list[str]:
    """Each docstring of a public module, class, function or method (what the API
    reference and ``help()`` show) that names a private module."""
    found: list[str] = []

    def visit(path: Path, node: ast.Module | Definition) -> None:
        doc = ast.get_docstring(node, clean=False)
        if doc and PRIVATE_MODULE.search(doc):
            found.append(f"{path.relative_to(ROOT)}: {getattr(node, 'name', '(module)')}")
        for child in ast.iter_child_nodes(node):
            if isinstance(child, Definition) and not child.name.startswith("_"):
                visit(path, child)

    for path in sorted((ROOT / "aiooutbox").rglob("*.py")):
        parts = path.relative_to(ROOT / "aiooutbox").parts
        if not any(part.startswith("_") and part != "__init__.py" for part in parts):
            visit(path, ast.parse(path.read_text()))
    return found


def test_no_public_docstring_names_a_private_module() -> None:
    """Users read about the MVCC watchdog, not ``aiooutbox._engine.watchdog``."""
    assert PRIVATE_MODULE.search("the MVCC watchdog (`aiooutbox._engine.watchdog`) warns")
    assert not PRIVATE_MODULE.search("self._engine_state, the_sql_text, a_values_list")
    assert not private_names_in_public_docstrings()


def test_the_docs_extra_formats_signatures_and_the_tests_have_it() -> None:
    """mkdocstrings formats signatures with Black or Ruff when one is installed, and cuts
    them on one line without; the test extra builds the site too."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {re.split(r"[\[<>=]", r)[0] for r in extras["docs"]}
    assert names & {"ruff", "black"}, extras["docs"]
    assert set(extras["docs"]) <= set(extras["test"])


def test_the_benchmarks_page_is_a_users_page() -> None:
    """Results, one section per scenario, each with the command that produced it and
    (but for two one-number sections) its table; the runs' history is another page."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(page.splitlines()) <= 320  # 300 until the live upgrade's section (17 lines)
    results = page[page.index("## Results") :]
    sections = re.split(r"^##+ ", results, flags=re.M)[2:]
    assert len(sections) >= 12
    for section in sections:
        title = section.splitlines()[0]
        assert "python -m benchmarks" in section, title
    assert sum("|---" in s for s in sections) >= len(sections) - 2
    assert "(benchmarks-history.md)" in page
