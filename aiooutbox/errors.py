"""Exceptions raised by aiooutbox, and the two a handler raises to steer its event.

    Exception
    ├── OutboxError                  base of everything aiooutbox raises itself
    │   ├── InvalidArgument          (also ValueError) bad input, raised before any write
    │   ├── SchemaNotReady           the outbox table is missing or older than the library
    │   └── SchemaTooNew             the database was migrated by a newer aiooutbox
    ├── Retry                        raised by a handler: retry after `delay` seconds
    └── Dead                         raised by a handler: give up now, keep the reason

Wrong *types* at a public entry point raise the built-in ``TypeError``.
"""

from __future__ import annotations

from datetime import timedelta

from ._values.limits import InvalidArgument, OutboxError, check_seconds

__all__ = ["Dead", "InvalidArgument", "OutboxError", "Retry", "SchemaNotReady", "SchemaTooNew"]


class SchemaNotReady(OutboxError):
    """The outbox schema is missing or behind the library: run ``aiooutbox migrate``."""


class SchemaTooNew(OutboxError):
    """The database schema was written by a newer aiooutbox; upgrade the library."""


class Retry(Exception):
    """Raise from a handler to retry the event after exactly ``delay`` seconds.

    The retry still counts as an attempt: once ``max_attempts`` is reached the event
    goes to ``dead`` instead.
    """

    def __init__(self, delay: float | timedelta = 0.0, reason: str = "retry requested") -> None:
        seconds = check_seconds("Retry(delay=...)", delay)
        super().__init__(reason)
        self.delay = seconds
        self.reason = reason


class Dead(Exception):
    """Raise from a handler to send the event straight to ``dead``, keeping ``reason``."""

    def __init__(self, reason: str = "marked dead by handler") -> None:
        super().__init__(reason)
        self.reason = reason
