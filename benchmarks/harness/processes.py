"""Consumers in child processes: ``python -m benchmarks.harness.child`` and the JSON-lines
protocol the parent speaks with it.

Consumers always run in a child process so that their CPU time, event loop and RSS are
their own; the parent loads data, runs producers and reads the child's JSON report from
its stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


class ChildError(RuntimeError):
    pass


@dataclass
class Child:
    """A consumer running in ``python -m benchmarks.harness.child``; talk to it with JSON lines."""

    process: asyncio.subprocess.Process
    spec: dict[str, Any]
    stderr_tail: list[str] = field(default_factory=list)
    _stderr_task: asyncio.Task[None] | None = None

    async def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        while True:
            line = await self.process.stdout.readline()
            if not line:
                await self.process.wait()
                raise ChildError(
                    f"child {self.spec.get('system')}/{self.spec.get('mode')} exited "
                    f"with {self.process.returncode}:\n" + "".join(self.stderr_tail[-30:])
                )
            text = line.decode().strip()
            if text.startswith("{"):
                message: dict[str, Any] = json.loads(text)
                return message

    async def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        message = await asyncio.wait_for(self.read(), timeout)
        if message.get("type") != "ready":
            raise ChildError(f"expected ready, got {message}")
        return message

    def send(self, **message: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(message) + "\n").encode())

    async def result(self, timeout: float) -> dict[str, Any]:
        message = await asyncio.wait_for(self.read(), timeout)
        if message.get("type") != "result":
            raise ChildError(f"expected result, got {message}")
        await asyncio.wait_for(self.process.wait(), 30)
        return message

    async def _pump_stderr(self) -> None:
        assert self.process.stderr is not None
        async for line in self.process.stderr:
            self.stderr_tail.append(line.decode(errors="replace"))
            del self.stderr_tail[:-200]

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


@contextlib.asynccontextmanager
async def child_process(
    spec: dict[str, Any], *, module: str = "benchmarks.harness.child"
) -> AsyncIterator[Child]:
    """Start a consumer child for ``spec`` (``module``: another child that speaks the
    same lines, e.g. `benchmarks.harness.soak_child`); kill it if the caller fails."""
    env = dict(os.environ)
    env.setdefault("PYTHONHASHSEED", "0")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        json.dumps(spec),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        limit=64 * 1024 * 1024,
    )
    child = Child(process, spec)
    child._stderr_task = asyncio.ensure_future(child._pump_stderr())
    try:
        yield child
    finally:
        child.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(process.wait(), 10)
        child._stderr_task.cancel()
