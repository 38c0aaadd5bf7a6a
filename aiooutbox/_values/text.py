"""Text that came from user code, made safe to store and log.

A handler's exception message may carry anything: NUL bytes from a binary response
body, lone surrogates from a bad decode, megabytes of HTML. PostgreSQL's ``text``
refuses NUL and invalid UTF-8, and one such value used to fail a whole settlement batch
forever. Everything we write that user code produced passes through `safe_text`.
"""

from __future__ import annotations

__all__ = ["safe_text"]


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
