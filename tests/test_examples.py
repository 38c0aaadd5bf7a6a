"""The examples and the docs' snippets, run against the real database."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import types
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from fastapi import FastAPI

import aiooutbox
from aiooutbox.integrations.background import run_consumer
from tests.test_integrations import TIMEOUT, eventually, serve_aiohttp, serve_asgi, statuses

ROOT = Path(__file__).resolve().parent.parent
ORDERS = [
    {"email": "ada@example.com", "item": "teapot", "quantity": 1},
    {"email": "grace@example.com", "item": "compiler", "quantity": 2},
    {"email": "edsger@example.com", "item": "semaphore", "quantity": 3},
]


@pytest.fixture
def example_env(dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("AIOOUTBOX_DSN", dsn)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    return dsn


async def assert_all_settled(dsn: str, events: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        assert await statuses(conn) == {"done": events}  # nothing left processing
        assert await conn.fetchval("SELECT count(*) FROM emails") == events
    finally:
        await conn.close()


# -- the orders services --------------------------------------------------------------


async def test_fastapi_example(example_env: str) -> None:
    from examples.fastapi_app import app

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
        shown = (await client.get(f"/orders/{ids[1]}")).json()
        assert shown["item"] == "compiler"
        assert shown["quantity"] == 2
        assert shown["confirmation_email"]["sent_at"]
    await assert_all_settled(example_env, len(ORDERS))


async def test_aiohttp_example(example_env: str) -> None:
    from examples.aiohttp_app import create_app

    async with serve_aiohttp(create_app()) as client:
        ids = []
        for order in ORDERS:
            response = await client.post("/orders", json=order)
            assert response.status == 201, await response.text()
            ids.append((await response.json())["id"])
        assert (await client.post("/orders", json={"email": "x@y.z"})).status == 422
        assert (await client.get("/orders/999999")).status == 404

        async def all_sent() -> bool:
            for order_id in ids:
                body = await (await client.get(f"/orders/{order_id}")).json()
                if body["confirmation_email"]["status"] != "sent":
                    return False
            return True

        await eventually(all_sent, "every confirmation email")
        shown = await (await client.get(f"/orders/{ids[2]}")).json()
        assert shown["email"] == "edsger@example.com"
        assert shown["confirmation_email"]["sent_at"]
    await assert_all_settled(example_env, len(ORDERS))


# -- producer.sql -----------------------------------------------------------------------


async def test_producer_sql_inserts_once_and_wakes_a_consumer(pool: asyncpg.Pool) -> None:
    sql = (ROOT / "examples" / "producer.sql").read_text()
    seen: list[Any] = []

    async def handle(event: aiooutbox.Event) -> None:
        seen.append((event.dedupe_key, event.payload))

    async with run_consumer(pool, {"orders.created": handle}):
        await pool.execute(sql)
        await pool.execute(sql)  # the same key again: a no-op
        await eventually(lambda: bool(seen), "the consumer to handle the SQL-produced event")
    assert seen == [("order-42-created", {"order_id": 42, "email": "ada@example.com"})]
    assert await statuses(pool) == {"done": 1}


# -- worker.py's webhook publisher --------------------------------------------------------


class Webhook:
    """A local webhook receiver answering with a configurable status."""

    def __init__(self) -> None:
        self.status = 200
        self.headers: dict[str, str] = {}
        self.received: list[tuple[dict[str, Any], str | None]] = []
        app = web.Application()
        app.router.add_post("/hook", self.receive)
        self.server = TestServer(app)

    async def receive(self, request: web.Request) -> web.Response:
        self.received.append((await request.json(), request.headers.get("Idempotency-Key")))
        return web.Response(status=self.status, headers=self.headers)

    @property
    def url(self) -> str:
        return str(self.server.make_url("/hook"))


@pytest.fixture
async def webhook(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Webhook]:
    hook = Webhook()
    await hook.server.start_server()
    monkeypatch.setenv("WEBHOOK_URL", hook.url)
    try:
        yield hook
    finally:
        await hook.server.close()


def an_event(event_id: int = 7) -> aiooutbox.Event:
    return aiooutbox.Event(event_id, "orders.created", {"order_id": 42}, "order-42-created")


async def test_worker_publishes_to_the_webhook(pool: asyncpg.Pool, webhook: Webhook) -> None:
    from examples.worker import handlers

    assert isinstance(handlers, aiooutbox.Router)
    assert set(handlers) == {"orders.created", "orders.cancelled"}
    async with run_consumer(pool, handlers):
        event_id = await aiooutbox.enqueue(
            pool, "orders.created", {"order_id": 42}, dedupe_key="order-42-created"
        )
        await eventually(lambda: _status_is(pool, event_id, "done"), "the event to be done")
    body, idempotency_key = webhook.received[0]
    assert body["id"] == event_id
    assert body["topic"] == "orders.created"
    assert body["payload"] == {"order_id": 42}
    assert idempotency_key == "order-42-created"


async def _status_is(pool: asyncpg.Pool, event_id: int | None, status: str) -> bool:
    found = await pool.fetchval(
        "SELECT status::text FROM outbox_events_all WHERE id = $1", event_id
    )
    return bool(found == status)


async def test_worker_runs_under_the_standalone_runner(
    dsn: str, pool: asyncpg.Pool, webhook: Webhook
) -> None:
    env = {**os.environ, "WEBHOOK_URL": webhook.url, "PYTHONPATH": str(ROOT)}
    runner = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "aiooutbox", "run", "examples.worker:handlers", "--dsn", dsn),
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        event_id = await aiooutbox.enqueue(pool, "orders.cancelled", {"order_id": 9})
        # a fresh interpreter imports, connects and checks the schema first: seconds on a
        # loaded machine
        await eventually(
            lambda: _status_is(pool, event_id, "done"), "the runner to publish", timeout=60
        )
        runner.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(runner.communicate(), TIMEOUT)
        assert runner.returncode == 0, output.decode()
    finally:
        if runner.returncode is None:
            runner.kill()
            await runner.wait()
    assert webhook.received[0][0]["topic"] == "orders.cancelled"
    assert await statuses(pool) == {"done": 1}


async def test_worker_retries_when_the_webhook_fails(pool: asyncpg.Pool, webhook: Webhook) -> None:
    from examples.worker import handlers, publish

    webhook.status = 500
    with pytest.raises(aiooutbox.Retry, match="HTTP 500") as raised:
        await publish(an_event())
    assert 0 <= raised.value.delay <= 2.0

    # through a consumer: 503 with Retry-After schedules the retry when the server asked
    webhook.status, webhook.headers = 503, {"Retry-After": "3600"}
    async with run_consumer(pool, handlers):
        event_id = await aiooutbox.enqueue(pool, "orders.created", {"order_id": 1})
        await eventually(lambda: _status_is(pool, event_id, "retry"), "the event to be retried")
    row = await pool.fetchrow(
        "SELECT last_error, available_at, attempts FROM outbox_events_all WHERE id = $1", event_id
    )
    assert row["last_error"] == "Retry: webhook answered HTTP 503"
    assert row["available_at"] > datetime.now(UTC) + timedelta(minutes=59)
    assert row["attempts"] == 1


async def test_worker_gives_up_on_a_refusal_and_retries_when_unreachable(
    webhook: Webhook,
) -> None:
    from examples.worker import publish

    webhook.status = 400
    with pytest.raises(aiooutbox.Dead, match="HTTP 400"):
        await publish(an_event())
    await webhook.server.close()  # nobody listens there any more
    with pytest.raises(aiooutbox.Retry, match="unreachable"):
        await publish(an_event())


# -- docs/web.md: every snippet runs -------------------------------------------------------

SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "web.md").read_text(), re.DOTALL)
USERS = "CREATE TABLE users (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, email TEXT)"


def load(source: str, index: int) -> types.ModuleType:
    module = types.ModuleType(f"docs_web_snippet_{index}")
    exec(compile(source, f"docs/web.md (snippet {index})", "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
async def test_docs_snippet(index: int, example_env: str, conn: asyncpg.Connection) -> None:
    await conn.execute(USERS)
    module = load(SNIPPETS[index], index)
    app = getattr(module, "app", None)
    if isinstance(app, FastAPI):
        async with serve_asgi(app) as client:
            response = await client.post("/users", params={"email": "ada@example.com"})
            assert response.status_code == 200, response.text
            await eventually(lambda: _all_done(conn), "the welcome event")
    elif isinstance(app, web.Application):
        async with serve_aiohttp(app) as http:
            reply = await http.post("/users", params={"email": "ada@example.com"})
            assert reply.status == 200, await reply.text()
            await eventually(lambda: _all_done(conn), "the welcome event")
    else:
        main = asyncio.create_task(module.main())
        await eventually(lambda: _all_done(conn), "the welcome event")
        main.cancel()  # what asyncio.run() does on Ctrl-C
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(main, TIMEOUT)
    assert await statuses(conn) == {"done": 1}
    assert await conn.fetchval("SELECT email FROM users") == "ada@example.com"


async def _all_done(conn: asyncpg.Connection) -> bool:
    found = await statuses(conn)
    return bool(found) and set(found) == {"done"}


def test_docs_have_the_three_snippets() -> None:
    assert len(SNIPPETS) == 3
