"""Typed records that cross module boundaries inside the consumer.

`ClaimedRow` is a claimed row, its fields the claim function's columns in order;
`Outcome` is why a row is settled the way it is; `Settlement` is one outcome waiting
to be written.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from operator import itemgetter
from typing import Any, NamedTuple

__all__ = [
    "ClaimedRow",
    "ConsumerStats",
    "Outcome",
    "Settlement",
    "aware",
    "epoch_seconds",
    "from_epoch",
    "getter",
]

_MIN = datetime.min.replace(tzinfo=UTC)
_MAX = datetime.max.replace(tzinfo=UTC)
# builds a `ClaimedRow` from a claim's record in one C call (no per-field __new__ args)
_new_tuple: Any = tuple.__new__


def aware(value: datetime) -> datetime:
    """A timestamptz as asyncpg returns it, with ``±infinity`` made comparable.

    asyncpg returns PostgreSQL's ``-infinity``/``infinity`` as *naive* ``datetime.min``
    and ``datetime.max``; every finite value is aware. A raw SQL producer may store
    either, and comparing a naive value with an aware one raises.
    """
    if value.tzinfo is not None:
        return value
    return _MIN if value <= datetime(1, 1, 2) else _MAX


def is_finite(value: datetime) -> bool:
    return value.tzinfo is not None and _MIN < value < _MAX


def from_epoch(seconds: float) -> datetime:
    """A claimed row's ``created_at`` as the aware datetime `Event` carries (the claim
    clamps it to the years 1 to 9999, so it is always finite)."""
    return datetime.fromtimestamp(seconds, UTC)


def epoch_seconds(value: datetime) -> float:
    """A timestamptz as asyncpg returns it, as epoch seconds (``±infinity``: ±inf)."""
    if not is_finite(value):
        return -math.inf if aware(value) == _MIN else math.inf
    return value.timestamp()


class Outcome(enum.Enum):
    """How an event's attempt ends."""

    DONE = "done"  # the handler returned
    RETRY = "retry"  # the handler failed: retry after a delay, or dead if out of attempts
    DEAD = "dead"  # dead now, whatever attempts remain (`Dead`, an undecodable row)
    RELEASED = "released"  # the consumer stopped first: back to retry, never to dead
    UNRUN = "unrun"  # a run member that never started: back to waiting, attempt given back


@dataclass(frozen=True, slots=True)
class Settlement:
    id: int
    attempts: int
    outcome: Outcome
    delay: float = 0.0
    error: str = ""
    blocks_key: bool = False  # dead keeps an ordered event's key blocked (on_dead="block")

    @property
    def code(self) -> str:
        """The outcome as the settle function spells it (migration 0005)."""
        if self.outcome in (Outcome.RETRY, Outcome.DEAD) and self.blocks_key:
            return f"{self.outcome.value}_block"
        return self.outcome.value


class ClaimedRow(NamedTuple):
    """A claimed row; a tuple, because the claim makes hundreds at once: built from the
    claim's record in one C call (`from_record`), where a dataclass's ``__init__``
    cost a microsecond a row (most of the hand-out), and read as fast as slots."""

    id: int
    topic: str
    payload: str
    dedupe_key: str | None
    headers: str
    attempts: int
    max_attempts: int
    created_at: float  # epoch seconds (the claim clamps it to the years 1 to 9999)
    available_at: float  # epoch seconds (±inf for ±infinity): the claim window's watermark
    message_id: str
    ordering_key: str | None = None
    is_head: bool = True  # False: a waiting event claimed behind its key's head
    group: str | None = None  # its group (fair claims); None: ungrouped
    # claimed before, as the claim from low marks says (None: `claimed_before` decides)
    redelivered: bool | None = None

    @classmethod
    def from_record(cls, record: Iterable[Any]) -> ClaimedRow:
        """A row of the claim, whose columns come in the fields' order (a test pins it)."""
        row: ClaimedRow = _new_tuple(cls, record)
        return row

    @classmethod
    def from_records(cls, records: list[Any]) -> list[ClaimedRow]:
        """`from_record` of each of a claim's records: a record's slice is a plain
        tuple, which the row copies in C at half the cost of iterating the record.
        ``records`` is emptied: asyncpg's reply holds the list until the connection's
        next query, which kept a claim's records alive for the collector to carry
        into its older generations."""
        whole = slice(None)
        rows = [_new_tuple(cls, record[whole]) for record in records]
        records.clear()
        return rows

    def claimed_before(self) -> bool:
        """True if this row may have been claimed before (and its lease recovered): its
        attempts say so, or, for a run member whose attempt recovery gave back, the error
        recovery left (the claims' ``redelivered`` column, migration 0019). Without that
        column (a row built by hand): an ``available_at`` moved past its creation, which
        since 0019 is true of every ordered event, so it errs towards True. What
        `Event.redelivered` reports."""
        if self.redelivered is not None:
            return self.redelivered
        return self.attempts > 1 or (
            self.ordering_key is not None and self.available_at > self.created_at
        )

    @property
    def size(self) -> int:
        """Characters of payload text: what decoding it costs."""
        return len(self.payload)


def getter(name: str) -> Callable[[ClaimedRow], Any]:
    """A getter of a `ClaimedRow` field made in C (`operator.itemgetter`): a claim's or a
    batch's rows are looked over with ``map`` rather than row by row."""
    return itemgetter(ClaimedRow._fields.index(name))


@dataclass
class ConsumerStats:
    """Counters since the consumer started; cheap to read at any time."""

    claimed: int = 0
    done: int = 0
    retried: int = 0
    dead: int = 0
    released: int = 0
    in_flight: int = 0
    claims: int = 0
    recovered: int = 0
