"""Running consumers inside applications: the background helper, FastAPI and aiohttp."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from asgi_lifespan import LifespanManager
from fastapi import FastAPI, HTTPException

import aiooutbox
from aiooutbox.integrations import aiohttp as outbox_aiohttp
from aiooutbox.integrations import fastapi as outbox_fastapi
from aiooutbox.integrations.background import run_consumer

ROOT = Path(__file__).resolve().parent.parent
# generous: a bound on a loaded 2-core machine, not a speed target (the waits end as soon as
# their condition holds)
TIMEOUT = 30.0
NOTES = "CREATE TABLE notes (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, body TEXT)"


async def eventually(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool],
    what: str,
    timeout: float = TIMEOUT,
) -> None:
    """Poll ``check`` until it is true; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


async def statuses(db: asyncpg.Pool | asyncpg.Connection) -> dict[str, int]:
    rows = await db.fetch("SELECT status::text, count(*) FROM outbox_events_all GROUP BY 1")
    return {r[0]: r[1] for r in rows}


def consumer_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("aiooutbox consumer")]


async def nothing(event: aiooutbox.Event) -> None:
    pass


# -- the core stays framework-free ----------------------------------------------------


def test_importing_the_core_imports_no_web_framework() -> None:
    code = (
        "import sys, aiooutbox, aiooutbox.integrations, aiooutbox.integrations.background\n"
        "web = {'fastapi', 'starlette', 'aiohttp', 'httpx', 'pydantic'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in web))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.stdout.strip() == "[]", result.stdout


# -- run_consumer -----------------------------------------------------------------------


async def test_run_consumer_is_ready_on_entry_and_settles_everything_on_exit(
    pool: asyncpg.Pool,
) -> None:
    handled: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        handled.append(event.payload["n"])

    async with run_consumer(pool, {"t": handle}, concurrency=8) as consumer:
        assert consumer.running
        assert consumer.listening  # ready means LISTEN is up: no wake-up is missed
        await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", {"n": n}) for n in range(30)])
        await eventually(lambda: len(handled) >= 30, "30 handled events")
        await eventually(lambda: _done(pool, 30), "30 done rows")
    assert not consumer.running
    assert consumer_tasks() == []
    assert sorted(handled) == list(range(30))
    assert await statuses(pool) == {"done": 30}


async def _done(pool: asyncpg.Pool, n: int) -> bool:
    return (await statuses(pool)).get("done", 0) == n


async def test_exit_lets_a_running_handler_finish(pool: asyncpg.Pool) -> None:
    started, finished = asyncio.Event(), asyncio.Event()

    async def slow(event: aiooutbox.Event) -> None:
        started.set()
        await asyncio.sleep(0.3)  # the handler's own work, running across shutdown
        finished.set()

    async with run_consumer(pool, {"t": slow}, shutdown_grace=10):
        await aiooutbox.enqueue(pool, "t", {})
        await asyncio.wait_for(started.wait(), TIMEOUT)
    assert finished.is_set()
    assert await statuses(pool) == {"done": 1}


async def test_exit_releases_a_handler_past_the_grace(pool: asyncpg.Pool) -> None:
    started = asyncio.Event()

    async def stuck(event: aiooutbox.Event) -> None:
        started.set()
        await asyncio.Event().wait()

    async with run_consumer(pool, {"t": stuck}, shutdown_grace=0.1):
        await aiooutbox.enqueue(pool, "t", {})
        await asyncio.wait_for(started.wait(), TIMEOUT)
    row = await pool.fetchrow(
        "SELECT status::text, last_error, lease_expires_at FROM outbox_events_all"
    )
    assert row["status"] == "retry"  # released: due again at once, the attempt counted
    assert "released" in row["last_error"]
    assert row["lease_expires_at"] is None


async def test_missing_schema_fails_on_entry(empty_dsn: str) -> None:
    async with asyncpg.create_pool(empty_dsn, min_size=1, max_size=2) as pool:
        with pytest.raises(aiooutbox.SchemaNotReady, match="migrate"):
            async with run_consumer(pool, {"t": nothing}):
                pytest.fail("entered without a schema")
    assert consumer_tasks() == []


async def test_unreachable_listener_fails_on_entry(pool: asyncpg.Pool) -> None:
    # the LISTEN connection fails inside the consumer's task; entry raises it
    with pytest.raises(OSError):
        async with run_consumer(
            pool, {"t": nothing}, listen_dsn="postgresql://postgres@127.0.0.1:1/none"
        ):
            pytest.fail("entered without a listener")
    assert consumer_tasks() == []


async def test_bad_handlers_and_options_fail_before_any_task(pool: asyncpg.Pool) -> None:
    def not_async(event: aiooutbox.Event) -> None:
        pass

    with pytest.raises(TypeError, match="async"):
        async with run_consumer(pool, {"t": not_async}):
            pytest.fail("entered")
    with pytest.raises(TypeError, match="concurency"):
        async with run_consumer(pool, {"t": nothing}, concurency=3):
            pytest.fail("entered")
    assert consumer_tasks() == []


async def test_a_crash_is_logged_at_once_and_raised_on_exit(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)

    async def app_lifetime() -> None:
        async with run_consumer(pool, {"t": nothing}, poll_interval=0.05) as consumer:
            await pool.close()  # the app's mistake: the pool closes under the consumer
            await eventually(lambda: not consumer.running, "the consumer to fail")
            await eventually(
                lambda: any(
                    r.name == "aiooutbox.integrations.background" and r.levelname == "ERROR"
                    for r in caplog.records
                ),
                "the failure to be logged while the app still runs",
            )

    try:
        with pytest.raises(aiooutbox.OutboxError, match="pool was closed"):
            await app_lifetime()
    finally:
        pool.terminate()


async def test_an_error_in_the_block_stops_the_consumer_and_propagates(pool: asyncpg.Pool) -> None:
    consumers: list[aiooutbox.OutboxConsumer] = []

    async def failing_startup() -> None:
        async with run_consumer(pool, {"t": nothing}) as consumer:
            consumers.append(consumer)
            raise LookupError("the next startup step failed")

    with pytest.raises(LookupError, match="next startup step"):
        await failing_startup()
    assert not consumers[0].running
    assert consumer_tasks() == []


async def test_cancelling_the_host_stops_gracefully_then_reraises(pool: asyncpg.Pool) -> None:
    entered, started = asyncio.Event(), asyncio.Event()
    finished: list[int] = []

    async def slow(event: aiooutbox.Event) -> None:
        started.set()
        await asyncio.sleep(0.3)
        finished.append(event.id)

    async def host() -> None:
        async with run_consumer(pool, {"t": slow}, shutdown_grace=10):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(host())
    await asyncio.wait_for(entered.wait(), TIMEOUT)
    await aiooutbox.enqueue(pool, "t", {})
    await asyncio.wait_for(started.wait(), TIMEOUT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(finished) == 1
    assert consumer_tasks() == []
    assert await statuses(pool) == {"done": 1}


# -- FastAPI --------------------------------------------------------------------------


def notes_api(dsn: str, handlers: dict[str, Any] | None) -> FastAPI:
    options = {"poll_interval": 0.5} if handlers else {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with (
            asyncpg.create_pool(dsn, min_size=1, max_size=5) as pool,
            outbox_fastapi.outbox_lifespan(app, pool, handlers, **options),
        ):
            yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/notes", status_code=201)
    async def create(
        body: str, conn: outbox_fastapi.TransactionDep, fail: bool = False
    ) -> dict[str, int]:
        note_id: int = await conn.fetchval(
            "INSERT INTO notes (body) VALUES ($1) RETURNING id", body
        )
        await aiooutbox.enqueue(conn, "notes.created", {"id": note_id})
        if fail:
            raise HTTPException(status_code=409, detail="changed my mind")
        return {"id": note_id}

    @app.post("/direct", status_code=201)
    async def direct(pool: outbox_fastapi.PoolDep) -> dict[str, int | None]:
        return {"event": await aiooutbox.enqueue(pool, "notes.created", {"id": 0})}

    return app


@asynccontextmanager
async def serve_asgi(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        LifespanManager(app, startup_timeout=30, shutdown_timeout=30) as manager,
        httpx.AsyncClient(
            transport=httpx.ASGITransport(manager.app), base_url="http://test"
        ) as client,
    ):
        yield client


def notes_handlers(seen: list[int]) -> dict[str, Any]:
    async def on_note(event: aiooutbox.Event) -> None:
        seen.append(event.payload["id"])

    return {"notes.created": on_note}


async def test_fastapi_request_transaction_commits_or_rolls_back_with_its_event(
    dsn: str, conn: asyncpg.Connection
) -> None:
    await conn.execute(NOTES)
    seen: list[int] = []
    app = notes_api(dsn, notes_handlers(seen))
    async with serve_asgi(app) as client:
        assert isinstance(app.state.aiooutbox_consumer, aiooutbox.OutboxConsumer)
        ok = await client.post("/notes", params={"body": "kept"})
        assert ok.status_code == 201, ok.text
        refused = await client.post("/notes", params={"body": "dropped", "fail": True})
        assert refused.status_code == 409
        await eventually(lambda: seen == [ok.json()["id"]], "the committed note's event")
    assert await conn.fetchval("SELECT array_agg(body) FROM notes") == ["kept"]
    assert await statuses(conn) == {"done": 1}  # the rolled-back request left no event
    assert not hasattr(app.state, "aiooutbox_pool")


async def test_fastapi_transaction_commits_before_the_response_is_sent(
    dsn: str, conn: asyncpg.Connection
) -> None:
    await conn.execute(NOTES)
    app = notes_api(dsn, None)
    visible_when_answering: list[int] = []

    async def spy(scope: Any, receive: Any, send: Any) -> None:
        async def spying_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                visible_when_answering.append(await conn.fetchval("SELECT count(*) FROM notes"))
            await send(message)

        await manager.app(scope, receive, spying_send)

    async with (
        LifespanManager(app) as manager,
        httpx.AsyncClient(transport=httpx.ASGITransport(spy), base_url="http://t") as client,
    ):
        response = await client.post("/notes", params={"body": "visible"})
        assert response.status_code == 201
    assert visible_when_answering == [1]


async def test_fastapi_producer_only_app(dsn: str, conn: asyncpg.Connection) -> None:
    await conn.execute(NOTES)
    app = notes_api(dsn, None)
    async with serve_asgi(app) as client:
        assert not hasattr(app.state, "aiooutbox_consumer")
        response = await client.post("/direct")
        assert response.status_code == 201
        assert isinstance(response.json()["event"], int)
    assert await statuses(conn) == {"pending": 1}  # no consumer ran


@pytest.mark.parametrize("handlers", [None, {"notes.created": nothing}])
async def test_fastapi_startup_fails_without_schema(
    empty_dsn: str, handlers: dict[str, Any] | None
) -> None:
    with pytest.raises(aiooutbox.SchemaNotReady):
        async with serve_asgi(notes_api(empty_dsn, handlers)):
            pytest.fail("the app started without a schema")
    assert consumer_tasks() == []


@pytest.mark.parametrize("handlers", [None, {"t": nothing}])
async def test_fastapi_lifespan_refuses_what_is_not_a_pool(
    conn: asyncpg.Connection, handlers: dict[str, Any] | None
) -> None:
    # a connection passes the schema check, then fails every request (no acquire())
    for thing in (conn, None, "postgresql://postgres@127.0.0.1/db"):
        app = FastAPI()
        with pytest.raises(TypeError, match=r"asyncpg\.Pool"):
            async with outbox_fastapi.outbox_lifespan(app, thing, handlers):
                pytest.fail(f"started with {thing!r}")
        assert not hasattr(app.state, "aiooutbox_pool")
    assert consumer_tasks() == []


async def test_fastapi_dependency_without_the_lifespan_says_what_to_do() -> None:
    app = FastAPI()

    @app.get("/")
    async def index(pool: outbox_fastapi.PoolDep) -> None:
        pass

    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        with pytest.raises(RuntimeError, match="outbox_lifespan"):
            await client.get("/")


# -- aiohttp --------------------------------------------------------------------------


def notes_app(dsn: str, handlers: dict[str, Any] | None) -> web.Application:
    options: dict[str, Any] = {"poll_interval": 0.5} if handlers else {}

    async def database(app: web.Application) -> AsyncIterator[None]:
        async with asyncpg.create_pool(dsn, min_size=1, max_size=5) as pool:
            app[outbox_aiohttp.POOL] = pool
            yield

    async def create(request: web.Request) -> web.Response:
        async with outbox_aiohttp.transaction(request) as conn:
            note_id = await conn.fetchval(
                "INSERT INTO notes (body) VALUES ($1) RETURNING id", request.query["body"]
            )
            await aiooutbox.enqueue(conn, "notes.created", {"id": note_id})
            if "fail" in request.query:
                raise web.HTTPConflict(text="changed my mind")
        return web.json_response({"id": note_id}, status=201)

    app = web.Application()
    app.cleanup_ctx.append(database)
    app.cleanup_ctx.append(outbox_aiohttp.outbox_ctx(handlers, **options))
    app.router.add_post("/notes", create)
    return app


@asynccontextmanager
async def serve_aiohttp(app: web.Application) -> AsyncIterator[TestClient[Any, Any]]:
    server = TestServer(app)
    try:
        await server.start_server()  # runs the cleanup contexts' startup halves
    except BaseException:
        await server.close()  # as web.run_app does: exit the contexts that entered
        raise
    async with TestClient(server) as client:
        yield client


async def test_aiohttp_request_transaction_commits_or_rolls_back_with_its_event(
    dsn: str, conn: asyncpg.Connection
) -> None:
    await conn.execute(NOTES)
    seen: list[int] = []
    app = notes_app(dsn, notes_handlers(seen))
    async with serve_aiohttp(app) as client:
        assert app[outbox_aiohttp.CONSUMER].running
        ok = await client.post("/notes", params={"body": "kept"})
        assert ok.status == 201, await ok.text()
        refused = await client.post("/notes", params={"body": "dropped", "fail": "1"})
        assert refused.status == 409
        note_id = (await ok.json())["id"]
        await eventually(lambda: seen == [note_id], "the committed note's event")
    assert not app[outbox_aiohttp.CONSUMER].running
    assert await conn.fetchval("SELECT array_agg(body) FROM notes") == ["kept"]
    assert await statuses(conn) == {"done": 1}


@pytest.mark.parametrize("handlers", [None, {"notes.created": nothing}])
async def test_aiohttp_startup_fails_without_schema(
    empty_dsn: str, handlers: dict[str, Any] | None
) -> None:
    with pytest.raises(aiooutbox.SchemaNotReady):
        async with serve_aiohttp(notes_app(empty_dsn, handlers)):
            pytest.fail("the app started without a schema")
    assert consumer_tasks() == []


async def test_aiohttp_without_a_pool_says_what_to_do() -> None:
    app = web.Application()
    app.cleanup_ctx.append(outbox_aiohttp.outbox_ctx({"t": nothing}))
    with pytest.raises(RuntimeError, match="cleanup context"):
        async with serve_aiohttp(app):
            pytest.fail("the app started without a pool")


@pytest.mark.parametrize("handlers", [None, {"t": nothing}])
async def test_aiohttp_startup_refuses_what_is_not_a_pool(
    conn: asyncpg.Connection, handlers: dict[str, Any] | None
) -> None:
    async def database(app: web.Application) -> AsyncIterator[None]:
        app[outbox_aiohttp.POOL] = conn  # a common mix-up
        yield

    app = web.Application()
    app.cleanup_ctx.append(database)
    app.cleanup_ctx.append(outbox_aiohttp.outbox_ctx(handlers))
    with pytest.raises(TypeError, match=r"asyncpg\.Pool"):
        async with serve_aiohttp(app):
            pytest.fail("the app started with a connection for a pool")
    assert consumer_tasks() == []


def test_aiohttp_misuse_fails_while_building_the_app() -> None:
    with pytest.raises(TypeError, match="async"):
        outbox_aiohttp.outbox_ctx({"t": lambda event: None})
    with pytest.raises(TypeError, match="need handlers"):
        outbox_aiohttp.outbox_ctx(None, concurrency=4)
