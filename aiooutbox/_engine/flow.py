"""A consumer's side of flow control: its view of the topic controls, and the claims
of its limited topics.

The database is the authority (migration 0010): the open claim leaves out paused and
limited topics whatever a consumer believes, and `<table>_claim_limited` decides how
many rows a limited topic may give. This view only decides what to ask for and when:

- it is read at start, again when a change is announced (the listener hears the
  notification `FLOW_NOTICE`), and every `REFRESH` seconds in case one was missed;
- paused topics are not claimed, not advertised as idle, and their due rows do not cut
  the idle wait short;
- a limited topic is claimed on its own statement, at most its share of a claim (the
  claim's rows split among the limited topics due and the open ones, in turn: `Turns`).
  When it gave fewer rows than asked, it is asked again only when that can help: at
  max_running, once the outcome of a row of it this consumer held is written, or after
  `RUNNING_RECHECK` (a slot another consumer freed); out of tokens, when the next one
  is due; with nothing claimable, after a wake-up or `EMPTY_RECHECK`. Asking them
  again takes at most `_RECHECK_SHARE` of the time: with hundreds of topics held back,
  those rechecks come less often;
- a consumer of every topic claims, while some topics are held, the topics a statement
  of their own found with events, held ones left out (`TopicList`).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import asyncpg
from anyio.abc import TaskStatus

from .._sql.db import TRANSIENT_ERRORS, PermanentDatabaseError, bounded, check_permanent
from .._sql.flow import ALL_TOPICS, FlowQueries, flow_queries
from .._values.text import exception_summary
from .claim_window import OPEN, TopicList, Turns
from .groups import GROUPS_PER_CLAIM, GroupCursor
from .leases import Leases
from .options import ConsumerOptions
from .rows import ClaimedRow, epoch_seconds

__all__ = ["EMPTY_RECHECK", "REFRESH", "RUNNING_RECHECK", "TOKENS_SOON", "Flow"]

logger = logging.getLogger("aiooutbox.consumer")

# the longest a consumer goes without re-reading the controls (a missed notification)
REFRESH = 1.0
_START_TRIES = 5  # first reads of the controls before a start fails (within a second)
# a limited topic at its max_running: look again this often for a slot another
# consumer freed (slots this consumer frees are seen at once)
RUNNING_RECHECK = 0.1
# a rate-limited topic whose next token comes within this many seconds is waited for
# without going idle (its round trips would let the tokens pile up past the burst)
TOKENS_SOON = 0.25
# a limited topic that had nothing to claim: asked again after a wake-up, or after this
# long (a busy consumer is not advertised as idle, so no notification comes for it)
EMPTY_RECHECK = 0.25
# ... or later, when asking the topics held back again takes more than this share of
# the time (hundreds of limited topics at their max_running)
_RECHECK_SHARE = 0.03
_MEASURED = 32  # what asking a topic takes is read from claims asking at least this many
_COLUMNS = 12  # the claim's columns; `held`, `retry_in` and `bytes` follow


@dataclass(frozen=True, slots=True)
class Control:
    paused: bool
    max_running: int | None
    rated: bool

    @property
    def limited(self) -> bool:
        return not self.paused and (self.max_running is not None or self.rated)


@dataclass(slots=True)
class _Held:
    why: str  # 'running', 'rate', 'empty', 'paused', 'open'
    until: float  # monotonic time after which the topic is asked again
    wakes: int  # the wake-up count when it was held ('empty': any later wake-up ends it)


class Flow:
    """The controls as this consumer last read them, and its limited topics' state."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        options: ConsumerOptions,
        topics: list[str] | None,
        leases: Leases,
        unsettled: Callable[[], list[int]],
        wakes: Callable[[], int],
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._pool = pool
        self._o = options
        self._fq = flow_queries(options.schema, options.table)
        self._topics = topics  # None: every topic
        self._leases = leases
        self._unsettled = unsettled  # rows whose outcome is recorded but not yet written
        self._wakes = wakes  # how many wake-ups the consumer has had
        self._on_change = on_change
        self._controls: dict[str, Control] = {}
        self.paused_all = False
        self.version = 0  # bumped whenever the controls read differ
        self._held: dict[str, _Held] = {}
        self._mine: dict[str, dict[int, ClaimedRow]] = {}  # max_running topic -> {id: claim}
        # a topic at its max_running waits for a row this consumer holds: its outcome
        # is worth writing at once (read for every finished event)
        self.slot_wait = False
        self.more = False  # the last claim took all it asked of a limited topic
        # waiting for tokens: the open topics had nothing at (wake-ups, time); they are
        # claimed again after a wake-up or `TOKENS_SOON` seconds
        self._open_quiet: tuple[int, float] | None = None
        self._open_found = 0  # rows the last claim of the open topics took
        self._turns = Turns()
        self._limited: tuple[int, list[str]] = (-1, [])  # (version, the limited topics)
        self._asking = 0.0  # what asking a limited topic took, when a claim took nothing
        self._listed = TopicList()  # every topic's consumer: the open topics with events
        self._stale = anyio.Event()

    # -- reading the controls ----------------------------------------------------------
    def notice(self) -> None:
        """A change was announced: read the controls again at once."""
        self._stale.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Read the controls now (a failure here fails the start), then keep them fresh.

        A connection dropped during the start (a backend terminated, a failover) is
        tried again a few times, within a second, before it fails the start: a
        consumer started while its database drops connections must not die of it."""
        for attempt in range(_START_TRIES):
            try:
                await self._first_refresh()
                break
            except TRANSIENT_ERRORS as exc:
                if attempt == _START_TRIES - 1:
                    raise
                logger.debug("reading the topic controls failed (%s); trying again", exc)
                await anyio.sleep(0.05 * 2**attempt)
        task_status.started()
        while True:
            with anyio.move_on_after(REFRESH * random.uniform(0.8, 1.0)):
                await self._stale.wait()
            self._stale = anyio.Event()
            try:
                await self.refresh()
            except TRANSIENT_ERRORS as exc:
                check_permanent(exc, "reading the topic controls")
                logger.debug("reading the topic controls failed: %s", exc)

    async def _first_refresh(self) -> None:
        """`refresh`, with a missing grant or a permanent error told apart at once."""
        try:
            await self.refresh()
        except asyncpg.InsufficientPrivilegeError as exc:
            # the grant added with flow control: name the statement that fixes it
            role = await bounded(
                self._pool,
                "fetchval",
                "SELECT quote_ident(current_user)",
                timeout=self._o.statement_timeout,
            )
            grant = f"GRANT SELECT, UPDATE ON {self._fq.controls_table} TO {role};"
            raise PermanentDatabaseError(
                f"reading the topic controls failed: {exception_summary(exc)}; run {grant}"
            ) from None
        except TRANSIENT_ERRORS as exc:
            check_permanent(exc, "reading the topic controls")
            raise

    async def refresh(self) -> None:
        rows = await bounded(
            self._pool, "fetch", self._fq.controls, timeout=self._o.statement_timeout
        )
        controls = {r[0]: Control(r[1], r[2], r[3]) for r in rows}
        paused_all = ALL_TOPICS in controls and controls.pop(ALL_TOPICS).paused
        if controls == self._controls and paused_all == self.paused_all:
            return
        changed = {
            t
            for t in controls.keys() | self._controls.keys()
            if controls.get(t) != self._controls.get(t)
        }
        self._controls, self.paused_all = controls, paused_all
        self.version += 1
        for topic in changed:
            self._held.pop(topic, None)
            if (c := controls.get(topic)) is None or c.max_running is None:
                self._mine.pop(topic, None)
        self.slot_wait = self.waiting_for_slot()
        if changed or paused_all:
            logger.info(
                "flow controls changed: paused %s; limited %s",
                "every topic" if paused_all else sorted(t for t, c in controls.items() if c.paused),
                sorted(t for t, c in controls.items() if c.limited),
                extra={"worker_id": self._o.worker_id},
            )
        if self._on_change is not None:
            self._on_change()

    @property
    def queries(self) -> FlowQueries:
        return self._fq

    def waiting_for_slot(self) -> bool:
        """Whether a limited topic waits for a row this consumer holds to finish."""
        return any(h.why == "running" and self._mine.get(t) for t, h in self._held.items())

    # -- what to claim -----------------------------------------------------------------
    def _scope(self, topic: str) -> bool:
        return self._topics is None or topic in self._topics

    @property
    def active(self) -> bool:
        """Whether any control applies to this consumer's topics."""
        return self.paused_all or any(self._scope(t) for t in self._controls)

    def open_topics(self) -> list[str] | None:
        """Topics for the open claim: None for every topic (the database leaves the held
        ones out), [] for none."""
        if self.paused_all:
            return []
        if self._topics is None or not self._controls:
            return self._topics
        return [t for t in self._topics if t not in self._controls]

    def limited(self) -> list[str]:
        if self.paused_all:
            return []
        if self._limited[0] != self.version:  # sorted once per change, not every claim
            found = sorted(t for t, c in self._controls.items() if c.limited and self._scope(t))
            self._limited = (self.version, found)
        return self._limited[1]

    def due(self, now: float) -> list[str]:
        """Limited topics worth asking now."""
        return [t for t in self.limited() if self._due(t, now)]

    def _due(self, topic: str, now: float) -> bool:
        held = self._held.get(topic)
        if held is None or now >= held.until:
            return True
        if held.why == "empty":
            return self._wakes() != held.wakes
        if held.why == "running" and self._finished(topic):
            self.slot_wait = self.waiting_for_slot()
            return True
        return False

    def _finished(self, topic: str) -> int:
        """Forget the rows of ``topic`` this consumer held whose outcome is written (their
        slots are free); return how many."""
        mine = self._mine.get(topic)
        if not mine:
            return 0
        unwritten = set(self._unsettled())
        holds = self._leases.holds
        finished = [i for i, row in mine.items() if not holds(row) and i not in unwritten]
        for i in finished:
            del mine[i]
        return len(finished)

    def next_due(self, now: float) -> float:
        """Seconds until a held limited topic is worth asking again (inf: none is)."""
        waits = [
            h.until - now
            for t, h in self._held.items()
            if h.why in ("running", "rate")
            and t in self._controls
            and self._controls[t].limited
            and self._scope(t)
        ]
        return max(0.0, min(waits)) if waits else math.inf

    def tokens_soon(self, wakes: int) -> float | None:
        """Seconds until the next token of a rate-limited topic out of them, if that is
        within `TOKENS_SOON` (the open topics are then left alone until it or a wake-up)."""
        now = time.monotonic()
        waits = [
            h.until - now
            for t, h in self._held.items()
            if h.why == "rate" and t in self._controls and self._controls[t].limited
        ]
        soon = max(0.0, min(waits)) if waits else math.inf
        if soon >= TOKENS_SOON:
            return None
        if not self._open_found and self._open_quiet is None:
            self._open_quiet = (wakes, now)
        return soon

    def open_quiet(self, now: float, wakes: int) -> bool:
        """Whether to leave the open topics out of this claim (see `tokens_soon`)."""
        quiet = self._open_quiet
        return quiet is not None and quiet[0] == wakes and now - quiet[1] < TOKENS_SOON

    def opened(self, rows: int) -> None:
        """The open topics were claimed: ``rows`` came."""
        self._open_quiet = None
        self._open_found = rows
        self._turns.served(OPEN)

    def quiet_topics(self) -> list[str] | None:
        """Topics whose due rows should cut an idle wait short: the open ones and the
        limited ones waiting for rows (None: every topic but `held_back`)."""
        if self.paused_all:
            return []
        if self._topics is None:
            return None
        return [t for t in self._topics if t not in self.held_back()]

    def held_back(self) -> list[str]:
        """Topics whose due rows must not end an idle wait: paused, or at a limit."""
        held = [t for t, c in self._controls.items() if c.paused]
        return held + [
            t
            for t, h in self._held.items()
            if h.why in ("running", "rate") and t in self._controls and self._controls[t].limited
        ]

    def advertised(self) -> list[str] | None:
        """Topics to advertise as idle for: not the paused ones (None: every topic)."""
        if self.paused_all:
            return []
        if self._topics is None:
            return None
        return [t for t in self._topics if not ((c := self._controls.get(t)) and c.paused)]

    # -- claiming limited topics ---------------------------------------------------------
    def shares(self, want: int, limited: list[str], open_topics: bool) -> dict[str, int]:
        """Rows to ask of each limited topic and of the open ones (`OPEN`), ``want`` in
        all, in the order to serve them (`Turns`)."""
        return self._turns.split(want, limited, open_topics)

    async def claim(
        self,
        conn: asyncpg.Connection,
        shares: dict[str, int],
        claimed: list[ClaimedRow],
        groups: GroupCursor,
    ) -> tuple[list[ClaimedRow], int]:
        """Claim up to ``shares[topic]`` rows of each topic (heads only), in that order,
        with at most `max_claim_bytes` of stored payloads in all, the rows ``claimed``
        already included; return them and their bytes."""
        o = self._o
        topics = list(shares)
        started = time.monotonic()
        records = await conn.fetch(
            self._fq.claim_limited_in_turn,
            o.worker_id,
            o.lease_timeout,
            topics,
            list(shares.values()),
            o.max_claim_bytes,
            [r.id for r in claimed],
            groups.value,
            GROUPS_PER_CLAIM,
            timeout=o.statement_timeout,
        )
        now = time.monotonic()
        rows: list[ClaimedRow] = []
        size = 0
        if len(topics) >= _MEASURED and all(r[0] is None for r in records):
            self._asking = (now - started) / len(topics)  # asked, nothing given
        # topics held back are asked again after their recheck, or once asking all the
        # limited topics again takes at most `_RECHECK_SHARE` of the time (but within
        # `REFRESH`); together (one jitter for all): in one claim, not one each
        later = min(self._asking * len(self.limited()) / _RECHECK_SHARE, REFRESH)
        jitter = random.uniform(0.8, 1.2)
        for topic in topics:
            self._held.pop(topic, None)
            self._finished(topic)  # forget the rows that finished
        for r in records:
            if r[0] is not None:
                values = list(r)[:_COLUMNS]
                # as the open claim's statement reads them (`ClaimedRow`)
                values[7] = epoch_seconds(values[7])
                values[8] = epoch_seconds(values[8])
                values.append(r["grp"])
                values.append(r["redelivered"])
                row = ClaimedRow.from_record(values)
                rows.append(row)
                size += r["bytes"]
                self._turns.served(row.topic)
                c = self._controls.get(row.topic)
                if c is not None and c.max_running is not None:
                    self._mine.setdefault(row.topic, {})[row.id] = row
                continue
            why, retry_in = r["held"], r["retry_in"]
            self._turns.served(r[1])
            if why == "rate":
                until = now + max(float(retry_in or 0.0), 0.001)
            elif why == "running":
                until = now + max(RUNNING_RECHECK, later) * jitter
            elif why == "empty":
                until = now + max(EMPTY_RECHECK, later)
            else:  # 'open' or 'paused': our view is stale
                until = now + REFRESH
                self._stale.set()
            self._held[r[1]] = _Held(why, until, self._wakes())
        # a topic not held gave all it was asked, or the byte cap cut it: it may have more
        self.more = any(t not in self._held for t in topics)
        groups.served([r.group for r in rows])
        self.slot_wait = self.waiting_for_slot()
        return rows, size

    # -- the open topics of a consumer of every topic --------------------------------------
    @property
    def lists_topics(self) -> bool:
        """Whether the open claim of this consumer of every topic names its topics
        (`TopicList`): some topics are held back."""
        return self._topics is None and bool(self._controls) and not self.paused_all

    async def listed(self, conn: asyncpg.Connection, now: float) -> list[str]:
        """The open topics with claimable events, looked up again when stale."""
        listed = self._listed
        if listed.topics is None or listed.stale(now, self.version):
            started = time.monotonic()
            found = await conn.fetchval(self._fq.open_topics, timeout=self._o.statement_timeout)
            listed.found(list(found), self.version, started, time.monotonic())
            return list(found)
        return listed.topics

    def forget_topics(self) -> None:
        """Look the open topics up again at the next claim (after an idle wait)."""
        self._listed.forget()
