"""The operator dashboard: a web UI over one outbox (the ``web`` extra).

``python -m aiooutbox dashboard --dsn DSN`` serves it; `create_app` returns the same
ASGI application to mount in your own (``app.mount("/outbox", create_app(pool=pool))``).
See docs/dashboard.md. The core library never imports this package; importing it
without the ``web`` extra installed (``pip install -e '.[web]'`` in a clone of
aiooutbox) raises an ImportError that says what to install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["BasicAuth", "Permission", "create_app", "credentials_from_env"]

if TYPE_CHECKING:
    from ._app import create_app
    from ._auth import BasicAuth, Permission, credentials_from_env


def __getattr__(name: str) -> Any:
    # lazy, so that the command line can register `dashboard` without the extra
    if name == "create_app":
        from ._deps import require

        require()
        from ._app import create_app

        return create_app
    if name in ("BasicAuth", "Permission", "credentials_from_env"):
        from . import _auth

        return getattr(_auth, name)
    raise AttributeError(f"module 'aiooutbox.web' has no attribute {name!r}")
