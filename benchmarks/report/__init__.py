"""Results out: the JSON document, results.md with the targets (`document`; each
scenario renders its own sections) and the PNG plots (`plots`, with matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .document import markdown, targets
from .plots import plot

__all__ = ["markdown", "plot", "targets", "write"]


def write(results: dict[str, Any], out: Path, *, plots: bool = True) -> dict[str, Path]:
    """Write results.json, results.md and (if matplotlib is installed) the plots."""
    out.mkdir(parents=True, exist_ok=True)
    results["targets"] = targets(results)
    paths = {"json": out / "results.json", "markdown": out / "results.md"}
    paths["json"].write_text(json.dumps(results, indent=1, default=str) + "\n")
    paths["markdown"].write_text(markdown(results))
    if plots:
        try:
            for path in plot(results, out):
                paths[path.stem] = path
        except ImportError:
            pass  # the bench extra draws plots: pip install -e '.[bench]'
    return paths
