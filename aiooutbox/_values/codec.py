"""JSON encoding for payloads and headers: strict by default, pluggable, orjson-aware."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgument
from .text import exception_message

__all__ = ["Decoder", "Encoder", "decode_json", "encode_json"]

Encoder = Callable[[Any], "str | bytes"]
Decoder = Callable[["str | bytes"], Any]

#: how to enqueue a type the stdlib encoder does not know (a datetime, a UUID, a Decimal)
ENCODER_HINT = (
    "pass encoder= to encode other types, e.g. encoder=lambda v: json.dumps(v, default=str)"
)

# a JSON ``\u0000`` escape (which jsonb rejects) is one preceded by an even number of
# backslashes; ``\\u0000`` is an escaped backslash followed by the text "u0000"
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _stdlib_dumps(value: Any) -> str:
    # NaN and Infinity are not JSON; PostgreSQL's jsonb would reject them anyway.
    return json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)


def _pick_loads() -> Decoder:
    try:
        import orjson  # optional speed-up: the speedups extra
    except ImportError:
        return json.loads
    loads: Decoder = orjson.loads
    return loads


decode_json: Decoder = _pick_loads()


def encode_json(value: Any, what: str, encoder: Encoder | None = None) -> str:
    """Serialise ``value`` to JSON text, raising `InvalidArgument`/`TypeError` on failure."""
    try:
        text = (encoder or _stdlib_dumps)(value)
    except RecursionError:
        # a value nested thousands deep; None: the traceback would be thousands of frames
        raise InvalidArgument(
            f"{what} is not JSON-serialisable: nested too deeply for the JSON encoder"
        ) from None
    except (TypeError, ValueError, OverflowError) as exc:
        cls = TypeError if isinstance(exc, TypeError) else InvalidArgument
        message = f"{what} is not JSON-serialisable: {exception_message(exc)}"
        if encoder is None and isinstance(exc, TypeError):  # a type json does not know
            message += f"; {ENCODER_HINT}"
        raise cls(message) from exc
    if isinstance(text, bytes):
        text = text.decode()
    if not isinstance(text, str):
        raise TypeError(f"the JSON encoder returned {type(text).__name__}, expected str or bytes")
    if "\x00" in text or ("\\u0000" in text and _NUL_ESCAPE.search(text)):
        raise InvalidArgument(f"{what} contains a NUL character, which jsonb cannot store")
    check_utf8(text, what)
    return text


def check_utf8(text: str, what: str) -> None:
    """Raise `InvalidArgument` if ``text`` cannot be sent as UTF-8 (a lone surrogate)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{what} is not valid Unicode text: {exc.reason}") from exc
