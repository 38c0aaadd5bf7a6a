"""`sink_for_url`: the URL scheme picks the sink, as ``relay --to URL`` does.

NATS and Kafka take several hosts, for a cluster whose first listed node may be down:
``nats://a:4222,nats://b:4222`` (or ``nats://a:4222,b:4222``) becomes one server URL
per host, each with the first URL's credentials when it has none of its own; and
``kafka://a:9092,b:9092`` (or ``kafka://a:9092,kafka://b:9092``) the bootstrap list.
`split_hosts` is that parsing; a host that is not ``host:port`` is refused here, in one
line, before anything connects.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from ..errors import InvalidArgument
from ._amqp import RabbitMQSink
from ._kafka import KafkaSink
from ._masked import masked, normal_scheme
from ._nats import NatsSink
from ._redis import RedisSink
from ._sink import Sink
from ._webhook import WebhookSink

__all__ = ["SCHEMES", "sink_for_url", "split_hosts"]

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
    url = normal_scheme(url.strip())
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme not in SCHEMES:
        raise InvalidArgument(
            f"cannot relay to {_shown(url)!r}: the URL must start with nats://, "
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
        return NatsSink(split_hosts(url), destination=destination, **options)
    if scheme == "kafka":
        servers = [u[len("kafka://") :] for u in split_hosts(url)]
        if any("@" in h or "/" in h for h in servers):
            raise InvalidArgument(
                f"{_shown(url)!r}: a kafka:// URL is host:port[,host:port] only (no "
                "credentials or path; pass them in producer_options)"
            )
        return KafkaSink(servers, destination=destination, **options)
    if "," in _netloc(url).rpartition("@")[2]:
        raise InvalidArgument(
            f"{scheme}:// takes one host, not {_shown(url)!r}; several hosts are for "
            "nats:// and kafka://"
        )
    if scheme in ("amqp", "amqps"):
        return RabbitMQSink(url, exchange=exchange or "", destination=destination, **options)
    return RedisSink(url, destination=destination, **options)


def _netloc(url: str) -> str:
    return url.partition("://")[2].partition("/")[0]


def _shown(url: str) -> str:
    """``url`` without its credentials, for an error message."""
    if "://" not in url:  # no URL: whatever precedes an @ may be a password
        return url.rpartition("@")[2]
    scheme, _, rest = masked(url).partition("://")
    netloc, slash, path = rest.partition("/")
    return f"{scheme}://{re.sub(r'[^,@]*@', '', netloc)}{slash}{path}"


def split_hosts(url: str) -> list[str]:
    """``scheme://[user:pw@]a:1,[scheme://]b:2[/path]`` as one URL per host.

    Each URL keeps the scheme, the path and query, and (when it names none of its own)
    the first host's credentials. Every host must be ``host:port`` (an IPv6 address in
    brackets); anything else raises `InvalidArgument` naming it.
    """
    scheme, _, rest = url.partition("://")
    if "@" in rest.partition("?")[0].partition("/")[2]:  # a "/" in the credentials
        raise InvalidArgument(
            f"{_shown(url)!r}: a '/' in the user or password must be percent-encoded (%2F)"
        )
    for other in re.findall(r",\s*([A-Za-z][A-Za-z0-9+.-]*)://", rest):
        if other.lower() != scheme.lower():
            raise InvalidArgument(
                f"{_shown(url)!r} mixes {other}:// into a {scheme}:// list of hosts"
            )
    # the scheme may be repeated before each host: drop those, keep the first
    rest = re.sub(rf",\s*{re.escape(scheme)}://", ",", rest, flags=re.IGNORECASE)
    netloc, slash, tail = rest.partition("/")
    tail = slash + tail if tail.strip("/") else ""
    parts = [p.strip() for p in netloc.split(",")]
    credentials = ""
    urls: list[str] = []
    for i, part in enumerate(parts):
        user, at, host = part.rpartition("@")
        if i == 0 and at:
            credentials = user + "@"
        _check_host(host, url, i + 1, scheme)
        urls.append(f"{scheme}://{(user + '@') if at else credentials}{host}{tail}")
    return urls


def _check_host(host: str, url: str, n: int, scheme: str) -> None:
    example = "kafka://127.0.0.1:9092" if scheme == "kafka" else "nats://127.0.0.1:4222"
    where = f"host {n} of {_shown(url)!r}" if "," in url else repr(_shown(url))
    if not host:
        raise InvalidArgument(f"{where} is empty: expected host:port, e.g. {example}")
    try:
        parsed = urlsplit(f"//{host}")
        port = parsed.port
    except ValueError as exc:
        raise InvalidArgument(f"{where}: {host!r} is not host:port ({exc})") from None
    if not parsed.hostname or (scheme == "kafka" and port is None):
        raise InvalidArgument(f"{where}: {host!r} is not host:port, e.g. {example}")
