"""Text that came from user code, made safe to store and log.

A handler's exception message may carry anything: NUL bytes from a binary response
body, lone surrogates from a bad decode, megabytes of HTML. PostgreSQL's ``text``
refuses NUL and invalid UTF-8, and one such value used to fail a whole settlement batch
forever. Everything we write that user code produced passes through `safe_text`.

Describing an exception must never fail either: an exception class that formats its
message lazily from attributes that were never set raises from ``__str__`` (and perhaps
``__repr__``), and one such handler error used to end ``run()``. Every place that turns
an exception into text goes through `exception_message` / `describe_exception`.
"""

from __future__ import annotations

__all__ = [
    "describe_exception",
    "exception_message",
    "exception_repr",
    "exception_summary",
    "safe_text",
]


def safe_text(text: str, limit: int) -> str:
    """``text`` without NUL, with unencodable characters replaced, at most ``limit`` chars."""
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii():
        # lone surrogates (from surrogateescape decoding, say) cannot be sent as UTF-8
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text[:limit]


def exception_repr(exc: BaseException) -> str:
    """``repr(exc)``, or ``<ClassName object>`` when its ``__repr__`` raises."""
    try:
        text = repr(exc)
    except Exception:
        return f"<{_class_name(exc)} object>"
    # repr() returns a str (or a str subclass, whose own methods we do not trust)
    return str.__str__(text)


def exception_message(exc: BaseException) -> str:
    """``str(exc)``, never raising.

    When ``__str__`` raises (or returns something that is not a str), the message is
    the exception's ``repr`` with a note of what went wrong, or, if ``repr`` fails too,
    just that note: ``<str() failed: AttributeError>``.
    """
    try:
        text = str(exc)
    except Exception as error:
        note = f"<str() failed: {_class_name(error)}>"
        try:
            shown = repr(exc)
        except Exception:
            return note
        return f"{str.__str__(shown)} {note}"
    return str.__str__(text)


def describe_exception(exc: BaseException, *, qualified: bool = False) -> str:
    """``ClassName: message`` (``ClassName`` alone for an empty message), never raising;
    ``qualified`` uses the class's ``__qualname__``."""
    name = _class_name(exc, qualified)
    message = exception_message(exc)
    return f"{name}: {message}" if message else name


def exception_summary(exc: BaseException) -> str:
    """`describe_exception`'s first line, for a log line: asyncpg appends the server's
    DETAIL and HINT on lines of their own (a prepared-statement error behind PgBouncer
    carries 15 lines of advice)."""
    return describe_exception(exc).split("\n", 1)[0].rstrip()


def _class_name(exc: BaseException, qualified: bool = False) -> str:
    cls = type(exc)
    return cls.__qualname__ if qualified else cls.__name__
