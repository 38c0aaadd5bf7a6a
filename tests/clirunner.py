"""Run ``python -m aiooutbox`` as a subprocess, as users and supervisors do."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any aiooutbox or DATABASE_URL setting."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AIOOUTBOX_") and k != "DATABASE_URL"
    }
    env.update(extra)
    return env


@dataclass
class Result:
    rc: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


async def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Result:
    """Run one command to completion."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aiooutbox",
        *args,
        cwd=ROOT,
        env=env if env is not None else clean_env(),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


class Runner:
    """A long-running ``run`` command whose stderr is collected line by line."""

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, nofile: int | None = None
    ) -> None:
        self.args = args
        self.env = env if env is not None else clean_env()
        self.nofile = nofile  # a limit of open file descriptors for the process, if set
        self.lines: list[str] = []
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._new_line = asyncio.Event()

    async def __aenter__(self) -> Runner:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "aiooutbox",
            "run",
            *self.args,
            cwd=ROOT,
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=None if self.nofile is None else self._limit,
        )
        self._reader = asyncio.ensure_future(self._read())
        return self

    def _limit(self) -> None:
        import resource

        assert self.nofile is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._proc is not None and self._reader is not None
        if self._proc.returncode is None:
            self._proc.kill()
        await self._proc.wait()
        await self._reader

    async def _read(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        async for raw in self._proc.stderr:
            self.lines.append(raw.decode().rstrip("\n"))
            self._new_line.set()

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self._proc is not None
        self._proc.send_signal(sig)

    async def wait_for_line(self, pattern: str, timeout: float = 30) -> re.Match[str]:
        """Wait until a stderr line matches ``pattern``; return the match."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for line in self.lines[seen:]:
                match = re.search(pattern, line)
                if match:
                    return match
            seen = len(self.lines)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self._reader is not None and self._reader.done()):
                raise AssertionError(f"no stderr line matched {pattern!r}:\n{self.stderr}")
            self._new_line.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._new_line.wait(), remaining)

    async def wait(self, timeout: float = 30) -> int:
        """Wait for the process to exit; return its exit status."""
        assert self._proc is not None and self._reader is not None
        rc = await asyncio.wait_for(self._proc.wait(), timeout)
        await self._reader
        return rc
