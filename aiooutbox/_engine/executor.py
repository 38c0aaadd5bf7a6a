"""Run one claimed row's handler and record its outcome.

Payloads are decoded here, in the worker that runs the event, not by the claim loop:
a claim of large payloads decoded in one go blocked the event loop (measured: 64 rows
of ~7 MB JSON, ~12 s without a heartbeat). Payloads above `_THREAD_DECODE_CHARS` are
decoded in a worker thread so the loop keeps serving heartbeats and other handlers.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Mapping

import anyio
import anyio.to_thread

from .._values.codec import Decoder, decode_json
from .._values.limits import MAX_ERROR_CHARS
from .._values.text import describe_exception, exception_repr, safe_text
from ..errors import Dead, Retry
from ..events import Event, build_event
from ..handlers import ALL_TOPICS, Handler
from ..observe import Observers
from ..retry import RetryPolicy
from .leases import Leases
from .rows import ClaimedRow, ConsumerStats, Outcome, Settlement, from_epoch
from .settler import Settler

__all__ = ["Executor", "describe"]

logger = logging.getLogger("aiooutbox.consumer")

_THREAD_DECODE_CHARS = 256 * 1024


def overran(scope: anyio.CancelScope, timeout: float) -> None:
    """Raise `TimeoutError` if a handler returned after its timeout's deadline: one
    that blocked the event loop (synchronous work) past it was never cancelled, and
    its attempt fails as a cancelled one does."""
    if anyio.current_time() >= scope.deadline:
        raise TimeoutError(
            f"the handler returned after its timeout of {timeout:g}s: it blocked the event"
            " loop past it (synchronous work), so it could not be cancelled in time"
        )


def describe(exc: BaseException) -> str:
    """The text kept in ``last_error``: type, message and the end of the traceback.

    Never raises: an exception whose ``__str__`` (or ``__repr__``) fails is described by
    its class name and ``repr`` (or its class name alone), its traceback kept.
    """
    text = safe_text(describe_exception(exc, qualified=True), MAX_ERROR_CHARS // 2)
    try:  # safe against a failing __str__ itself; a malformed __notes__ still raises
        trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-8))
    except Exception:
        trace = "".join(traceback.format_tb(exc.__traceback__, limit=-8))
    return safe_text(text + "\n" + trace[-(MAX_ERROR_CHARS - len(text) - 1) :], MAX_ERROR_CHARS)


def _reason(exc: Retry | Dead) -> str:
    """The reason a handler gave, as text (a subclass may have set anything there)."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str):
        return reason
    try:
        return str(reason)
    except Exception:
        return describe_exception(exc)


class Executor:
    """Decodes a row, runs its handler under the timeout, and settles the outcome."""

    def __init__(
        self,
        *,
        handlers: Mapping[str, Handler],
        settler: Settler,
        leases: Leases,
        stats: ConsumerStats,
        retry: RetryPolicy,
        handler_timeout: float | None,
        decoder: Decoder,
        is_stopping: Callable[[], bool],
        is_hurried: Callable[[], bool],
        on_finished: Callable[[], None],
        on_fatal: Callable[[BaseException], None],
        observers: Observers,
        lease_margin: float = 0.0,
    ) -> None:
        self._handlers = handlers
        self._settler = settler
        self._leases = leases
        self._stats = stats
        self._retry = retry
        self._handler_timeout = handler_timeout
        self._decode = decoder
        self._is_stopping = is_stopping
        self._is_hurried = is_hurried
        self._on_finished = on_finished
        self._on_fatal = on_fatal
        self._observers = observers
        # a handler starts only if its lease lasts at least this much longer by our
        # clock: time for the heartbeat, overdue after a blocked loop, to renew it
        self._lease_margin = lease_margin

    async def execute_run(self, run: list[ClaimedRow]) -> None:
        """Run an ordered key's run of events one after another (the workers hand a
        lone event straight to `execute`).

        The run stops at the first event that is not finished for good (a retry, a
        release, a dead event of a key that blocks): its later events were never
        started and go back to waiting, so the key resumes from there, in order.
        """
        for i, row in enumerate(run):
            try:
                outcome = await self.execute(row)
            except BaseException:
                self.give_back(run[i + 1 :])
                raise
            if outcome == "lapsed":
                # the lease of this run is gone (or in doubt): start none of it (see
                # `Executor.lapsed`)
                for later in run[i + 1 :]:
                    self._finish(later)
                return
            if outcome not in ("done", "dead") and i + 1 < len(run):
                self.give_back(run[i + 1 :])
                return

    def give_back(self, rows: list[ClaimedRow]) -> None:
        """Rows claimed behind a head that will not run now: back to waiting."""
        for row in rows:
            if not self._superseded(row):
                self._settler.record(Settlement(row.id, row.attempts, Outcome.UNRUN))
            self._finish(row)

    def drop(self, run: ClaimedRow | list[ClaimedRow]) -> None:
        """A unit of work no worker will run (a fast stop): its first event released,
        the rest of an ordered run given back to waiting behind it."""
        head, rest = (run[0], run[1:]) if isinstance(run, list) else (run, [])
        self.release(head)
        self._finish(head)
        self.give_back(rest)

    def _superseded(self, row: ClaimedRow) -> bool:
        """True (and logged) if this consumer claimed the row again after this claim's
        lease lapsed: the row is the newer claim's to settle. Settlements are fenced by
        worker and attempt, and a run member comes back with its attempt given back,
        so this claim's outcome could otherwise land on the newer claim."""
        if self._leases.holds(row):
            return False
        logger.warning(
            "event %d (%s): outcome of attempt %d not written: its lease lapsed and this "
            "consumer claimed the event again since",
            row.id,
            row.topic,
            row.attempts,
            extra={"event_id": row.id, "topic": row.topic, "attempt": row.attempts},
        )
        return True

    def _finish(self, row: ClaimedRow) -> None:
        self._leases.finish(row)
        self._stats.in_flight -= 1
        self._on_finished()

    def lapsed(self, row: ClaimedRow) -> str:
        """Give up a claim whose lease may be gone before its handler starts.

        Its lease ends within the margin by our clock, was found lost by the heartbeat,
        or the row was claimed again since: the event loop was blocked past the lease (a
        handler's synchronous work), and another consumer may already run the event,
        and the events of its key after it. Nothing is written: an outcome fenced by
        worker and attempt could land on a later claim of the same row by this consumer
        (a run member's attempt is given back with it), and a release by worker id
        could take part of a key's run and leave the rest for recovery to make a second
        head of. The rows come back as a crashed worker's do, through lease recovery,
        all of a key's together: their lease has lapsed already, or will within the
        margin.
        """
        logger.warning(
            "event %d (%s): not started, its lease lapsed first (was the event loop "
            "blocked for longer than the lease?); it comes back through lease recovery, "
            "with the later events of its key claimed with it",
            row.id,
            row.topic,
            extra={"event_id": row.id, "topic": row.topic, "attempt": row.attempts},
        )
        return "lapsed"

    async def execute(self, row: ClaimedRow) -> str:
        """Run ``row``'s handler; return the outcome (done, retry, dead, released, ...).

        One coroutine from the claimed row to its recorded outcome: this runs once per
        event, and every call layer here was a measurable share of a no-op drain.
        """
        try:
            if self._is_stopping():
                self.release(row)
                return "released"
            if not self._leases.startable(row, time.monotonic() + self._lease_margin):
                return self.lapsed(row)
            if len(row.payload) > _THREAD_DECODE_CHARS:  # `row.size`, without the call
                event = await self._event_in_thread(row)
            else:
                event = self._event(row, self._decode)
            if event is None:
                return "retry"
            handler = self._handlers.get(row.topic) or self._handlers[ALL_TOPICS]
            timeout = handler.timeout if handler.timeout is not None else self._handler_timeout
            observers = self._observers
            observing = observers.per_event  # a plain attribute, kept fresh once per claim
            token = observers.handler_started(event) if observing else None
            started = time.perf_counter() if observing else 0.0
            outcome = "done"
            error: BaseException | None = None
            try:
                if timeout is None:
                    await handler.func(event)
                else:
                    with anyio.fail_after(timeout) as scope:
                        await handler.func(event)
                    overran(scope, timeout)
            except Retry as exc:
                error = exc
                outcome = self._fail(row, exc, Outcome.RETRY, handler, delay=exc.delay)
            except Dead as exc:
                error = exc
                outcome = self._fail(row, exc, Outcome.DEAD, handler)
            except anyio.get_cancelled_exc_class() as exc:
                error = exc
                if self._is_hurried():
                    outcome = "released"
                    self.release(row)
                    raise
                # the handler raised CancelledError on its own: a failure like any other
                outcome = self._fail(row, exc, Outcome.RETRY, handler)
            except Exception as exc:
                error = exc
                outcome = self._fail(row, exc, Outcome.RETRY, handler)
            except BaseException as exc:
                # SystemExit, KeyboardInterrupt and friends: settle this event, then stop
                # the consumer gracefully and re-raise from run()
                error = exc
                outcome = self._fail(row, exc, Outcome.RETRY, handler)
                logger.error(
                    "handler raised %s; stopping the consumer",
                    exception_repr(exc),
                    extra={"event_id": row.id, "topic": row.topic, "attempt": row.attempts},
                )
                self._on_fatal(exc)
            else:
                # the usual case (no claim ever replaced another) costs one attribute
                leases = self._leases
                if not leases.replaced or leases.holds(row) or not self._superseded(row):
                    self._settler.done(row.id, row.attempts, row.topic)
                self._stats.done += 1
                if observing:
                    observers.settled(row.topic, "done")
            finally:
                if observing:
                    seconds = time.perf_counter() - started
                    shown = "dead" if outcome == "dead_block" else outcome
                    observers.handler_finished(event, token, shown, seconds, error)
            return outcome
        finally:  # `_finish`, inlined
            self._leases.finish(row)
            self._stats.in_flight -= 1
            self._on_finished()

    async def _event_in_thread(self, row: ClaimedRow) -> Event | None:
        try:
            payload = await anyio.to_thread.run_sync(self._decode, row.payload)
        except anyio.get_cancelled_exc_class():
            self.release(row)
            raise
        except BaseException as exc:
            self.undecodable(row, exc)
            return None
        return self._event(row, lambda _: payload)

    def undecodable(self, row: ClaimedRow, exc: BaseException) -> str:
        """Fail ``row``, whose payload or headers the decoder refused (a retry); one
        that raised ``SystemExit``, ``KeyboardInterrupt`` or another `BaseException`
        also stops the consumer gracefully, as a handler raising it does."""
        shown = self._fail(row, exc, Outcome.RETRY, None)
        if not isinstance(exc, Exception):
            logger.error(
                "the decoder raised %s on event %d; stopping the consumer",
                exception_repr(exc),
                row.id,
                extra={"event_id": row.id, "topic": row.topic, "attempt": row.attempts},
            )
            self._on_fatal(exc)
        return shown

    def _event(self, row: ClaimedRow, decode: Decoder) -> Event | None:
        """The handler's view of ``row``, or ``None`` (recorded as a failure) if its
        payload or headers cannot be decoded."""
        try:
            payload = decode(row.payload)
            headers = decode_json(row.headers) if row.headers != "{}" else {}
        except anyio.get_cancelled_exc_class():
            self.release(row)
            raise
        except BaseException as exc:
            self.undecodable(row, exc)
            return None
        if not isinstance(headers, dict):
            # only a raw SQL producer can store this; no retry will change it
            self._fail(row, ValueError("headers must be a JSON object"), Outcome.DEAD, None)
            return None
        return build_event(
            row.id,
            row.topic,
            payload,
            row.dedupe_key,
            headers,
            row.attempts,
            row.max_attempts,
            from_epoch(row.created_at),
            row.message_id,
            row.ordering_key,
            row.claimed_before(),
            row.group,
        )

    def release(self, row: ClaimedRow) -> None:
        """Back to retry at once: the consumer stopped before the handler finished."""
        self._stats.released += 1
        if self._observers:
            self._observers.settled(row.topic, "released")
        if self._superseded(row):
            return
        self._settler.record(
            Settlement(
                row.id,
                row.attempts,
                Outcome.RELEASED,
                0.0,
                "released: the consumer stopped before the handler finished",
            )
        )

    def _fail(
        self,
        row: ClaimedRow,
        exc: BaseException,
        outcome: Outcome,
        handler: Handler | None,
        *,
        delay: float | None = None,
    ) -> str:
        """Record a failed attempt; return the outcome it leads to (retry or dead)."""
        if delay is None:
            policy = (handler.retry if handler is not None else None) or self._retry
            delay = policy.delay(row.attempts)
        dead = outcome is Outcome.DEAD or row.attempts >= row.max_attempts
        if handler is None:
            handler = self._handlers.get(row.topic) or self._handlers.get(ALL_TOPICS)
        blocks = row.ordering_key is not None and handler is not None and handler.on_dead == "block"
        if dead:
            self._stats.dead += 1
        else:
            self._stats.retried += 1
        if isinstance(exc, (Retry, Dead)):
            error = safe_text(f"{type(exc).__name__}: {_reason(exc)}", MAX_ERROR_CHARS)
        else:
            error = describe(exc)
        summary = safe_text(describe_exception(exc), 500)
        then = (
            f"dead after {row.attempts}/{row.max_attempts} attempts"
            + (f"; key {row.ordering_key!r} stays blocked" if blocks else "")
            if dead
            else f"retry in {delay:.1f}s"
        )
        extra = {
            "event_id": row.id,
            "topic": row.topic,
            "attempt": row.attempts,
            "max_attempts": row.max_attempts,
            "outcome": "dead" if dead else "retry",
            "retry_in": None if dead else round(delay, 3),
        }
        if isinstance(exc, Retry) and not dead:
            logger.info("event %d (%s): %s; %s", row.id, row.topic, summary, then, extra=extra)
        else:
            logger.warning(
                "event %d (%s) attempt %d/%d failed: %s; %s",
                row.id,
                row.topic,
                row.attempts,
                row.max_attempts,
                summary,
                then,
                extra=extra,
            )
        if not self._superseded(row):
            self._settler.record(Settlement(row.id, row.attempts, outcome, delay, error, blocks))
            self._settler.tallies.failed(row.topic, dead)
        if self._observers:
            self._observers.settled(row.topic, "dead" if dead else "retry")
        # a dead event of a key that blocks stops its run, as a retry does
        return ("dead_block" if blocks else "dead") if dead else "retry"
