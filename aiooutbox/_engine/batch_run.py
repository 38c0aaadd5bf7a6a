"""Run a batch handler: make a batch of its topic's waiting events, call it once, and
record each event's outcome.

Per event only what must be: its lease checked (one call for the batch), its `Event`
built, its id recorded for the settlement. Per batch the rest: one coroutine, one
timeout, one observer call, one done statement's worth of ids.

What the handler's result means (docs/batches.md): None, every event done; a raise,
every event's attempt failed with it; a mapping of event ids to exceptions, those
failed and the others done; anything else (an id not in the batch, a value that is not
an exception instance, another type) is refused: logged, and every event failed with
an error that says why. An ordered key's events come in order, and once one of them
fails (retry, or dead on a key that blocks) its later events in the batch go back to
waiting behind it, their attempt given back, as the events of an unrun run do.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import anyio.to_thread

from .._values.codec import decode_json
from .._values.limits import MAX_ERROR_CHARS
from .._values.text import exception_repr, safe_text
from ..errors import Dead, Retry
from ..events import Event, _EventBuilder
from ..handlers import Handler
from .batch_payloads import Undecodable, decode_all, decode_each
from .batch_results import check_result, log_failures
from .batches import BatchHandoff, Pool, Slots
from .executor import Executor, _reason, describe, overran
from .handoff import Ticket
from .rows import ClaimedRow, Outcome, Settlement, from_epoch

__all__ = ["BatchExecutor", "batch_worker"]

logger = logging.getLogger("aiooutbox.consumer")

_SHOWN_IDS = 20  # event ids named in a log line about a batch


class BatchExecutor(Executor):
    """`Executor` for a consumer with batch handlers: per-event units as before, and
    `run_ticket` for a batch topic's ticket."""

    _handoff: BatchHandoff
    _slots: Slots

    def attach(self, handoff: BatchHandoff, slots: Slots) -> None:
        """The hand-off whose pools this executor makes batches of, and the slots."""
        self._handoff = handoff
        self._slots = slots

    # -- making a batch --------------------------------------------------------------
    async def run_ticket(self, pool: Pool) -> None:
        """Make a batch of ``pool``'s events (up to its cap, the free slots, after its
        linger), put the ticket back for the rest, run the batch."""
        handoff, slots = self._handoff, self._slots
        taken = 0
        try:
            if self._is_stopping():
                for unit in pool.take_all():
                    self.drop(unit)
                return
            if pool.linger and pool.size < pool.cap:
                await self._linger(pool)
            want = min(pool.cap, pool.size)
            if want <= 0:
                return
            if not slots.take_now(want):
                await slots.take(want)
            taken = want
            more = min(pool.cap, pool.size) - taken
            if more > 0:
                taken += slots.take_up_to(more)
            rows, rests = pool.form(taken)
        finally:
            handoff.put_back(pool)
        if len(rows) < taken:
            slots.give(taken - len(rows))
        try:
            await self._batch(pool, rows, rests)
        finally:
            slots.give(len(rows))

    async def _linger(self, pool: Pool) -> None:
        """Wait up to the handler's linger for the batch to fill."""
        try:
            with anyio.move_on_after(pool.linger):
                while pool.size < pool.cap and not self._is_stopping():
                    pool.arrived = anyio.Event()
                    await pool.arrived.wait()
        finally:
            pool.arrived = None

    # -- running it ------------------------------------------------------------------
    async def _batch(
        self, pool: Pool, rows: list[ClaimedRow], rests: list[list[ClaimedRow]]
    ) -> None:
        stopped: set[str] = set()  # keys whose later events go back to waiting
        lapsed: set[str] = set()  # keys whose later events are left to lease recovery
        going_on = False
        try:
            if self._is_stopping():
                self._release(rows, stopped)
                return
            gone = self._leases.unstartable(rows, time.monotonic() + self._lease_margin)
            if gone:
                rows = self._without_lapsed(pool.topic, rows, gone, lapsed)
            if rows:  # every lease may have lapsed while the batch waited its turn
                events, started = await self._events(rows, stopped)
                if started:
                    await self._call(pool, events, started, stopped)
            going_on = True
        finally:
            for rest in rests:
                key = rest[0].ordering_key
                if key in lapsed:
                    for row in rest:
                        self._finish(row)
                elif key in stopped or not going_on or self._is_stopping():
                    self.give_back(rest)
                else:
                    self._handoff.continue_run(pool, rest)

    def _release(self, rows: list[ClaimedRow], stopped: set[str]) -> dict[str, int]:
        """The consumer stopped first: each key's first event released, its later ones
        given back to waiting behind it; unordered events released."""
        counts = {"released": 0, "unrun": 0}
        for row in rows:
            key = row.ordering_key
            if key is not None:
                if key in stopped:
                    self.give_back([row])
                    counts["unrun"] += 1
                    continue
                stopped.add(key)
            self.release(row)
            self._finish(row)
            counts["released"] += 1
        return counts

    def _without_lapsed(
        self, topic: str, rows: list[ClaimedRow], gone: list[ClaimedRow], lapsed: set[str]
    ) -> list[ClaimedRow]:
        """Leave out the rows whose lease may be gone, and the later events of their
        keys; nothing is written for them (see `Executor.lapsed`)."""
        gone_ids = {id(row) for row in gone}
        kept: list[ClaimedRow] = []
        left: list[int] = []
        for row in rows:
            key = row.ordering_key
            if id(row) in gone_ids or (key is not None and key in lapsed):
                if key is not None:
                    lapsed.add(key)
                left.append(row.id)
                self._finish(row)
            else:
                kept.append(row)
        logger.warning(
            "%d event(s) of %r not started, their lease lapsed first (was the event loop "
            "blocked for longer than the lease?); they come back through lease recovery, "
            "with the later events of their keys: ids %s",
            len(left),
            topic,
            ", ".join(map(str, left[:_SHOWN_IDS])),
            extra={"topic": topic, "event_ids": left[:1000]},
        )
        return kept

    async def _events(
        self, rows: list[ClaimedRow], stopped: set[str]
    ) -> tuple[list[Event], list[ClaimedRow]]:
        """The handler's events, and the rows they are; a row that cannot be decoded is
        failed as a per-event handler's would be (its key's later events wait)."""
        events: list[Event] = []
        started: list[ClaimedRow] = []
        payloads = decode_all(rows) if self._decode is decode_json else None
        if payloads is None:
            try:
                payloads = await decode_each(rows, self._decode)
            except anyio.get_cancelled_exc_class():
                # a hurried stop: each key's first event released, its later ones given back
                self._release(rows, set())
                raise
        new, builder, event_class = object.__new__, _EventBuilder, Event
        last_created = None
        created_at = None
        keys_in: set[str] = set()  # keys with an event in the batch already
        for row, payload in zip(rows, payloads, strict=True):
            (
                row_id,
                topic,
                _,
                dedupe,
                head_text,
                attempts,
                most,
                created,
                at,
                mid,
                key,
                _,
                grp,
                again,
            ) = row
            if key is not None and key in stopped:
                self.give_back([row])
                continue
            if type(payload) is Undecodable:
                self._undecodable(row, payload.error, Outcome.RETRY, stopped, keys_in)
                continue
            if head_text == "{}":  # the usual headers: none
                headers = {}
            else:
                try:
                    headers = decode_json(head_text)
                except Exception as exc:
                    self._undecodable(row, exc, Outcome.RETRY, stopped, keys_in)
                    continue
                if not isinstance(headers, dict):
                    # only a raw SQL producer can store this; no retry will change it
                    error = ValueError("headers must be a JSON object")
                    self._undecodable(row, error, Outcome.DEAD, stopped, keys_in)
                    continue
            if key is not None:
                keys_in.add(key)
            if created != last_created:  # one conversion for events enqueued together
                created_at = from_epoch(created)
                last_created = created
            # `build_event`, inlined to the slots' stores (no call): this runs for every
            # event of every batch; a field added to `Event` is set here too (test_batch.py)
            event = new(builder)
            event.id = row_id
            event.topic = topic
            event.payload = payload
            event.dedupe_key = dedupe
            event.headers = headers
            event.attempts = attempts
            event.max_attempts = most
            event.created_at = created_at
            event.message_id = mid
            event.ordering_key = key
            event.redelivered = (
                again if again is not None else attempts > 1 or (key is not None and at > created)
            )
            event.group = grp
            event.__class__ = event_class
            events.append(event)
            started.append(row)
        return events, started

    def _undecodable(
        self,
        row: ClaimedRow,
        exc: BaseException,
        outcome: Outcome,
        stopped: set[str],
        keys_in: set[str],
    ) -> None:
        """Fail a row whose payload or headers cannot be read, as a per-event handler's
        would be; its key's later events of the batch go back to waiting. A row behind
        an earlier event of its key in this batch is given back unattempted instead:
        that event runs first, and the row fails only once it leads its key."""
        key = row.ordering_key
        if key is not None and key in keys_in:
            stopped.add(key)
            self.give_back([row])
            return
        if outcome is Outcome.RETRY:
            shown = self.undecodable(row, exc)
        else:
            shown = self._fail(row, exc, outcome, None)
        self._finish(row)
        if key is not None and shown != "dead":
            stopped.add(key)

    async def _call(
        self, pool: Pool, events: list[Event], started: list[ClaimedRow], stopped: set[str]
    ) -> None:
        handler = pool.handler
        timeout = handler.timeout if handler.timeout is not None else self._handler_timeout
        observers = self._observers
        observing = observers.per_event
        token = observers.batch_started(events) if observing else None
        began = time.perf_counter() if observing else 0.0
        # the handler gets a list of its own: what it does to it changes nothing here
        given = list(events) if observing else events
        failure: BaseException | None = None
        failures: dict[Any, Any] | None = None
        fatal: BaseException | None = None
        try:
            if timeout is None:
                result = await handler.func(given)
            else:
                with anyio.fail_after(timeout) as scope:
                    result = await handler.func(given)
                overran(scope, timeout)
        except anyio.get_cancelled_exc_class() as exc:
            if self._is_hurried():
                counts = self._release(started, stopped)
                if observing:
                    seconds = time.perf_counter() - began
                    observers.batch_finished(events, token, counts, seconds, exc)
                raise
            failure = exc  # the handler raised CancelledError on its own: a failure
        except Exception as exc:
            failure = exc
        except BaseException as exc:
            # SystemExit, KeyboardInterrupt and friends: settle the batch, then stop the
            # consumer gracefully and re-raise from run()
            failure = fatal = exc
        else:
            if result is not None:
                failures, failure, fatal = check_result(pool, result, started)
        counts = self._settle(pool, started, failure, failures, stopped)
        if observing:
            seconds = time.perf_counter() - began
            observers.batch_finished(events, token, counts, seconds, failure)
        if fatal is not None:
            logger.error(
                "batch handler for %r raised %s; stopping the consumer",
                pool.topic,
                exception_repr(fatal),
                extra={"topic": pool.topic, "event_ids": [r.id for r in started][:1000]},
            )
            self._on_fatal(fatal)

    # -- settling it -----------------------------------------------------------------
    def _settle(
        self,
        pool: Pool,
        started: list[ClaimedRow],
        failure: BaseException | None,
        failures: dict[Any, Any] | None,
        stopped: set[str],
    ) -> dict[str, int]:
        """Record each started event's outcome; return them counted."""
        leases = self._leases
        observers = self._observers
        topic = pool.topic
        if failure is None and not failures:
            done = started
            if leases.replaced:
                done = [r for r in started if leases.holds(r) or not self._superseded(r)]
            self._settler.done_all(done)
            self._stats.done += len(started)
            if observers.per_event:
                for _ in started:
                    observers.settled(topic, "done")
            counts = {"done": len(started)}
        else:
            counts = self._failed(pool, started, failure, failures or {}, stopped)
        leases.finish_all(started)
        self._stats.in_flight -= len(started)
        self._on_finished()
        return counts

    def _failed(
        self,
        pool: Pool,
        started: list[ClaimedRow],
        failure: BaseException | None,
        failures: dict[Any, Any],
        stopped: set[str],
    ) -> dict[str, int]:
        handler = pool.handler
        counts = {"done": 0, "retry": 0, "dead": 0, "unrun": 0}
        texts: dict[int, str] = {}  # each exception described once
        done: list[ClaimedRow] = []
        failed: list[int] = []
        first: tuple[ClaimedRow, BaseException] | None = None
        for row in started:
            key = row.ordering_key
            if key is not None and key in stopped:
                if not self._superseded(row):
                    self._settler.record(Settlement(row.id, row.attempts, Outcome.UNRUN))
                counts["unrun"] += 1
                continue
            exc = failure if failure is not None else failures.get(row.id)
            if exc is None:
                done.append(row)
                continue
            shown = self._fail_one(row, exc, handler, texts)
            counts["dead" if shown.startswith("dead") else "retry"] += 1
            failed.append(row.id)
            if first is None:
                first = (row, exc)
            if key is not None and shown != "dead":
                stopped.add(key)
        leases = self._leases
        if leases.replaced:
            done = [r for r in done if leases.holds(r) or not self._superseded(r)]
        self._settler.done_all(done)
        counts["done"] = len(done)
        self._stats.done += len(done)
        if self._observers.per_event:
            for _ in done:
                self._observers.settled(pool.topic, "done")
        if first is not None:
            log_failures(pool, started, counts, failed, first, whole=failure is not None)
        return {k: v for k, v in counts.items() if v}

    def _fail_one(
        self, row: ClaimedRow, exc: BaseException, handler: Handler, texts: dict[int, str]
    ) -> str:
        """Record ``row``'s failed attempt (no log line of its own: the batch has one);
        return what it leads to: retry, dead, or dead_block."""
        if isinstance(exc, Retry):
            outcome, delay = Outcome.RETRY, exc.delay
        else:
            outcome = Outcome.DEAD if isinstance(exc, Dead) else Outcome.RETRY
            delay = (handler.retry or self._retry).delay(row.attempts)
        dead = outcome is Outcome.DEAD or row.attempts >= row.max_attempts
        blocks = row.ordering_key is not None and handler.on_dead == "block"
        if dead:
            self._stats.dead += 1
        else:
            self._stats.retried += 1
        error = texts.get(id(exc))
        if error is None:
            if isinstance(exc, (Retry, Dead)):
                error = safe_text(f"{type(exc).__name__}: {_reason(exc)}", MAX_ERROR_CHARS)
            else:
                error = describe(exc)
            texts[id(exc)] = error
        if not self._superseded(row):
            self._settler.record(Settlement(row.id, row.attempts, outcome, delay, error, blocks))
            self._settler.tallies.failed(row.topic, dead)
        if self._observers.per_event:
            self._observers.settled(row.topic, "dead" if dead else "retry")
        return ("dead_block" if blocks else "dead") if dead else "retry"


async def batch_worker(handoff: BatchHandoff, executor: BatchExecutor, slots: Slots) -> None:
    """A worker of a consumer with batch handlers: a ticket makes a batch (which takes
    its slots); any other unit takes one slot while it runs."""
    handoff.joins()
    take = handoff.take_nowait
    while True:
        if (run := take()) is None and (run := await handoff.get()) is None:
            return
        if isinstance(run, Pool):
            await executor.run_ticket(run)
            continue
        if isinstance(run, Ticket):  # pragma: no cover - every ticket is a pool
            continue
        if not slots.take_now(1):
            try:
                await slots.take(1)
            except BaseException:
                executor.drop(run)
                raise
        try:
            if isinstance(run, list):
                await executor.execute_run(run)
            else:
                await executor.execute(run)
        finally:
            slots.give(1)
