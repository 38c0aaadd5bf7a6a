"""`NatsSink`: publish to NATS JetStream and await each PubAck.

Every message carries ``Nats-Msg-Id`` = the event's ``message_id``, so a publish
repeated after a crash or a lost connection, within the stream's duplicate window
(``duplicate_window``, 2 minutes by default), is dropped by JetStream: exactly once into
the stream. Past the window a repeat is stored again (at-least-once); downstream
consumers dedupe on the ``outbox-message-id`` header. The id is a UUID, not the row id:
two outboxes relaying into one stream share row ids, and JetStream would silently drop
the second one's events as duplicates.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from ._sink import Message, Sink, logger, require

__all__ = ["NatsSink", "NoStreamForSubject"]


class NoStreamForSubject(Exception):
    """No JetStream stream captures the subject: the message was not stored.

    Retried with the consumer's backoff, then ``dead``; streams are the operator's to
    create, so a sink never creates one.
    """


class NatsSink(Sink):
    """Publish each event to a JetStream subject (the destination) and await the PubAck.

    ``servers`` is a URL or a list of them (``nats://host:4222``); ``connect_options``
    go to `nats.connect`. The connection reconnects forever on its own; while it is down,
    publishes wait (``reconnect_wait``) and are repeated with the same ``Nats-Msg-Id``.
    """

    name = "nats"

    def __init__(
        self,
        servers: str | list[str] = "nats://127.0.0.1:4222",
        *,
        destination: str = "{topic}",
        connect_timeout: float | timedelta = 10.0,
        publish_timeout: float | timedelta = 10.0,
        reconnect_wait: float | timedelta = 60.0,
        connect_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            destination=destination,
            connect_timeout=connect_timeout,
            publish_timeout=publish_timeout,
            reconnect_wait=reconnect_wait,
        )
        self._nats = require("nats", "nats")
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        if not self.servers or not all(isinstance(s, str) and s for s in self.servers):
            raise TypeError(f"servers must be a URL or a list of URLs, not {servers!r}")
        self._options = dict(connect_options or {})
        self._nc: Any = None
        self._js: Any = None
        #: PubAcks that said "duplicate": repeats JetStream dropped
        self.duplicates = 0
        errors = self._nats.errors
        js_errors = require("nats.js.errors", "nats")
        self._outages: tuple[type[BaseException], ...] = (
            errors.TimeoutError,
            errors.ConnectionClosedError,
            errors.ConnectionReconnectingError,
            errors.StaleConnectionError,
            errors.OutboundBufferLimitError,
            errors.NoServersError,
            errors.FlushTimeoutError,
            js_errors.ServiceUnavailableError,
            OSError,
            TimeoutError,
        )
        self._no_stream = js_errors.NoStreamResponseError

    def describe(self) -> str:
        return ",".join(self.servers)

    async def _open(self) -> None:
        async def quiet(exc: Exception) -> None:  # nats-py logs every error otherwise
            logger.debug("nats: %s: %s", type(exc).__name__, exc)

        options: dict[str, Any] = {
            "servers": self.servers,
            "connect_timeout": max(1, int(self.connect_timeout)),
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "allow_reconnect": True,
            "error_cb": quiet,
        }
        options.update(self._options)
        # nats-py retries the first connect too when reconnects are allowed; refuse at once
        # instead, so an unreachable broker at start is an error rather than a hang
        self._nc = await _connect_once(self._nats, options)
        self._js = self._nc.jetstream(timeout=self.publish_timeout)
        await self._js.account_info()  # JetStream enabled for this account?

    async def _close(self) -> None:
        if self._nc is not None:
            await self._nc.close()

    async def _send(self, message: Message) -> None:
        headers = message.headers.copy()
        headers["Nats-Msg-Id"] = message.message_id
        try:
            ack = await self._js.publish(
                message.destination,
                message.body,
                timeout=self.publish_timeout,
                headers=headers,
            )
        except self._no_stream:
            if not self._nc.is_connected:
                raise ConnectionError("NATS connection lost") from None
            raise NoStreamForSubject(
                f"no JetStream stream captures subject {message.destination!r}"
            ) from None
        if ack.duplicate:
            self.duplicates += 1

    def _is_outage(self, exc: BaseException) -> bool:
        return isinstance(exc, self._outages)


async def _connect_once(nats: Any, options: dict[str, Any]) -> Any:
    """Connect, raising if no server answers now (nats-py would otherwise keep trying the
    first connect forever), then keep reconnecting forever after a loss."""
    wanted = options.get("max_reconnect_attempts", -1)
    nc = await nats.connect(**{**options, "max_reconnect_attempts": 1})
    nc.options["max_reconnect_attempts"] = wanted
    return nc
