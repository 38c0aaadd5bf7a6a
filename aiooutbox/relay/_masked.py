"""`masked`: a broker or webhook URL as it may be shown, logged or stored.

A relay names its destination in log lines, start-up errors, an event's last error and
the worker id kept in ``locked_by``; a URL's password (``user:pw@``), a token given as
its user (``nats://TOKEN@host``) and its query values (``?token=...``,
``?password=...``) must reach none of them.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from .._values.text import exception_message
from ..errors import InvalidArgument

__all__ = ["checked_url", "masked", "normal_scheme"]

#: where a URL's query or fragment starts
_QUERY = re.compile(r"[?#]")
_HIDDEN = "***"


def masked(url: str) -> str:
    """``url`` with each host's password (or lone user: it may be a token) and every
    query value replaced by ``***``; text that is no URL comes back unchanged. What
    precedes a host's last ``@`` is taken for credentials even when it holds a ``/``
    (an unescaped password): a path with an ``@`` is shown cut, never a password."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = _QUERY.search(rest)
    head, tail = (rest, "") if end is None else (rest[: end.start()], rest[end.start() :])
    if "@" in head:
        hosts = []
        for part in head.split(","):
            user, at, host = part.rpartition("@")
            if at:
                name, colon, _ = user.partition(":")
                user = f"{name}:{_HIDDEN}" if colon and "/" not in name else _HIDDEN
            hosts.append(f"{user}{at}{host}")
        head = ",".join(hosts)
    if tail.startswith("?"):
        query = tail[1:].partition("#")[0]
        values = [p.partition("=") for p in query.split("&")]
        tail = "?" + "&".join(f"{k}={_HIDDEN}" if eq else _HIDDEN for k, eq, _ in values)
    return f"{scheme}{sep}{head}{tail}"


def normal_scheme(url: str) -> str:
    """``url`` with its scheme in lower case (RFC 3986: schemes are case-insensitive),
    so that the clients, which compare it case-sensitively, take it."""
    scheme, sep, rest = url.partition("://")
    if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        return f"{scheme.lower()}://{rest}"
    return url


def checked_url(url: object, schemes: tuple[str, ...], kind: str, host: bool = False) -> str:
    """``url`` with its scheme lower-cased, if it is one of ``schemes`` with a valid
    port (and a host, if ``host``); else `TypeError` (not such a URL) or
    `InvalidArgument` (a port that is no number in 0-65535, no host), neither showing a
    password. Checked when the sink is made: the clients fail later, in a traceback or
    as an unreachable broker."""
    if not isinstance(url, str):
        raise TypeError(f"url must be {kind} URL, not {type(url).__name__}")
    url = normal_scheme(url)
    if url.partition("://")[0] not in schemes or "://" not in url:
        shown = masked(url) if "://" in url else url.rpartition("@")[2]
        raise TypeError(f"url must be {kind} URL, not {shown!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is no port
    except ValueError as exc:
        raise InvalidArgument(
            f"url {masked(url)!r} is not a valid URL ({exception_message(exc)})"
        ) from None
    if host and not parts.hostname:
        raise InvalidArgument(f"url {masked(url)!r} names no host")
    return url
