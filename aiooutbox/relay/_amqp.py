"""`RabbitMQSink`: publish with publisher confirms, persistent and mandatory.

Each message is persistent (delivery mode 2) with ``message_id`` = the event's
``message_id``, published ``mandatory`` on a confirming channel: the call returns only
once the broker acked it, and a message no queue is bound for comes back as a failure
(`Unroutable`, retried then ``dead``) instead of being dropped. RabbitMQ does not
dedupe, so a repeat after a crash or a lost connection is delivered twice: downstream
consumers dedupe on ``message_id``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .._values.text import exception_message
from ._sink import Message, Sink, require

__all__ = ["RabbitMQSink", "Unroutable"]


class Unroutable(Exception):
    """The broker returned the message: no queue is bound for its routing key."""


class RabbitMQSink(Sink):
    """Publish each event to an exchange with the destination as routing key.

    ``exchange=""`` (the default exchange) routes to the queue named by the routing key;
    a named exchange must exist (it is checked at start, never declared). The
    connection is aio-pika's robust one: it reconnects on its own, and publishes wait
    for it (``reconnect_wait``).
    """

    name = "rabbitmq"
    cloudevents_binding = "amqp"

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
        if not isinstance(url, str) or not url.startswith(("amqp://", "amqps://")):
            raise TypeError(f"url must be an amqp:// or amqps:// URL, not {url!r}")
        if not isinstance(exchange, str):
            raise TypeError(f"exchange must be a str, not {exchange!r}")
        self._pika = require("aio_pika", "rabbitmq")
        self._aiormq = require("aiormq", "rabbitmq")
        self.url = url
        self.exchange_name = exchange
        self._connection: Any = None
        self._exchange: Any = None
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

    def describe(self) -> str:
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        where = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
        return f"{where} exchange {self.exchange_name!r}" if self.exchange_name else where

    async def _open(self) -> None:
        # aio-pika waits 5 s between reconnect attempts by default; events wait meanwhile
        self._connection = await self._pika.connect_robust(
            self.url, timeout=self.connect_timeout, reconnect_interval=1
        )
        channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
        if self.exchange_name:
            self._exchange = await channel.get_exchange(self.exchange_name, ensure=True)
        else:
            self._exchange = channel.default_exchange

    async def _close(self) -> None:
        if self._connection is not None:
            await self._connection.close()

    async def _send(self, message: Message) -> None:
        event = message.event
        amqp = self._pika.Message(
            message.body,
            headers=message.headers,
            content_type=message.content_type,
            delivery_mode=self._pika.DeliveryMode.PERSISTENT,
            message_id=message.message_id,
            timestamp=event.created_at,
            type=event.topic,
        )
        try:
            await self._exchange.publish(
                amqp,
                routing_key=message.destination,
                mandatory=True,
                timeout=self.publish_timeout,
            )
        except self._returned:
            raise Unroutable(
                f"no queue is bound for routing key {message.destination!r} on "
                f"exchange {self.exchange_name or '(default)'!r}"
            ) from None
        except self._nacked as exc:
            reason = exception_message(exc)
            raise Unroutable(f"the broker refused the message (nack): {reason}") from None

    def _is_outage(self, exc: BaseException) -> bool:
        return isinstance(exc, self._outages)
