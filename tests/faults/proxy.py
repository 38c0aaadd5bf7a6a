"""An asyncio TCP proxy, run in its own thread, that cuts or stalls traffic on demand.

The habit comes from asyncpg's ``_testbase/fuzzer.py``: the client connects to the
proxy, the proxy to the server, and the test decides what the path does:

- `stall` blackholes both directions: connections stay open, nothing is forwarded (bytes
  wait in the proxy, as TCP would retransmit them), new connections are accepted and
  hang. It models a frozen network path or a partition shorter than TCP's timeout.
- `cut` resets every connection (RST) and refuses new ones until `restore`.
- `restore` resumes forwarding and accepting.

The proxy runs in a thread with its own event loop, so a test loop that is busy (or
deliberately stalled) never stalls the network as a side effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Coroutine
from typing import Any, Self
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = ["TCPProxy"]


class TCPProxy:
    def __init__(
        self, target_host: str, target_port: int, host: str = "127.0.0.1", unix: str | None = None
    ) -> None:
        self.target = (target_host, target_port)
        self.unix = unix  # a Unix socket to forward to instead (the embedded server's)
        self.host = host
        self.port = 0
        self.connections_made = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._flowing: asyncio.Event | None = None
        self._cut = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def for_dsn(cls, dsn: str) -> TCPProxy:
        """A proxy to the server ``dsn`` names: a host and port, or a Unix socket's
        directory in its query (``?host=/dir``, as the embedded server's DSN has)."""
        parts = urlsplit(dsn)
        socket_dir = parse_qs(parts.query).get("host", [""])[0]
        if socket_dir.startswith("/"):
            return cls("", 0, unix=f"{socket_dir}/.s.PGSQL.{parts.port or 5432}")
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"the proxy needs a TCP DSN with host and port, got {dsn!r}")
        return cls(parts.hostname, parts.port)

    def proxied(self, dsn: str) -> str:
        """The same DSN pointed at the proxy, without asyncpg's SSL negotiation.

        asyncpg's default ``sslmode=prefer`` first asks the server for TLS. A connect (or
        a query's cancel request, which opens a connection of its own) that times out on
        a stalled path in the same loop iteration as the path closes leaves that
        negotiation's future holding an exception nobody retrieves: "Future exception was
        never retrieved: ConnectionError('unexpected connection_lost() call')", which the
        fault tests' loop guard fails on (seen once in a whole-suite run). What the
        fault tests examine is the path, not the negotiation (a DSN that sets its own
        ``sslmode`` keeps it).
        """
        parts = urlsplit(dsn)
        userinfo, at, _ = parts.netloc.rpartition("@")
        # a Unix socket's directory in the query would take the connection past the proxy
        query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "host"])
        if "sslmode=" not in query:
            query = f"{query}&sslmode=disable" if query else "sslmode=disable"
        return urlunsplit(
            parts._replace(netloc=f"{userinfo}{at}{self.host}:{self.port}", query=query)
        )

    # -- control (any thread) --------------------------------------------------------
    def start(self) -> Self:
        self._thread.start()
        self._call(self._start())
        return self

    def stall(self) -> None:
        self._call(self._set_flowing(False))

    def cut(self) -> None:
        self._call(self._do_cut())

    def restore(self) -> None:
        self._call(self._restore())

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    # -- the proxy loop ----------------------------------------------------------------
    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _set_flowing(self, on: bool) -> None:
        assert self._flowing is not None
        if on:
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _do_cut(self) -> None:
        self._cut = True
        for writer in list(self._writers):
            _reset(writer)
        self._writers.clear()

    async def _restore(self) -> None:
        self._cut = False
        await self._set_flowing(True)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            _reset(writer)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            _reset(writer)
            return
        self.connections_made += 1
        try:
            if self.unix is not None:
                up_reader, up_writer = await asyncio.open_unix_connection(self.unix)
            else:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _reset(writer)
            return
        self._writers.update((writer, up_writer))
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.ensure_future(self._pump(src, dst, (writer, up_writer)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        assert self._flowing is not None
        try:
            while True:
                await self._flowing.wait()
                data = await src.read(65536)
                if not data:
                    break
                await self._flowing.wait()  # a stall holds the bytes already read
                if dst.is_closing():
                    break
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in pair:
                self._writers.discard(w)
                if not w.is_closing():
                    w.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST rather than FIN, as a broken path or a killed peer would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
