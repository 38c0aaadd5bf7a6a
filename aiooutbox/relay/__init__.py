"""Relays: publish the outbox to a broker, one sink per broker, each a consumer handler.

::

    async with NatsSink("nats://127.0.0.1:4222") as sink:
        async with aiooutbox.OutboxConsumer(pool, concurrency=2048) as consumer:
            await consumer.run({"*": sink.handler(batch=256)})  # "*": every topic

A sink's batch handler publishes a batch of events with its client's pipelined calls,
awaits the broker's confirms and returns each event's outcome, so a row is ``done``
only once the broker holds its message; a key's events go out one after another
(per-key order), each refused or failed message is settled on its own. Every message carries the
event's ``message_id`` (a UUID unique across databases and tables, the same on every
retry) for brokers and downstream consumers to dedupe on. Each sink needs its extra,
``nats``, ``rabbitmq``, ``kafka``, ``redis`` or ``webhook`` (in a clone of aiooutbox:
``pip install -e '.[kafka]'``).
See docs/relay.md.
"""

from __future__ import annotations

from ._amqp import Nacked, RabbitMQSink, Unroutable
from ._batch import HeldBack
from ._kafka import KafkaSink
from ._nats import NatsSink, NoStreamForSubject, PublishDenied
from ._redis import RedisSink
from ._sink import BrokerUnavailable, Message, Sink, SinkClosed
from ._url import sink_for_url
from ._webhook import WebhookError, WebhookSink, sign

__all__ = [
    "BrokerUnavailable",
    "HeldBack",
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
