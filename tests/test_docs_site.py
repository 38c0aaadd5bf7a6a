"""The documentation site builds with `mkdocs build --strict` (as .ci/run does), from the
repository's own pages: a broken link, anchor or API reference fails this test."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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


def test_every_doc_is_in_the_nav_and_the_api_reference_is_complete() -> None:
    pages = set(_nav_pages(_config()["nav"]))
    docs = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert docs - pages == set(), "add them to mkdocs.yml's nav"
    package = ROOT / "aiooutbox"
    public = (
        {  # every public module but the command line, which docs/cli.md describes
            p.stem for p in package.glob("*.py") if not p.stem.startswith("_")
        }
        | {"relay"}
        | {f"integrations.{p.stem}" for p in (package / "integrations").glob("[!_]*.py")}
    )
    public -= {"cli"}
    assert {"consumer", "inbox", "relay", "integrations.fastapi"} <= public
    for name in public:
        stub = (ROOT / "docs" / "api" / f"{name}.md").read_text()
        assert f"::: aiooutbox.{name}\n" in stub, name
    assert "::: aiooutbox\n" in (ROOT / "docs" / "api" / "index.md").read_text()
