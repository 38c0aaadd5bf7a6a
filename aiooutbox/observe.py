"""`Observer`: what a consumer reports to metrics and tracing, at no cost when unused.

Pass observers with ``OutboxConsumer(pool, observers=[...])``. Every method is called
on the event loop, synchronously, in the task that did the work; it must be quick and
must not raise (an observer that raises is logged and the work goes on). Gauges such
as the number of running handlers are read from the consumer when needed
(`OutboxConsumer.stats`, `OutboxConsumer.listening`) rather than pushed.

The per-event hooks go only to the observers that want them: those that override one,
and only while `Observer.wants_events` says so (asked once per claim), so an observer
with nothing to record (health, or tracing while no SDK is configured) costs the events
nothing (measured: calling a tracing observer with no SDK per event cost 1.0-1.7 us of
a no-op event's ~10 us of consumer CPU; docs/benchmarks.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import asyncpg

from ._engine.options import ConsumerOptions
from ._engine.rows import ConsumerStats
from ._engine.watchdog import MvccReport
from .events import Event

__all__ = ["ObservedConsumer", "Observer"]

logger = logging.getLogger("aiooutbox.observe")

OUTCOMES = ("done", "retry", "dead", "released")


class ObservedConsumer(Protocol):
    """What an observer reads of the consumer it is attached to; `OutboxConsumer` is one.

    Observers are given the consumer, not the other way round, so this is all the
    observing side needs to know of it.
    """

    @property
    def worker_id(self) -> str: ...
    @property
    def options(self) -> ConsumerOptions: ...
    @property
    def pool(self) -> asyncpg.Pool: ...
    @property
    def stats(self) -> ConsumerStats: ...
    @property
    def running(self) -> bool: ...
    @property
    def listening(self) -> bool: ...
    @property
    def mvcc(self) -> MvccReport | None: ...
    @property
    def settle_backlog(self) -> int: ...


class Observer:
    """Base class: every hook does nothing. Override the ones you need."""

    def attached(self, consumer: ObservedConsumer) -> None:
        """``consumer`` was created with this observer: keep it to read its gauges.

        Called once, from ``OutboxConsumer()``; unlike the other hooks, an error raised
        here propagates (an observer refusing a second consumer is misuse)."""

    def claimed(self, rows: int, seconds: float) -> None:
        """A claim returned ``rows`` rows (possibly 0) after ``seconds``."""

    def wants_events(self) -> bool:
        """Whether the per-event hooks (`handler_started`, `handler_finished`,
        `settled`) should be called for the events of the claim just made.

        Asked after each `claimed` call (and once when the consumer is built), never
        per event. Only asked of observers that override a per-event hook; the default
        says yes. An error here counts as yes."""
        return True

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
        those released or failed before their handler ran, and each event of a batch)."""

    def batch_started(self, events: list[Event]) -> Any:
        """A batch handler is about to run ``events`` (all of one topic, in the order
        given to it; the handler gets a list of its own); the value returned is passed
        back to `batch_finished`. `handler_started` is not called for them."""
        return None

    def batch_finished(
        self,
        events: list[Event],
        token: Any,
        outcomes: Mapping[str, int],
        seconds: float,
        error: BaseException | None,
    ) -> None:
        """The batch handler of ``events`` ended after ``seconds``. ``outcomes`` counts
        its events by outcome (``done``, ``retry``, ``dead``, ``released``, and
        ``unrun``: an ordered event given back to wait behind an earlier one of its key
        that failed); ``error`` is what the call raised (or why its result was refused),
        None if it returned. `settled` is called for each event too."""


_HOOKS = ("handler_started", "handler_finished", "settled", "batch_started", "batch_finished")


def _per_event(observer: Observer) -> bool:
    """Whether ``observer``'s class overrides a per-event (or per-batch) hook."""
    cls = type(observer)
    return any(getattr(cls, hook) is not getattr(Observer, hook) for hook in _HOOKS)


class Observers(Observer):
    """Fans each call out to several observers; a failing one is logged and skipped.

    ``per_event`` (a plain attribute, read by the executor per event) is true while any
    observer wants the per-event hooks; it is recomputed after each claim.
    """

    def __init__(self, observers: Sequence[Observer]) -> None:
        for observer in observers:
            if not isinstance(observer, Observer):
                raise TypeError(
                    f"observers must be aiooutbox.observe.Observer instances, not {observer!r}"
                )
        self._all = tuple(observers)
        self._eventful = tuple(o for o in self._all if _per_event(o))
        self._live: tuple[Observer, ...] = ()
        self.per_event = False
        self._refresh()

    def __bool__(self) -> bool:
        return bool(self._all)

    def _refresh(self) -> None:
        live = []
        for o in self._eventful:
            try:
                wanted = o.wants_events()
            except Exception:
                logger.exception("observer %r failed in wants_events()", o)
                wanted = True
            if wanted:
                live.append(o)
        self._live = tuple(live)
        self.per_event = bool(live)

    def attached(self, consumer: ObservedConsumer) -> None:
        # called once, from OutboxConsumer(): an observer refusing it (misuse) raises there
        for o in self._all:
            o.attached(consumer)

    def claimed(self, rows: int, seconds: float) -> None:
        for o in self._all:
            try:
                o.claimed(rows, seconds)
            except Exception:
                logger.exception("observer %r failed in claimed()", o)
        if self._eventful:
            self._refresh()

    def handler_started(self, event: Event) -> Any:
        # the observers are kept with their tokens: the live set may change (after a
        # claim) while the handler runs
        live = self._live
        if len(live) == 1:  # the common case, without a list per event
            try:
                return live, live[0].handler_started(event)
            except Exception:
                logger.exception("observer %r failed in handler_started()", live[0])
                return live, None
        tokens = []
        for o in live:
            try:
                tokens.append(o.handler_started(event))
            except Exception:
                logger.exception("observer %r failed in handler_started()", o)
                tokens.append(None)
        return live, tokens

    def handler_finished(
        self,
        event: Event,
        token: Any,
        outcome: str,
        seconds: float,
        error: BaseException | None,
    ) -> None:
        live, tokens = token
        if len(live) == 1:
            pairs: Any = ((live[0], tokens),)
        else:
            # in reverse, so context tokens are detached in the order they were attached
            pairs = reversed(list(zip(live, tokens, strict=True)))
        for o, t in pairs:
            try:
                o.handler_finished(event, t, outcome, seconds, error)
            except Exception:
                logger.exception("observer %r failed in handler_finished()", o)

    def settled(self, topic: str, outcome: str) -> None:
        for o in self._live:
            try:
                o.settled(topic, outcome)
            except Exception:
                logger.exception("observer %r failed in settled()", o)

    def batch_started(self, events: list[Event]) -> Any:
        live = self._live
        tokens = []
        for o in live:
            try:
                tokens.append(o.batch_started(events))
            except Exception:
                logger.exception("observer %r failed in batch_started()", o)
                tokens.append(None)
        return live, tokens

    def batch_finished(
        self,
        events: list[Event],
        token: Any,
        outcomes: Mapping[str, int],
        seconds: float,
        error: BaseException | None,
    ) -> None:
        live, tokens = token
        # in reverse, so context tokens are detached in the order they were attached
        for o, t in reversed(list(zip(live, tokens, strict=True))):
            try:
                o.batch_finished(events, t, outcomes, seconds, error)
            except Exception:
                logger.exception("observer %r failed in batch_finished()", o)
