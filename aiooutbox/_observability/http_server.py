"""`MetricsServer`: ``/metrics`` and ``/healthz`` over a small asyncio HTTP server.

It runs on the consumer's event loop, so gauges are read at scrape time without
threads; bound to 127.0.0.1 unless told otherwise. Import it from `aiooutbox.metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

import anyio
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder

from ..errors import InvalidArgument
from ..health import HealthStatus

__all__ = ["HealthCheck", "MetricsServer"]


class HealthCheck(Protocol):
    """What ``/healthz`` asks: `ConsumerHealth`, or one answering for several."""

    async def check(self) -> HealthStatus: ...


logger = logging.getLogger("aiooutbox.metrics")


class MetricsServer:
    """``GET /metrics`` (Prometheus text, or OpenMetrics if asked) and ``GET /healthz``.

    ``async with MetricsServer(registry, health, port=9464) as server:`` binds at once,
    so a port in use raises `OSError` before anything else starts; ``server.port`` is
    the bound port (useful with ``port=0``). Each connection answers one request and is
    closed; a client that sends nothing for 10 s is dropped. Without ``health``,
    ``/healthz`` answers 404.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        health: HealthCheck | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 9464,
    ) -> None:
        if isinstance(port, bool) or not isinstance(port, int):
            raise TypeError(f"port must be an int, not {type(port).__name__}")
        if not 0 <= port <= 65535:
            raise InvalidArgument(f"port must be between 0 and 65535, got {port}")
        self.registry = REGISTRY if registry is None else registry
        self.health = health
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> MetricsServer:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        sockets = self._server.sockets
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        logger.info(
            "serving /metrics and /healthz on http://%s:%d",
            self.host if ":" not in self.host else f"[{self.host}]",
            self.port,
            extra={"metrics_host": self.host, "metrics_port": self.port},
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._connections):
            task.cancel()
        with anyio.CancelScope(shield=True):
            if self._connections:
                await asyncio.wait(list(self._connections), timeout=5)
            with anyio.move_on_after(5):
                await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            with anyio.move_on_after(10):
                status, headers, body = await self._answer(reader)
                head = f"HTTP/1.1 {status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
                head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                writer.write(head.encode("latin-1") + body)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the client went away, or sent garbage
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception), anyio.CancelScope(shield=True):
                with anyio.move_on_after(1):
                    await writer.wait_closed()

    async def _answer(
        self, reader: asyncio.StreamReader
    ) -> tuple[str, list[tuple[str, str]], bytes]:
        request = await reader.readuntil(b"\r\n\r\n")
        lines = request.decode("latin-1").split("\r\n")
        method, _, rest = lines[0].partition(" ")
        target = rest.partition(" ")[0].partition("?")[0]
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in lines[1:] if line)
        }
        text = [("Content-Type", "text/plain; charset=utf-8")]
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", [*text, ("Allow", "GET, HEAD")], b"GET only\n"
        if target == "/metrics":
            encode, content_type = choose_encoder(headers.get("accept", ""))
            body = encode(self.registry)
            return "200 OK", [("Content-Type", content_type)], b"" if method == "HEAD" else body
        if target == "/healthz" and self.health is not None:
            import json

            result = await self.health.check()
            status = "200 OK" if result.ok else "503 Service Unavailable"
            body = (json.dumps(result.as_dict(), default=str) + "\n").encode()
            content = [("Content-Type", "application/json")]
            return status, content, b"" if method == "HEAD" else body
        return "404 Not Found", text, b"not found: try /metrics or /healthz\n"
