"""Relays: publish the outbox to a broker, one sink per broker, each a consumer handler.

::

    async with NatsSink("nats://127.0.0.1:4222") as sink:
        async with aiooutbox.OutboxConsumer(pool, concurrency=256) as consumer:
            await consumer.run({"*": sink})        # "*": every topic in the outbox

A sink publishes one event, awaits the broker's confirm and returns, so the row is
``done`` only once the broker holds the message; throughput comes from the consumer's
concurrency, per-key order from its ``ordering_key`` handling. Every message carries the
event's ``message_id`` (a UUID unique across databases and tables, the same on every
retry) for brokers and downstream consumers to dedupe on. Each sink needs its extra:
``aiooutbox[nats]``, ``[rabbitmq]``, ``[kafka]``, ``[redis]``, ``[webhook]``.
See docs/relay.md.
"""

from __future__ import annotations

from ._amqp import Nacked, RabbitMQSink, Unroutable
from ._kafka import KafkaSink
from ._nats import NatsSink, NoStreamForSubject, PublishDenied
from ._redis import RedisSink
from ._sink import BrokerUnavailable, Message, Sink, SinkClosed
from ._url import sink_for_url
from ._webhook import WebhookError, WebhookSink, sign

__all__ = [
    "BrokerUnavailable",
    "KafkaSink",
    "Message",
    "Nacked",
    "NatsSink",
    "NoStreamForSubject",
    "PublishDenied",
    "RabbitMQSink",
    "RedisSink",
    "Sink",
    "SinkClosed",
    "Unroutable",
    "WebhookError",
    "WebhookSink",
    "sign",
    "sink_for_url",
]
