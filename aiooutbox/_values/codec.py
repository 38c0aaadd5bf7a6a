"""JSON encoding for payloads and headers: strict by default, pluggable, orjson-aware."""

from __future__ import annotations

import json
import math
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
    "pass encoder= to encode other types, e.g."
    " encoder=lambda v: json.dumps(v, default=str, allow_nan=False)"
)

# The integers every decoder a consumer may run returns unchanged: orjson (the speedups
# extra) turns others into floats, or fails on them past a float's range, and the
# stdlib fails past 4,300 digits. Refused at enqueue, whichever decoder is installed
# here, so a payload means the same to every consumer.
MIN_INT = -(2**63)
MAX_INT = 2**64 - 1
INT_RANGE = (
    "integers must fit in 64 bits (-2**63 .. 2**64-1) to reach a handler unchanged;"
    " send larger numbers as strings"
)
# bytes.translate table: ASCII digits to b"0", "e"/"E" to b"e", "+" kept, every other
# byte to b"x". An integer outside MIN_INT..MAX_INT has at least 19 digits, and a number
# past a float's range that many or an exponent of three digits, so text without them
# (most payloads) needs no check of its numbers; UTF-8 puts no ASCII byte inside a
# multi-byte character.
_SHAPE = bytes(
    0x30 if 0x30 <= b <= 0x39 else 0x65 if b in b"eE" else b if b == 0x2B else 0x78
    for b in range(256)
)
_LONG_RUN = b"0" * 19

# a JSON ``\u0000`` escape (which jsonb rejects) is one preceded by an even number of
# backslashes; ``\\u0000`` is an escaped backslash followed by the text "u0000"
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
# a surrogate escape (perhaps not one, after an escaped backslash: the parse decides)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


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


def encode_json(
    value: Any, what: str, encoder: Encoder | None = None, *, json_object: bool = False
) -> str:
    """Serialise ``value`` to JSON text, raising `InvalidArgument`/`TypeError` on failure.

    A custom ``encoder``'s output is checked as PostgreSQL and every consumer's decoder
    would read it (``json_object``: it must be a JSON object); the built-in encoder's
    is checked only where a cheap test says an integer may be out of range.
    """
    if encoder is not None:
        return _custom(value, what, encoder, json_object)
    try:
        text = _stdlib_dumps(value)
    except RecursionError:
        # a value nested thousands deep; None: the traceback would be thousands of frames
        raise InvalidArgument(
            f"{what} is not JSON-serialisable: nested too deeply for the JSON encoder"
        ) from None
    except (TypeError, ValueError, OverflowError) as exc:
        cls = TypeError if isinstance(exc, TypeError) else InvalidArgument
        message = f"{what} is not JSON-serialisable: {exception_message(exc)}"
        if isinstance(exc, TypeError):  # a type json does not know
            message += f"; {ENCODER_HINT}"
        raise cls(message) from exc
    if "\x00" in text or ("\\u0000" in text and _NUL_ESCAPE.search(text)):
        raise InvalidArgument(f"{what} contains a NUL character, which jsonb cannot store")
    try:
        data = text.encode()  # a copy for ASCII text; check_utf8's encode for the rest
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{what} is not valid Unicode text: {exc.reason}") from exc
    # the cheap test: translate and find cost a few percent of the encoding above (the
    # built-in encoder writes no number past a float's range)
    if len(data) > 18 and data.translate(_SHAPE).find(_LONG_RUN) >= 0:
        _parse(text, what, "")  # digits in a string are fine: only numbers are refused
    return text


def _check_text(text: str, what: str) -> None:
    if "\x00" in text or ("\\u0000" in text and _NUL_ESCAPE.search(text)):
        raise InvalidArgument(f"{what} contains a NUL character, which jsonb cannot store")
    check_utf8(text, what)


class _Refused(ValueError):
    """A number in the JSON text that a consumer's decoder would not return unchanged."""


def _int(digits: str) -> int:
    # both limits have 20 characters; a longer literal is out of range (and int() of
    # one past 4,300 digits would fail on its own)
    number = int(digits) if len(digits) <= 20 else None
    if number is None or not MIN_INT <= number <= MAX_INT:
        shown = digits if len(digits) <= 30 else f"{digits[:24]}… ({len(digits)} digits)"
        raise _Refused(f"holds the integer {shown}: {INT_RANGE}")
    return number


def _float(digits: str) -> float:
    number = float(digits)
    if not math.isfinite(number):
        raise _Refused(f"holds the number {digits[:30]}, beyond a float's range")
    return number


def _constant(name: str) -> Any:
    raise _Refused(
        f"holds {name}, which is not JSON (PostgreSQL refuses it);"
        " pass allow_nan=False to json.dumps"
    )


def _parse(text: str, what: str, by: str, numbers: bool = True) -> Any:
    """``text`` parsed, refusing non-JSON constants and (``numbers``) numbers a decoder
    would change; checking them costs a Python call per number."""
    try:
        if not numbers:
            return json.loads(text, parse_constant=_constant)
        return json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except _Refused as exc:
        raise InvalidArgument(f"{what}{by} {exc}") from None
    except RecursionError:
        raise InvalidArgument(f"{what}{by} is nested too deeply to check") from None
    except ValueError as exc:  # json.JSONDecodeError: only a custom encoder's text
        raise InvalidArgument(f"{what}{by} is not valid JSON: {exc}") from None


def _custom(value: Any, what: str, encoder: Encoder, json_object: bool) -> str:
    """A custom encoder's output, checked: PostgreSQL would refuse what it cannot store
    mid-statement, aborting the caller's transaction, and a consumer's decoder would
    change or refuse numbers it cannot represent."""
    by = f" (from encoder {_name(encoder)})"
    try:
        text: object = encoder(value)
    except RecursionError:
        raise InvalidArgument(f"{what} is not JSON-serialisable{by}: nested too deeply") from None
    except (TypeError, ValueError, OverflowError) as exc:
        cls = TypeError if isinstance(exc, TypeError) else InvalidArgument
        raise cls(f"{what} is not JSON-serialisable{by}: {exception_message(exc)}") from exc
    if isinstance(text, bytes):
        try:
            text = text.decode()
        except UnicodeDecodeError as exc:
            raise InvalidArgument(
                f"{what}{by} is not UTF-8: {exc.reason} at byte {exc.start}"
            ) from None
    if not isinstance(text, str):
        raise TypeError(f"{what}{by} is a {type(text).__name__}, expected str or bytes")
    _check_text(text, what + by)
    parsed = _parse(text, what, by, numbers=False)
    shape = text.encode().translate(_SHAPE)
    if any(shape.find(sign) >= 0 for sign in (_LONG_RUN, b"0e000", b"0e+000")):
        _parse(text, what, by)
    if json_object and not isinstance(parsed, dict):
        kind = _JSON_KINDS.get(type(parsed), "number")
        raise InvalidArgument(f"{what}{by} is a JSON {kind}, not an object")
    if "\\u" in text and _SURROGATE_ESCAPE.search(text):
        # an escaped lone surrogate (json.dumps's ensure_ascii writes them): jsonb refuses
        check_utf8(json.dumps(parsed, ensure_ascii=False), what + by)
    return text


_JSON_KINDS = {list: "array", str: "string", bool: "boolean", type(None): "null"}


def _name(encoder: object) -> str:
    name = getattr(encoder, "__qualname__", None) or type(encoder).__qualname__
    return str(name)[:60]


def check_utf8(text: str, what: str) -> None:
    """Raise `InvalidArgument` if ``text`` cannot be sent as UTF-8 (a lone surrogate)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{what} is not valid Unicode text: {exc.reason}") from exc
