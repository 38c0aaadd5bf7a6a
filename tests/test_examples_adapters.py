"""The SQLAlchemy, psycopg and Django examples, run against the real database."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.test_examples import ORDERS, assert_all_settled
from tests.test_integrations import eventually, serve_asgi, statuses
from tests.test_readme import _blocks

ROOT = Path(__file__).resolve().parent.parent
PRODUCERS_DOC = ROOT / "docs" / "producers.md"


@pytest.fixture
def example_env(dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("AIOOUTBOX_DSN", dsn)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    return dsn


async def test_sqlalchemy_example(example_env: str) -> None:
    from examples.sqlalchemy_app import app

    async with serve_asgi(app) as client:
        ids = []
        for order in ORDERS:
            response = await client.post("/orders", json=order)
            assert response.status_code == 201, response.text
            ids.append(response.json()["id"])
        assert (await client.post("/orders", json={"email": "x@y.z"})).status_code == 422
        assert (await client.get("/orders/999999")).status_code == 404

        async def all_sent() -> bool:
            for order_id in ids:
                body = (await client.get(f"/orders/{order_id}")).json()
                if body["confirmation_email"]["status"] != "sent":
                    return False
            return True

        await eventually(all_sent, "every confirmation email")
    await assert_all_settled(example_env, len(ORDERS))
    conn = await asyncpg.connect(example_env)
    try:
        keys = [
            r[0] for r in await conn.fetch("SELECT dedupe_key FROM outbox_events_all ORDER BY id")
        ]
    finally:
        await conn.close()
    assert keys == [f"order-{i}-created" for i in ids]


async def run(*args: str, env: dict[str, str], timeout: float = 60) -> str:
    proc = await asyncio.create_subprocess_exec(
        *args, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_psycopg_script(example_env: str) -> None:
    env = {**os.environ, "AIOOUTBOX_DSN": example_env}
    out = await run(sys.executable, "examples/psycopg_script.py", env=env)
    assert "blocking: order 1, event" in out
    assert "rolled-back savepoint's event is gone" in out
    conn = await asyncpg.connect(example_env)
    try:
        rows = await conn.fetch(
            "SELECT e.payload->>'order_id', o.item FROM outbox_events_all e"
            " JOIN orders o ON o.id = (e.payload->>'order_id')::bigint ORDER BY e.id"
        )
        assert [tuple(r) for r in rows] == [("1", "teapot"), ("2", "compiler"), ("3", "lock")]
        assert await conn.fetchval("SELECT count(*) FROM outbox_events_all") == 3
    finally:
        await conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@asynccontextmanager
async def background(*args: str, env: dict[str, str]) -> AsyncIterator[Any]:
    """A child process for the block, stopped with SIGTERM (as a deployment would)."""
    proc = await asyncio.create_subprocess_exec(
        *args, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        proc.stderr_text = err.decode()  # type: ignore[attr-defined]


async def test_django_example_with_the_consumer_beside_it(example_env: str) -> None:
    env = {**os.environ, "AIOOUTBOX_DSN": example_env, "PYTHONUNBUFFERED": "1"}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    manage = [sys.executable, "examples/django_app/manage.py"]
    await run(*manage, "migrate", env=env)
    port = free_port()
    consumer_args = ["-m", "aiooutbox", "run", "examples.django_app.orders_site.jobs:handlers"]
    async with (
        background(*manage, "runserver", "--noreload", f"127.0.0.1:{port}", env=env) as site,
        background(sys.executable, *consumer_args, "--migrate", env=env) as consumer,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client,
    ):

        async def serving() -> bool:
            try:
                await client.get("/orders/0")
            except httpx.TransportError:
                return False
            return True

        await eventually(serving, "the Django site to listen")
        ids = []
        for order in ORDERS:
            response = await client.post("/orders", json=order)
            assert response.status_code == 201, response.text
            ids.append(response.json()["id"])
        assert (await client.post("/orders", json={"email": "x@y.z"})).status_code == 422
        assert (await client.get("/orders/999999")).status_code == 404

        async def all_sent() -> bool:
            for order_id in ids:
                body = (await client.get(f"/orders/{order_id}")).json()
                if body["confirmation_email"]["status"] != "sent":
                    return False
            return True

        await eventually(all_sent, "every confirmation email from the consumer beside it")
        assert site.returncode is None
        assert consumer.returncode is None
    assert consumer.returncode == 0, consumer.stderr_text
    await assert_all_settled(example_env, len(ORDERS))
    conn = await asyncpg.connect(example_env)
    try:
        assert await statuses(conn) == {"done": len(ORDERS)}
    finally:
        await conn.close()


@pytest.mark.parametrize("index", range(len(_blocks("python", PRODUCERS_DOC))))
async def test_producers_doc_snippet_runs(index: int, dsn: str, tmp_path: Path) -> None:
    script = tmp_path / f"producers_{index}.py"
    script.write_text(_blocks("python", PRODUCERS_DOC)[index])
    env = {**os.environ, "AIOOUTBOX_DSN": dsn}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    out = await run(sys.executable, str(script), env=env)
    assert out, "each snippet prints what it did"
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT topic, payload::text FROM outbox_events_all ORDER BY id")
    finally:
        await conn.close()
    if index == 0:
        assert "kept [1, 2, 3]" in out
        assert [r[1] for r in rows] == ['{"kept": 1}', '{"kept": 2}', '{"kept": 3}']
    else:
        assert [tuple(r) for r in rows] == [("docs.django", '{"n": 1}')]
