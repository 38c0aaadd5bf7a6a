"""`MetricsServer`: ``/metrics`` and ``/healthz`` over a small asyncio HTTP server.

It runs on the consumer's event loop, so gauges are read at scrape time without
threads; bound to 127.0.0.1 unless told otherwise. Import it from `aiooutbox.metrics`.

It accepts connections itself (not ``asyncio.start_server``) so that it can hold a cap:
at the cap it closes the oldest client still sending nothing to let a new one in, and
when every connection is being answered it stops accepting until one ends; the kernel's
backlog queues the rest. So idle clients cannot use up the process's file descriptors,
and asyncio never gets to log a failed ``accept()`` per attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Protocol

import anyio
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder, generate_latest

from .._values.text import describe_exception
from ..errors import InvalidArgument
from ..health import HealthStatus
from .http_request import BadRequest, Request, Response, parse_head, text

__all__ = ["HealthCheck", "MetricsServer"]

logger = logging.getLogger("aiooutbox.metrics")

#: a client has this long to send its request line and headers
READ_TIMEOUT = 5.0
#: the longest ``/healthz`` waits for its check (`ConsumerHealth` bounds its probe at 3 s)
HEALTH_TIMEOUT = 5.0
#: the longest an answer may take to be written
WRITE_TIMEOUT = 10.0
#: the most bytes of request line and headers read (431 above)
MAX_HEAD = 16384
#: connections served at once, unless the descriptor limit asks for fewer
MAX_CONNECTIONS = 64
# that one client gave up: accept the next at once; any other error (out of descriptors
# or memory) pauses accept() a second, logged once a minute
_GAVE_UP = {errno.ECONNABORTED, errno.EPROTO, errno.EINTR}
_ACCEPT_PAUSE = 1.0
_LOG_EVERY = 60.0


class HealthCheck(Protocol):
    """What ``/healthz`` asks: `ConsumerHealth`, or one answering for several."""

    async def check(self) -> HealthStatus: ...


def default_max_connections() -> int:
    """64, or a quarter of the soft descriptor limit if that is less (at least 4)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # pragma: no cover - Windows
        return MAX_CONNECTIONS
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return MAX_CONNECTIONS
    return max(4, min(MAX_CONNECTIONS, soft // 4))


@dataclass(eq=False)
class _Connection:
    task: asyncio.Task[None] | None = None
    transport: asyncio.WriteTransport | None = None
    idle: bool = True  # no complete request head yet: the one to close at the cap


class MetricsServer:
    """``GET /metrics`` (Prometheus text, or OpenMetrics if asked) and ``GET /healthz``.

    ``async with MetricsServer(registry, health, port=9464) as server:`` binds at once,
    so a port in use raises `OSError` before anything else starts; ``server.port`` is
    the bound port (useful with ``port=0``). Each connection answers one request and is
    closed; a client that has not sent its request within 5 s is dropped (408), and at
    most ``max_connections`` are open at once (default: 64, fewer under a low descriptor
    limit). ``/healthz`` answers within 5 s, 503 if the check did not. Without
    ``health``, ``/healthz`` answers 404.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        health: HealthCheck | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 9464,
        max_connections: int | None = None,
    ) -> None:
        if isinstance(port, bool) or not isinstance(port, int):
            raise TypeError(f"port must be an int, not {type(port).__name__}")
        if not 0 <= port <= 65535:
            raise InvalidArgument(f"port must be between 0 and 65535, got {port}")
        if max_connections is not None and (
            isinstance(max_connections, bool)
            or not isinstance(max_connections, int)
            or max_connections < 1
        ):
            raise InvalidArgument(
                f"max_connections must be a positive int, not {max_connections!r}"
            )
        if registry is not None and (
            isinstance(registry, type) or not callable(getattr(registry, "collect", None))
        ):
            raise TypeError(
                f"registry must be a prometheus_client CollectorRegistry or None,"
                f" not {type(registry).__name__}"
            )
        if health is not None and (
            isinstance(health, type) or not callable(getattr(health, "check", None))
        ):
            raise TypeError(
                f"health must have an async check() (ConsumerHealth), not {type(health).__name__}"
            )
        if not isinstance(host, str):
            raise TypeError(f"host must be a str, not {type(host).__name__}")
        self.registry = REGISTRY if registry is None else registry
        self.health = health
        self.host = host
        self.port = port
        self.max_connections = max_connections or default_max_connections()
        self._sockets: list[socket.socket] = []
        self._acceptors: list[asyncio.Task[None]] = []
        self._connections: dict[_Connection, None] = {}  # oldest first
        # set when a connection ends or becomes one the cap may close: the acceptor waits
        # on it while every connection is being answered (or not yet started)
        self._room = asyncio.Event()
        self._logged_exhaustion = -_LOG_EVERY

    async def __aenter__(self) -> MetricsServer:
        self._sockets = await self._bind()
        self.port = int(self._sockets[0].getsockname()[1])
        loop = asyncio.get_running_loop()
        self._acceptors = [loop.create_task(self._accept(sock)) for sock in self._sockets]
        logger.info(
            "serving /metrics and /healthz on http://%s:%d",
            self.host if ":" not in self.host else f"[{self.host}]",
            self.port,
            extra={"metrics_host": self.host, "metrics_port": self.port},
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Stop accepting, then close every connection: idle ones by closing their
        transport (their task returns), ones being answered by cancelling our own task.

        Never by cancelling a task asyncio's streams made: on Python 3.11 that logs a
        traceback per connection (``StreamReaderProtocol`` asks the cancelled task for
        its exception)."""
        acceptors, self._acceptors = self._acceptors, []
        for task in acceptors:
            task.cancel()
        with anyio.CancelScope(shield=True):
            if acceptors:
                await asyncio.wait(acceptors)
            for sock in self._sockets:
                sock.close()
            self._sockets = []
            tasks = []
            for connection in list(self._connections):
                if connection.transport is not None:
                    connection.transport.abort()
                if connection.task is not None:
                    if not connection.idle or connection.transport is None:
                        connection.task.cancel()  # our own task: nothing logs its cancellation
                    tasks.append(connection.task)
            if tasks:
                await asyncio.wait(tasks, timeout=5)

    # -- accepting ---------------------------------------------------------------------
    async def _bind(self) -> list[socket.socket]:
        """Listening sockets for every address of ``host``, as asyncio would bind them;
        with port 0 they all take the port the first one got."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        sockets: list[socket.socket] = []
        try:
            for family, kind, proto, _, address in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                sockets.append(sock)
                if os.name == "posix":
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if self.port == 0 and len(sockets) > 1:
                    address = (address[0], sockets[0].getsockname()[1], *address[2:])
                sock.bind(address)
                sock.listen(128)
                sock.setblocking(False)
        except BaseException:
            for sock in sockets:
                sock.close()
            raise
        if not sockets:  # pragma: no cover - getaddrinfo returns at least one or raises
            raise OSError(f"no address to listen on for {self.host!r}")
        return sockets

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while len(self._connections) >= self.max_connections and self._oldest_idle() is None:
                self._room.clear()
                await self._room.wait()  # every connection is being answered, or starting
            try:
                client, _ = await loop.sock_accept(sock)
            except OSError as exc:
                if exc.errno not in _GAVE_UP:
                    self._exhausted(exc)
                    await asyncio.sleep(_ACCEPT_PAUSE)
                continue
            if len(self._connections) >= self.max_connections:
                oldest = self._oldest_idle()
                if oldest is not None and oldest.transport is not None:
                    oldest.idle = False  # not chosen twice
                    oldest.transport.abort()
                    await asyncio.sleep(0)  # its descriptor is closed on the next turn
            connection = _Connection()
            self._connections[connection] = None
            connection.task = loop.create_task(self._connection(client, connection))

    def _oldest_idle(self) -> _Connection | None:
        for connection in self._connections:
            if connection.idle and connection.transport is not None:
                return connection
        return None

    def _exhausted(self, exc: OSError) -> None:
        now = time.monotonic()
        if now - self._logged_exhaustion >= _LOG_EVERY:
            self._logged_exhaustion = now
            logger.warning(
                "the metrics server cannot accept connections: %s (out of file descriptors?"
                " raise `ulimit -n`); retrying every %gs, logged once a minute",
                exc.strerror or exc,
                _ACCEPT_PAUSE,
            )

    # -- one connection ------------------------------------------------------------------
    async def _connection(self, client: socket.socket, connection: _Connection) -> None:
        try:
            try:
                reader, writer = await asyncio.open_connection(sock=client, limit=MAX_HEAD)
            except OSError:
                client.close()
                return
            connection.transport = writer.transport
            self._room.set()  # idle until its request head arrives: the cap may close it
            try:
                await self._exchange(reader, writer, connection)
            except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
                pass  # the client went away (or was closed to make room)
            except Exception as exc:  # a bug of ours: one line, never a traceback per request
                logger.error("the metrics server failed a request: %s", describe_exception(exc))
                logger.debug("the metrics server failed a request", exc_info=exc)
            finally:
                if not writer.is_closing():
                    writer.transport.abort()
        finally:
            self._connections.pop(connection, None)
            self._room.set()

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connection: _Connection
    ) -> None:
        response: Response | None = None
        request: Request | None = None
        with anyio.move_on_after(READ_TIMEOUT):
            try:
                request = parse_head(await reader.readuntil(b"\r\n\r\n"))
            except asyncio.LimitOverrunError:
                response = text("431 Request Header Fields Too Large", "request head too large")
            except BadRequest as exc:
                response = text("400 Bad Request", str(exc))
        connection.idle = False
        if request is not None:
            response = await self._answer(request)
        elif response is None:
            response = text("408 Request Timeout", f"no request within {READ_TIMEOUT:g}s")
        head_only = request is not None and request.method == "HEAD"
        with anyio.fail_after(WRITE_TIMEOUT):
            writer.write(response.encode(head_only))
            await writer.drain()
            await _close(reader, writer, unread=request is None)

    async def _answer(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            return text("405 Method Not Allowed", "GET only", ("Allow", "GET, HEAD"))
        if request.path == "/metrics":
            return self._metrics(request.headers.get("accept", ""))
        if request.path == "/healthz" and self.health is not None:
            return await self._healthz(self.health)
        return text("404 Not Found", "not found: try /metrics or /healthz")

    def _metrics(self, accept: str) -> Response:
        try:
            encode, content_type = choose_encoder(accept)
        except Exception:
            return text("400 Bad Request", "unsupported Accept header")
        try:
            body = encode(self.registry)
        except Exception as exc:
            try:  # the format asked for, or the registry itself?
                generate_latest(self.registry)
            except Exception:
                logger.error("/metrics failed: %s", describe_exception(exc))
                logger.debug("/metrics failed", exc_info=exc)
                return text("500 Internal Server Error", "collecting the metrics failed")
            return text("400 Bad Request", "unsupported Accept header")
        return Response("200 OK", body, [("Content-Type", content_type)])

    async def _healthz(self, health: HealthCheck) -> Response:
        result: HealthStatus | None = None
        with anyio.move_on_after(HEALTH_TIMEOUT):
            try:
                result = await health.check()
            except Exception as exc:
                logger.error("/healthz failed: %s", describe_exception(exc))
                logger.debug("/healthz failed", exc_info=exc)
                result = HealthStatus(False, f"the health check failed: {describe_exception(exc)}")
        if result is None:
            result = HealthStatus(
                False, f"the health check did not answer within {HEALTH_TIMEOUT:g}s"
            )
        status = "200 OK" if result.ok else "503 Service Unavailable"
        body = (json.dumps(result.as_dict(), default=str) + "\n").encode()
        return Response(status, body, [("Content-Type", "application/json")])


async def _close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, unread: bool) -> None:
    """Close after the answer. With ``unread`` input (a refused request), stop writing and
    read what the client still sends for up to a second first: closing a socket holding
    unread bytes sends a reset, which can destroy the answer before the client reads it."""
    if unread and writer.can_write_eof():
        with contextlib.suppress(OSError):
            writer.write_eof()
        with anyio.move_on_after(1):
            for _ in range(64):  # at most 64 reads of what the stream buffers
                if not await reader.read(MAX_HEAD):
                    break
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
