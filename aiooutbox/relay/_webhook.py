"""`WebhookSink`: POST each event as JSON, signed per the Standard Webhooks spec.

Headers: ``webhook-id`` (the event's ``message_id``, the receiver's idempotency key),
``webhook-timestamp`` (Unix seconds), ``webhook-signature`` (``v1,`` + base64 of
HMAC-SHA256 over ``"{id}.{timestamp}.{body}"`` with the secret), plus the event's own
headers (trace context included; the names reserved dropped, the request's and the
client's own among them) and the ``outbox-*`` ones. Outcomes: 2xx done; 408,
429 and 5xx retried (``Retry-After`` honoured on 429 and 503); any other 4xx ``dead``,
with the status and the start of the response body as the event's last error; a
timeout or refused connection retried with the consumer's backoff.

``{topic}`` and ``{ordering_key}`` are percent-encoded into the URL (``/``, ``?``, ``#``
and ``..`` in a topic cannot change the path or add a query); a header value that is
not ASCII is sent as UTF-8, and a header HTTP cannot carry (a name that is not a token,
a line break or control character in a value, a value with leading or trailing spaces
or tabs) sends the event to ``dead`` at once. The URL's password and query values
are masked wherever it is shown: logs, errors, an event's last error, ``locked_by``.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import hashlib
import hmac
import logging
import re
import time
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

from ..errors import Dead, InvalidArgument, Retry
from ..events import Event
from ._masked import checked_url, masked
from ._message import Message, ReservedHeaders, check_template, ordering_key, shown
from ._sink import Sink, require

__all__ = ["WebhookError", "WebhookSink", "sign"]

#: headers that describe the request itself (HTTP framing), beyond the names every
#: broker reserves (webhook-*, content-*): an event's own are dropped
_REQUEST_HEADERS = (
    "host",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "proxy-connection",
)
#: what httpx sends on every request unless told otherwise
_CLIENT_DEFAULTS = ("accept", "accept-encoding", "user-agent")
_MAX_RETRY_AFTER = 86400.0
#: requests of one batch sent at once (the client keeps this many connections alive)
_PARALLEL = 64
_ERROR_BODY = 500
#: an HTTP header name is a token (RFC 9110); a value has no control characters but tab
#: and no whitespace around it (h11, under httpx, refuses both: RFC 9110's field-value)
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NOT_IN_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_AROUND_VALUE = re.compile(r"\A[ \t]|[ \t]\Z")


def url_part(value: str) -> str:
    """``value`` as one percent-encoded URL path segment (or query value)."""
    part = quote(value, safe="")
    # "." and ".." are left alone by quote(), and would move up the path
    return part.replace(".", "%2E") if part in (".", "..") else part


def render_url(template: str, event: Event) -> str:
    """The webhook URL of ``event``: the template with its fields percent-encoded."""
    key = ordering_key(event)
    if key is None and "ordering_key" in template:
        raise Dead(f"url {shown(template)} needs an ordering_key; the event has none")
    return template.format(topic=url_part(event.topic), ordering_key=url_part(key or ""))


class _MaskedUrls(logging.Filter):
    """Mask the URLs in httpx's own log lines (``HTTP Request: POST URL``), which
    would show the webhook URL's password and query."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(masked(str(a)) if "://" in str(a)[:12] else a for a in record.args)
        return True


class WebhookError(Exception):
    """The receiver answered with a status worth retrying (408, 429 or 5xx)."""


def _secret_bytes(secret: str | bytes) -> bytes:
    if isinstance(secret, bytes):
        if not secret:
            raise InvalidArgument("the webhook secret must not be empty")
        return secret
    if not isinstance(secret, str):
        raise TypeError(f"secret must be a 'whsec_...' str or bytes, not {type(secret).__name__}")
    try:
        key = base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except ValueError:
        raise InvalidArgument("the webhook secret must be 'whsec_' + base64, or bytes") from None
    if not key:
        raise InvalidArgument("the webhook secret must not be empty")
    return key


def sign(secret: str | bytes, message_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value for one request (Standard Webhooks, v1)."""
    content = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(_secret_bytes(secret), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), capped."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        current = datetime.fromtimestamp(now if now is not None else time.time(), UTC)
        seconds = (when - current).total_seconds()
    return min(max(seconds, 0.0), _MAX_RETRY_AFTER)


class WebhookSink(Sink):
    """POST each event's payload to ``url`` (a template: ``{topic}`` may appear in it).

    ``secret`` is the endpoint's signing secret (``whsec_`` + base64, or raw bytes);
    ``client_options`` go to `httpx.AsyncClient`. One pooled client serves every call.
    Unlike the broker sinks, an unreachable receiver is the event's failure: it is
    retried with the consumer's backoff and can end ``dead``.
    """

    name = "webhook"
    cloudevents_binding = "http"

    def __init__(
        self,
        url: str,
        *,
        secret: str | bytes,
        connect_timeout: float | timedelta = 10.0,
        publish_timeout: float | timedelta = 10.0,
        max_in_flight: int | None = None,
        format: str = "outbox",
        cloudevents_source: str | None = None,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        url = checked_url(url, ("http", "https"), "an http:// or https://", host=True)
        super().__init__(
            destination=check_template(url, "url"),
            connect_timeout=connect_timeout,
            publish_timeout=publish_timeout,
            reconnect_wait=0,
            max_in_flight=max_in_flight,
            format=format,
            cloudevents_source=cloudevents_source,
        )
        self._key = _secret_bytes(secret)
        #: header names checked to be tokens
        self._header_names: set[str] = set()
        self._httpx = require("httpx", "webhook")
        self.url = url
        self._options = dict(client_options or {})
        self._client: Any = None
        self._quiet: logging.Filter | None = None
        # the client's own headers (httpx's and those of client_options) win too
        configured = self._httpx.Headers(self._options.get("headers") or {})
        self._reserved = ReservedHeaders((*_REQUEST_HEADERS, *_CLIENT_DEFAULTS, *configured.keys()))

    def describe(self) -> str:
        return masked(self.url)

    async def _open(self) -> None:
        timeout = self._httpx.Timeout(self.publish_timeout, connect=self.connect_timeout)
        limits = self._httpx.Limits(max_connections=None, max_keepalive_connections=_PARALLEL)
        options: dict[str, Any] = {"timeout": timeout, "limits": limits}
        options.update(self._options)
        self._client = self._httpx.AsyncClient(**options)
        self._quiet = _MaskedUrls()
        logging.getLogger("httpx").addFilter(self._quiet)

    async def _close(self) -> None:
        if self._quiet is not None:
            logging.getLogger("httpx").removeFilter(self._quiet)
        if self._client is not None:
            await self._client.aclose()

    def _message(self, event: Event) -> Message:
        return Message.of(event, self.destination, render_url, self._reserved)

    def _message_problem(self, message: Message) -> str | None:
        headers = message.headers
        if not self._header_names.issuperset(headers):  # names seen before are tokens
            for name in headers:
                if not _HEADER_NAME.fullmatch(name):
                    return f"the header name {name!r} is not an HTTP token: HTTP cannot carry it"
            if len(self._header_names) < 1024:
                self._header_names.update(headers)
        around = _AROUND_VALUE.search
        for name, value in headers.items():
            if around(value):
                return (
                    f"the header {name!r} has a value with leading or trailing whitespace "
                    f"({value[:40]!r}): HTTP cannot carry it (RFC 9110 field-value)"
                )
        if _NOT_IN_VALUE.search("\t".join(headers.values())):
            for name, value in headers.items():
                if _NOT_IN_VALUE.search(value):
                    return (
                        f"the header {name!r} has a line break or control character in its "
                        "value: HTTP cannot carry it"
                    )
        return None

    def request_headers(self, message: Message, timestamp: int) -> dict[str, str | bytes]:
        # values that are not ASCII go as UTF-8 bytes (httpx would refuse the str)
        # the names reserved are gone already (`Message.of`): no header below is doubled
        headers: dict[str, str | bytes] = {
            k: v if v.isascii() else v.encode() for k, v in message.headers.items()
        }
        headers["content-type"] = message.content_type
        headers["webhook-id"] = message.message_id
        headers["webhook-timestamp"] = str(timestamp)
        headers["webhook-signature"] = sign(self._key, message.message_id, timestamp, message.body)
        return headers

    async def _send(self, message: Message) -> None:
        url = message.destination
        timestamp = int(time.time())
        response = await self._client.post(
            url, content=message.body, headers=self.request_headers(message, timestamp)
        )
        status = response.status_code
        if 200 <= status < 300:
            return
        text = response.text[:_ERROR_BODY]
        detail = f"HTTP {status} from {masked(url)}: {text}"
        if status in (429, 503):
            delay = retry_after(response.headers.get("retry-after"))
            if delay is not None:
                raise Retry(delay, detail)
        if 400 <= status < 500 and status not in (408, 429):
            raise Dead(detail)
        raise WebhookError(detail)

    async def _send_many(self, messages: list[Message]) -> list[BaseException | None]:
        """One request per event, at most ``_PARALLEL`` of a batch at once (the
        client's pool keeps 64 connections alive); each with its own outcome."""
        if len(messages) <= _PARALLEL:
            return await super()._send_many(messages)
        gate = asyncio.Semaphore(_PARALLEL)

        async def one(message: Message) -> None:
            async with gate:
                await self._send(message)

        results = await asyncio.gather(*map(one, messages), return_exceptions=True)
        return [r if isinstance(r, Exception) else None for r in results]

    def _is_outage(self, exc: BaseException) -> bool:
        return False
