"""What a client sends, read strictly: whole numbers in ASCII digits, text PostgreSQL can
store, JSON objects PostgreSQL's jsonb accepts, and times it can represent.

Python is generous where the database is not: ``'²'.isdigit()`` is true and ``int``
refuses it, ``int('١٢')`` is 12, ``int(' 1_2 ')`` is 12; ``json.loads`` takes ``NaN``,
``Infinity``, ``\\u0000`` and lone surrogates, none of which a ``jsonb`` holds; and a
time in the year 1 east of UTC is before the first instant Python can represent in UTC.
Each helper here says what is wrong instead, so the page answers 400 with the reason.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from typing import Any
from urllib.parse import unquote_to_bytes

__all__ = ["BadInput", "json_object", "stored_text", "strict_utf8", "utc_time", "whole_number"]

BIGINT_MAX = 2**63 - 1
_DIGITS = frozenset("0123456789")


class BadInput(ValueError):
    """A value a client sent that cannot be used; the message says why."""


def whole_number(text: str, what: str, *, low: int = 1, high: int = BIGINT_MAX) -> int:
    """``text`` as an int from ``low`` to ``high``, written in ASCII digits only."""
    text = text.strip()
    if not text or len(text) > 19 or not _DIGITS.issuperset(text):
        raise BadInput(f"{what} must be a whole number written in the digits 0-9")
    value = int(text)
    if not low <= value <= high:
        raise BadInput(f"{what} must be from {low} to {high:,}")
    return value


def stored_text(text: str, what: str) -> str:
    """``text`` if PostgreSQL can store it: no NUL, valid Unicode (no lone surrogate)."""
    if "\x00" in text:
        raise BadInput(f"{what} contains a NUL character")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise BadInput(f"{what} is not valid Unicode text") from None
    return text


def strict_utf8(raw: bytes, what: str) -> None:
    """`BadInput` unless every name and value of the urlencoded ``raw`` (a query string,
    a form's body) is UTF-8 once percent-decoded. The parsers decode what is not to
    U+FFFD (or as latin-1): a form would act on a name nobody typed."""
    for pair in raw.split(b"&"):
        name, _, value = pair.partition(b"=")
        try:
            field = unquote_to_bytes(name.replace(b"+", b" ")).decode("utf-8")
        except UnicodeDecodeError:
            raise BadInput(f"{what} has a field name that is not valid UTF-8") from None
        try:
            unquote_to_bytes(value.replace(b"+", b" ")).decode("utf-8")
        except UnicodeDecodeError:
            shown = field[:40] if field.isprintable() else repr(field[:40])
            raise BadInput(f"{shown} is not valid UTF-8 text") from None


def _reject_constant(name: str) -> Any:
    raise BadInput(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def json_object(text: str, what: str) -> str:
    """``text`` as a JSON object ``jsonb`` accepts, re-encoded; `BadInput` otherwise."""
    try:
        parsed = json.loads(text, parse_constant=_reject_constant)
    except BadInput as exc:
        raise BadInput(f"{what}: {exc}") from None
    except RecursionError:
        raise BadInput(f"{what} is nested too deeply") from None
    except ValueError as exc:
        raise BadInput(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise BadInput(f'{what} must be a JSON object, like {{"customer": "c-1"}}')
    stack: list[Any] = [parsed]
    while stack:  # iterative: a deeply nested value must not exhaust the stack
        value = stack.pop()
        if isinstance(value, dict):
            for key in value:
                stored_text(key, what)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str):
            stored_text(value, what)
        elif isinstance(value, float) and not math.isfinite(value):
            raise BadInput(f"{what} has a number JSON cannot hold")
    return json.dumps(parsed, ensure_ascii=False)


def utc_time(text: str, what: str) -> datetime:
    """An ISO 8601 date and time (UTC unless it says otherwise), as an aware UTC datetime."""
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise BadInput(f"{what} must be a date and time, like 2026-01-31T12:00 (UTC)") from None
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=timezone.utc)
    try:
        return parsed.astimezone(timezone.utc)
    except OverflowError:
        raise BadInput(f"{what} is outside the years 1-9999 once moved to UTC") from None
