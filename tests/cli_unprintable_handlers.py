"""Handlers whose exceptions cannot be turned into text, for the runner's tests."""

from __future__ import annotations

import os

import aiooutbox


class LazyMessage(Exception):
    """Formats its message from an attribute the raiser forgot to set."""

    def __str__(self) -> str:
        return f"order {self.order_id} refused"  # type: ignore[attr-defined]


class LazyExit(SystemExit):
    """A fatal error (the consumer stops) that cannot describe itself either."""

    def __str__(self) -> str:
        return f"exit {self.reason}"  # type: ignore[attr-defined]


if os.environ.get("UNPRINTABLE_AT_IMPORT"):
    raise LazyMessage("at import")


async def lazy(event: aiooutbox.Event) -> None:
    raise LazyMessage(event.id)


async def fatal(event: aiooutbox.Event) -> None:
    raise LazyExit(1)


async def fine(event: aiooutbox.Event) -> None:
    return None


def factory() -> dict[str, object]:
    raise LazyMessage("in the factory")


handlers = {"lazy": lazy, "fine": fine}
fatal_handlers = {"fatal": fatal}
