"""A private primary with a streaming standby made by ``pg_basebackup``, for failover.

Both are `PrivatePostgres` servers on their own free ports; the standby's data
directory is a base backup of the primary with ``-R`` (``standby.signal`` and
``primary_conninfo`` written for it). `kill_primary` is a SIGKILL of the postmaster,
`promote` turns the standby into the new primary.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tests.faults.private_pg import PrivatePostgres

__all__ = ["ReplicaPair", "replica_pair"]


class Standby(PrivatePostgres):
    def __init__(self, primary: PrivatePostgres) -> None:
        super().__init__()
        self.primary = primary

    def init(self) -> None:
        self._run(
            "pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "postgres",
            "-D", str(self.data), "-R", "-X", "stream", "--checkpoint=fast", "--no-sync",
            timeout=120,
        )  # fmt: skip

    def promote(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "promote")


@dataclass
class ReplicaPair:
    primary: PrivatePostgres
    standby: Standby

    def dsn(self, database: str, *, read_write: bool = True) -> str:
        """Both hosts; with ``read_write`` a connection only lands on the primary."""
        hosts = f"127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
        attrs = "?target_session_attrs=read-write" if read_write else ""
        return f"postgresql://postgres@{hosts}/{database}{attrs}"

    def standby_dsn(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.standby.port}/{database}"

    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster (its backends exit on the postmaster's death)."""
        pid = int((self.primary.data / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        raise RuntimeError(f"the primary's postmaster {pid} survived SIGKILL")


@contextlib.contextmanager
def replica_pair() -> Iterator[ReplicaPair]:
    """A started primary and a started standby streaming from it; both destroyed on exit."""
    primary = PrivatePostgres()
    standby: Standby | None = None
    try:
        primary.init()
        primary.start()
        standby = Standby(primary)
        standby.init()
        standby.start()
        yield ReplicaPair(primary, standby)
    finally:
        if standby is not None:
            standby.destroy()
        # a SIGKILLed primary leaves a stale pid file; its backends exit by themselves
        with contextlib.suppress(subprocess.SubprocessError, RuntimeError, OSError):
            primary.destroy()
