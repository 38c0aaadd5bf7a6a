"""`RabbitMQSink`: publish with publisher confirms, persistent and mandatory.

Each message is persistent (delivery mode 2) with ``message_id`` = the event's
``message_id``, published ``mandatory`` on one of the sink's confirming channels
(`CHANNELS`, taken in turn): the call returns only once the broker acked it, and a
message no queue is bound for comes back and sends its event to ``dead`` at once
(`Unroutable` as the cause) instead of being dropped.
RabbitMQ does not dedupe, so a repeat after a crash or a lost connection is delivered
twice: downstream consumers dedupe on ``message_id``.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .._values.text import exception_message
from ._masked import checked_url, masked
from ._sink import Message, Sink, require

__all__ = ["Nacked", "RabbitMQSink", "Unroutable"]

#: AMQP's short strings (routing keys, the ``type`` property) hold at most 255 bytes
MAX_SHORT_STRING = 255
#: the longest header name RabbitMQ's client library writes: pamqp cuts longer field
#: names to 128 bytes, silently (two long names become one, a value is lost)
MAX_HEADER_NAME = 128
#: frame_max when the connection has not said (RabbitMQ's default)
FRAME_MAX = 131072
#: header tables this much under frame_max are not measured exactly (bytes)
_FRAME_MARGIN = 4096
#: confirming channels a sink publishes on, in turn. A channel takes one publish per
#: event-loop pass (aiormq hands its lock from one publish to the next), so one channel
#: alone queued a batch's publishes behind each other for hundreds of ms on a busy loop;
#: a key's next event is published only once the previous one is confirmed, so its order
#: does not depend on the channel
CHANNELS = 8
#: what RabbitMQ says when it closes the channel for a message over max_message_size
_TOO_LARGE = re.compile(r"message size (\d+) is larger than configured max size (\d+)")


class Unroutable(Exception):
    """The broker returned the message: no queue is bound for its routing key.

    The event goes to ``dead`` at once, with the broker's reply (``312 NO_ROUTE``);
    requeue it (``dead retry``) once a queue is bound.
    """


class Nacked(Exception):
    """The broker refused the message with a nack (a full queue that rejects publishes,
    an internal error): retried with the consumer's backoff."""


class RabbitMQSink(Sink):
    """Publish each event to an exchange with the destination as routing key.

    ``exchange=""`` (the default exchange) routes to the queue named by the routing key;
    a named exchange must exist (it is checked at start, never declared). The
    connection is aio-pika's robust one: it reconnects on its own, and publishes wait
    for it (``reconnect_wait``).

    Refused at once (`Dead`): a routing key over AMQP's 255 bytes, a header name over 128
    bytes (the client would cut it), headers that do not fit in one frame (the
    connection's ``frame_max``: RabbitMQ would close the whole connection), a message no
    queue is bound for, and one over the broker's ``max_message_size`` (RabbitMQ closes
    the channel for it; the sink then refuses larger messages without publishing them). A
    routing key is literal when published (``*`` and ``#`` are wildcards only in
    bindings), so any topic may be one.
    """

    name = "rabbitmq"
    cloudevents_binding = "amqp"
    # RabbitMQ's sender-selected distribution: more routing keys than the destination
    reserved_names = ("cc", "bcc")

    def __init__(
        self,
        url: str = "amqp://guest:guest@127.0.0.1:5672/",
        *,
        exchange: str = "",
        destination: str = "{topic}",
        connect_timeout: float | timedelta = 10.0,
        publish_timeout: float | timedelta = 10.0,
        reconnect_wait: float | timedelta = 60.0,
        max_in_flight: int | None = None,
        format: str = "outbox",
        cloudevents_source: str | None = None,
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
        url = checked_url(url, ("amqp", "amqps"), "an amqp:// or amqps://", host=True)
        if not isinstance(exchange, str):
            raise TypeError(f"exchange must be a str, not {exchange!r}")
        self._pika = require("aio_pika", "rabbitmq")
        self._aiormq = require("aiormq", "rabbitmq")
        self.url = url
        self.exchange_name = exchange
        self._connection: Any = None
        #: the confirming channels publishes take in turn (`CHANNELS`)
        self._channels: list[Any] = []
        self._turn = 0
        errors = self._aiormq.exceptions
        self._outages: tuple[type[BaseException], ...] = (
            errors.AMQPConnectionError,
            errors.ChannelInvalidStateError,
            errors.ChannelClosed,
            ConnectionError,
            OSError,
            TimeoutError,
        )
        self._returned = errors.PublishError
        self._nacked = errors.DeliveryError
        self._precondition = errors.ChannelPreconditionFailed
        self._access_refused = errors.ChannelAccessRefused
        #: the broker's max_message_size, once a refusal told it
        self.max_message_size: int | None = None
        #: the connection's negotiated frame_max, once connected
        self.frame_max = FRAME_MAX
        self._header = require("pamqp.header", "rabbitmq").ContentHeader
        self._frame = require("pamqp.frame", "rabbitmq").marshal

    def describe(self) -> str:
        try:
            parts = urlsplit(self.url)
            host = parts.hostname or ""
            netloc = f"{host}:{parts.port}" if parts.port else host
            where = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
        except ValueError:  # never raise: start-up errors and outages call it
            where = masked(self.url)
        return f"{where} exchange {self.exchange_name!r}" if self.exchange_name else where

    async def _open(self) -> None:
        # aio-pika waits 5 s between reconnect attempts by default; events wait meanwhile
        self._connection = await self._pika.connect_robust(
            self.url, timeout=self.connect_timeout, reconnect_interval=1
        )
        for _ in range(CHANNELS):
            channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
            self._channels.append(channel)
        underlay = getattr(self._connection.transport, "connection", None)
        tune = getattr(underlay, "connection_tune", None)
        if tune is not None:  # what this connection negotiated; 0: no limit
            self.frame_max = int(tune.frame_max) or 2**32 - 1
        if self.exchange_name:  # it must exist: checked once (a passive declare)
            await self._channels[0].get_exchange(self.exchange_name, ensure=True)

    async def _close(self) -> None:
        if self._connection is not None:
            await self._connection.close()

    def _destination_problem(self, destination: str) -> str | None:
        size = len(destination.encode())
        if size > MAX_SHORT_STRING:
            return f"the routing key is {size} bytes; AMQP allows {MAX_SHORT_STRING} bytes at most"
        return None

    def _message_problem(self, message: Message) -> str | None:
        limit = self.max_message_size
        if limit is not None and len(message.body) > limit:
            return (
                f"message size {len(message.body)} is larger than configured max size "
                f"{limit} (the broker's max_message_size, from its refusal of an earlier one)"
            )
        # at most 4 bytes a character: most tables are measured without encoding them
        rough = 0
        for name, value in message.headers.items():
            if len(name) > MAX_HEADER_NAME // 4 and len(name.encode()) > MAX_HEADER_NAME:
                return (
                    f"the header name {name[:40]!r}... is {len(name.encode())} bytes; "
                    f"RabbitMQ's client writes at most {MAX_HEADER_NAME} (it would cut it)"
                )
            rough += 4 * (len(name) + len(value)) + 6
        if rough + _FRAME_MARGIN > self.frame_max:
            return self._frame_problem(message)
        return None

    def _frame_problem(self, message: Message) -> str | None:
        """Why the message's content header frame (its properties, headers among them)
        would not fit in one frame: RabbitMQ closes the connection for it (501
        FRAME_ERROR), failing every publish on it."""
        header = self._header(0, len(message.body), self._amqp_message(message).properties)
        size = len(self._frame(header, 1))
        if size <= self.frame_max:
            return None
        return (
            f"its headers and properties take {size} bytes, over the connection's frame_max "
            f"of {self.frame_max}: AMQP carries them in one frame"
        )

    def _refusal(self, exc: BaseException, message: Message) -> str | None:
        if isinstance(exc, Unroutable):
            return str(exc)
        if isinstance(exc, self._precondition):
            # the broker closed the channel; every publish in flight on it fails with
            # this, but only the one over the limit is refused: the others go again
            found = _TOO_LARGE.search(str(exc))
            if found is not None and len(message.body) > int(found[2]):
                self.max_message_size = int(found[2])
                return str(exc)
        return None

    def _amqp_message(self, message: Message) -> Any:
        """The aio-pika message of ``message``."""
        event = message.event
        topic = event.topic
        return self._pika.Message(
            message.body,
            headers=message.headers,
            content_type=message.content_type,
            delivery_mode=self._pika.DeliveryMode.PERSISTENT,
            message_id=message.message_id,
            timestamp=event.created_at,
            # a short string: a longer topic travels only in the outbox-topic header
            type=topic if len(topic) < 64 or len(topic.encode()) <= MAX_SHORT_STRING else None,
        )

    async def _send(self, message: Message) -> None:
        amqp = self._amqp_message(message)
        chosen = self._channels[self._turn]
        self._turn = (self._turn + 1) % len(self._channels)
        try:
            if chosen.is_closed:
                raise self._aiormq.exceptions.ChannelInvalidStateError(f"{chosen!r} closed")
            channel = await chosen.get_underlay_channel()  # waits for a reconnection
            # aiormq's call under aio-pika's publish, without waiting for the writer to
            # send the frames (``wait=False``; aio-pika's waits, holding the channel's
            # lock meanwhile): the next publish has the lock without waiting for the
            # writer; the confirm is awaited all the same
            await channel.basic_publish(
                amqp.body,
                exchange=self.exchange_name,
                routing_key=message.destination,
                properties=amqp.properties,
                mandatory=True,
                timeout=self.publish_timeout,
                wait=False,
            )
        except self._returned as exc:
            delivery = getattr(getattr(exc, "message", None), "delivery", None)
            code = getattr(delivery, "reply_code", 312)
            text = getattr(delivery, "reply_text", "NO_ROUTE")
            raise Unroutable(
                f"returned by the broker ({code} {text}): no queue is bound for routing key "
                f"{message.destination!r} on exchange {self.exchange_name or '(default)'!r}"
            ) from None
        except self._nacked as exc:
            reason = exception_message(exc)
            raise Nacked(f"the broker refused the message (nack): {reason}") from None

    def _is_outage(self, exc: BaseException) -> bool:
        # ACCESS_REFUSED closes the channel too, but it is no outage: the user may not
        # publish there (a permission the operator grants), so the event is retried
        return isinstance(exc, self._outages) and not isinstance(exc, self._access_refused)
