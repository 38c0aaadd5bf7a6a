"""The events filter: parsed from a query string, turned into a parameterised WHERE.

Every value is a bind parameter; the SQL text is assembled only from the fixed
fragments below. A filter an index can answer (an id, a dedupe key, an unfinished or
dead status) is searched whole; any other is searched in windows of `WINDOW` ids going
back from the newest, so one page never reads more than a window of rows however rare
the matches (the page offers the next, older window).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlencode

from .._admin.records import STATUSES

__all__ = ["EventFilter", "FilterError", "parse_filter"]

WINDOW = 50_000
PAGE = 50
# statuses a partial index covers: filtering on them reads only their rows
INDEXED_STATUSES = frozenset({"pending", "retry", "processing", "waiting", "dead"})
_MAX_TEXT = 1000


class FilterError(ValueError):
    """A filter field the user typed wrong; the page shows the message."""


@dataclass(frozen=True)
class EventFilter:
    topic: str = ""
    status: str = ""
    ordering_key: str = ""
    dedupe_key: str = ""
    id: int | None = None
    created_from: datetime | None = None
    created_to: datetime | None = None
    payload: str = ""  # a JSON object, matched with @>
    headers: str = ""
    error: str = ""  # a substring of the last error
    before: int | None = None  # keyset: ids below this one
    max_id: int | None = None  # bulk actions: only ids up to the one seen when counting
    errors: tuple[str, ...] = field(default=(), compare=False)

    @property
    def indexed(self) -> bool:
        """Can an index find every match (no id window needed)?"""
        return self.id is not None or bool(self.dedupe_key) or self.status in INDEXED_STATUSES

    @property
    def empty(self) -> bool:
        return not any(self.params(include_cursor=False).values())

    def params(self, *, include_cursor: bool = True) -> dict[str, str]:
        """The query-string form (for links), without empty fields."""
        out: dict[str, str] = {}
        for f in fields(self):
            if f.name in ("errors",) or (not include_cursor and f.name in ("before", "max_id")):
                continue
            value = getattr(self, f.name)
            if value is None or value == "":
                continue
            if isinstance(value, datetime):
                value = value.strftime("%Y-%m-%dT%H:%M:%S")
            out[f.name] = str(value)
        return out

    def query(self, **changes: object) -> str:
        params = self.params()
        for key, value in changes.items():
            if value is None or value == "":
                params.pop(key, None)
            else:
                params[key] = str(value)
        return urlencode(params)

    def where(
        self, *, first: int = 1, floor: int | None = None, cursor: bool = True
    ) -> tuple[str, list[Any]]:
        """The WHERE clause and its arguments, placeholders numbered from ``first``."""
        parts: list[str] = []
        args: list[Any] = []

        def add(fragment: str, value: Any) -> None:
            args.append(value)
            parts.append(fragment.replace("$?", f"${first + len(args) - 1}"))

        if self.status in STATUSES:
            # a literal from the fixed set, not a parameter: only a constant lets the
            # planner prove a partial index's predicate (and so use that index)
            parts.append(f"status = '{self.status}'")
        if self.topic:
            add("topic = $?", self.topic)
        if self.ordering_key:
            add("ordering_key = $?", self.ordering_key)
            if self.status in ("pending", "retry", "processing", "waiting"):
                parts.append("ordering_key IS NOT NULL")
        if self.dedupe_key:
            add("dedupe_key = $?", self.dedupe_key)
        if self.id is not None:
            add("id = $?", self.id)
        if self.created_from is not None:
            add("created_at >= $?", self.created_from)
        if self.created_to is not None:
            add("created_at < $?", self.created_to)
        if self.payload:
            add("payload @> $?::jsonb", self.payload)
        if self.headers:
            add("headers @> $?::jsonb", self.headers)
        if self.error:
            add("strpos(last_error, $?) > 0", self.error)
        if cursor and self.before is not None:
            add("id < $?", self.before)
        if self.max_id is not None:
            add("id <= $?", self.max_id)
        if floor is not None:
            add("id >= $?", floor)
        return (" AND ".join(parts) or "true"), args


def _text(name: str, value: str, problems: list[str]) -> str:
    value = value.strip()
    if len(value) > _MAX_TEXT:
        problems.append(f"{name} is longer than {_MAX_TEXT} characters")
        return ""
    if "\x00" in value:
        problems.append(f"{name} contains a NUL character")
        return ""
    return value


def _int(name: str, value: str, problems: list[str]) -> int | None:
    value = value.strip()
    if not value:
        return None
    if not value.isdigit() or len(value) > 19 or int(value) > 2**63 - 1:
        problems.append(f"{name} must be a positive whole number")
        return None
    return int(value)


def _time(name: str, value: str, problems: list[str]) -> datetime | None:
    value = value.strip()
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        problems.append(f"{name} must be a date and time, like 2026-01-31T12:00 (UTC)")
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def _json(name: str, value: str, problems: list[str]) -> str:
    value = _text(name, value, problems)
    if not value:
        return ""
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        problems.append(f"{name} is not valid JSON: {exc}")
        return ""
    if not isinstance(parsed, dict):
        problems.append(f'{name} must be a JSON object, like {{"customer": "c-1"}}')
        return ""
    return json.dumps(parsed)


def parse_filter(query: Mapping[str, str], *, status: str | None = None) -> EventFilter:
    """The filter a query string describes; mistakes are collected in ``errors``."""
    problems: list[str] = []
    chosen = status if status is not None else query.get("status", "").strip()
    if chosen and chosen not in STATUSES:
        problems.append(f"status must be one of {', '.join(STATUSES)}")
        chosen = ""
    return EventFilter(
        topic=_text("topic", query.get("topic", ""), problems),
        status=chosen,
        ordering_key=_text("ordering key", query.get("ordering_key", ""), problems),
        dedupe_key=_text("dedupe key", query.get("dedupe_key", ""), problems),
        id=_int("id", query.get("id", ""), problems),
        created_from=_time("created from", query.get("created_from", ""), problems),
        created_to=_time("created to", query.get("created_to", ""), problems),
        payload=_json("payload", query.get("payload", ""), problems),
        headers=_json("headers", query.get("headers", ""), problems),
        error=_text("error", query.get("error", ""), problems),
        before=_int("before", query.get("before", ""), problems),
        max_id=_int("max_id", query.get("max_id", ""), problems),
        errors=tuple(problems),
    )
