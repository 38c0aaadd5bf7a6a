"""`Message`: the one format every broker gets — body, headers, key and destination of
an event — and the destination templates it is rendered from.

Kept apart from `Sink` so that formats built on it (CloudEvents) and the sinks can both
use it without importing each other.
"""

from __future__ import annotations

import json
import logging
import string
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._values.text import exception_message
from ..errors import Dead, InvalidArgument
from ..events import Event
from ._masked import masked

__all__ = [
    "RESERVED_PREFIXES",
    "Message",
    "ReservedHeaders",
    "check_template",
    "ordering_key",
    "own_headers",
    "payload_body",
    "render_destination",
]

logger = logging.getLogger("aiooutbox.relay")

_FIELDS = frozenset({"topic", "ordering_key"})

#: the broker headers (or properties, or stream fields) every sink adds to the event's own
TOPIC_HEADER = "outbox-topic"
EVENT_ID_HEADER = "outbox-event-id"
MESSAGE_ID_HEADER = "outbox-message-id"
DEDUPE_KEY_HEADER = "outbox-dedupe-key"
ORDERING_KEY_HEADER = "outbox-ordering-key"

#: header names an event's own headers may not start with, on every broker and in every
#: format: the relay's own (outbox-), the CloudEvents attributes in each binding's
#: spelling (ce- HTTP, NATS and Knative's RabbitMQ; ce_ Kafka; cloudEvents_ and
#: cloudEvents: AMQP), Standard Webhooks' (webhook-) and the body's (content-type,
#: content-length, content-encoding, ...). Compared case-folded, spaces stripped.
RESERVED_PREFIXES = (
    "outbox-",
    "ce-",
    "ce_",
    "cloudevents_",
    "cloudevents:",
    "webhook-",
    "content-",
)
#: how many header names a `ReservedHeaders` remembers its verdict on
_REMEMBERED = 4096


class ReservedHeaders:
    """Which of an event's own header names a relay drops: those that would stand beside,
    or be read as, the relay's own or the broker's (`RESERVED_PREFIXES` and ``prefixes``,
    and the exact ``names``), in any case and with any surrounding spaces, since
    receivers compare names without case (HTTP, the CloudEvents SDKs) and some clients
    strip them (nats-py). A name dropped is logged once."""

    __slots__ = ("names", "prefixes", "verdicts")

    def __init__(self, names: Iterable[str] = (), prefixes: Iterable[str] = ()) -> None:
        self.names = frozenset(n.casefold() for n in names)
        self.prefixes = RESERVED_PREFIXES + tuple(p.casefold() for p in prefixes)
        #: name -> reserved or not, for the names seen (bounded)
        self.verdicts: dict[str, bool] = {}

    def keep(self, own: Mapping[str, Any]) -> dict[str, Any]:
        """``own`` without the names reserved (one look-up a name seen before)."""
        verdicts = self.verdicts
        kept = {}
        for name, value in own.items():
            verdict = verdicts.get(name)
            if not (self.judge(name) if verdict is None else verdict):
                kept[name] = value
        return kept

    def judge(self, name: str) -> bool:
        """Whether ``name`` is reserved, remembered (and logged once when it is)."""
        folded = str(name).strip().casefold()
        verdict = folded in self.names or folded.startswith(self.prefixes)
        if len(self.verdicts) >= _REMEMBERED:
            self.verdicts.clear()
        self.verdicts[name] = verdict
        if verdict:
            logger.warning(
                "relay: an event's header %r is not published: the name is reserved "
                "for the relay's and the broker's own (docs/relay.md, Reserved headers)",
                str(name)[:80],
            )
        return verdict


#: the names every broker reserves (a sink adds its broker's own)
ANY_BROKER = ReservedHeaders()


def own_headers(event: Event, reserved: ReservedHeaders = ANY_BROKER) -> dict[str, Any]:
    """The event's own headers a relay passes on, values as the producer gave them."""
    own = event.headers
    return reserved.keep(own) if own else {}


def check_template(template: object, what: str = "destination") -> str:
    """A ``str.format`` template using only plain ``{topic}`` and ``{ordering_key}``
    fields: a conversion or format spec (``{topic!r}``, ``{topic:.3}``) would change, or
    fail to render, every destination."""
    if not isinstance(template, str):
        raise TypeError(f"{what} must be a str template such as '{{topic}}', not {template!r}")
    quoted = shown(template)
    try:
        parsed = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(template)]
    except ValueError as exc:
        raise InvalidArgument(
            f"{what} {quoted} is not a valid template: {exception_message(exc)}"
        ) from None
    fields = [f for f, _, _ in parsed if f is not None]
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise InvalidArgument(
            f"{what} {quoted} names {', '.join(map(repr, unknown))}; only {{topic}} and "
            "{ordering_key} are available"
        )
    for field, spec, conv in parsed:
        if field is not None and (spec or conv):
            written = (
                "{" + field + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
            )
            raise InvalidArgument(
                f"{what} {quoted} has {written}: only plain {{topic}} and {{ordering_key}} "
                "fields are allowed, without a conversion or format spec"
            )
    if not template.strip():
        raise InvalidArgument(f"{what} must not be blank")
    return template


def shown(destination: str) -> str:
    """``destination`` quoted for a message, the middle of a long one elided, and a
    URL's credentials masked (a webhook's destination is its URL)."""
    destination = masked(destination)
    if len(destination) <= 120:
        return repr(destination)
    return repr(destination[:80]) + "..." + repr(destination[-30:])


def ordering_key(event: Event) -> str | None:
    """The event's ordering key, on libraries with and without per-key order."""
    key = getattr(event, "ordering_key", None)
    return key if isinstance(key, str) else None


def render_destination(template: str, event: Event) -> str:
    """The subject, routing key, topic or stream ``event`` goes to; `Dead` if it cannot."""
    key = ordering_key(event)
    if key is None and "ordering_key" in template:
        raise Dead(f"destination {template!r} needs an ordering_key; the event has none")
    return template.format(topic=event.topic, ordering_key=key or "")


def _stdlib_body(payload: Any) -> bytes:
    try:
        return json.dumps(
            payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode()
    except RecursionError:
        # jsonb takes ~1000 levels; no retry can write what the encoder cannot
        raise Dead(
            f"the payload is nested {_depth(payload)} levels deep: deeper than the relay's "
            "JSON encoder writes (orjson stops at 254 levels, Python's json near the "
            f"interpreter's recursion limit, {sys.getrecursionlimit()})"
        ) from None


def _depth(payload: Any) -> int:
    """How deep lists and objects nest in ``payload`` (without recursing)."""
    deepest = 0
    todo = [(payload, 0)]
    while todo:
        value, level = todo.pop()
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            deepest = max(deepest, level + 1)
            todo.extend((item, level + 1) for item in value)
    return deepest


def _pick_body() -> Callable[[Any], bytes]:
    """orjson when installed (the ``speedups`` extra): the stdlib encoder cost ~5% of a
    relay's CPU. Its output is the same compact JSON; anything it refuses (an int past
    64 bits, a key that is not a str, nesting past 254 levels) falls back to the stdlib,
    whose `RecursionError` is `Dead`."""
    try:
        import orjson
    except ImportError:
        return _stdlib_body
    dumps = orjson.dumps

    def body(payload: Any) -> bytes:
        try:
            encoded: bytes = dumps(payload)
        except TypeError:
            return _stdlib_body(payload)
        return encoded

    return body


payload_body = _pick_body()


def _header_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class Message:
    """What one event becomes on any broker: a destination, JSON bytes and headers."""

    destination: str
    body: bytes
    message_id: str
    headers: dict[str, str]
    key: str | None
    event: Event
    content_type: str = "application/json"

    @classmethod
    def of(
        cls,
        event: Event,
        template: str,
        render: Callable[[str, Event], str] | None = None,
        reserved: ReservedHeaders = ANY_BROKER,
    ) -> Message:
        """The message for ``event``; ``render`` fills the destination template (default
        `render_destination`); the event's headers named as ``reserved`` are dropped."""
        if not event.message_id:
            raise Dead("the event has no message_id; migrate the outbox schema")
        body = payload_body(event.payload)
        own = event.headers
        headers: dict[str, str] = {}
        if own:
            verdicts = reserved.verdicts
            for name, value in own.items():
                dropped = verdicts.get(name)
                if not (reserved.judge(name) if dropped is None else dropped):
                    headers[name] = value if type(value) is str else _header_value(value)
        headers[TOPIC_HEADER] = event.topic
        headers[EVENT_ID_HEADER] = str(event.id)
        headers[MESSAGE_ID_HEADER] = event.message_id
        if event.dedupe_key is not None:
            headers[DEDUPE_KEY_HEADER] = event.dedupe_key
        key = ordering_key(event)
        if key is not None:
            headers[ORDERING_KEY_HEADER] = key
        # the default template is the topic itself: no format() per event
        if render is not None:
            destination = render(template, event)
        elif template == "{topic}":
            destination = event.topic
        else:
            destination = render_destination(template, event)
        return cls(destination, body, event.message_id, headers, key, event)
