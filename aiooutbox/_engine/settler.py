"""Batched, fenced settlement of handler outcomes.

Outcomes are buffered and written with one statement per (kind, attempt) group: ``done``
rows as ``WHERE id = ANY($1)`` (through the primary key, whatever the backlog), failures
with their delays and errors. A flush that fails on passing trouble is retried with
backoff; one that fails on a refused value (SQLSTATE class 22) is split until the bad
row is alone, which is then written with a placeholder error, so one row can never hold
back the others. `close` makes the last flush, shielded from cancellation and bounded
by its deadline even while a background flush is retrying.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable, Iterable, Iterator
from itertools import compress

import anyio
import asyncpg

from .._sql.db import (
    TRANSIENT_ERRORS,
    HeldConnection,
    check_permanent,
    is_data_error,
    pool_is_closed,
)
from .._sql.statements import Queries
from .._values.text import describe_exception, exception_message, exception_summary
from .rollups import Tallies
from .rows import ClaimedRow, Outcome, Settlement, getter
from .settlements import WRITE_ROWS, done_statement, failed_statement, outcome_statements
from .settlements import Pending as _Batch

__all__ = ["Settler"]

logger = logging.getLogger("aiooutbox.settler")

_SHOWN_IDS = 20  # ids named in a log line about outcomes that could not be written
_PROMOTE_RETRY = 0.05  # seconds before trying again a key whose promotion was deferred
_PLACEHOLDER = "(the error text of this attempt could not be stored: {})"
# the connection is kept from one flush to the next, and given back once no outcome
# came for this long (a drain flushes every few milliseconds)
_HOLD_IDLE = _PROMOTE_RETRY
_ID, _ATTEMPTS, _REDELIVERED = map(getter, ("id", "attempts", "redelivered"))


class Settler:
    """Collects outcomes and flushes them on size, on a short timer, and on close."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        queries: Queries,
        worker_id: str,
        *,
        flush_interval: float,
        flush_size: int,
        statement_timeout: float,
        on_promoted: Callable[[], None] = lambda: None,
        on_retry_due: Callable[[float], None] = lambda _: None,
        on_written: Callable[[], None] = lambda: None,
        tallies: Tallies | None = None,
    ) -> None:
        self._pool = pool
        # per-topic counts for the dashboard's charts (`Rollups` writes them)
        self.tallies = tallies if tallies is not None else Tallies()
        # kept between flushes while outcomes keep coming (see `HeldConnection`)
        self._conn = HeldConnection(pool, statement_timeout)
        self._q = queries
        self._worker_id = worker_id
        self._flush_interval = flush_interval
        self._flush_size = flush_size
        self._timeout = statement_timeout
        self._pending = _Batch()
        self._has_work = anyio.Event()
        self._flushed = anyio.Event()
        self._flush_lock = anyio.Lock()
        self._deadline: float | None = None  # set by close(): every flush gives up then
        self._closed = False  # close() ran its final flush: run() flushes no more
        self._writing = _Batch()  # the batch a flush is writing now
        self._ended: list[_Batch] | None = None  # writes ended during a claim (`claiming`)
        self._on_promoted = on_promoted
        self._on_retry_due = on_retry_due
        self._on_written = on_written  # a flush wrote its outcomes (flow control's slots)
        self._hurry = False  # flush without waiting for more outcomes to join
        self._promote_later: set[str] = set()  # keys a producer held locked (see 0005)
        self._promoting: set[str] = set()
        self.promoted = 0  # waiting ordered events promoted to their key's head
        self.fenced = 0  # outcomes ignored because the lease had moved on
        self.dropped = 0  # stale outcomes of lapsed claims dropped before being written
        self.abandoned = 0  # outcomes given up at shutdown (their leases will expire)

    def is_closed(self) -> bool:
        """`close` has run its final flush: nothing more is written."""
        return self._closed

    # -- recording (synchronous, never fails) --------------------------------------
    def done(self, event_id: int, attempts: int, topic: str | None = None) -> None:
        """`record` of a done outcome, without building a `Settlement` (the hot path);
        ``topic`` is counted for the dashboard's charts."""
        if topic is not None:
            self.tallies.done[topic] += 1
        self._pending.done[attempts].append(event_id)
        self._pending.size += 1
        if self._pending.size == 1 or self._pending.size >= self._flush_size:
            self._has_work.set()

    def done_all(self, rows: Iterable[ClaimedRow]) -> None:
        """`done` of each of ``rows`` (a batch handler's events, of one topic) in one call."""
        rows = rows if isinstance(rows, list) else list(rows)
        count = len(rows)
        if not count:
            return
        done = self._pending.done
        attempts = set(map(_ATTEMPTS, rows))
        if len(attempts) == 1:  # the usual case: in C, not row by row
            done[attempts.pop()].extend(map(_ID, rows))
        else:
            for row in rows:
                done[row.attempts].append(row.id)
        self.tallies.done[rows[-1].topic] += count
        self._pending.size += count
        if self._pending.size == count or self._pending.size >= self._flush_size:
            self._has_work.set()

    def record(self, settlement: Settlement) -> None:
        if settlement.outcome is Outcome.DONE:
            self._pending.done[settlement.attempts].append(settlement.id)
        else:
            self._pending.failed[settlement.attempts].append(settlement)
        self._pending.size += 1
        if self._pending.size == 1 or self._pending.size >= self._flush_size:
            self._has_work.set()

    def hurry(self) -> None:
        """Write what is recorded now: a limited topic waits for its slot (flow control)."""
        self._hurry = True
        self._has_work.set()

    @property
    def backlog(self) -> int:
        """Outcomes not yet written: waiting for a flush, or in the write under way."""
        return self._pending.size + self._writing.size

    def unsettled_ids(self) -> list[int]:
        """Rows whose outcome is recorded here but not yet written (still processing)."""
        return self._pending.ids() + self._writing.ids()

    @contextlib.contextmanager
    def claiming(self) -> Iterator[None]:
        """Around a claim, from before it is sent until its rows are handed out: keep
        each batch whose write ends meanwhile, for `drop_stale`."""
        self._ended = []
        try:
            yield
        finally:
            self._ended = None

    def stale_possible(self) -> bool:
        """Outcomes are waiting, being written, or were written during the claim."""
        return bool(self._pending.size or self._writing.size or self._ended)

    def stale_claims(self, rows: list[ClaimedRow]) -> list[ClaimedRow]:
        """`drop_stale` for the claimed ``rows`` that may have been claimed before;
        returns those that must not start (usually none, and at once)."""
        if not self.stale_possible():
            return []
        said = list(map(_REDELIVERED, rows))  # the claim says (None: `claimed_before`)
        again = (
            [(r.id, r.attempts) for r in compress(rows, said)]
            if None not in said
            else [(r.id, r.attempts) for r in rows if r.claimed_before()]
        )
        unsure = self.drop_stale(again) if again else set()
        return [r for r in rows if r.id in unsure] if unsure else []

    def drop_stale(self, claimed: list[tuple[int, int]]) -> set[int]:
        """Forget the outcomes recorded for rows this worker has just claimed again at
        the same attempt (``claimed``: id and attempts of each claimed row).

        Such an outcome is an earlier claim's whose lease lapsed (a blocked event loop,
        a slow flush): the row was recovered and claimed anew, and a run member comes
        back with its attempt given back, so the settlement's fence (worker, attempt)
        would match the new claim and settle a row that is about to run. Unwritten
        ones are dropped (written before the new claim, they would have been fenced
        off). Returns the claimed ids whose stale outcome is being written now, or
        whose write ended while the claim was under way (`claiming`: a settle's UPDATE
        waits for the claim's row locks, and its reply may be read before the claim's):
        whether it landed on the new claim is unknown, so those must not start. An
        outcome of another attempt is no such case (a retry just written, its row due
        at once and claimed again: the fence tells the two apart).
        """
        if not self.stale_possible():
            return set()
        ours = set(claimed)
        pending = self._pending.by_attempt()
        stale = {i for i, a in ours if i in pending.get(a, ())}
        if stale:
            self._pending = self._pending.without(stale)
            self.dropped += len(stale)
            logger.warning(
                "%d outcome(s) of claims whose lease lapsed not written: this consumer "
                "claimed the events again since (ids %s)",
                len(stale),
                ", ".join(map(str, sorted(stale)[:_SHOWN_IDS])),
                extra={"event_ids": sorted(stale)[:1000]},
            )
        unsure: set[int] = set()
        for batch in (self._writing, *(self._ended or ())):
            if batch:
                at = batch.by_attempt()
                unsure.update(i for i, a in ours if i in at.get(a, ()))
        return unsure

    async def wait_flushed(self) -> None:
        """Wait until the next flush completes (used for back-pressure)."""
        await self._flushed.wait()

    # -- flushing ------------------------------------------------------------------
    async def run(self) -> None:
        """Flush until `close` (the final flush) has run, or until cancelled.

        The consumer calls `close` while this still runs: nothing is written after it
        (a deferred promotion retried then wrote past the stop).
        """
        try:
            await self._run()
        finally:
            with anyio.CancelScope(shield=True):
                await self._conn.release()

    async def _run(self) -> None:
        while not self.is_closed():
            # deferred promotions are retried after _PROMOTE_RETRY (as long as _HOLD_IDLE)
            with anyio.move_on_after(_HOLD_IDLE):
                await self._has_work.wait()
            if not self._has_work.is_set():
                # no outcome for a while: the connection goes back to the pool
                await self._conn.release()
                if not self._promote_later:
                    await self._has_work.wait()
            self._has_work = anyio.Event()
            if self._pending.size < self._flush_size and not self._hurry:
                # let a few more outcomes join this batch
                with anyio.move_on_after(self._flush_interval):
                    while self._pending.size < self._flush_size:
                        await self._has_work.wait()
                        self._has_work = anyio.Event()
            self._hurry = False
            async with self._flush_lock:
                if self.is_closed():  # `close` flushed last: nothing is ours to write
                    break
                await self._flush_locked()

    async def close(self, timeout: float) -> None:
        """Final flush, shielded from cancellation, given up after ``timeout`` seconds.

        A background flush that is retrying sees the same deadline and stops at it, so
        the bound holds whatever it was doing; only a write already under way (itself
        bounded by the statement timeout) is waited for.
        """
        with anyio.CancelScope(shield=True):
            self._deadline = anyio.current_time() + timeout
            with anyio.move_on_after(timeout + 2 * self._timeout):
                async with self._flush_lock:
                    await self._flush_locked()
            self._abandon("the database could not be reached before the shutdown deadline")
            self._closed = True
            await self._conn.release()
            self._has_work.set()  # run() sees it and ends
            if self._promote_later:
                keys = sorted(self._promote_later)
                logger.warning(
                    "%d ordered key(s) could not move on to their next event before the "
                    "stop (a producer held the key); a running consumer's orphan sweep "
                    "promotes them: %s",
                    len(keys),
                    ", ".join(keys[:_SHOWN_IDS]) + (" ..." if len(keys) > _SHOWN_IDS else ""),
                    extra={"ordering_keys": keys[:1000]},
                )

    async def _flush_locked(self) -> None:
        delay = 0.05
        promote = bool(self._promote_later)  # deferred promotions ride along once
        while self._pending or promote:
            promote = False
            batch, self._pending = self._pending.split(WRITE_ROWS)
            self._writing = batch
            try:
                # a write under way finishes even if we are cancelled: its rows are settled
                with anyio.CancelScope(shield=True):
                    try:
                        await self._write(batch)
                    finally:  # it may have landed on a claim under way (`drop_stale`)
                        if self._ended is not None:
                            self._ended.append(batch)
            except TRANSIENT_ERRORS as exc:
                self._writing = _Batch()
                check_permanent(exc, "writing outcomes")
                self._merge_back(batch)
                if pool_is_closed(self._pool):
                    self._abandon("the asyncpg pool was closed")
                    return
                deadline = self._deadline
                if deadline is not None and anyio.current_time() + delay > deadline:
                    self._abandon(describe_exception(exc))
                    return
                logger.warning(
                    "settlement flush failed (%s); retrying in %.2fs",
                    exception_summary(exc),
                    delay,
                    extra={"outcomes": batch.size},
                )
                await anyio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 5.0)
            else:
                self._writing = _Batch()
                self._on_written()
        flushed, self._flushed = self._flushed, anyio.Event()
        flushed.set()

    def _abandon(self, why: str) -> None:
        if not self._pending:
            return
        ids = self._pending.ids()
        self.abandoned += len(ids)
        shown = ", ".join(map(str, ids[:_SHOWN_IDS])) + (" ..." if len(ids) > _SHOWN_IDS else "")
        logger.error(
            "gave up writing %d outcome(s) at shutdown (%s); their leases will expire and "
            "the events will be retried: ids %s",
            len(ids),
            why,
            shown,
            extra={"outcomes": len(ids), "event_ids": ids[:1000]},
        )
        self._pending = _Batch()

    def _merge_back(self, batch: _Batch) -> None:
        for attempts, ids in batch.done.items():
            self._pending.done[attempts].extend(ids)
        for attempts, failures in batch.failed.items():
            self._pending.failed[attempts].extend(failures)
        self._pending.size += batch.size

    def _statements(self, batch: _Batch) -> list[tuple[str, tuple[object, ...], int]]:
        statements = outcome_statements(self._q, self._worker_id, batch)
        if self._promote_later:
            # keys whose promotion a producer's lock deferred earlier: try them again
            self._promoting = set(self._promote_later)
            statements.append((self._q.promote, (sorted(self._promoting),), -1))
        return statements

    async def _write(self, batch: _Batch) -> None:
        statements = self._statements(batch)
        async with self._conn.use() as conn:
            try:
                results = await self._execute(conn, statements)
            except asyncpg.PostgresError as exc:
                if not is_data_error(exc):
                    raise
                # a refused value: never retry the batch as a whole (it would fail forever)
                await self._write_apart(conn, batch, exc)
                return
        for (_, _, expected), result in zip(statements, results, strict=True):
            self._absorb(result, expected)
        self._announce_retries(batch)

    def _announce_retries(self, batch: _Batch) -> None:
        """Tell the claim loop when the retries just written become due: an UPDATE sends
        no notification, so an idle consumer would otherwise wait for its poll."""
        delays = [
            f.delay
            for failures in batch.failed.values()
            for f in failures
            if f.outcome in (Outcome.RETRY, Outcome.RELEASED)
        ]
        if delays:
            self._on_retry_due(min(delays))

    async def _execute(
        self, conn: asyncpg.Connection, statements: list[tuple[str, tuple[object, ...], int]]
    ) -> list[asyncpg.Record]:
        # one statement needs no explicit transaction (and saves two round trips);
        # several are applied together so a retried flush never half-repeats
        if len(statements) == 1:
            sql, args, _ = statements[0]
            return [await conn.fetchrow(sql, *args, timeout=self._timeout)]
        async with conn.transaction():
            return [
                await conn.fetchrow(sql, *args, timeout=self._timeout)
                for sql, args, _ in statements
            ]

    def _absorb(self, result: asyncpg.Record, expected: int) -> None:
        """Count fenced outcomes; keep keys whose promotion a producer's lock deferred."""
        if expected >= 0:
            self._count_fenced(result["settled"], expected)
        self._promote_later.difference_update(self._promoting)
        self._promoting = set()
        self._promote_later.update(result["skipped"] or ())
        if result["promoted"]:
            self.promoted += result["promoted"]
            self._on_promoted()

    async def _write_apart(
        self, conn: asyncpg.Connection, batch: _Batch, first: asyncpg.PostgresError
    ) -> None:
        logger.warning(
            "settlement flush refused a value (%s: %s); writing the %d outcome(s) apart",
            type(first).__name__,
            first,
            batch.size,
        )
        for attempts, ids in batch.done.items():
            statement = done_statement(self._q, self._worker_id, attempts, ids)
            self._absorb((await self._execute(conn, [statement]))[0], len(ids))
        for attempts, failures in batch.failed.items():
            await self._write_failures(conn, attempts, failures)

    async def _write_failures(
        self, conn: asyncpg.Connection, attempts: int, failures: list[Settlement]
    ) -> None:
        try:
            result = (
                await self._execute(
                    conn, [failed_statement(self._q, self._worker_id, attempts, failures)]
                )
            )[0]
        except asyncpg.PostgresError as exc:
            if not is_data_error(exc):
                raise
            if len(failures) > 1:
                half = len(failures) // 2
                await self._write_failures(conn, attempts, failures[:half])
                await self._write_failures(conn, attempts, failures[half:])
                return
            bad = failures[0]
            if bad.error.startswith(_PLACEHOLDER[:20]):
                logger.error(
                    "event %d: its outcome was refused even with a placeholder error (%s); "
                    "its lease will expire and it will be retried",
                    bad.id,
                    exception_message(exc),
                    extra={"event_id": bad.id},
                )
                return
            logger.warning(
                "event %d: error text refused (%s); storing a placeholder instead",
                bad.id,
                exception_message(exc),
                extra={"event_id": bad.id},
            )
            placeholder = _PLACEHOLDER.format(type(exc).__name__)
            await self._write_failures(
                conn,
                attempts,
                [
                    Settlement(
                        bad.id, bad.attempts, bad.outcome, bad.delay, placeholder, bad.blocks_key
                    )
                ],
            )
            return
        self._absorb(result, len(failures))

    def _count_fenced(self, updated: int, expected: int) -> None:
        if updated < expected:
            self.fenced += expected - updated
            logger.warning(
                "%d outcome(s) ignored: the row was no longer held by this worker on this "
                "attempt (its lease expired and it was recovered or re-claimed, or an earlier "
                "try of this flush committed before its connection dropped)",
                expected - updated,
                extra={"fenced": expected - updated},
            )
