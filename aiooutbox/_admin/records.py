"""The records `aiooutbox.admin` returns: what ``stats`` and ``dead list`` report.

Plain frozen data with ``as_dict()`` for ``--json``; no I/O, so `cli.output` renders them
and tests build them without a database.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .._engine.watchdog import MvccReport

__all__ = [
    "STATUSES",
    "BlockedKey",
    "DeadEvent",
    "FlowChange",
    "OutboxStats",
    "TopicControl",
    "TopicInfo",
    "TopicStats",
    "UnconsumedTopic",
    "WorkerStats",
    "dead_event",
    "stored_json",
]

# the states `stats` counts: the table's statuses, with `pending` split by time into
# `pending` (due now) and `scheduled` (not due yet: enqueued with a delay)
STATUSES = ("pending", "scheduled", "retry", "processing", "waiting", "done", "dead")


@dataclass(frozen=True)
class TopicStats:
    """Rows of one topic by status (every status present), and its lag in seconds.

    ``lag`` is how long the oldest event that could be claimed now has waited for a
    consumer; ``None`` when nothing is waiting.
    """

    topic: str
    counts: dict[str, int]
    lag: float | None


@dataclass(frozen=True)
class WorkerStats:
    """Rows one consumer holds, and the age in seconds of its oldest claim."""

    worker: str
    rows: int
    oldest_claim_age: float


@dataclass(frozen=True)
class UnconsumedTopic:
    """A topic whose events wait while no consumer seems to handle it.

    No row of it is being processed and no idle consumer advertises it: either no
    running consumer has a handler for it, or they are all too busy to claim it.
    """

    topic: str
    waiting: int
    lag: float


@dataclass(frozen=True)
class BlockedKey:
    """An ordered key whose head cannot run now, with how many events wait behind it.

    ``status`` is ``retry`` (the head keeps failing; ``available_at`` is its next try)
    or ``dead`` (a handler with ``on_dead="block"``: retry or purge it to move on).
    """

    ordering_key: str
    head_id: int
    topic: str
    status: str
    attempts: int
    available_at: datetime
    last_error: str | None
    waiting: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "ordering_key": self.ordering_key,
            "head_id": self.head_id,
            "topic": self.topic,
            "status": self.status,
            "attempts": self.attempts,
            "available_at": self.available_at.isoformat(),
            "last_error": self.last_error,
            "waiting": self.waiting,
        }


@dataclass(frozen=True)
class TopicControl:
    """A topic's flow controls (``topic == ""``: the pause of every topic).

    ``rate`` is in events per second, ``rate_text`` as it was given (``"10/min"``);
    ``burst`` is how many events may be claimed at once after a quiet spell.
    """

    topic: str
    paused: bool = False
    max_running: int | None = None
    rate: float | None = None
    rate_text: str | None = None
    burst: float | None = None
    updated_at: datetime | None = None
    updated_by: str | None = None

    @property
    def limited(self) -> bool:
        return self.max_running is not None or self.rate is not None

    def as_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "paused": self.paused,
            "max_running": self.max_running,
            "rate": self.rate_text,
            "burst": self.burst,
            "updated_at": self.updated_at.isoformat() if self.updated_at else None,
            "updated_by": self.updated_by,
        }


@dataclass(frozen=True)
class TopicInfo:
    """One topic as ``python -m aiooutbox topics`` lists it.

    ``queued`` events are pending or retry (``due`` of them claimable now), ``waiting``
    ones are ordered behind their key's head, ``running`` ones are claimed. ``lag`` is
    how long the oldest due event has waited (``None``: none is due). ``paused`` is
    true when the topic or every topic is paused.
    """

    topic: str
    queued: int
    due: int
    waiting: int
    running: int
    lag: float | None
    paused: bool
    control: TopicControl

    def as_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "queued": self.queued,
            "due": self.due,
            "waiting": self.waiting,
            "running": self.running,
            "lag_seconds": self.lag,
            "paused": self.paused,
            "max_running": self.control.max_running,
            "rate": self.control.rate_text,
            "burst": self.control.burst,
            "updated_at": (
                self.control.updated_at.isoformat() if self.control.updated_at else None
            ),
            "updated_by": self.control.updated_by,
        }


@dataclass(frozen=True)
class FlowChange:
    """One logged change of a topic's controls: who, when, what before and after."""

    id: int
    at: datetime
    actor: str
    topic: str
    action: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "at": self.at.isoformat(),
            "actor": self.actor,
            "topic": self.topic,
            "action": self.action,
            "before": self.before,
            "after": self.after,
        }


@dataclass(frozen=True)
class OutboxStats:
    """A snapshot of one outbox table, as ``python -m aiooutbox stats`` shows it."""

    outbox: str
    topics: list[TopicStats] = field(default_factory=list)
    in_flight: list[WorkerStats] = field(default_factory=list)
    unconsumed: list[UnconsumedTopic] = field(default_factory=list)
    # the xmin horizon's holders and the table's dead tuples (the MVCC watchdog's view)
    mvcc: MvccReport | None = None
    blocked_keys: list[BlockedKey] = field(default_factory=list)
    # topics paused or limited (the topic "" is the pause of every topic)
    controls: list[TopicControl] = field(default_factory=list)
    # the ``done`` counts are estimates (past 50,000 rows); every other count is exact
    done_estimated: bool = False

    @property
    def paused(self) -> list[str]:
        """Paused topics; ``["*"]`` when every topic is paused."""
        if any(c.topic == "" and c.paused for c in self.controls):
            return ["*"]
        return [c.topic for c in self.controls if c.paused]

    @property
    def totals(self) -> dict[str, int]:
        """Rows by status over all topics."""
        return {s: sum(t.counts[s] for t in self.topics) for s in STATUSES}

    @property
    def lag(self) -> float | None:
        """The largest lag of any topic, or ``None`` when nothing is waiting."""
        lags = [t.lag for t in self.topics if t.lag is not None]
        return max(lags) if lags else None

    @property
    def dead(self) -> int:
        return self.totals["dead"]

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data."""
        return {
            "outbox": self.outbox,
            "totals": self.totals,
            "done_estimated": self.done_estimated,
            "lag_seconds": self.lag,
            "dead": self.dead,
            "topics": {t.topic: {**t.counts, "lag_seconds": t.lag} for t in self.topics},
            "in_flight": [
                {"worker": w.worker, "rows": w.rows, "oldest_claim_age_seconds": w.oldest_claim_age}
                for w in self.in_flight
            ],
            "unconsumed": [
                {"topic": u.topic, "waiting": u.waiting, "lag_seconds": u.lag}
                for u in self.unconsumed
            ],
            "mvcc": None if self.mvcc is None else self.mvcc.as_dict(),
            "blocked_keys": [b.as_dict() for b in self.blocked_keys],
            "paused": self.paused,
            "limits": {
                c.topic: {"max_running": c.max_running, "rate": c.rate_text, "burst": c.burst}
                for c in self.controls
                if c.limited
            },
        }


@dataclass(frozen=True)
class DeadEvent:
    """An event in ``dead``, with the error of its last attempt.

    ``payload`` is the decoded payload; when its stored JSON cannot be read (a number
    beyond a float's range, nesting past the decoder's depth) it is the stored text
    itself and ``payload_error`` says why.
    """

    id: int
    topic: str
    dedupe_key: str | None
    attempts: int
    max_attempts: int
    last_error: str | None
    created_at: datetime
    finished_at: datetime | None
    payload: Any
    payload_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; ``payload_error`` only when the payload is its text."""
        extra = {} if self.payload_error is None else {"payload_error": self.payload_error}
        return {
            "id": self.id,
            "topic": self.topic,
            "dedupe_key": self.dedupe_key,
            "attempts": self.attempts,
            "max_attempts": self.max_attempts,
            "last_error": self.last_error,
            "created_at": self.created_at.isoformat(),
            "finished_at": self.finished_at.isoformat() if self.finished_at else None,
            "payload": self.payload,
            **extra,
        }


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"the number {text[:40]} is beyond a float's range")
    return number


def stored_json(text: str) -> tuple[Any, str | None]:
    """Stored JSON decoded exactly (integers of any size), else ``(text, why not)``."""
    try:
        return json.loads(text, parse_float=_finite), None
    except RecursionError:
        return text, "nested too deeply to decode"
    except ValueError as exc:
        return text, str(exc)


def dead_event(row: Sequence[Any]) -> DeadEvent:
    """A `DeadEvent` of a row of ``AdminQueries.dead_list``."""
    payload, error = stored_json(row[8])
    return DeadEvent(
        id=row[0],
        topic=row[1],
        dedupe_key=row[2],
        attempts=row[3],
        max_attempts=row[4],
        last_error=row[5],
        created_at=row[6],
        finished_at=row[7],
        payload=payload,
        payload_error=error,
    )
