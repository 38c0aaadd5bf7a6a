"""``run --metrics-port`` as a supervisor and a kubelet see it: ``/healthz`` while the
database stalls, shutting down with HTTP clients connected, and idle clients under a
low file-descriptor limit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import time

import asyncpg
import pytest

import aiooutbox
from tests.clirunner import Runner, clean_env
from tests.faults.proxy import TCPProxy
from tests.helpers import wait_until


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def get(port: int, path: str, timeout: float = 30) -> tuple[int, str]:
    """One GET; (status, body); (0, "") when the server closed without an answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    if not raw:
        return 0, ""
    head, _, body = raw.decode().partition("\r\n\r\n")
    return int(head.split(" ", 2)[1]), body


@pytest.mark.slow  # waits out max_silence (13 s) with the claim loop idle
async def test_healthz_is_a_503_in_time_when_the_database_stalls_with_every_slot_busy(
    dsn: str, pool: asyncpg.Pool
) -> None:
    """The probe's own short bound: not statement_timeout (10 s), which the server's
    connection bound used to cut first, leaving the client with no answer at all."""
    await aiooutbox.enqueue(pool, "sleepy", {})
    port = free_port()
    with TCPProxy.for_dsn(dsn) as proxy:
        args = ["tests.cli_handlers:handlers", "--dsn", proxy.proxied(dsn), "--topics", "sleepy"]
        args += ["--concurrency", "1", "--prefetch", "0", "--poll-interval", "1s"]
        args += ["--no-listen", "--shutdown-grace", "1s", "--metrics-port", str(port)]
        async with Runner(*args, env=clean_env()) as runner:
            await runner.wait_for_line("consuming")

            async def busy_and_probed() -> bool:
                status, body = await get(port, "/healthz")
                return status == 200 and "slot busy" in body

            await wait_until(busy_and_probed, timeout=40, interval=0.5)
            proxy.stall()
            await asyncio.sleep(1.2)  # past the probe's one-second cache
            started = time.monotonic()
            status, body = await get(port, "/healthz")
            took = time.monotonic() - started
            assert status == 503 and took < 8, (status, took, body, runner.stderr)
            reason = json.loads(body)["reason"]
            assert "the database did not answer within 3s" in reason, reason
            proxy.restore()
            runner.signal()
            assert await runner.wait(60) == 0, runner.stderr


async def test_stopping_with_http_clients_connected_logs_no_traceback(dsn: str) -> None:
    port = free_port()
    args = ["tests.cli_handlers:handlers", "--dsn", dsn, "--metrics-port", str(port)]
    async with Runner(*args, env=clean_env()) as runner:
        await runner.wait_for_line("consuming")
        clients = []
        for data in (b"", b"GET /metrics HTTP/1.1\r\n", b"GET /healthz HTTP/1.1\r\nHost: x"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(data)
            await writer.drain()
            clients.append((reader, writer))
        await asyncio.sleep(0.5)
        runner.signal()
        assert await runner.wait() == 0, runner.stderr
        for reader, writer in clients:
            assert await asyncio.wait_for(reader.read(), 5) in (b"", b"HTTP/1.1")
            writer.close()
    assert "Traceback" not in runner.stderr and "CancelledError" not in runner.stderr, runner.stderr


@pytest.mark.slow  # holds 200 idle connections for seconds
async def test_idle_clients_under_a_low_descriptor_limit_leave_healthz_answering(
    dsn: str,
) -> None:
    port = free_port()
    args = ["tests.cli_handlers:handlers", "--dsn", dsn, "--metrics-port", str(port)]
    held: list[socket.socket] = []
    async with Runner(*args, nofile=128, env=clean_env()) as runner:
        await runner.wait_for_line("consuming")
        try:
            for _ in range(200):
                try:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=0.5)
                    sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # never finished
                except OSError:
                    continue  # the backlog is full: the server is not accepting past its cap
                held.append(sock)
            answers = []
            for _ in range(4):
                started = time.monotonic()
                try:
                    status, _ = await get(port, "/healthz", timeout=10)
                except TimeoutError:
                    status = -1  # no answer within 10 s: the acceptor stalled
                answers.append((status, round(time.monotonic() - started, 2)))
                await asyncio.sleep(1)
            assert all(status == 200 and took < 3 for status, took in answers), answers
        finally:
            for sock in held:
                sock.close()
        runner.signal(signal.SIGTERM)
        assert await runner.wait() == 0, runner.stderr[-3000:]
    assert "out of system resource" not in runner.stderr, runner.stderr[-3000:]
    assert len(runner.lines) < 20, runner.stderr[-3000:]
