"""The little HTTP/1.x that `MetricsServer` speaks: parse one request head, write one answer.

Strict on purpose: a probe or a scraper sends a well-formed ``GET``; anything else is
answered 400 with a short body rather than guessed at (a lowercase method, a request
line without a version, a header line without a colon).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["BadRequest", "Request", "Response", "parse_head"]

# RFC 9110 token characters; methods are case-sensitive and every registered one is upper
_REQUEST_LINE = re.compile(rb"([A-Z]+) ([\x21-\x7e]+) HTTP/1\.[0-9]")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


class BadRequest(Exception):
    """The request head is not HTTP/1.x this server accepts: answer 400 with this reason."""


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # the target without its query
    headers: dict[str, str]  # names lowercased; a repeated header keeps its last value


@dataclass(frozen=True)
class Response:
    status: str
    body: bytes = b""
    headers: list[tuple[str, str]] = field(
        default_factory=lambda: [("Content-Type", "text/plain; charset=utf-8")]
    )

    def encode(self, head_only: bool) -> bytes:
        """The bytes to send; ``head_only`` (HEAD) keeps Content-Length but drops the body."""
        head = f"HTTP/1.1 {self.status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in self.headers)
        head += f"Content-Length: {len(self.body)}\r\nConnection: close\r\n\r\n"
        return head.encode("latin-1") + (b"" if head_only else self.body)


def text(status: str, message: str, *extra: tuple[str, str]) -> Response:
    """A short plain-text answer."""
    headers = [("Content-Type", "text/plain; charset=utf-8"), *extra]
    return Response(status, (message + "\n").encode(), headers)


def parse_head(head: bytes) -> Request:
    """``head``: the request line and headers, up to and including the blank line."""
    lines = head.removesuffix(b"\r\n\r\n").split(b"\r\n")
    match = _REQUEST_LINE.fullmatch(lines[0])
    if match is None:
        raise BadRequest("malformed request line (expected METHOD /path HTTP/1.1)")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or _TOKEN.fullmatch(name) is None:
            raise BadRequest("malformed header line")
        headers[name.decode("ascii").lower()] = value.strip(b" \t").decode("latin-1")
    target = match.group(2).decode("ascii")
    return Request(match.group(1).decode("ascii"), target.partition("?")[0], headers)
