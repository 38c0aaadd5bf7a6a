"""`RedisSink`: ``XADD`` each event to a Redis stream.

Fields: ``message_id`` (the event's UUID), ``payload`` (JSON), ``topic``, ``event_id``,
``headers`` (the event's headers as a JSON object, their values as the producer gave
them: ``{"x-num": 0}`` stays a number), and ``dedupe_key`` and ``ordering_key`` when
set. Redis does not dedupe, so a repeat (an event whose earlier attempt may have been
added: its relay died, or an attempt failed) is looked up first, by ``XRANGE`` from the
stream id of a time before its first attempt (its ``created_at`` less
``clock_skew``) to the end, matching ``message_id``; found, it is not added again
(`relay._lookup`). First attempts never look. ``maxlen`` trims approximately (``MAXLEN ~``), so old
entries go in whole macro-nodes, cheaply.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from datetime import timedelta
from typing import Any

from .._values.limits import check_count
from ._lookup import Lookup, Seen, check_skew
from ._masked import checked_url, masked
from ._message import Message, own_headers, payload_body
from ._sink import Sink, require

__all__ = ["RedisSink"]

#: replies that refuse this command whatever the retries, and what they mean
_REFUSALS = {
    "WRONGTYPE": "the key holds another type of value, not a stream",
    "Protocol error: invalid bulk length": (
        "a value over the server's proto-max-bulk-len (the payload is too large)"
    ),
}
#: replies of a server that cannot take writes for now (full, a replica, busy, a
#: cluster failing over): held like a lost connection
_BUSY = ("OOM", "READONLY", "BUSY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "LOADING")
_BUSY_CLASSES = frozenset(
    {"OutOfMemoryError", "ReadOnlyError", "TryAgainError", "ClusterDownError", "MasterDownError"}
)
#: the least ``proto-max-bulk-len`` a server takes (1mb): no smaller value is refused
_BULK_FLOOR = 1024 * 1024
#: entries per XRANGE of a look-up
_PAGE = 2000
#: the streams whose start of an XADD command a sink keeps
_HEADS = 4096


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(value), value)


#: the fields' names as the protocol sends them
_NAMES = [_bulk(n) for n in (b"message_id", b"topic", b"event_id", b"payload", b"headers")]
_DEDUPE, _ORDERING = _bulk(b"dedupe_key"), _bulk(b"ordering_key")


def _head(stream: str, maxlen: int | None) -> tuple[int, bytes]:
    """The arguments of an ``XADD`` to ``stream`` before its fields: their count and
    their bytes."""
    args = [b"XADD", stream.encode()]
    if maxlen is not None:
        args += [b"MAXLEN", b"~", str(maxlen).encode()]
    args.append(b"*")
    return len(args), b"".join(map(_bulk, args))


# connections of a sink without max_in_flight: Redis runs one command at a time, so more
# in flight than this only queue on its side (publishes past it wait for a connection)
_CONNECTIONS = 100


class RedisSink(Sink):
    """Append each event to the stream named by the destination.

    ``url`` is ``redis://host:port/db`` (or ``rediss://``); ``maxlen`` caps each stream
    approximately (``None``: no cap). The client reconnects on the next command after a
    loss; publishes wait for it (``reconnect_wait``), as they do while the server
    answers that it cannot write now (OOM, READONLY, BUSY, LOADING, TRYAGAIN, ...).

    Refused at once (`Dead`): a stream name whose key holds another type (WRONGTYPE) and
    a payload over the server's ``proto-max-bulk-len``. Stream names are literal keys:
    no wildcards.

    ``read_back=True`` (the default) looks a repeated event up in its stream before
    adding it again (see the module); ``clock_skew`` (seconds) is how far the Redis
    server's clock may run behind the database's.
    """

    name = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        destination: str = "{topic}",
        maxlen: int | None = None,
        connect_timeout: float | timedelta = 10.0,
        publish_timeout: float | timedelta = 10.0,
        reconnect_wait: float | timedelta = 60.0,
        max_in_flight: int | None = None,
        format: str = "outbox",
        cloudevents_source: str | None = None,
        read_back: bool = True,
        clock_skew: float | timedelta = 60.0,
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
        url = checked_url(url, ("redis", "rediss", "unix"), "a redis:// or rediss://")
        if maxlen is not None:
            check_count("maxlen", maxlen, 1, 2**63 - 1)
        self._redis = require("redis.asyncio", "redis")
        self._exceptions = require("redis.exceptions", "redis")
        if not isinstance(read_back, bool):
            raise TypeError(f"read_back must be a bool, not {read_back!r}")
        self.clock_skew = check_skew(clock_skew)
        self.url = url
        self.maxlen = maxlen
        self._client: Any = None
        #: stream -> the start of its XADD commands (`_head`)
        self._heads: dict[str, tuple[int, bytes]] = {}
        if read_back:
            self._lookup = Lookup(self._read)

    def describe(self) -> str:
        # without credentials: a password may be in the userinfo or the query
        return masked(self.url).rpartition("@")[2]

    async def _open(self) -> None:
        # A blocking pool: a publish beyond its connections waits for one (up to
        # publish_timeout) instead of failing. redis-py's default pool refuses the 101st
        # concurrent command with MaxConnectionsError (`max_connections=None` means 100
        # since redis-py 8), which a relay at concurrency 256 took for an outage of a
        # healthy server: "unavailable", events held, hundreds of retries per run.
        # No socket_timeout: a timer per reply cost a tenth of the client's CPU a
        # message; each call is bounded by publish_timeout as a whole instead (a reply
        # cut short closes its connection: redis-py drops a connection whose read was
        # cancelled).
        pool = self._redis.BlockingConnectionPool.from_url(
            self.url,
            max_connections=self.max_in_flight or _CONNECTIONS,
            timeout=self.publish_timeout,
            socket_connect_timeout=self.connect_timeout,
        )
        self._client = self._redis.Redis.from_pool(pool)  # the client closes its pool
        await self._client.ping()

    async def _close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def _fields(self, message: Message) -> dict[str, str | bytes]:
        event = message.event
        fields: dict[str, str | bytes] = {
            "message_id": message.message_id,
            "topic": event.topic,
            "event_id": str(event.id),
            "payload": message.body,
            # the event's own headers, values as they are (message.headers holds text),
            # but for the names reserved
            "headers": payload_body(own_headers(event, self._reserved)) if event.headers else b"{}",
        }
        if event.dedupe_key is not None:
            fields["dedupe_key"] = event.dedupe_key
        if message.key is not None:
            fields["ordering_key"] = message.key
        return fields

    async def _send(self, message: Message) -> None:
        async with asyncio.timeout(self.publish_timeout):
            await self._client.xadd(
                message.destination, self._fields(message), maxlen=self.maxlen, approximate=True
            )

    async def _send_many(self, messages: list[Message]) -> list[BaseException | None]:
        """One pipeline (not a transaction) of ``XADD`` on one connection of the pool:
        one round trip, the replies in order, a command's error in its place. Redis runs
        a connection's commands in the order sent; a connection lost midway may have
        added a prefix of them (those whose reply came have their outcome; the rest the
        error, and the look-up before the repeat finds what was added). The commands
        are packed here, not by the client's pipeline (a third of the relay's CPU a
        message went to its generic packing), and a lost connection is not sent again
        by the client's retries: the sink decides what is repeated.

        A value of 1 MB or more goes in a command of its own: the server closes the
        connection on a value over its ``proto-max-bulk-len`` (1 MB at the least), which
        would fail every command after it in the pipeline as if the server were away."""
        results: list[BaseException | None] = [None] * len(messages)
        packed: list[bytes] = []
        chosen: list[int] = []
        alone: list[int] = []
        for i, message in enumerate(messages):
            command = self._command(message)
            if command is None:
                alone.append(i)
            else:
                packed.append(command)
                chosen.append(i)
        if chosen:
            try:
                async with asyncio.timeout(self.publish_timeout):
                    replies = await self._pipeline(packed)
            except Exception as exc:
                replies = [exc] * len(chosen)
            for i, reply in zip(chosen, replies, strict=True):
                results[i] = reply
        for i in alone:
            try:
                await self._send(messages[i])
            except Exception as exc:
                results[i] = exc
        return results

    async def _pipeline(self, packed: list[bytes]) -> list[BaseException | None]:
        """Send the ``packed`` commands on one connection, read their replies: each
        one's error, or None; after a lost connection, the error for the rest."""
        pool = self._client.connection_pool
        try:
            connection = await pool.get_connection()
        except TypeError:  # redis-py before 5.3 wants the command's name
            connection = await pool.get_connection("XADD")
        replies: list[BaseException | None] = []
        try:
            await connection.send_packed_command(b"".join(packed))
            for _ in packed:
                try:
                    await connection.read_response()
                except self._exceptions.ResponseError as exc:
                    replies.append(exc)
                else:
                    replies.append(None)
        except BaseException as exc:
            # the replies still on the socket belong to nobody: the connection goes
            await connection.disconnect(nowait=True)
            if not isinstance(exc, Exception):
                raise
            replies += [exc] * (len(packed) - len(replies))
        finally:
            await pool.release(connection)
        return replies

    def _command(self, message: Message) -> bytes | None:
        """``XADD`` of ``message`` in the protocol's bytes; None for a value of 1 MB or
        more (it goes alone)."""
        event = message.event
        payload = message.body
        headers = payload_body(own_headers(event, self._reserved)) if event.headers else b"{}"
        if len(payload) >= _BULK_FLOOR or len(headers) >= _BULK_FLOOR:
            return None
        stream = message.destination
        head = self._heads.get(stream)
        if head is None:
            if len(self._heads) >= _HEADS:
                self._heads.clear()
            head = self._heads[stream] = _head(stream, self.maxlen)
        count, start = head
        values = [
            message.message_id.encode(),
            event.topic.encode(),
            str(event.id).encode(),
            payload,
            headers,
        ]
        names = _NAMES
        if event.dedupe_key is not None or message.key is not None:
            names = list(_NAMES)
            if event.dedupe_key is not None:
                names.append(_DEDUPE)
                values.append(event.dedupe_key.encode())
            if message.key is not None:
                names.append(_ORDERING)
                values.append(message.key.encode())
        parts = [b"*%d\r\n" % (count + 2 * len(values)), start]
        for name, value in zip(names, values, strict=True):
            parts += (name, b"$%d\r\n" % len(value), value, b"\r\n")
        return b"".join(parts)

    async def _published(self, message: Message, asked: float) -> bool:
        assert self._lookup is not None
        created = message.event.created_at
        since = int(created.timestamp() * 1000 - self.clock_skew * 1000) if created else 0
        return await self._lookup.contains(
            [message.destination], message.message_id, max(since, 0), asked
        )

    async def _read(self, stream: Hashable, seen: Seen) -> None:
        """Add the ``message_id`` of every entry of ``stream`` from where ``seen`` stopped
        (or its bound) to the end."""
        if seen.position is None:
            start = f"{seen.since_ms}-0"
        else:
            ms, seq = seen.position
            start = f"{ms}-{seq + 1}"  # the entry after the last one read (Redis 5 too)
        while True:
            async with asyncio.timeout(self.publish_timeout):
                entries = await self._client.xrange(stream, min=start, max="+", count=_PAGE)
            for _, fields in entries:
                found = fields.get(b"message_id")
                if found is not None:
                    seen.ids.add(found.decode("utf-8", "replace"))
            if entries:
                ms, _, seq = entries[-1][0].decode().partition("-")
                seen.position = (int(ms), int(seq))
                start = f"{ms}-{int(seq) + 1}"
            if len(entries) < _PAGE:
                return

    def _may_have_landed(self, exc: BaseException) -> bool:
        # the client's pool had no free connection: the command was never sent
        return type(exc).__name__ != "MaxConnectionsError"

    def _refusal(self, exc: BaseException, message: Message) -> str | None:
        if type(exc) is not self._exceptions.ResponseError:  # subclasses: OOM, NOPERM, ...
            return None
        text = str(exc)
        for start, meaning in _REFUSALS.items():
            if text.startswith(start):
                return f"{text} ({meaning})"
        return None

    def _is_outage(self, exc: BaseException) -> bool:
        errors = self._exceptions
        if isinstance(
            exc, (errors.ConnectionError, errors.TimeoutError, errors.BusyLoadingError, OSError)
        ):
            return True
        if isinstance(exc, errors.ResponseError):
            # redis-py strips the error code of the classes it knows (OutOfMemoryError,
            # ReadOnlyError, ...): tell them by class name, the rest by their text
            code = getattr(exc, "status_code", None) or str(exc).split(" ", 1)[0]
            return code in _BUSY or type(exc).__name__ in _BUSY_CLASSES
        return False
