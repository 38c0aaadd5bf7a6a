"""MkDocs hooks (mkdocs.yml, `hooks:`): the repository's own files make the site.

The site's pages are the files a reader of the repository reads: docs/*.md, plus the
README as the home page, examples/README.md and the changelog. Their links are written
for GitHub, relative to each file's place in the repository. This hook maps them onto
the site: a link to one of those pages goes to that page; a link to any other file of
the repository (a plot, an example, the LICENSE) goes to a copy of it under `repo/`
(a Markdown file there is rendered as a page); a link to a directory goes to its
README.md. A link whose target does not exist is left as written, so that
`mkdocs build --strict` fails on it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
#: files outside docs/ that are pages of the site, and their place in it
PAGES = {
    "README.md": "index.md",
    "examples/README.md": "examples.md",
    "CHANGELOG.md": "changelog.md",
}
#: where other files of the repository that a page links to are copied
COPIES = "repo"

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_LINK = re.compile(r"(!?\[[^\]\n]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")

# repository path -> site path, for every file outside docs/ that the site holds
_site_paths: dict[str, str] = {}
# site path of a page -> its repository path
_repo_paths: dict[str, str] = {}


def _repo_path(site_path: str) -> str:
    """Where a file of the site lives in the repository (relative to its root)."""
    return _repo_paths.get(site_path, f"docs/{site_path}")


def _resolve(repo_dir: str, target: str) -> str | None:
    """The repository path a relative link from `repo_dir` points at, if it exists."""
    path = posixpath.normpath(posixpath.join(repo_dir, target))
    if path.startswith("../") or path == "..":
        return None
    if (ROOT / path).is_dir():
        path = posixpath.join(path, "README.md") if path != "." else "README.md"
    return path if (ROOT / path).is_file() else None


def _links(markdown: str) -> list[tuple[str, str]]:
    """(path, anchor) of every relative link outside code blocks."""
    found = []
    for match in _LINK.finditer(_FENCE.sub("", markdown)):
        target = match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            continue
        path, _, anchor = target.partition("#")
        found.append((path, anchor))
    return found


def on_files(files: Files, config: MkDocsConfig, **_: Any) -> Files:
    _site_paths.clear()
    _repo_paths.clear()
    for repo_path, site_path in PAGES.items():
        if files.get_file_from_path(site_path) is not None:
            raise ValueError(f"docs/{site_path} would hide {repo_path}, the site's {site_path}")
        files.append(File.generated(config, site_path, abs_src_path=str(ROOT / repo_path)))
        _site_paths[repo_path] = site_path
        _repo_paths[site_path] = repo_path
    # copy what the pages link to outside docs/, and what those copies link to
    queue = [f.src_uri for f in files.documentation_pages()]
    while queue:
        site_path = queue.pop()
        repo_path = _repo_path(site_path)
        for path, _anchor in _links((ROOT / repo_path).read_text(encoding="utf-8")):
            target = _resolve(posixpath.dirname(repo_path), path)
            if target is None or target.startswith("docs/") or target in _site_paths:
                continue
            copy = f"{COPIES}/{target}"
            # reachable by links, not listed in the nav
            files.append(
                File.generated(
                    config,
                    copy,
                    abs_src_path=str(ROOT / target),
                    inclusion=InclusionLevel.NOT_IN_NAV,
                )
            )
            _site_paths[target] = copy
            _repo_paths[copy] = target
            if copy.endswith(".md"):
                queue.append(copy)
    return files


def _rewrite(match: re.Match[str], repo_dir: str, site_dir: str) -> str:
    target = match.group(2)
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return match.group(0)
    path, hash_, anchor = target.partition("#")
    repo_path = _resolve(repo_dir, path)
    if repo_path is None:
        return match.group(0)  # mkdocs reports it
    if repo_path.startswith("docs/"):
        site_path = repo_path.removeprefix("docs/")
    else:
        site_path = _site_paths[repo_path]
    link = posixpath.relpath(site_path, site_dir or ".") + hash_ + anchor
    return match.group(1) + link + match.group(3)


def on_page_markdown(markdown: str, page: Page, **_: Any) -> str:
    repo_dir = posixpath.dirname(_repo_path(page.file.src_uri))
    site_dir = posixpath.dirname(page.file.src_uri)
    out, last = [], 0
    for fence in _FENCE.finditer(markdown):
        text = markdown[last : fence.start()]
        out.append(_LINK.sub(lambda m: _rewrite(m, repo_dir, site_dir), text))
        out.append(fence.group(0))
        last = fence.end()
    out.append(_LINK.sub(lambda m: _rewrite(m, repo_dir, site_dir), markdown[last:]))
    return "".join(out)
