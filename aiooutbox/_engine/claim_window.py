"""The dispatcher's pure parts: where the next claim starts (`ClaimWindow`), whether
traffic is dense (`Arrivals`), how a claim is split among limited topics (`Turns`) and
when a consumer of every topic looks again for topics with events (`TopicList`). No
I/O, so unit tests drive them with made-up clocks."""

from __future__ import annotations

import json
import math
import time
from collections import deque
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._sql.statements import Queries

__all__ = ["OPEN", "Arrivals", "ClaimWindow", "Marks", "TopicList", "Turns"]

# Full claims run at least every _FULL_CLAIM_EVERY[1] s, and more often (down to
# [0] s) while they are cheap: at most _FULL_CLAIM_SHARE of the time goes to them.
_FULL_CLAIM_EVERY = (0.02, 0.25)
_FULL_CLAIM_SHARE = 0.05
# trail the oldest claimed row: producers commit out of their now() order (see
# docs/benchmarks.md, "watermark lag")
_WATERMARK_LAG = 0.010  # seconds
# A consumer of every topic, while some topics are held back (paused or limited), looks
# for the topics with claimable events at most every _TOPICS_EVERY s, and less often
# when looking costs more than _TOPICS_SHARE of the time (see `TopicList`)
_TOPICS_EVERY = 0.25
_TOPICS_SHARE = 0.03
# the open topics' turn in `Turns` (no topic is empty)
OPEN = ""


class ClaimWindow:
    """Where the next claim starts, and how many rows it may take.

    Every row that leaves 'pending' leaves a dead entry at the head of the claimable
    index until VACUUM, so a claim that always starts from the oldest entry walks more
    of them with every event handled. Most claims therefore start just before the
    ``available_at`` of the oldest row the previous claim returned; a full claim
    catches rows the watermark hides (a producer that committed late with an older
    ``now()``, rows another consumer skipped or released), so their extra delay is
    bounded by the full claims' interval: at most 250 ms, and as little as 20 ms while
    full claims are cheap.

    After a claim times out, the next ones ask for a quarter as many rows (down to
    one), then double back towards the full size with each claim that succeeds.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = limit  # rows the next claim may take, shrunk after timeouts
        self.watermark: tuple[datetime, int] | None = None
        self._full_every = _FULL_CLAIM_EVERY[1]
        self._full_at = -math.inf

    def next_is_full(self, now: float) -> bool:
        return self.watermark is None or now - self._full_at >= self._full_every

    def force_full(self) -> None:
        """The next claim starts from the oldest entry (before going idle, after trouble)."""
        self._full_at = -math.inf

    def claimed(
        self, available_ats: list[float], *, full: bool, started: float, ended: float
    ) -> None:
        """A claim ended; ``available_ats``: its rows' as epoch seconds (±inf allowed)."""
        if full:
            self._full_at = started
            low, high = _FULL_CLAIM_EVERY
            self._full_every = min(high, max(low, (ended - started) / _FULL_CLAIM_SHARE))
        self.size = min(self.limit, self.size * 2)
        if not available_ats:
            return
        first = min(available_ats)
        if not math.isfinite(first):  # a row at ±infinity: the oldest finite one, if any
            finite = [a for a in available_ats if math.isfinite(a)]
            if not finite:
                return
            first = min(finite)
        try:
            oldest = (datetime.fromtimestamp(first - _WATERMARK_LAG, UTC), 0)
        except (OverflowError, OSError, ValueError):  # a row scheduled at the dawn of time
            return
        if full or self.watermark is None or oldest > self.watermark:
            self.watermark = oldest

    def timed_out(self) -> int:
        """Shrink after a claim timeout; returns the new size."""
        self.size = max(1, self.size // 4)
        self.force_full()
        return self.size


# a position lock (migration 0019) held longer than this no longer holds the marks back:
# it is awaited, and the marks go back to it once when it is released
_AWAIT_AFTER = 0.05  # seconds
# marks are read anew (pg_locks and a probe per topic and per group of it: that claim
# costs about twice the plain one, more with many groups) at most every _MARKS_EVERY s,
# and less often while it is dear: at most _MARKS_SHARE of the time goes to it (every
# max(20 ms, 20 x the last such claim's duration)). Claims in between start at the
# marks they have, which only stay lower (they walk the dead entries of the claims made
# since). Read every 20 ms, a 50,000-event drain ran at 0.91x the code before
# (docs/benchmarks-history.md, "Low marks: how often to read them").
_MARKS_EVERY = 0.02
_MARKS_SHARE = 0.05
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class Marks:
    """Each claimed topic's live low mark, and the position locks awaited.

    A mark is a position ``(available_at, id)`` before which the topic has no claimable
    row and none can appear: the claim (`Queries.claim_marked`) starts at the lowest mark
    of its topics and returns each topic's new one, found by a probe that does not lock
    (docs/internals.md, "The hot path"). A topic without a mark (this consumer's first
    claim of it) is claimed from the start until its first mark. A topic with many
    groups gets a new mark only when a *sweep* of its groups ends: each reading probes
    at most `PROBE_GROUPS` of them (migration 0020), and the sweep goes on at the
    next. The marks are kept as the claim gave
    them: epoch microseconds (None: from the start) and an id, exact. They are read
    anew at most every max(20 ms, 20 x that claim's duration) (`claim`, `_MARKS_SHARE`);
    claims in between start at them.
    """

    grace = _AWAIT_AFTER

    def __init__(self) -> None:
        self._marks: dict[str, tuple[int | None, int]] = {}
        # each topic's sweep of its groups under way (migration 0020): the group probed
        # last, and the lowest candidate found so far (microseconds, None: -infinity; id)
        self._sweeps: dict[str, tuple[str, int | None, int]] = {}
        self.awaited: list[int] = []  # position keys (milliseconds) awaited
        self._until = -math.inf  # the marks are read anew from then on
        self._asked = 0.0  # when the claim that reads them was made
        self._server: str | None = None  # the start time of the server they were read on

    def claim(self, q: Queries, topics: list[str], now: float) -> tuple[str, tuple[Any, ...], bool]:
        """The next claim of ``topics``: its statement, its arguments after the claim's
        seven, and whether it returns new marks (`update`). That is
        `Queries.claim_marked` when the marks are due or a topic has none (or one from
        the start), else `Queries.claim_in_turn` from the lowest of them. Either takes
        the group cursor and the groups per claim after these."""
        marks = [self._marks.get(t) for t in topics]
        if now < self._until and all(
            (m is not None and m[0] is not None) or t in self._sweeps
            for t, m in zip(topics, marks, strict=True)
        ):
            if any(m is None or m[0] is None for m in marks):
                # a topic's first sweep of its groups is under way: from the start
                return q.claim_in_turn, (None, None), False
            us, id_ = min((m[0], m[1]) for m in marks if m is not None and m[0] is not None)
            return q.claim_in_turn, (_EPOCH + timedelta(microseconds=us), id_), False
        self._asked = now
        return q.claim_marked, self.args(topics), True

    def renew(self) -> None:
        """The next claim reads the marks anew (the consumer goes idle: a key awaited
        may have been released, and the marks go back to it only at such a claim)."""
        self._until = -math.inf

    def of(self, topics: list[str]) -> tuple[list[int | None], list[int | None]]:
        """The marks of ``topics`` as the claim takes them: microseconds, ids."""
        us: list[int | None] = []
        ids: list[int | None] = []
        for topic in topics:
            mark = self._marks.get(topic)
            us.append(None if mark is None else mark[0])
            ids.append(None if mark is None else mark[1])
        return us, ids

    def args(self, topics: list[str]) -> tuple[object, ...]:
        """The claim's arguments for ``topics`` after its seven (`Queries.claim_marked`):
        the marks, the keys awaited, the grace; the group cursor and the groups per claim
        come next, then `sweeps`."""
        return (*self.of(topics), self.awaited, self.grace)

    def probe_args(self, topics: list[str]) -> tuple[object, ...]:
        """The idle probe's arguments (`Queries.idle_probe_marked`): the topics, their
        marks, and the keys awaited (one that left pg_locks takes the probe back)."""
        return (topics, *self.of(topics), self.awaited)

    def sweeps(self, topics: list[str]) -> tuple[list[str | None], list[int | None], list[int]]:
        """Each topic's sweep of its groups as `Queries.claim_marked` takes it: the group
        its probe reached (None: a sweep starts), the sweep's lowest candidate."""
        after: list[str | None] = []
        us: list[int | None] = []
        ids: list[int] = []
        for topic in topics:
            sweep = self._sweeps.get(topic)
            after.append(None if sweep is None else sweep[0])
            us.append(None if sweep is None else sweep[1])
            ids.append(0 if sweep is None else sweep[2])
        return after, us, ids

    def update(self, topics: list[str], found: str, server: str | None = None) -> None:
        """A claim of ``topics`` returned ``found``: {"us": [...], "id": [...],
        "awaited": [...]}, the marks in the order of ``topics``, and since migration 0020
        "after", "low_us", "low_id": each topic's sweep (a None "after": none).

        ``server``: the start time of the server that read them. On a server that
        started since the last reading (a promoted standby, a restore, a restart) rows
        can lie behind the marks: a claim the old primary committed and never
        replicated leaves its rows pending there. The marks are dropped, so the next
        claim reads them anew from the start."""
        if server != self._server:
            known, self._server = self._server is not None, server
            if known:
                self._marks.clear()
                self._sweeps.clear()
                self.awaited = []
                self.renew()
                return
        new = json.loads(found)
        for topic, us, id_ in zip(topics, new["us"], new["id"], strict=True):
            self._marks[topic] = (us, id_)
        none = [None] * len(topics)
        sweeps = zip(
            topics,
            new.get("after") or none,
            new.get("low_us") or none,
            new.get("low_id") or none,
            strict=True,
        )
        for topic, after, low_us, low_id in sweeps:
            if after is None:
                self._sweeps.pop(topic, None)
            else:
                self._sweeps[topic] = (after, low_us, low_id or 0)
        self.awaited = list(new["awaited"] or ())
        now = time.monotonic()
        self._until = now + max(_MARKS_EVERY, (now - self._asked) / _MARKS_SHARE)

    def mark(self, topic: str) -> tuple[int | None, int] | None:
        return self._marks.get(topic)


class Arrivals:
    """Recent claimed rows per second: is traffic dense enough to linger?

    Lingering after an empty claim (looking again after 2, 4, ... 32 ms) spares
    producers NOTIFY's commit-time lock under steady load, but events that arrive while
    nobody is advertised idle wait for the next look: at 50 events/s that made wake-up
    p99 25 ms. Below `_DENSE` rows per second the consumer advertises itself idle at once
    and is woken by the notification instead.
    """

    _WINDOW = 1.0
    _DENSE = 200.0

    def __init__(self) -> None:
        self._seen: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, now: float, rows: int) -> None:
        self._seen.append((now, rows))
        self._total += rows
        self._trim(now)

    def dense(self, now: float) -> bool:
        return self.rate(now) >= self._DENSE

    def rate(self, now: float) -> float:
        """Rows claimed per second over the last second."""
        self._trim(now)
        return self._total / self._WINDOW

    def _trim(self, now: float) -> None:
        while self._seen and now - self._seen[0][0] > self._WINDOW:
            self._total -= self._seen.popleft()[1]


class Turns:
    """How many rows of a claim each limited topic may give, taking turns.

    The claim's rows (free slots plus what may be claimed ahead) are split evenly among
    the limited topics due and the open topics (one share for all of them), in turn:
    topics in name order and the open topics last, starting after the last one the
    previous claim gave a row more than the others (or, with no such row, after its
    first), or after the last one it served when the byte cap stopped it earlier. The
    shares never add up to more than the claim may take; with fewer rows than topics
    (one free slot, sixty limited topics) each claim serves the next ones. Topics are
    served in that order, so the first also gets the first row of the byte cap; the
    open topics are served last (on what the others left) unless they come first.
    """

    def __init__(self) -> None:
        self._last: str | None = None  # the next claim starts after this one
        self._order: list[str] = []  # the last claim's topics given rows, as served
        self._next = 0  # where in it the next claim starts after, unless the byte cap
        self._served: set[str] = set()  # left some unserved: then after the last served

    def split(self, want: int, limited: list[str], open_topics: bool) -> dict[str, int]:
        """Rows to ask of each of ``limited`` and of the open topics (`OPEN`), in the
        order to serve them; those given none are left out."""
        self._settle()
        turns = sorted(limited) + ([OPEN] if open_topics else [])
        if not turns or want <= 0:
            return {}
        start = 0
        if (last := self._last) is not None:
            start = next((i for i, t in enumerate(turns) if _after(t, last)), 0)
        order = turns[start:] + turns[:start]
        if order[0] != OPEN and open_topics:
            order.remove(OPEN)
            order.append(OPEN)  # served on what the limited topics leave
        base, extra = divmod(want, len(order))
        shares = {t: base + (i < extra) for i, t in enumerate(order)}
        self._order = [t for t in order if shares[t] > 0]
        self._next = max(extra - 1, 0)
        return {t: shares[t] for t in self._order}

    def served(self, topic: str) -> None:
        """The claim served ``topic``: it gave rows, or said why it had none to give."""
        self._served.add(topic)

    def _settle(self) -> None:
        if self._order:
            order = self._order
            missed = next((i for i, t in enumerate(order) if t not in self._served), len(order))
            self._last = order[min(self._next, max(missed - 1, 0))]
            self._order, self._served = [], set()


def _after(topic: str, last: str) -> bool:
    """Whether ``topic`` comes after ``last`` in turn (the open topics are the last)."""
    if last == OPEN:
        return False
    return topic == OPEN or topic > last


class TopicList:
    """The topics a consumer of every topic claims while some topics are held back.

    Its claim would otherwise look for every topic with claimable events at each claim
    (a skip scan of the claimable index): one index descent per topic, held or not, so
    a thousand paused topics with events cost each claim ~15 ms. With held topics it
    looks them up on a statement of its own instead, leaving the held ones out, and
    claims the topics found until the list is stale: when the controls changed, after
    an idle wait (`forget`), or once it is `_TOPICS_EVERY` old (longer when looking
    took more than `_TOPICS_SHARE` of that time). A topic that gets its first events
    while the consumer is busy is claimed within that time.
    """

    def __init__(self) -> None:
        self.topics: list[str] | None = None
        self._version = -1
        self._until = -math.inf

    def stale(self, now: float, version: int) -> bool:
        return self.topics is None or version != self._version or now >= self._until

    def found(self, topics: list[str], version: int, started: float, ended: float) -> None:
        self.topics, self._version = topics, version
        self._until = ended + max(_TOPICS_EVERY, (ended - started) / _TOPICS_SHARE)

    def forget(self) -> None:
        self.topics = None
