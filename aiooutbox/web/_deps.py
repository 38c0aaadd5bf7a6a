"""The ``web`` extra's libraries, checked once with a one-line answer when missing."""

from __future__ import annotations

import importlib.util

from .._values.extras import install_hint

__all__ = ["MissingExtra", "require"]

NEEDED = {"starlette": "starlette", "jinja2": "jinja2", "multipart": "python-multipart"}


class MissingExtra(ImportError):
    pass


def require(server: bool = False) -> None:
    """Raise `MissingExtra` naming what to install unless the dashboard can run."""
    needed = dict(NEEDED)
    if server:
        needed["uvicorn"] = "uvicorn"
    missing = [pip for module, pip in needed.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise MissingExtra(f"the dashboard needs {', '.join(missing)}: {install_hint('web')}")
