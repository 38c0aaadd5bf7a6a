"""Handlers the CLI tests load with ``python -m aiooutbox run tests.cli_handlers:...``."""

from __future__ import annotations

import asyncio
import logging

import aiooutbox
from aiooutbox.handlers import HandlerFunc

logger = logging.getLogger("tests.cli_handlers")


async def slow(event: aiooutbox.Event) -> None:
    logger.warning("slow handler started event %d", event.id)  # the runner logs to stderr
    await asyncio.sleep(0.5)


async def sleepy(event: aiooutbox.Event) -> None:
    await asyncio.sleep(60)


async def quick(event: aiooutbox.Event) -> None:
    pass


async def failing(event: aiooutbox.Event) -> None:
    raise RuntimeError(f"cannot handle {event.payload!r}")


async def fatal(event: aiooutbox.Event) -> None:
    raise SystemExit(0)


handlers = {"slow": slow, "sleepy": sleepy, "quick": quick, "failing": failing}

router = aiooutbox.Router()
router.add("quick", quick)
router.add("failing", failing, retry=aiooutbox.RetryPolicy(base=0.01, max_delay=0.05))


def make_handlers() -> dict[str, HandlerFunc]:
    return {"quick": quick}


async def make_handlers_async() -> aiooutbox.Router:
    return router


fatal_handlers = {"fatal": fatal}

not_handlers = 42
empty: dict[str, HandlerFunc] = {}
sync_handlers = {"quick": lambda event: None}


def bad_factory() -> dict[str, HandlerFunc]:
    raise LookupError("no configuration")
