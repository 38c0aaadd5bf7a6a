"""One table of limits and the checks built on it, shared by every public entry point.

Numbers, durations, topics and user text are checked here and nowhere else, so the
library, the CLI and the web integrations agree on what they accept and say it the
same way. `InvalidArgument`, the error every check raises, and its base are born here
(`aiooutbox.errors` is where users import them), so that `Retry` can check its delay
with the same rule without the two modules importing each other.
"""

from __future__ import annotations

import math
from datetime import timedelta

__all__ = [
    "InvalidArgument",
    "OutboxError",
    "MAX_ATTEMPTS",
    "MAX_DELAY_SECONDS",
    "MAX_ENQUEUE_DELAY_SECONDS",
    "MAX_ERROR_CHARS",
    "MAX_TOPIC_LENGTH",
    "MAX_WORKER_ID",
    "check_count",
    "check_number",
    "check_seconds",
    "check_topic_name",
    "optional_seconds",
]


class OutboxError(Exception):
    """Base class for errors raised by aiooutbox itself."""

    __module__ = "aiooutbox.errors"


class InvalidArgument(OutboxError, ValueError):
    """A value passed to aiooutbox is out of range or malformed; nothing was written."""

    __module__ = "aiooutbox.errors"


MAX_TOPIC_LENGTH = 255
# a retry further out than this is a mistake, and now() + it must stay a valid
# timestamptz (an overflow would fail the whole settle batch): the limit of
# Retry(delay=...), RetryPolicy.max_delay and every consumer duration
MAX_DELAY_SECONDS = 10 * 366 * 86400.0
# enqueue(delay=...) schedules work, documented (docs/producers.md) as 0 to 1000 years;
# now() + it stays below LATEST_AVAILABLE_AT's range by construction
MAX_ENQUEUE_DELAY_SECONDS = 1000 * 366 * 86400.0
# an event's max_attempts
MAX_ATTEMPTS = 1_000_000
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
        raise TypeError(
            f"{name} must be seconds or a timedelta, not {type(value).__name__} {value!r:.80}"
        )
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float
        seconds = math.inf
    if not math.isfinite(seconds) or not minimum <= seconds <= maximum:
        bounds = (
            f"of at least {minimum:g}"
            if maximum == math.inf
            else f"between {minimum:g} and {maximum:.0f}{_years(maximum)}"
        )
        raise InvalidArgument(
            f"{name} must be a finite number of seconds {bounds}, got {seconds:g}"
        )
    return seconds


def _years(seconds: float) -> str:
    years = seconds / (366 * 86400)
    return f" ({years:.0f} years)" if math.isfinite(years) and years == round(years) >= 1 else ""


def optional_seconds(name: str, value: object, *, minimum: float) -> float | None:
    return None if value is None else check_seconds(name, value, minimum=minimum)


def check_number(name: str, value: object, low: float, high: float) -> float:
    """A finite int or float (not a bool) within ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {type(value).__name__} {value!r:.80}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or not low <= number <= high:
        bounds = f"at least {low:g}" if high == math.inf else f"within [{low:g}, {high:g}]"
        raise InvalidArgument(f"{name} must be a finite number {bounds}, got {value!r:.80}")
    return number


def check_count(name: str, value: object, low: int, high: int) -> int:
    """An int (not a bool) within ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} {value!r:.80}")
    if not low <= value <= high:
        raise InvalidArgument(f"{name} must be between {low} and {high}, got {value}")
    return value


def check_topic_name(topic: object, what: str = "topic") -> str:
    """A topic: 1-255 characters, not blank, no NUL, valid Unicode."""
    if not isinstance(topic, str):
        raise TypeError(f"{what} must be a str, not {type(topic).__name__}")
    if not topic.strip():
        raise InvalidArgument(
            f"{what} must be a non-empty string of 1-{MAX_TOPIC_LENGTH} characters, "
            f"not blank: {topic!r}"
        )
    if len(topic) > MAX_TOPIC_LENGTH:
        raise InvalidArgument(
            f"{what} is {len(topic)} characters long; the limit is {MAX_TOPIC_LENGTH}: "
            f"{topic[:40]!r}..."
        )
    if "\x00" in topic:
        raise InvalidArgument(f"{what} contains a NUL character: {topic!r}")
    if not topic.isascii():
        try:
            topic.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidArgument(f"{what} is not valid Unicode text: {exc.reason}") from exc
    return topic
