"""The two event shapes users touch: `NewEvent` going in, `Event` coming out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime, timedelta
from typing import Any

__all__ = ["Event", "NewEvent"]


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event to enqueue with `enqueue_many`; the fields mirror `enqueue`'s arguments."""

    topic: str
    payload: Any
    dedupe_key: str | None = None
    delay: float | timedelta | None = None
    available_at: datetime | None = None
    max_attempts: int | None = None
    headers: Mapping[str, Any] | None = None
    ordering_key: str | None = None
    group: str | None = None


@dataclass(frozen=True, slots=True)
class Event:
    """A claimed event as a handler sees it.

    ``attempts`` counts this attempt too, so the first delivery has ``attempts == 1``
    and the last one allowed has ``attempts == max_attempts``.
    """

    id: int
    topic: str
    payload: Any
    dedupe_key: str | None
    headers: dict[str, Any] = field(default_factory=dict)
    attempts: int = 1
    max_attempts: int = 5
    created_at: datetime | None = None
    #: a UUID unique across databases, tables and re-creations, the same on every retry:
    #: what brokers and downstream consumers should dedupe on (``id`` is per table)
    message_id: str | None = None
    #: events with the same key are handled one at a time, in order; None: unordered
    ordering_key: str | None = None
    #: an earlier attempt of this event may have run: ``attempts > 1``, or an ordered
    #: event taken back, without its attempt, from a consumer that lost it while it
    #: waited behind its key's head (true as well for an ordered event an operator
    #: redrove from dead: it keeps its error). False: this is the first run.
    redelivered: bool = False
    #: the event's group (a tenant, say): claims serve groups in turn; None: ungrouped
    group: str | None = None

    @property
    def is_last_attempt(self) -> bool:
        """True when a failure now sends the event to ``dead``."""
        return self.attempts >= self.max_attempts


def _mutable_twin(cls: type) -> Any:
    """A plain (not frozen) slots dataclass with ``cls``'s fields, in order."""
    names = [f.name for f in fields(cls)]
    twin = type(f"_{cls.__name__}Builder", (), {"__annotations__": dict.fromkeys(names, Any)})
    return dataclass(slots=True)(twin)


_EventBuilder = _mutable_twin(Event)


def build_event(*values: Any) -> Event:
    """``Event(*values)``, at a third of the cost: the consumer builds one per event.

    A frozen dataclass sets each field through ``object.__setattr__``; the twin sets
    them as a plain one does, and its instance then becomes an `Event` (the two have
    the same slots, so the layouts match). The result is an ordinary, frozen `Event`.
    """
    event = _EventBuilder(*values)
    event.__class__ = Event
    result: Event = event
    return result
