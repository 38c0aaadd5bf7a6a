"""Start ``python -m aiooutbox dashboard`` as a subprocess (a real uvicorn server) on a
free port, and read the address from its startup line; or serve an app made by
`aiooutbox.web.create_app` with uvicorn inside the test's own event loop, so that the
test can read the app's state (its live hub's counters) while browsers use it."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tests.clirunner import ROOT, clean_env

_LINE = re.compile(r"dashboard for \S+ on (http://\S+/) \((.*)\)")


@dataclass
class Dashboard:
    url: str  # ends with /
    access: str  # what the startup line says about permissions
    proc: asyncio.subprocess.Process
    log: list[str] = field(default_factory=list)  # its stderr lines so far

    def at(self, path: str) -> str:
        return self.url.rstrip("/") + path


@contextlib.asynccontextmanager
async def dashboard(
    dsn: str, *args: str, env: dict[str, str] | None = None, host: str = "127.0.0.1"
) -> AsyncIterator[Dashboard]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aiooutbox",
        "dashboard",
        "--dsn",
        dsn,
        "--host",
        host,
        "--port",
        "0",
        "--refresh",
        "0.5s",
        *args,
        cwd=ROOT,
        env=clean_env(**(env or {})),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(30):
            while True:
                raw = await proc.stderr.readline()
                if not raw:
                    raise AssertionError(f"the dashboard exited: {''.join(seen)}")
                line = raw.decode()
                seen.append(line)
                match = _LINE.search(line)
                if match:
                    break
        url = match[1].replace("0.0.0.0", "127.0.0.1")
        drain = asyncio.create_task(_drain(proc.stderr, seen))
        try:
            yield Dashboard(url, match[2], proc, seen)
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGINT)
                try:
                    await asyncio.wait_for(proc.wait(), 15)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
            await drain
        errors = [line for line in seen if "Traceback" in line or "ERROR" in line]
        assert not errors, "".join(seen)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _drain(stream: asyncio.StreamReader, seen: list[str]) -> None:
    while raw := await stream.readline():
        seen.append(raw.decode())


@contextlib.asynccontextmanager
async def in_process(app: Any) -> AsyncIterator[str]:
    """``app`` served by uvicorn in this event loop on a free loopback port, for the
    block; yields its URL (ends with /). The app's lifespan runs (its shutdown closes the
    dashboard's live hub)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=3
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(30):
            while not server.started:  # uvicorn has no started event
                if task.done():
                    await task
                    raise AssertionError("uvicorn stopped before it served")
                await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        sock.close()
