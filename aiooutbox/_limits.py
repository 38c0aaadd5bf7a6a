"""One table of limits and the checks built on it, shared by every public entry point.

Numbers, durations, topics and user text are checked here and nowhere else, so the
library, the CLI and the web integrations agree on what they accept and say it the
same way.
"""

from __future__ import annotations

import math
from datetime import timedelta

from .errors import InvalidArgument

__all__ = [
    "MAX_DELAY_SECONDS",
    "MAX_ERROR_CHARS",
    "MAX_TOPIC_LENGTH",
    "MAX_WORKER_ID",
    "check_count",
    "check_seconds",
    "check_topic_name",
    "optional_seconds",
]

MAX_TOPIC_LENGTH = 255
# a retry or schedule further out than this is a mistake, and now() + it must stay a
# valid timestamptz: one limit for Retry(delay=...), RetryPolicy.max_delay and enqueue
MAX_DELAY_SECONDS = 10 * 366 * 86400.0
MAX_WORKER_ID = 200
# what we keep of a handler's exception (text and traceback) in last_error
MAX_ERROR_CHARS = 4000


def check_seconds(
    name: str, value: object, *, minimum: float = 0.0, maximum: float = MAX_DELAY_SECONDS
) -> float:
    """A duration in seconds (a number, not a bool, or a timedelta) within bounds."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds or a timedelta, not {value!r}")
    if not math.isfinite(value) or not minimum <= value <= maximum:
        raise InvalidArgument(
            f"{name} must be a finite number of seconds between {minimum:g} and "
            f"{maximum:g}, got {value!r}"
        )
    return float(value)


def optional_seconds(name: str, value: object, *, minimum: float) -> float | None:
    return None if value is None else check_seconds(name, value, minimum=minimum)


def check_count(name: str, value: object, low: int, high: int) -> int:
    """An int (not a bool) within ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {value!r}")
    if not low <= value <= high:
        raise InvalidArgument(f"{name} must be between {low} and {high}, got {value}")
    return value


def check_topic_name(topic: object, what: str = "topic") -> str:
    """A topic: 1-255 characters, not blank, no NUL, valid Unicode."""
    if not isinstance(topic, str):
        raise TypeError(f"{what} must be a str, not {type(topic).__name__}")
    if not topic.strip() or len(topic) > MAX_TOPIC_LENGTH or "\x00" in topic:
        shown = topic if len(topic) <= 80 else topic[:77] + "..."
        raise InvalidArgument(
            f"{what} must be 1-{MAX_TOPIC_LENGTH} characters, not blank, without NUL: {shown!r}"
        )
    if not topic.isascii():
        try:
            topic.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidArgument(f"{what} is not valid Unicode text: {exc.reason}") from exc
    return topic
