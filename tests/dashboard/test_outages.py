"""The dashboard command when its database goes away or stops answering, and when it is
stopped: a page answers 503 with a one-line reason (and the log has one warning line,
no traceback) while the database refuses connections or the network to it passes
nothing, within a bound, and pages work again once it is back; stopping the command
with a live stream open ends that stream and exits at once. The real command, a real
PostgreSQL (our own test database switched off with ALLOW_CONNECTIONS), and a TCP proxy
the test starts and freezes."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
import httpx
import pytest

from tests.conftest import Databases
from tests.dashboard.server import dashboard

pytestmark = pytest.mark.slow

PAGES = ["/", "/events", "/dead", "/events/1", "/topics/t", "/consumers", "/audit"]


def _database(dsn: str) -> str:
    return urlsplit(dsn).path.lstrip("/")


async def _admin(databases: Databases, sql: str) -> None:
    conn = await asyncpg.connect(databases.admin_dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def _timed(client: httpx.AsyncClient, url: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = await client.get(url)
    return response, time.monotonic() - started


async def _refused(client: httpx.AsyncClient, url: str, bound: float) -> tuple[httpx.Response, int]:
    """The first answer to ``url`` that is not a page (one read before the outage may be
    served from the view's cache for a while), each within ``bound`` seconds; and how
    many answers it took."""
    async with asyncio.timeout(60):
        for tries in range(1, 1000):
            r, took = await _timed(client, url)
            assert took < bound, f"{url} answered {r.status_code} after {took:.1f} s"
            if r.status_code not in (200, 404):
                return r, tries
            await asyncio.sleep(0.5)
    raise AssertionError(f"{url} kept answering {r.status_code}")


async def test_a_database_that_refuses_connections_is_a_503_and_pages_come_back(
    dsn: str, databases: Databases
) -> None:
    name = _database(dsn)
    async with dashboard(dsn) as d, httpx.AsyncClient(timeout=60) as client:
        for path in PAGES:
            assert (await client.get(d.at(path))).status_code in (200, 404), path
        logged = len(d.log)
        await _admin(databases, f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        try:
            await _admin(
                databases,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                f" WHERE datname = '{name}' AND pid <> pg_backend_pid()",
            )
            await asyncio.sleep(0.5)
            for path in PAGES:
                r, _ = await _refused(client, d.at(path), 20)
                assert r.status_code == 503, (path, r.status_code, r.text[-300:])
                assert r.text.startswith("database unavailable: "), r.text
                assert "not currently accepting connections" in r.text or "terminat" in r.text
                assert r.text.count("\n") == 1 and "internal error" not in r.text
                assert "content-security-policy" in r.headers
            assert (await client.get(d.at("/healthz"))).status_code == 200
        finally:
            await _admin(databases, f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        await asyncio.sleep(0.2)
        outage = d.log[logged:]
        warnings = [line for line in outage if "database unavailable" in line]
        assert len(warnings) >= len(PAGES), "".join(outage)  # one a 503
        assert all("WARNING" in line for line in warnings), "".join(outage)
        traced = [line for line in outage if "Traceback" in line or line.startswith(" ")]
        assert not traced, "".join(outage)
        # back: every page answers again, with no restart
        for path in PAGES:
            r = await client.get(d.at(path))
            assert r.status_code in (200, 404), (path, r.status_code, r.text[-300:])


class FreezingProxy:
    """A TCP proxy to PostgreSQL that can stop passing data (a network that drops
    everything: connections stay open, nothing arrives) and start again."""

    def __init__(self, dsn: str) -> None:
        parts = urlsplit(dsn)
        port = parts.port or 5432
        # the embedded server listens on a Unix socket only (``?host=/its/dir``)
        socket_dir = parse_qs(parts.query).get("host", [""])[0]
        self.unix = f"{socket_dir}/.s.PGSQL.{port}" if socket_dir.startswith("/") else None
        self.target = (parts.hostname or "127.0.0.1", port)
        self.frozen = asyncio.Event()
        self.thawed = asyncio.Event()
        self.thawed.set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []

    def freeze(self) -> None:
        self.thawed.clear()

    def thaw(self) -> None:
        self.thawed.set()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await reader.read(65536):
                await self.thawed.wait()
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.thawed.wait()  # frozen: accepted, and nothing more
        if self.unix is not None:
            up_reader, up_writer = await asyncio.open_unix_connection(self.unix)
        else:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.writers += [writer, up_writer]
        for pipe in (self._pipe(reader, up_writer), self._pipe(up_reader, writer)):
            task = asyncio.create_task(pipe)
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[int]:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        try:
            yield server.sockets[0].getsockname()[1]
        finally:
            self.thaw()
            server.close()
            for writer in self.writers:
                writer.close()
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)


async def test_a_network_that_stops_passing_data_is_a_503_within_a_bound(dsn: str) -> None:
    parts = urlsplit(dsn)
    proxy = FreezingProxy(dsn)
    async with proxy.serving() as port:
        query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "host"])
        via = urlunsplit(parts._replace(netloc=f"{parts.username}@127.0.0.1:{port}", query=query))
        async with dashboard(via) as d, httpx.AsyncClient(timeout=120) as client:
            pages = ["/dead", "/events/1", "/audit", "/"]
            for path in pages:
                assert (await client.get(d.at(path))).status_code in (200, 404), path
            proxy.freeze()
            try:
                # the server's statement_timeout never arrives: the client's own timeouts
                # (12 s a statement, 5 s a connection) must answer
                answers = await asyncio.gather(*(_refused(client, d.at(p), 45) for p in pages))
                for path, (r, _) in zip(pages, answers, strict=True):
                    assert r.status_code == 503, (path, r.status_code, r.text[-300:])
                    assert r.text.startswith("database unavailable: "), r.text
                # a page asked while all is frozen: answered within the bound too
                r, took = await _timed(client, d.at("/keys"))
                assert r.status_code == 503 and took < 45, f"{r.status_code} after {took:.1f} s"
                assert (await client.get(d.at("/healthz"))).status_code == 200
            finally:
                proxy.thaw()
            # once data passes again, the pages come back
            async with asyncio.timeout(60):
                while True:
                    statuses = [(await client.get(d.at(p))).status_code for p in pages]
                    if all(s in (200, 404) for s in statuses):
                        break
                    await asyncio.sleep(1)
            assert not [line for line in d.log if "Traceback" in line], "".join(d.log)


async def test_stopping_the_command_with_a_live_stream_open_is_prompt(dsn: str) -> None:
    async with dashboard(dsn) as d, httpx.AsyncClient(timeout=30) as client:
        async with client.stream("GET", d.at("/live")) as stream:
            chunks = stream.aiter_text()
            assert "retry:" in await anext(chunks)
            started = time.monotonic()
            d.proc.send_signal(signal.SIGINT)
            rest = "".join([chunk async for chunk in chunks])  # the stream ends
            await asyncio.wait_for(d.proc.wait(), 30)
            took = time.monotonic() - started
        assert d.proc.returncode in (0, 130)  # 130: interrupted, as the command says
        # uvicorn's own wait for open streams was 3 s; a stop that ends them is far quicker
        assert took < 2.8, f"the command took {took:.2f} s to stop:\n{''.join(d.log)}"
        assert "Traceback" not in rest
    # (on leaving, `dashboard` checks its stderr has no ERROR and no traceback)
    assert not [line for line in d.log if "ERROR" in line or "Cancel" in line], d.log
