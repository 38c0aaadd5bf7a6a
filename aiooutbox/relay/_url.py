"""`sink_for_url`: the URL scheme picks the sink, as ``relay --to URL`` does."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from ..errors import InvalidArgument
from ._amqp import RabbitMQSink
from ._kafka import KafkaSink
from ._nats import NatsSink
from ._redis import RedisSink
from ._sink import Sink
from ._webhook import WebhookSink

__all__ = ["SCHEMES", "sink_for_url"]

SCHEMES = ("nats", "tls", "amqp", "amqps", "kafka", "redis", "rediss", "http", "https")


def sink_for_url(
    url: str,
    *,
    destination: str = "{topic}",
    exchange: str | None = None,
    secret: str | bytes | None = None,
    **options: Any,
) -> Sink:
    """A sink for ``nats://``, ``amqp(s)://``, ``kafka://host:port[,host:port]``,
    ``redis(s)://`` or ``http(s)://`` URLs; other ``options`` go to the sink's class."""
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, not {type(url).__name__}")
    scheme = urlsplit(url).scheme.lower()
    if scheme not in SCHEMES:
        raise InvalidArgument(
            f"cannot relay to {url.split('@')[-1]!r}: the URL must start with nats://, "
            "amqp://, amqps://, kafka://, redis://, rediss://, http:// or https://"
        )
    if exchange is not None and scheme not in ("amqp", "amqps"):
        raise InvalidArgument("an exchange applies only to amqp:// URLs")
    if scheme in ("http", "https"):
        if secret is None:
            raise InvalidArgument("a webhook needs a signing secret (whsec_...)")
        if destination != "{topic}":
            raise InvalidArgument("a webhook's destination is its URL; put {topic} in it")
        return WebhookSink(url, secret=secret, **options)
    if secret is not None:
        raise InvalidArgument("a secret applies only to http(s):// webhooks")
    if scheme in ("nats", "tls"):
        return NatsSink(url, destination=destination, **options)
    if scheme in ("amqp", "amqps"):
        return RabbitMQSink(url, exchange=exchange or "", destination=destination, **options)
    if scheme == "kafka":
        servers = url[len("kafka://") :].strip("/")
        if not servers:
            raise InvalidArgument("kafka:// needs host:port, e.g. kafka://127.0.0.1:9092")
        return KafkaSink(servers.split(","), destination=destination, **options)
    return RedisSink(url, destination=destination, **options)
