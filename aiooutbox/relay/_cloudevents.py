"""CloudEvents (spec v1.0): each event as a CloudEvent, in the binding its broker has.

Attributes: ``id`` = the event's ``message_id``, ``source`` (configurable), ``specversion``
``1.0``, ``type`` = the topic, ``time`` = ``created_at`` (RFC 3339), ``datacontenttype``
``application/json``, and the extensions ``partitionkey`` (the ordering key, when set)
and ``traceparent``/``tracestate`` (distributed tracing, from the event's own headers
when present).

``format="cloudevents"`` uses each broker's binary content mode: the body is the
payload's JSON, the attributes are headers (``ce_`` for Kafka, ``ce-`` for HTTP and NATS,
``cloudEvents_`` for AMQP) and ``datacontenttype`` is the content type (the
``content-type`` header, or the AMQP ``content_type`` property). Redis has no binding, so
its stream entry's ``payload`` field holds the structured event.
``format="cloudevents-structured"`` puts the whole event in the body as JSON
(``application/cloudevents+json``) on every broker. The event's own headers and the
``outbox-*`` ones travel as in the default format, beside the attributes.
"""

from __future__ import annotations

import re
from datetime import UTC
from typing import Any
from urllib.parse import quote

from ..errors import InvalidArgument
from ..events import Event
from ._message import Message, ordering_key, payload_body

__all__ = ["FORMATS", "CloudEvents", "check_format", "check_source", "default_source"]

#: the values of a sink's ``format`` (and the relay's ``--format``)
FORMATS = ("outbox", "cloudevents", "cloudevents-structured")

SPECVERSION = "1.0"
JSON = "application/json"
STRUCTURED = "application/cloudevents+json"

#: binary-mode attribute prefix per binding; ``None``: no binding (structured only)
_PREFIX = {"kafka": "ce_", "http": "ce-", "nats": "ce-", "amqp": "cloudEvents_", None: None}
#: bindings whose content type travels as a ``content-type`` header of the message
_CONTENT_TYPE_HEADER = {"kafka", "nats"}
#: bindings whose header values are percent-encoded (HTTP binding, 3.1.3.2; NATS too)
_PERCENT = {"http", "nats"}
_TRACING = ("traceparent", "tracestate")

# RFC 3986 URI-reference: the characters it allows, %XX escapes, and a scheme when the
# first segment has a colon (a relative reference cannot have one there)
_URI_CHARS = re.compile(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*")
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")


def check_format(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"format must be a str, not {value!r}")
    if value not in FORMATS:
        raise InvalidArgument(
            f"unknown format {value[:40]!r}: use {', '.join(FORMATS)} (default outbox)"
        )
    return value


def check_source(value: object) -> str:
    """A CloudEvents ``source``: a non-empty URI-reference (RFC 3986)."""
    if not isinstance(value, str):
        raise TypeError(f"cloudevents_source must be a str, not {value!r}")
    shown = repr(value[:60])
    if not value:
        raise InvalidArgument("the CloudEvents source must not be empty (a URI-reference)")
    if not _URI_CHARS.fullmatch(value):
        bad = next(c for c in value if not _URI_CHARS.fullmatch(c))
        raise InvalidArgument(
            f"CloudEvents source {shown} is not a URI-reference: {bad!r} is not allowed "
            "(percent-encode it)"
        )
    if _BAD_ESCAPE.search(value):
        raise InvalidArgument(
            f"CloudEvents source {shown} is not a URI-reference: '%' must start a %XX escape"
        )
    if value.count("#") > 1:
        raise InvalidArgument(f"CloudEvents source {shown} is not a URI-reference: two '#'")
    first = re.split(r"[/?#]", value, maxsplit=1)[0]
    if ":" in first and not _SCHEME.fullmatch(first.partition(":")[0]):
        raise InvalidArgument(
            f"CloudEvents source {shown} is not a URI-reference: the part before ':' is "
            "not a scheme (write './' before a relative path with a colon)"
        )
    return value


def default_source(database: str, schema: str, table: str) -> str:
    """``/aiooutbox/<database>/<schema>.<table>``, each part percent-encoded as needed."""
    parts = (database, f"{schema}.{table}")
    return "/aiooutbox/" + "/".join(quote(p, safe="") for p in parts)


def _time(event: Event) -> str | None:
    created = event.created_at
    if created is None:
        return None
    if created.tzinfo is not None:
        created = created.astimezone(UTC)
    text = created.isoformat()
    return text.removesuffix("+00:00") + "Z" if created.tzinfo is not None else text + "Z"


class CloudEvents:
    """Turns an event into the `Message` of one broker's CloudEvents binding.

    ``binding``: ``"kafka"``, ``"http"``, ``"nats"``, ``"amqp"`` or ``None`` (none:
    structured). ``sources``: the source per database name (the relay's
    ``aiooutbox_database`` context, set when it serves several databases).
    """

    def __init__(
        self,
        binding: str | None,
        *,
        structured: bool = False,
        source: str,
        sources: dict[str, str] | None = None,
    ) -> None:
        self.binding = binding
        self.prefix = None if structured else _PREFIX[binding]
        self.source = check_source(source)
        self.sources = {k: check_source(v) for k, v in (sources or {}).items()}

    def _source(self) -> str:
        if self.sources:
            from ..cli.logsetup import DATABASE

            name = DATABASE.get()
            if name is not None and name in self.sources:
                return self.sources[name]
        return self.source

    def attributes(self, event: Event) -> dict[str, str]:
        """The event's context attributes (``datacontenttype`` included), as strings."""
        assert event.message_id
        found: dict[str, str] = {
            "specversion": SPECVERSION,
            "id": event.message_id,
            "source": self._source(),
            "type": event.topic,
            "datacontenttype": JSON,
        }
        when = _time(event)
        if when is not None:
            found["time"] = when
        key = ordering_key(event)
        if key is not None:
            found["partitionkey"] = key
        own = event.headers or {}
        for name in _TRACING:
            value = own.get(name)
            if isinstance(value, str) and value:
                found[name] = value
        return found

    def message(self, plain: Message) -> Message:
        """``plain`` (the default format's message) as this binding's CloudEvent."""
        attributes = self.attributes(plain.event)
        headers = plain.headers
        prefix = self.prefix
        if prefix is None:  # structured: the whole event is the body
            envelope: dict[str, Any] = dict(attributes)
            envelope["data"] = plain.event.payload
            body = payload_body(envelope)
            content_type = STRUCTURED
        else:
            body = plain.body
            content_type = attributes.pop("datacontenttype")
            percent = self.binding in _PERCENT
            for name, value in attributes.items():
                headers[prefix + name] = _percent(value) if percent else value
        if self.binding in _CONTENT_TYPE_HEADER:
            headers["content-type"] = content_type
        return Message(
            plain.destination,
            body,
            plain.message_id,
            headers,
            plain.key,
            plain.event,
            content_type,
        )


def _percent(value: str) -> str:
    """Percent-encode what the HTTP binding says must be: space, '"', '%' and every
    character outside printable ASCII (as UTF-8 bytes)."""
    if value.isascii() and value.isprintable() and not any(c in value for c in ' "%'):
        return value
    return quote(value, safe="".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"%'))
