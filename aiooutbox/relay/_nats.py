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
import contextlib
import itertools
import re
import time
from datetime import timedelta
from typing import Any

from .._values.codec import decode_json
from .._values.text import describe_exception
from ._masked import checked_url
from ._sink import Message, Sink, logger, require

__all__ = ["NatsSink", "NoStreamForSubject", "subject_problem"]

#: whitespace and control characters end a subject in NATS's protocol line
_NOT_IN_SUBJECT = re.compile(r"[\x00-\x20\x7f]")
#: subjects of the server's own APIs: a publish there is a request, not a message to store
_RESERVED = ("$JS.", "$JSC.", "$SYS.", "$NRG.")
#: the server's protocol line is 4 KiB (``max_control_line``); a longer one closes the
#: connection. The line also holds the verb, the reply inbox and two sizes.
MAX_SUBJECT_BYTES = 4000
#: a header name NATS carries: an HTTP token (nats-py refuses others)
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
#: the server's error for a publish the user may not make (lower-cased by nats-py)
_DENIED = re.compile(r'permissions violation for publish to "(.*)"')
#: "NATS/1.0\r\n" before the headers and "\r\n" after them
_HEADER_FRAME = 12


def subject_problem(subject: str) -> str | None:
    """Why NATS cannot take ``subject`` as a publish subject (None: it can)."""
    if not subject:
        return "not a valid NATS subject: it is empty"
    if _NOT_IN_SUBJECT.search(subject):
        return "not a valid NATS subject: it contains whitespace or a control character"
    tokens = subject.split(".")
    if "" in tokens:
        return "not a valid NATS subject: an empty token (a leading, trailing or doubled '.')"
    if "*" in tokens or ">" in tokens:
        return (
            "a '*' or '>' token is a wildcard to NATS, and a message cannot be published "
            "to a wildcard subject"
        )
    if subject.startswith(_RESERVED):
        return (
            "the subject is reserved for the NATS server's own API "
            f"({', '.join(p + '>' for p in _RESERVED)})"
        )
    size = len(subject.encode())
    if size > MAX_SUBJECT_BYTES:
        return (
            f"the subject is {size} bytes; NATS's 4 KiB protocol line leaves room for "
            f"{MAX_SUBJECT_BYTES}"
        )
    return None


class NoStreamForSubject(Exception):
    """No JetStream stream captures the subject: the message was not stored.

    The event is ``dead`` at once with this reason (requeue it with ``dead retry`` once a
    stream captures the subject); streams are the operator's to create, so a sink never
    creates one.
    """


class PublishDenied(Exception):
    """The server refused the publish: the user may not publish to the subject. Retried
    with the consumer's backoff (not held as an outage): a grant fixes it."""


class NotAPubAck(Exception):
    """The answer to a publish was not JetStream's: no stream stored the message."""


class NatsSink(Sink):
    """Publish each event to a JetStream subject (the destination) and await the PubAck.

    ``servers`` is a URL or a list of them (``nats://host:4222``); ``connect_options``
    go to `nats.connect`. The connection reconnects forever on its own; while it is down,
    publishes wait (``reconnect_wait``) and are repeated with the same ``Nats-Msg-Id``.
    A connection the server closed for good (nats-py gives up after a protocol error)
    is opened again.

    Refused at once (`Dead`): a subject NATS cannot take (empty tokens, whitespace, a
    ``*`` or ``>`` token, which NATS reads as a wildcard, the server's ``$JS.``/``$SYS.``
    API), a message over the server's ``max_payload`` (payload and headers together),
    a header name that is not an HTTP token, a subject no stream captures, and what
    JetStream answers with a 400 error (over the stream's ``max_msg_size``, a sealed
    stream, ...).
    """

    name = "nats"
    cloudevents_binding = "nats"
    # JetStream's own (Nats-Msg-Id, Nats-Expected-*, Nats-Rollup, Nats-TTL, ...) and the
    # status a client reads a message as a server's answer by (nats-py skips it)
    reserved_names = ("status",)
    reserved_prefixes = ("nats-",)

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
        listed = [servers] if isinstance(servers, str) else list(servers)
        if not listed or not all(isinstance(s, str) and s for s in listed):
            what = type(servers).__name__
            raise TypeError(f"servers must be a URL or a list of URLs, not a {what}")
        # nats-py takes only lower-case schemes (RFC 3986: any case); a bad port would
        # fail every connection attempt as "no servers available"
        self.servers = [
            checked_url(s, ("nats", "tls", "ws", "wss"), "a nats:// or tls://") if "://" in s else s
            for s in listed
        ]
        self._options = dict(connect_options or {})
        self._nc: Any = None
        self._js: Any = None
        self._inbox = ""
        self._tokens = itertools.count()
        #: token -> (future of the PubAck message, monotonic deadline, subject)
        self._acks: dict[str, tuple[asyncio.Future[Any], float, str]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._reopening = asyncio.Lock()
        #: header names checked to be tokens (the outbox-* ones and the events' own)
        self._header_names: set[str] = set()
        #: PubAcks that said "duplicate": repeats JetStream dropped
        self.duplicates = 0
        #: connections opened again after the server closed one for good
        self.reopened = 0
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
        self._refused_by_client = (errors.BadSubjectError, errors.BadHeaderError)
        self._too_large = errors.MaxPayloadError

    def describe(self) -> str:
        # without credentials: the logs and start-up errors print it
        return ",".join(server.rpartition("@")[2] for server in self.servers)

    async def _open(self) -> None:
        async def quiet(exc: Exception) -> None:  # nats-py logs every error otherwise
            logger.debug("nats: %s", describe_exception(exc))

        options: dict[str, Any] = {
            "servers": self.servers,
            "connect_timeout": max(1, int(self.connect_timeout)),
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "allow_reconnect": True,
            "error_cb": self._on_error,
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
            self._sweeper = None
        try:
            if self._nc is not None:
                await self._nc.close()
        finally:
            closed = self._nats.errors.ConnectionClosedError
            for future, _, _ in list(self._acks.values()):
                if not future.done():
                    future.set_exception(closed())
            self._acks.clear()

    async def _on_error(self, exc: Exception) -> None:
        """nats-py's error callback (it would log every error otherwise). A publish the
        user may not make is dropped by the server with an error, not answered: fail its
        PubAck at once rather than leave it to time out as if the server were away."""
        logger.debug("nats: %s: %s", type(exc).__name__, exc)
        denied = _DENIED.search(str(exc))
        if denied is None:
            return
        subject = denied[1]  # nats-py lowers the error's case, the subject's too
        for token, (future, _, sent_to) in list(self._acks.items()):
            if sent_to.lower() == subject and not future.done():
                del self._acks[token]
                future.set_exception(
                    PublishDenied(
                        f"Permissions Violation: the server does not let this user publish "
                        f"to {sent_to!r} (grant it and the retry publishes)"
                    )
                )

    async def _reopen(self, closed: Any) -> None:
        """Connect again: nats-py closes a connection for good when the server answers a
        protocol error (``-ERR``), and would fail every publish after it."""
        async with self._reopening:
            if self._nc is not closed or not self.started:
                return  # another publish reopened it, or the sink is closing
            logger.warning(
                "nats sink: the server closed the connection (%s); connecting again",
                closed.last_error,
            )
            await self._close()
            try:
                await asyncio.wait_for(self._open(), self.connect_timeout)
            except BaseException:
                # half open (no inbox yet): closed, so the next publish tries again
                with contextlib.suppress(Exception):
                    await self._close()
                raise
            self.reopened += 1

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
            late = [t for t, (_, deadline, _) in self._acks.items() if deadline <= now]
            for token in late:
                future, _, _ = self._acks.pop(token)
                if not future.done():
                    future.set_exception(timeout())

    def _destination_problem(self, destination: str) -> str | None:
        return subject_problem(destination)

    def _message_problem(self, message: Message) -> str | None:
        """A header name NATS cannot carry, or a message over the server's ``max_payload``:
        the server closes the connection for a message over it (nats-py checks only the
        payload, not the headers with it)."""
        headers = message.headers  # this message's own dict
        names = self._header_names
        if not names.issuperset(headers):  # names seen before are tokens
            for name in headers:
                stripped = name.strip()
                if stripped != name:  # nats-py strips it: two names would merge into one
                    return (
                        f"the header name {name!r} has whitespace around it: NATS clients "
                        "strip it, so it could merge with another header"
                    )
                if stripped and not _HEADER_NAME.fullmatch(stripped):  # nats-py skips ""
                    return (
                        f"the header name {name!r} is not an HTTP token "
                        "(letters, digits and !#$%&'*+-.^_`|~): NATS cannot carry it"
                    )
            if len(names) < 1024:
                names.update(headers)
        values = "".join(headers.values())
        if "\r" in values or "\n" in values:  # as nats-py >= 2.13 does; older ones did not
            for name, value in headers.items():
                headers[name] = value.translate(_NEWLINES)
        fixed = _HEADER_FRAME + len("Nats-Msg-Id") + len(message.message_id) + 4
        body = len(message.body)
        # at most 4 bytes a character, ": " and "\r\n" a header
        bound = fixed + sum(map(len, headers)) + 4 * len(values) + 4 * len(headers)
        limit = int(self._nc.max_payload) if self._nc is not None else 0
        if limit <= 0 or body + bound <= limit:
            return None
        size = fixed
        for name, value in headers.items():
            if name.strip():
                size += len(name.strip()) + len(value.strip().encode()) + 4
        if body + size <= limit:
            return None
        return (
            f"the message is {body + size} bytes (payload {body}, headers {size}), over the "
            f"NATS server's max_payload of {limit} bytes"
        )

    def _refusal(self, exc: BaseException, message: Message) -> str | None:
        if isinstance(exc, (NoStreamForSubject, NotAPubAck)):
            return str(exc)
        if isinstance(exc, self._refused_by_client):
            return f"{type(exc).__name__}: {exc}"
        if isinstance(exc, self._too_large):
            return f"the payload is over the NATS server's max_payload ({exc})"
        if isinstance(exc, self._api_error) and getattr(exc, "code", None) == 400:
            # a bad request for this message: over the stream's max_msg_size or the
            # 64 KiB of headers, a sealed stream, an expectation header that failed, ...
            return (
                f"JetStream refused it: {getattr(exc, 'description', exc)} "
                f"(err_code {getattr(exc, 'err_code', '?')})"
            )
        return None

    async def _send(self, message: Message) -> None:
        result = (await self._send_many([message]))[0]
        if result is not None:
            raise result

    async def _send_many(self, messages: list[Message]) -> list[BaseException | None]:
        """Every message published with a reply subject of the sink's inbox (nats-py
        buffers them and writes them together), then the PubAcks awaited. NATS keeps a
        connection's messages in the order published."""
        if self._nc.is_closed:
            await self._reopen(self._nc)
        results: list[BaseException | None] = [None] * len(messages)
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.publish_timeout
        acks = self._acks
        waiting: list[tuple[int, str, asyncio.Future[Any]]] = []
        try:
            for i, message in enumerate(messages):
                headers = message.headers  # this message's own dict; a repeat sets the same id
                headers["Nats-Msg-Id"] = message.message_id
                token = str(next(self._tokens))
                future: asyncio.Future[Any] = loop.create_future()
                acks[token] = (future, deadline, message.destination)
                waiting.append((i, token, future))  # its token is dropped however this ends
                try:
                    await self._nc.publish(
                        message.destination, message.body, reply=self._inbox + token,
                        headers=headers,
                    )  # fmt: skip
                except Exception as exc:
                    waiting.pop()
                    acks.pop(token, None)
                    results[i] = exc
            streams: dict[str, BaseException | None] = {}  # asked of JetStream in this call
            for i, _, future in waiting:
                try:
                    await self._stored(await future, messages[i], streams)
                except Exception as exc:
                    results[i] = exc
        finally:
            for _, token, _ in waiting:
                acks.pop(token, None)
        return results

    async def _stored(
        self, ack: Any, message: Message, streams: dict[str, BaseException | None]
    ) -> None:
        """Raise unless ``ack`` is JetStream's PubAck of ``message``; ``streams``: what
        JetStream said of each subject asked about so far (once a subject a call)."""
        if ack.headers and ack.headers.get("Status") == "503":  # no responders
            if not self._nc.is_connected:
                raise ConnectionError("NATS connection lost")
            subject = message.destination
            if subject not in streams:
                try:
                    await self._require_stream(subject)
                    streams[subject] = None
                except Exception as exc:
                    streams[subject] = exc
            if streams[subject] is not None:
                raise streams[subject]  # type: ignore[misc]
            # a stream captures the subject, yet nobody answered: JetStream is away for
            # now (a server shutting down stops JetStream before it drops connections)
            raise ConnectionError(f"JetStream did not answer for {message.destination!r}")
        try:
            reply = decode_json(ack.data)
        except ValueError:
            reply = None
        if isinstance(reply, dict) and "error" in reply:
            raise self._api_error.from_error(reply["error"])
        if not isinstance(reply, dict) or "stream" not in reply:
            raise NotAPubAck(
                f"the answer on {message.destination!r} is not a JetStream PubAck "
                f"({bytes(ack.data[:80])!r}): no stream stored the message; a NATS "
                "service answers on this subject"
            )
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
