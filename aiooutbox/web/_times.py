"""Times as stored, whatever their year.

PostgreSQL holds times from 4713 BC to the year 294276 and ``±infinity``; Python's
``datetime`` (and so asyncpg's decoding) only the years 1-9999, and asyncpg decodes
``infinity`` as the year 9999. A producer may store any of them (``available_at =
'infinity'`` is documented: never), so the event pages read their times as text
(`as_text`) and turn the ones Python can hold into datetimes (`stored`): the others are
shown as they are stored, never an error.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

__all__ = ["Stored", "as_text", "later", "stored"]

Stored = datetime | str | None  # a str: a time outside the years 1-9999, as stored

_FIRST = "'0001-01-01 00:00:00+00'"


def as_text(column: str) -> str:
    """SQL: ``column`` as UTC text named ``column``: ``YYYY-MM-DD HH:MM:SS.US`` (with
    `` BC`` before the year 1), ``infinity`` or ``-infinity``."""
    return (
        f"CASE WHEN NOT isfinite({column}) THEN {column}::text"
        f" ELSE to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US')"
        f" || CASE WHEN {column} < {_FIRST} THEN ' BC' ELSE '' END END AS {column}"
    )


def stored(text: str | None) -> Stored:
    """`as_text`'s value: an aware UTC datetime when Python can hold it, else the text
    to show (``infinity``, ``10000-01-01 00:00:00 UTC``, ``0044-03-15 00:00:00 UTC
    BC``)."""
    if text is None:
        return None
    try:
        return datetime.fromisoformat(text).replace(tzinfo=timezone.utc)
    except ValueError:
        pass
    if not text[:1].isdigit():  # infinity, -infinity
        return text
    stamp, bc, _ = text.partition(" BC")
    return f"{stamp.removesuffix('.000000')} UTC{bc}"


def later(value: Stored) -> bool:
    """Is ``value`` after now (a time stored past the year 9999 or ``infinity`` is)?"""
    if isinstance(value, str):
        return not value.startswith("-") and not value.endswith(" BC")
    if value is None:
        return False
    try:
        return value.timestamp() > time.time()
    except (OverflowError, ValueError, OSError):
        return value.year > 1
