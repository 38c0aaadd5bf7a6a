"""A TCP proxy that can freeze the connections it already carries and no others.

`TCPProxy.stall` hangs new connections too; a link that went deaf (a middlebox that
dropped its state, a stalled socket) leaves new connections working. `freeze` models
that: every connection open now stops forwarding for good, new ones flow normally.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from tests.faults.proxy import TCPProxy

__all__ = ["DeafProxy"]


class DeafProxy(TCPProxy):
    def __init__(self, target_host: str, target_port: int, host: str = "127.0.0.1") -> None:
        super().__init__(target_host, target_port, host)
        self._generation = 0
        self._frozen_below = 0

    @classmethod
    def for_dsn(cls, dsn: str) -> DeafProxy:
        parts = urlsplit(dsn)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"the proxy needs a TCP DSN with host and port, got {dsn!r}")
        return cls(parts.hostname, parts.port)

    def freeze(self) -> None:
        """Existing connections forward nothing from now on; new ones are unaffected."""
        self._call(self._freeze())

    async def _freeze(self) -> None:
        self._frozen_below = self._generation

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._generation += 1
        generation = self._generation
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.connections_made += 1
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.ensure_future(self._forward(src, dst, generation))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _forward(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, generation: int
    ) -> None:
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    break
                if generation <= self._frozen_below:
                    continue  # deaf: the bytes vanish, the connection stays open
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            if not dst.is_closing():
                dst.close()
