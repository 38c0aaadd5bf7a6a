"""The claim loop: claim rows sized to the free handler slots, hand them to workers.

The pure parts are in `claim_window` (no I/O, unit-tested): where the next claim starts
(`Marks`: each topic's low mark; `ClaimWindow`: the watermark of a consumer of every
topic) and how many rows to ask for after a timeout. `Dispatcher` is the loop around
them: linger after an empty claim, advertise idleness, wait for a wake-up or the poll.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from itertools import compress
from typing import Any

import anyio
import asyncpg

from .._engine.flow import Flow
from .._sql.db import TRANSIENT_ERRORS, HeldConnection, bounded, check_permanent, pool_is_closed
from .._values.text import exception_message, exception_summary
from ..errors import OutboxError
from ..observe import Observers
from .claim_window import OPEN, Arrivals, ClaimWindow, Marks
from .groups import GROUPS_PER_CLAIM, PROBE_GROUPS, GroupCursor
from .handoff import Handoff, Run, runs_of
from .idle import declare
from .leases import Leases
from .listener import Listener
from .options import RUN_ROWS_PER_HEAD, ConsumerOptions, run_length
from .rows import ClaimedRow, ConsumerStats, getter
from .settler import Settler
from .signals import Signals, wait_any, wait_for

__all__ = ["Dispatcher", "Signals"]

logger = logging.getLogger("aiooutbox.consumer")

# After an empty claim, look again after these pauses before declaring idle, so that
# under steady load a consumer never waits on NOTIFY (and producers never pay for it).
_LINGER = (0.002, 0.004, 0.008, 0.016, 0.032)
# an idle consumer that sees a transaction holding the table's write lock looks again
_RECHECK = (0.01, 1.0)
# rows claimed ahead of the free workers: about this many seconds of work at the recent rate
_AHEAD_FOR = 0.1
# the claim's connection is kept from one claim to the next (see `HeldConnection`), and
# given back when the loop goes idle or waits this long for free slots
_HOLD_IDLE = 0.05
_IS_HEAD = getter("is_head")
_GROUP = getter("group")


class Dispatcher:
    """Claims for free slots until stopped; hands each row to the workers."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        options: ConsumerOptions,
        *,
        topics: list[str] | None,
        stats: ConsumerStats,
        leases: Leases,
        settler: Settler,
        signals: Signals,
        listener: Listener | None,
        is_stopping: Callable[[], bool],
        observers: Observers,
        flow: Flow,
    ) -> None:
        self._pool = pool
        self._conn = HeldConnection(pool, options.statement_timeout)
        self._flow = flow
        self._observers = observers
        self._o = options
        self._q = options.queries
        self._topics = topics  # None: every topic
        self._stats = stats
        self._leases = leases
        self._settler = settler
        self._signals = signals
        self._listener = listener
        self._is_stopping = is_stopping
        self.window = ClaimWindow(options.dense_claim_size)
        self.groups = GroupCursor()  # where the next claim resumes among groups
        self.marks = Marks()  # a claim of listed topics starts at their marks, not the window
        self._arrivals = Arrivals()
        self._recheck = _RECHECK[0]  # the next look while a writer's transaction is open
        # a claim failed (its reply may have been lost), or we just started (a consumer
        # restarted under a fixed worker_id may have left rows behind)
        self._reconcile = True
        self._warned_down: float | None = None  # the listener outage last warned about
        self._claim_rows = 0  # rows of recent claims, their heads' runs included
        self._heads = 1  # heads of the last claim that found any (`run_length`)

    @property
    def _listening(self) -> bool:
        return self._listener is not None and self._listener.connected

    async def run(self, handoff: Handoff[Run]) -> None:
        try:
            await self._run(handoff)
        finally:
            with anyio.CancelScope(shield=True):
                await self._conn.release()

    async def _run(self, handoff: Handoff[Run]) -> None:
        o, s, signals = self._o, self._stats, self._signals
        backoff = 0.05
        # the wait after an advertisement failed, doubling up to the poll interval
        unadvertised = first_unadvertised = min(0.05, o.poll_interval)
        linger = 0
        idle = False
        advertised_on = -1  # the listener connection (reconnect count) idle was declared on
        advertised_at = -math.inf  # when the idle advertisement was last written
        advertised_flow = self._flow.version  # the flow controls it was written under
        full = False
        while not self._is_stopping():
            # claim ahead of the free workers (`prefetch`), as many rows as the recent
            # rate gets through in _AHEAD_FOR: the next claim's round trip then overlaps
            # the handlers instead of idling them, and no row waits long for a worker
            ahead = min(o.ahead, int(self._arrivals.rate(time.monotonic()) * _AHEAD_FOR))
            if ahead:
                most = min(o.concurrency + ahead, o.claim_size + ahead)
                if o.batch_size is not None:
                    most = min(most, o.batch_size)
                want = min(o.concurrency + ahead - s.in_flight, most)
                # after a full claim, claim again once half of what we may hold is free:
                # the rows still held cover its round trip (a claim at once would take
                # only what the handlers freed meanwhile, a few rows each time)
                refill = max(1, o.claim_size // 4, most // 2)
            else:
                want = min(o.concurrency - s.in_flight, o.claim_size)
                refill = max(1, o.claim_size // 4)
            if self._settler.backlog > o.max_unwritten(self._claim_rows):
                await self._conn.release()  # the settler may need one to catch up
                await wait_for(self._settler.wait_flushed(), o.poll_interval)
                continue
            if want <= 0 or (full and want < refill):
                # a backlog is waiting: claim again as soon as enough slots free, when
                # no more than this many rows are in flight
                signals.slots_at = o.concurrency + ahead - (refill if full else 1)
                signals.clear_slot_freed()
                try:
                    if self._conn.held:
                        await wait_for(signals.slot_freed.wait(), _HOLD_IDLE)
                        if signals.slot_freed.is_set():
                            continue
                        await self._conn.release()  # slow handlers: no claim for a while
                    await signals.slot_freed.wait()
                finally:
                    signals.slots_at = math.inf
                continue
            signals.clear_wake()
            signals.clear_listener_back()
            try:
                if self._reconcile:
                    await self.take_back_orphans("whose claim reply was lost")
                rows = await self._claim(want, handoff)
            except TRANSIENT_ERRORS as exc:
                if pool_is_closed(self._pool):
                    raise OutboxError(
                        "the asyncpg pool was closed under a running consumer"
                    ) from exc
                check_permanent(exc, "claiming events")
                self._reconcile = True
                self._claim_failed(exc, want, backoff)
                # a listener that reconnects meanwhile shows the server is back: claim then
                await wait_any(
                    (signals.stop, signals.listener_back), backoff * (0.5 + random.random())
                )
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.05
            # the handlers started first (in `_claim`): the advert only gates NOTIFY, and
            # a stale one for a round trip costs at most one extra notification
            if rows and idle and self._arrivals.dense(time.monotonic()):
                # dense traffic: spare producers NOTIFY. While it is sparse the
                # advertisement stays, saving two round trips per wake-up, and an
                # event that commits meanwhile wakes us instead of waiting a linger.
                idle = False
                await self._declare(busy=True)
            heads = sum(map(_IS_HEAD, rows))
            self._heads = heads or self._heads  # for the next claim's `run_length`
            # full: the heads (runs ride along beyond them) took every row asked for
            full = heads >= min(want, self.window.size)
            if self._flow.more:  # a limited topic gave all its share: it may have more
                self._flow.more = False
                full = True
            if full:
                linger = 0
                continue
            if rows:
                linger = 0
            if self._flow.active and (soon := self._flow.tokens_soon(signals.wakes)) is not None:
                await wait_for(signals.wake.wait(), soon)  # not idle: tokens would pile up
                continue
            if linger < len(_LINGER) and self._arrivals.dense(time.monotonic()):
                await wait_for(signals.wake.wait(), _LINGER[linger])
                linger += 1
                continue
            listener = self._listener
            if idle and listener is not None and listener.reconnects != advertised_on:
                # the listener reconnected: after a server crash the unlogged idle table
                # is empty, so producers would notify nobody until we advertise again
                idle = False
            # claims work again but the listener is still down (it may sit in its
            # reconnect backoff): idle now and an event committed meanwhile waits for the
            # poll. Have it reconnect at once and wait for that; its reconnect wakes us for
            # one more claim, then we advertise with it up.
            if (
                o.listen
                and listener is not None
                and not listener.connected
                and await self._listener_back(listener)
            ):
                continue
            # leaving the fast path: the next claim starts at the oldest entry or new marks
            self.window.force_full()
            self.marks.renew()
            self._flow.forget_topics()
            await self._conn.release()
            advertising = (
                o.listen
                and self._listening
                and (
                    not idle
                    or time.monotonic() - advertised_at > o.poll_interval / 2
                    or advertised_flow != self._flow.version
                )
            )
            if advertising:
                # advertise, then look once more: an insert that committed before the
                # advertisement saw no idle consumer and sent no notification. Refresh
                # it well before it expires (it lives 2 x poll_interval + 5 s), and when
                # a pause changed the topics it names.
                was_idle, advertised_flow = idle, self._flow.version
                idle = await self._declare(busy=False)
                if idle:
                    advertised_on = listener.reconnects if listener is not None else -1
                    advertised_at = time.monotonic()
                    unadvertised = first_unadvertised
                    if not was_idle:
                        continue
                else:
                    # not advertised (the database did not answer): no producer will
                    # notify us, so look again after a backoff, not a poll interval
                    await wait_any(
                        (signals.stop, signals.wake), unadvertised * random.uniform(0.5, 1.5)
                    )
                    unadvertised = min(unadvertised * 2, o.poll_interval)
                    continue
            await wait_for(signals.wake.wait(), await self._idle_timeout(idle))

    async def _listener_back(self, listener: Listener) -> bool:
        """Ask the listener to reconnect now and wait for it (a connect's worth of time);
        say once per outage when it is not back."""
        tried = listener.reconnect_now()
        # a connect's worth of time (its timeout), or until a stop
        await wait_any((tried, self._signals.stop), self._o.statement_timeout)
        if listener.connected:
            return True
        if self._is_stopping():
            return False
        if self._warned_down != listener.down_since:
            self._warned_down = listener.down_since
            logger.warning(
                "claims work but the listener is still down; until it reconnects, new "
                "events wait for the poll (poll_interval=%.1fs)",
                self._o.poll_interval,
            )
        return False

    def _claim_failed(self, exc: BaseException, want: int, backoff: float) -> None:
        if isinstance(exc, (TimeoutError, asyncpg.QueryCanceledError)):
            before = min(want, self.window.size)
            after = self.window.timed_out()
            logger.warning(
                "claim of up to %d row(s) got no answer within statement_timeout (%.1fs); "
                "claiming at most %d next (large payloads or a slow server: raise "
                "statement_timeout or lower max_claim_bytes); retrying in %.2fs",
                before,
                self._o.statement_timeout,
                after,
                backoff,
                extra={"claim_size": after},
            )
            return
        logger.warning("claim failed (%s); retrying in %.2fs", exception_summary(exc), backoff)

    async def _claim(self, want: int, handoff: Handoff[Run]) -> list[ClaimedRow]:
        """Claim up to ``want`` rows and hand them to the workers; return them.

        Limited topics (flow control) and the open topics each on a share of ``want``,
        taking turns (`Turns`), on one connection, all within `max_claim_bytes`: the
        limited ones first, then the open ones on the rows and bytes left, unless the
        open ones come first in turn."""
        window = self.window
        started = time.monotonic()
        want = min(want, window.size)
        flow = self._flow
        topics = flow.open_topics()
        claim_open = topics != [] and not flow.open_quiet(started, self._signals.wakes)
        shares = flow.shares(want, flow.due(started), claim_open) if flow.active else {}
        open_first = next(iter(shares), None) == OPEN
        limited = {t: n for t, n in shares.items() if t != OPEN}
        if not (limited or claim_open):
            return []
        full = window.next_is_full(started)
        taken: list[ClaimedRow] = []
        rows: list[ClaimedRow] = []
        size = 0  # stored payload bytes of the limited rows
        opened = False
        # shielded: a claim the server committed is always read and handed out, so a
        # fast stop during a claim releases its rows instead of stranding them for a
        # lease (the wait is bounded by the acquire and statement timeouts); from the
        # connection's taking until they are, the settler keeps the writes that end
        with anyio.CancelScope(shield=True):
            async with self._conn.use() as conn:
                with self._settler.claiming():
                    if claim_open and topics is None and flow.lists_topics:
                        topics = await flow.listed(conn, started)
                        claim_open = topics != []
                    if claim_open and open_first:
                        opened = True
                        rows = await self._claim_open(conn, topics, shares[OPEN], 0, full)
                    if limited:
                        taken, size = await flow.claim(conn, limited, rows, self.groups)
                        self._stats.claims += 1
                    rest = want - len(taken)
                    if claim_open and not opened and rest > 0 and size < self._o.max_claim_bytes:
                        rows, opened = await self._claim_open(conn, topics, rest, size, full), True
                    ended = time.monotonic()
                    if self._observers:  # first: they say here whether they want these events
                        self._observers.claimed(len(taken) + len(rows), ended - started)
                    if taken:
                        self._hand_out(taken, handoff, started, first=True)
                    if rows:
                        self._hand_out(rows, handoff, started)
        if opened:
            self._stats.claims += 1
            flow.opened(len(rows))
            ats = [r.available_at for r in rows] if topics is None else []  # its watermark
            window.claimed(ats, full=full and topics is None, started=started, ended=ended)
            self.groups.served(set(map(_GROUP, compress(rows, map(_IS_HEAD, rows)))))  # in C
        # the largest recent claim (a small last one does not pause a big one's outcomes)
        self._claim_rows = max(len(taken) + len(rows), self._claim_rows * 3 // 4)
        return taken + rows if taken else rows

    async def _claim_open(
        self, conn: asyncpg.Connection, topics: list[str] | None, want: int, used: int, full: bool
    ) -> list[ClaimedRow]:
        args: tuple[Any, ...] = (
            self._o.worker_id,
            self._o.lease_timeout,
            topics,
            want,
            self._o.max_claim_bytes - used,  # the limited topics' rows took ``used``
            # an ordered key's events behind its head, run in order by one worker
            run_length(want, self._heads),
            # every run together: four times as many rows as heads (a run occupies one
            # worker, so runs add rows to a claim, not concurrency)
            RUN_ROWS_PER_HEAD * want,
        )
        if topics is not None:  # from each topic's low mark (`Marks`)
            sql, more, marked = self.marks.claim(self._q, topics, time.monotonic())
        else:  # every topic: from the watermark, now and then from the start
            sql, more, marked = self._q.claim_in_turn, (None, None), False
            more = more if full else self.window.watermark or more
        args += (*more, self.groups.value, GROUPS_PER_CLAIM)  # resuming among groups
        if marked and topics is not None:  # each topic's sweep of its groups goes on
            args += (*self.marks.sweeps(topics), PROBE_GROUPS)
        records = await conn.fetch(sql, *args, timeout=self._o.statement_timeout)
        if marked and topics is not None:  # the last record holds the new marks
            self.marks.update(topics, *records.pop()[2:4])
        return ClaimedRow.from_records(records)

    async def take_back_orphans(self, why: str) -> None:
        """Release rows that carry our worker id but that we do not hold.

        A claim whose reply was lost (a dropped connection, a timeout after the commit)
        leaves its rows ``processing`` under our id; without this they would wait for
        their lease to expire. Fenced by ``locked_by``: rows another consumer holds are
        never touched. Runs between claims (no claim of ours is in flight), and once
        more when the consumer stops; rows we hold or whose outcome waits in the
        settler are excluded.
        """
        released = await bounded(
            self._pool,
            "fetch",
            self._q.release_orphans,
            self._o.worker_id,
            # held, or settled here but not yet written: neither is an orphan
            self._leases.ids() + self._settler.unsettled_ids(),
            timeout=self._o.statement_timeout,
        )
        self._reconcile = False
        if released:
            logger.warning(
                "released %d event(s) claimed by this consumer %s",
                len(released),
                why,
                extra={"event_ids": [r[0] for r in released][:1000]},
            )

    def _hand_out(
        self,
        rows: list[ClaimedRow],
        handoff: Handoff[Run],
        started: float,
        *,
        first: bool = False,
    ) -> None:
        """Record and hand out claimed rows; ``first``: ahead of rows claimed earlier (a
        limited topic's rows count against its limit until they run)."""
        self._arrivals.add(time.monotonic(), len(rows))
        self._stats.claimed += len(rows)
        self._stats.in_flight += len(rows)
        # the claim set each lease to end at its own start + lease_timeout, which came
        # after `started`: this end is never later than the database's
        self._leases.hold_all(rows, started + self._o.lease_timeout)
        self._settler.tallies.claims(rows)  # the lag at claim, for the dashboard's charts
        # a lapsed claim's outcome of a row claimed again is dropped unwritten; if it may
        # have settled this claim, the row is given up as a lapsed one is (`drop_stale`)
        for row in self._settler.stale_claims(rows):
            self._leases.lost(row)
        if first:
            handoff.put_first_all(runs_of(rows))
            return
        handoff.put_all(runs_of(rows))

    async def _idle_timeout(self, advertised: bool) -> float:
        """Jittered poll interval, shortened to when the next delayed event becomes due,
        and while a transaction that may hold an un-notified insert is still open."""
        timeout = self._o.poll_interval * random.uniform(0.8, 1.2)
        flow = self._flow
        if flow.active:
            timeout = min(timeout, flow.next_due(time.monotonic()))
        topics = flow.quiet_topics() if flow.active else self._topics
        try:
            args: tuple[Any, ...] = () if topics is None else self.marks.probe_args(topics)
            sql = self._q.idle_probe_any if topics is None else self._q.idle_probe_marked
            if topics is None and (held := flow.held_back()):
                sql, args = flow.queries.idle_probe_except, (held,)
            probe = await bounded(
                self._pool, "fetchrow", sql, *args, timeout=self._o.statement_timeout
            )
        except TRANSIENT_ERRORS as exc:
            check_permanent(exc, "looking for delayed events")
            return timeout
        due: float | None = probe["due"]
        if due is not None:
            timeout = min(timeout, max(due, 0.0) + 0.001)
        # The wake-up trigger looks for idle consumers when the INSERT runs, not at its
        # COMMIT: a producer that inserted before we were advertised and commits after
        # our last claim notifies nobody. Its transaction holds the table's write lock
        # until then, so while such a lock is held, look again soon.
        if advertised and probe["writers"]:
            timeout = min(timeout, self._recheck)
            self._recheck = min(self._recheck * 2, _RECHECK[1])
        else:
            self._recheck = _RECHECK[0]
        return timeout

    async def _declare(self, *, busy: bool) -> bool:
        """Advertise this consumer as idle (or withdraw it); return whether it is idle."""
        try:
            await declare(self._pool, self._o, self._flow.advertised(), busy=busy)
        except TRANSIENT_ERRORS as exc:
            check_permanent(exc, "advertising idleness")
            logger.debug("idle advertisement failed: %s", exception_message(exc))
            return busy
        return not busy
