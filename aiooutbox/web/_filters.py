"""The events filter: parsed from a query string, turned into a parameterised WHERE.

Every value is a bind parameter; the SQL text is assembled only from the fixed
fragments below. A filter an index can answer (an id, a dedupe key, an unfinished or
dead status) is searched whole; any other is searched in windows of `WINDOW` ids going
back from the newest, so one page never reads more than a window of rows however rare
the matches (the page offers the next, older window).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from ._input import BadInput, json_object, stored_text, strict_utf8, utc_time, whole_number

__all__ = ["EventFilter", "FilterError", "parse_filter"]

WINDOW = 50_000
PAGE = 50
# the states a filter may name: `pending` is due now, `scheduled` pending and not due
# yet (the table's status is pending for both)
STATES = ("pending", "scheduled", "retry", "processing", "waiting", "done", "dead")
# statuses a partial index covers: filtering on them reads only their rows
INDEXED_STATUSES = frozenset({"pending", "scheduled", "retry", "processing", "waiting", "dead"})
# the WHERE of each state: literals from this fixed set, not parameters (only a
# constant lets the planner prove a partial index's predicate, and so use that index)
_STATE_SQL = {
    "pending": "status = 'pending' AND available_at <= now()",
    "scheduled": "status = 'pending' AND available_at > now()",
}
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
            if isinstance(value, datetime):  # UTC, as the form's fields are
                value = value.replace(tzinfo=None).isoformat(timespec="seconds")
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

        if self.status in STATES:
            parts.append(_STATE_SQL.get(self.status, f"status = '{self.status}'"))
        if self.topic:
            add("topic = $?", self.topic)
        if self.ordering_key:
            add("ordering_key = $?", self.ordering_key)
            if self.status in ("pending", "scheduled", "retry", "processing", "waiting"):
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
    try:
        return stored_text(value, name)
    except BadInput as exc:
        problems.append(str(exc))
        return ""


def _int(name: str, value: str, problems: list[str]) -> int | None:
    if not value.strip():
        return None
    try:
        return whole_number(value, name)
    except BadInput as exc:
        problems.append(str(exc))
        return None


def _time(name: str, value: str, problems: list[str]) -> datetime | None:
    value = value.strip()
    if not value:
        return None
    try:
        return utc_time(stored_text(value, name), name)
    except BadInput as exc:
        problems.append(str(exc))
        return None


def _json(name: str, value: str, problems: list[str]) -> str:
    value = _text(name, value, problems)
    if not value:
        return ""
    try:
        return json_object(value, name)
    except BadInput as exc:
        problems.append(str(exc))
        return ""


def parse_filter(
    query: Mapping[str, str], *, status: str | None = None, raw: bytes = b""
) -> EventFilter:
    """The filter a query string describes; mistakes are collected in ``errors``.
    ``raw``: the query string as sent, checked for text that is not UTF-8 (which
    ``query`` holds as U+FFFD)."""
    problems: list[str] = []
    try:
        strict_utf8(raw, "the filter")
    except BadInput as exc:
        problems.append(str(exc))
    chosen = status if status is not None else query.get("status", "").strip()
    if chosen and chosen not in STATES:
        problems.append(f"status must be one of {', '.join(STATES)}")
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
