"""`Observer`: what a consumer reports to metrics and tracing, at no cost when unused.

Pass observers with ``OutboxConsumer(pool, observers=[...])``. Every method is called
on the event loop, synchronously, in the task that did the work; it must be quick and
must not raise (an observer that raises is logged and the work goes on). Gauges such
as the number of running handlers are read from the consumer when needed
(`OutboxConsumer.stats`, `OutboxConsumer.listening`) rather than pushed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .events import Event

if TYPE_CHECKING:
    from .consumer import OutboxConsumer

__all__ = ["Observer"]

logger = logging.getLogger("aiooutbox.observe")

OUTCOMES = ("done", "retry", "dead", "released")


class Observer:
    """Base class: every hook does nothing. Override the ones you need."""

    def attached(self, consumer: OutboxConsumer) -> None:
        """``consumer`` was created with this observer: keep it to read its gauges.

        Called once, from ``OutboxConsumer()``; unlike the other hooks, an error raised
        here propagates (an observer refusing a second consumer is misuse)."""

    def claimed(self, rows: int, seconds: float) -> None:
        """A claim returned ``rows`` rows (possibly 0) after ``seconds``."""

    def handler_started(self, event: Event) -> Any:
        """A handler is about to run ``event``; the value returned is passed back to
        `handler_finished` (a span, a context token)."""
        return None

    def handler_finished(
        self,
        event: Event,
        token: Any,
        outcome: str,
        seconds: float,
        error: BaseException | None,
    ) -> None:
        """The handler of ``event`` ended after ``seconds`` with ``outcome`` (one of
        ``done``, ``retry``, ``dead``, ``released``) and, unless done, ``error``."""

    def settled(self, topic: str, outcome: str) -> None:
        """An outcome was recorded for an event of ``topic`` (every event, including
        those released or failed before their handler ran)."""


class Observers(Observer):
    """Fans each call out to several observers; a failing one is logged and skipped."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        for observer in observers:
            if not isinstance(observer, Observer):
                raise TypeError(
                    f"observers must be aiooutbox.observe.Observer instances, not {observer!r}"
                )
        self._all = tuple(observers)

    def __bool__(self) -> bool:
        return bool(self._all)

    def attached(self, consumer: OutboxConsumer) -> None:
        # called once, from OutboxConsumer(): an observer refusing it (misuse) raises there
        for o in self._all:
            o.attached(consumer)

    def claimed(self, rows: int, seconds: float) -> None:
        for o in self._all:
            try:
                o.claimed(rows, seconds)
            except Exception:
                logger.exception("observer %r failed in claimed()", o)

    def handler_started(self, event: Event) -> Any:
        tokens = []
        for o in self._all:
            try:
                tokens.append(o.handler_started(event))
            except Exception:
                logger.exception("observer %r failed in handler_started()", o)
                tokens.append(None)
        return tokens

    def handler_finished(
        self,
        event: Event,
        token: Any,
        outcome: str,
        seconds: float,
        error: BaseException | None,
    ) -> None:
        # in reverse, so context tokens are detached in the order they were attached
        for o, t in reversed(list(zip(self._all, token, strict=True))):
            try:
                o.handler_finished(event, t, outcome, seconds, error)
            except Exception:
                logger.exception("observer %r failed in handler_finished()", o)

    def settled(self, topic: str, outcome: str) -> None:
        for o in self._all:
            try:
                o.settled(topic, outcome)
            except Exception:
                logger.exception("observer %r failed in settled()", o)
