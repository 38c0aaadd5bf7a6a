"""The command line's two failures, told apart by exit status (2 bad usage, 1 failure)."""

from __future__ import annotations

__all__ = ["CommandError", "UsageError"]


class UsageError(Exception):
    """Bad input from the command line: exit status 2."""


class CommandError(Exception):
    """The command could not do its job: exit status 1."""
