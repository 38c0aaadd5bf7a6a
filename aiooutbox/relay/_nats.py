"""`NatsSink`: publish to NATS JetStream and await each PubAck.

Every message carries ``Nats-Msg-Id`` = the event's ``message_id``, so a publish
repeated after a crash or a lost connection, within the stream's duplicate window
(``duplicate_window``, 2 minutes by default), is dropped by JetStream: exactly once into
the stream. Past the window a repeat is stored again (at-least-once); downstream
consumers dedupe on the ``outbox-message-id`` header. The id is a UUID, not the row id:
two outboxes relaying into one stream share row ids, and JetStream would silently drop
the second one's events as duplicates.

Publishes go out as plain NATS publishes with a reply subject on one inbox of the
sink's own, and the PubAck is matched back by a counter token: nats-py's
``js.publish`` draws a random token and arms a timer per message (measured: a fifth of
the relay's CPU went there, docs/benchmarks.md); here one sweep every eighth of
``publish_timeout`` fails the PubAcks overdue, so a publish times out after between 1
and 1.125 ``publish_timeout``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from datetime import timedelta
from typing import Any

from .._values.codec import decode_json
from .._values.text import describe_exception
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
    cloudevents_binding = "nats"

    def __init__(
        self,
        servers: str | list[str] = "nats://127.0.0.1:4222",
        *,
        destination: str = "{topic}",
        connect_timeout: float | timedelta = 10.0,
        publish_timeout: float | timedelta = 10.0,
        reconnect_wait: float | timedelta = 60.0,
        max_in_flight: int | None = None,
        format: str = "outbox",
        cloudevents_source: str | None = None,
        connect_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            destination=destination,
            connect_timeout=connect_timeout,
            publish_timeout=publish_timeout,
            reconnect_wait=reconnect_wait,
            max_in_flight=max_in_flight,
            format=format,
            cloudevents_source=cloudevents_source,
        )
        self._nats = require("nats", "nats")
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        if not self.servers or not all(isinstance(s, str) and s for s in self.servers):
            raise TypeError(f"servers must be a URL or a list of URLs, not {servers!r}")
        self._options = dict(connect_options or {})
        self._nc: Any = None
        self._js: Any = None
        self._inbox = ""
        self._tokens = itertools.count()
        #: token -> (future of the PubAck message, monotonic deadline)
        self._acks: dict[str, tuple[asyncio.Future[Any], float]] = {}
        self._sweeper: asyncio.Task[None] | None = None
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
            errors.NoRespondersError,
            OSError,
            TimeoutError,
        )
        self._api_error = js_errors.APIError
        self._not_found = js_errors.NotFoundError

    def describe(self) -> str:
        return ",".join(self.servers)

    async def _open(self) -> None:
        async def quiet(exc: Exception) -> None:  # nats-py logs every error otherwise
            logger.debug("nats: %s", describe_exception(exc))

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
        self._inbox = self._nc.new_inbox() + "."
        await self._nc.subscribe(self._inbox + "*", cb=self._on_ack)
        self._sweeper = asyncio.ensure_future(self._sweep())

    async def _close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        try:
            if self._nc is not None:
                await self._nc.close()
        finally:
            closed = self._nats.errors.ConnectionClosedError
            for future, _ in list(self._acks.values()):
                if not future.done():
                    future.set_exception(closed())
            self._acks.clear()

    async def _on_ack(self, msg: Any) -> None:
        entry = self._acks.pop(msg.subject[len(self._inbox) :], None)
        if entry is not None and not entry[0].done():
            entry[0].set_result(msg)

    async def _sweep(self) -> None:
        """Fail the PubAcks overdue: one timer for every publish in flight."""
        timeout = self._nats.errors.TimeoutError
        while True:
            await asyncio.sleep(self.publish_timeout / 8)
            now = time.monotonic()
            late = [t for t, (_, deadline) in self._acks.items() if deadline <= now]
            for token in late:
                future, _ = self._acks.pop(token)
                if not future.done():
                    future.set_exception(timeout())

    async def _send(self, message: Message) -> None:
        headers = message.headers  # this message's own dict; a repeat sets the same id
        headers["Nats-Msg-Id"] = message.message_id
        token = str(next(self._tokens))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._acks[token] = (future, time.monotonic() + self.publish_timeout)
        try:
            await self._nc.publish(
                message.destination, message.body, reply=self._inbox + token, headers=headers
            )
            ack = await future
        finally:
            self._acks.pop(token, None)
        if ack.headers and ack.headers.get("Status") == "503":  # no responders
            if not self._nc.is_connected:
                raise ConnectionError("NATS connection lost")
            await self._require_stream(message.destination)
            # a stream captures the subject, yet nobody answered: JetStream is away for
            # now (a server shutting down stops JetStream before it drops connections)
            raise ConnectionError(f"JetStream did not answer for {message.destination!r}")
        reply = decode_json(ack.data)
        if "error" in reply:
            raise self._api_error.from_error(reply["error"])
        if reply.get("duplicate"):
            self.duplicates += 1

    async def _require_stream(self, subject: str) -> None:
        """`NoStreamForSubject` when JetStream itself says no stream captures
        ``subject``; when it cannot say (it is away too), the outage error propagates."""
        try:
            await self._js.find_stream_name_by_subject(subject)
        except self._not_found as exc:
            raise NoStreamForSubject(f"no JetStream stream captures subject {subject!r}") from exc

    def _is_outage(self, exc: BaseException) -> bool:
        return isinstance(exc, self._outages)


async def _connect_once(nats: Any, options: dict[str, Any]) -> Any:
    """Connect, raising if no server answers now (nats-py would otherwise keep trying the
    first connect forever), then keep reconnecting forever after a loss."""
    wanted = options.get("max_reconnect_attempts", -1)
    nc = await nats.connect(**{**options, "max_reconnect_attempts": 1})
    nc.options["max_reconnect_attempts"] = wanted
    return nc
