"""Outcomes waiting to be written, and the statements that write them: one per kind
and attempt number (fenced by worker and attempt in the settle functions)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .._sql.statements import Queries, id_array
from .rows import Settlement

__all__ = [
    "WRITE_ROWS",
    "Pending",
    "Statement",
    "done_statement",
    "failed_statement",
    "outcome_statements",
]

Statement = tuple[str, tuple[object, ...], int]  # sql, arguments, rows it should settle
# outcomes per statement: the statements of one flush follow each other (each commits
# on its own), so an ordered key's next event is promoted by the first and claimed
# while the rest are written; with one statement per flush a backlog over ordering keys
# went claim, run, settle, claim ... with one core idle, and a drain of 1,000 keys ran
# at two thirds of the speed (docs/internals.md, the settler)
WRITE_ROWS = 512


@dataclass
class Pending:
    """Outcomes of one flush: done ids and failures, by attempt number."""

    done: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    failed: dict[int, list[Settlement]] = field(default_factory=lambda: defaultdict(list))
    size: int = 0

    def __bool__(self) -> bool:
        return self.size > 0

    def ids(self) -> list[int]:
        ids = [i for group in self.done.values() for i in group]
        return ids + [s.id for group in self.failed.values() for s in group]

    def by_attempt(self) -> dict[int, set[int]]:
        """The row ids by the attempt their outcome is fenced on."""
        by: dict[int, set[int]] = defaultdict(set)
        for attempts, ids in self.done.items():
            by[attempts].update(ids)
        for attempts, failures in self.failed.items():
            by[attempts].update(f.id for f in failures)
        return by

    def split(self, most: int) -> tuple[Pending, Pending]:
        """At most ``most`` of these outcomes, and the rest (``self`` whole if it fits)."""
        if self.size <= most:
            return self, Pending()
        first, rest = Pending(), Pending()
        room = most
        groups: tuple[tuple[dict[int, list[Any]], ...], ...] = (
            (self.done, first.done, rest.done),
            (self.failed, first.failed, rest.failed),
        )
        for mine, taken, left in groups:
            for attempts, outcomes in mine.items():
                if room > 0:
                    taken[attempts] = outcomes[:room]
                    room -= len(taken[attempts])
                    outcomes = outcomes[len(taken[attempts]) :]
                if outcomes:
                    left[attempts] = outcomes
        first.size = most - room
        rest.size = self.size - first.size
        return first, rest

    def without(self, ids: set[int]) -> Pending:
        """These outcomes but those of ``ids``."""
        kept = Pending()
        for attempts, done in self.done.items():
            for i in done:
                if i not in ids:
                    kept.done[attempts].append(i)
                    kept.size += 1
        for attempts, failures in self.failed.items():
            for f in failures:
                if f.id not in ids:
                    kept.failed[attempts].append(f)
                    kept.size += 1
        return kept


def done_statement(q: Queries, worker_id: str, attempts: int, ids: list[int]) -> Statement:
    """Settle ``ids`` done (the ids as array text: one parameter however many)."""
    return (q.settle_done_text, (id_array(ids), worker_id, attempts), len(ids))


def failed_statement(
    q: Queries, worker_id: str, attempts: int, failures: list[Settlement]
) -> Statement:
    """Settle ``failures``: arrays of their ids, delays, errors and outcome codes."""
    return (
        q.settle_failed,
        (
            [f.id for f in failures],
            [f.delay for f in failures],
            [f.error for f in failures],
            [f.code for f in failures],
            worker_id,
            attempts,
        ),
        len(failures),
    )


def outcome_statements(q: Queries, worker_id: str, pending: Pending) -> list[Statement]:
    """The statements that write ``pending``, one per kind and attempt number."""
    statements = [done_statement(q, worker_id, a, ids) for a, ids in pending.done.items()]
    return statements + [
        failed_statement(q, worker_id, a, failures) for a, failures in pending.failed.items()
    ]
