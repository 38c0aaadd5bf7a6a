"""`MetricsServer` as a client sees it over real sockets: hostile and malformed requests,
idle clients, its connection cap, and shutting down with connections open."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
from prometheus_client import CollectorRegistry

from aiooutbox.health import HealthStatus
from aiooutbox.metrics import MetricsServer, OutboxMetrics


class Healthy:
    """A health check that always answers (what the server does with it is tested here)."""

    async def check(self) -> HealthStatus:
        return HealthStatus(True, "fine")


class Stuck:
    """A health check that never answers."""

    async def check(self) -> HealthStatus:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


async def exchange(
    port: int, data: bytes, timeout: float = 15
) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` raw, read to EOF: (status, headers lowercased, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
        await writer.wait_closed()
    assert raw, f"no HTTP answer to {data[:80]!r}"
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    return int(lines[0].split(" ", 2)[1]), headers, body


def loud(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every warning or error logged (asyncio's "exception in callback" included)."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    OutboxMetrics(registry)
    return registry


@pytest.mark.parametrize(
    "accept",
    [
        "application/openmetrics-text; version=abc",
        "text/plain; version=1.a",
        "text/plain; version=x, application/openmetrics-text",
    ],
)
async def test_a_hostile_accept_header_is_a_400_and_logs_nothing(
    registry: CollectorRegistry, caplog: pytest.LogCaptureFixture, accept: str
) -> None:
    async with MetricsServer(registry, port=0) as server:
        request = f"GET /metrics HTTP/1.1\r\nAccept: {accept}\r\n\r\n".encode()
        status, _, body = await exchange(server.port, request)
        assert status == 400 and b"Accept" in body and len(body) < 100, (status, body)
        status, _, body = await exchange(server.port, b"GET /metrics HTTP/1.1\r\n\r\n")
        assert status == 200 and b"aiooutbox_claims" in body
    assert not loud(caplog), loud(caplog)


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"garbage\r\n\r\n", 400),
        (b"\r\n\r\n", 400),  # an empty request line
        (b"get /metrics HTTP/1.1\r\n\r\n", 400),  # methods are case-sensitive
        (b"GET /metrics\r\n\r\n", 400),  # no version
        (b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n", 400),
        (b"POST /metrics HTTP/1.1\r\n\r\n", 405),
        (b"GET /nothing HTTP/1.1\r\n\r\n", 404),
        (b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n", 431),
    ],
)
async def test_malformed_requests_get_the_right_status(
    registry: CollectorRegistry,
    caplog: pytest.LogCaptureFixture,
    request_bytes: bytes,
    status: int,
) -> None:
    async with MetricsServer(registry, Healthy(), port=0) as server:
        found, headers, body = await exchange(server.port, request_bytes)
        assert found == status, (found, body)
        assert int(headers["content-length"]) == len(body)
    assert not loud(caplog), loud(caplog)


async def test_head_answers_carry_no_body(registry: CollectorRegistry) -> None:
    async with MetricsServer(registry, Healthy(), port=0) as server:
        for path, status in (("/nothing", 404), ("/metrics", 200), ("/healthz", 200)):
            found, headers, body = await exchange(
                server.port, f"HEAD {path} HTTP/1.1\r\n\r\n".encode()
            )
            assert (found, body) == (status, b""), (path, found, body)
            assert int(headers["content-length"]) > 0  # what GET would send


async def test_a_stuck_health_check_is_a_503_within_the_bound(registry: CollectorRegistry) -> None:
    async with MetricsServer(registry, Stuck(), port=0) as server:
        started = time.monotonic()
        status, _, body = await exchange(server.port, b"GET /healthz HTTP/1.1\r\n\r\n")
        took = time.monotonic() - started
    assert status == 503 and took < 9, (status, took, body)
    assert "did not answer within 5s" in json.loads(body)["reason"]


async def test_an_idle_client_is_dropped_after_the_read_timeout(
    registry: CollectorRegistry,
) -> None:
    async with MetricsServer(registry, port=0) as server:
        started = time.monotonic()
        status, _, _ = await exchange(server.port, b"GET /metrics HTTP/1.1\r\n", timeout=30)
        took = time.monotonic() - started
    assert status == 408 and 3 < took < 15, (status, took)


async def test_idle_clients_past_the_cap_do_not_keep_healthz_out(
    registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    idle: list[asyncio.StreamWriter] = []
    async with MetricsServer(registry, Healthy(), port=0, max_connections=8) as server:
        try:
            for _ in range(60):
                _, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(b"GET /healthz HTTP/1.1\r\n")  # never finished
                idle.append(writer)
            await asyncio.sleep(0.2)
            open_now = len(server._connections)
            for _ in range(5):
                started = time.monotonic()
                status, _, _ = await exchange(server.port, b"GET /healthz HTTP/1.1\r\n\r\n")
                took = time.monotonic() - started
                assert status == 200 and took < 2, (status, took)
        finally:
            for writer in idle:
                writer.close()
    assert open_now <= 9, open_now  # the cap, and one being let in
    assert not loud(caplog), loud(caplog)


async def test_leaving_with_connections_open_logs_nothing(
    registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    """Idle clients and one waiting on a stuck health check, then the server stops."""
    clients = []
    async with MetricsServer(registry, Stuck(), port=0) as server:
        for data in (b"", b"GET /metrics HTTP/1.1\r\n", b"GET /healthz HTTP/1.1\r\n\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(data)
            clients.append((reader, writer))
        await asyncio.sleep(0.3)
        started = time.monotonic()
    took = time.monotonic() - started
    for reader, writer in clients:
        await asyncio.wait_for(reader.read(), 5)  # closed
        writer.close()
    await asyncio.sleep(0.1)  # let any callback asyncio would log run
    assert took < 2, took
    assert not loud(caplog), loud(caplog)
