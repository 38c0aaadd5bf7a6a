"""docs/dashboard.md's mounting snippets run as written: inside FastAPI (with a
permission callable, under a path prefix) and beside an aiohttp application."""

from __future__ import annotations

import asyncio
import re
import socket
import types
from pathlib import Path

import httpx
import pytest
from asgi_lifespan import LifespanManager

DOC = Path(__file__).resolve().parents[2] / "docs" / "dashboard.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)


def load(index: int) -> types.ModuleType:
    module = types.ModuleType(f"dashboard_doc_{index}")
    exec(compile(SNIPPETS[index], f"docs/dashboard.md (snippet {index})", "exec"), module.__dict__)
    return module


async def test_fastapi_mount_with_a_permission_callable(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIOOUTBOX_DSN", dsn)
    app = load(0).app
    async with LifespanManager(app) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            assert (await client.get("/outbox/")).status_code == 403
            page = await client.get("/outbox/dead", headers={"x-forwarded-user": "carol"})
            assert page.status_code == 200
            assert "Retry selected" not in page.text  # read
            # every link and form of the mounted app stays under its prefix
            for target in re.findall(r'(?:href|action|src)="([^"]+)"', page.text):
                assert target.startswith("/outbox/") or target == "data:,", target
            alice = await client.get("/outbox/events", headers={"x-forwarded-user": "alice"})
            assert alice.status_code == 200 and "write" in alice.text
            js = await client.get("/outbox/static/dashboard.js", headers={"x-forwarded-user": "a"})
            assert js.status_code == 200 and "EventSource" in js.text


async def test_aiohttp_runs_it_beside(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from aiohttp import web

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AIOOUTBOX_DSN", dsn)
    monkeypatch.setenv("DASHBOARD_PORT", str(port))
    app = load(1).app
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(100):
                try:
                    r = await client.get(f"http://127.0.0.1:{port}/")
                    break
                except httpx.ConnectError:
                    await asyncio.sleep(0.1)
            assert r.status_code == 200 and "Overview" in r.text
            assert "read-only" in r.text
    finally:
        await runner.cleanup()
