"""A property-based test of the row state machine, on the real SQL and a real server.

Hypothesis interleaves, across three workers: enqueue, claim (one at a time, and several
at once on separate connections), settle done, settle failed (retry, forced dead, release
at stop), lease heartbeat, lease expiry (``lease_expires_at`` moved into the past, as
time would), lease recovery, a worker crash (it forgets its claims) and the operator's
redrive of dead rows. Every statement is the library's own, from `aiooutbox._sql.statements`.

Each rule checks the exact effect of its statement against the snapshot before it;
invariants check after every step:

- no event is lost: every enqueued id is still there;
- ``attempts`` never decreases, except through the operator's explicit redrive;
- a ``done`` or ``dead`` row never changes, except through that redrive;
- a fenced-out settlement (wrong worker or stale attempt) changes nothing;
- no double claim: a claim only takes ``pending``/``retry`` rows, and concurrent claims
  return disjoint sets;
- status and lease columns agree (``processing`` iff a lease is set).

At the end, time is allowed to pass (leases expire, delays elapse) and a finisher drains
the table: every event ends ``done`` or ``dead``.

A second machine (`test_ordered_state_machine`) drives ordered events: claims that take
a run behind each head, settlements as the executor makes them (a run stops at the first
event not finished for good, the rest goes back to waiting), stalled workers whose
leases are recovered in batches of one to three rows (cutting runs in two), crashes,
producers holding a key's lock while a head is settled, recovered or purged, and the
operator's ``purge --status dead``, ``dead purge``, ``dead retry`` and hand-written
``DELETE``s, with the consumers' orphan sweep. After every step, in SQL: no event lost;
no key with two runs at once (processing events of two workers, or a claimable head
beside processing events); no waiting event overtaken by a later one of its key; and no
key left without a head, except those only the sweep can move on (a hand-written
``DELETE``, a promotion lost with a crashed consumer or skipped by lease recovery) or
whose deferred promotion a settler still holds. Its teardown drains everything, the
operator purging the dead events that block their keys: nothing is left unhandled.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Coroutine, Iterator
from datetime import datetime
from typing import Any, TypeVar

import asyncpg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import aiooutbox
from aiooutbox import admin
from aiooutbox._engine.options import DEFAULT_MAX_CLAIM_BYTES as MAX_CLAIM_BYTES
from aiooutbox._sql.admin import admin_queries
from aiooutbox._sql.statements import queries
from tests.conftest import TEMPLATE, _drop, _new_database, with_database

pytestmark = pytest.mark.slow

WORKERS = ("w1", "w2", "w3")
LEASE = 60.0  # never expires on its own during an example; the expire rule does it
Q = queries()
T = TypeVar("T")


class Row:
    __slots__ = (
        "attempts",
        "available_at",
        "finished_at",
        "id",
        "last_error",
        "lease_expires_at",
        "locked_by",
        "max_attempts",
        "status",
        "updated_at",
    )

    def __init__(self, record: asyncpg.Record) -> None:
        for name in self.__slots__:
            setattr(self, name, record[name])

    def as_tuple(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    id: int
    status: str
    attempts: int
    max_attempts: int
    locked_by: str | None
    lease_expires_at: datetime | None
    available_at: datetime
    finished_at: datetime | None
    last_error: str | None
    updated_at: datetime


SNAPSHOT = (
    "SELECT id, status::text, attempts, max_attempts, locked_by, lease_expires_at,"
    " available_at, finished_at, last_error, updated_at FROM outbox_events_all"
)


class World:
    """The event loop and connections an example runs on (one per test, reused)."""

    def __init__(self, dsn: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.dsn = dsn
        self.conns: list[asyncpg.Connection] = [
            self.run(asyncpg.connect(dsn)) for _ in range(len(WORKERS))
        ]

    @property
    def conn(self) -> asyncpg.Connection:
        return self.conns[0]

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def snapshot(self) -> dict[int, Row]:
        return {r["id"]: Row(r) for r in self.run(self.conn.fetch(SNAPSHOT))}

    def close(self) -> None:
        for conn in self.conns:
            self.run(conn.close())
        self.loop.close()


STEPS: Counter[str] = Counter()


def make_machine(world: World) -> type[RuleBasedStateMachine]:
    class OutboxMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            world.run(
                world.conn.execute("TRUNCATE outbox_events, outbox_events_done RESTART IDENTITY")
            )
            self.enqueued: set[int] = set()
            # what each worker believes it holds: id -> attempts it claimed at
            self.claims: dict[str, dict[int, int]] = {w: {} for w in WORKERS}
            self.redriven: set[int] = set()  # ids the operator redrove in the last step
            self.before: dict[int, Row] = {}

        # -- helpers -------------------------------------------------------------------
        def _fresh(self, rows: dict[int, Row], worker: str, event_id: int) -> bool:
            row = rows[event_id]
            return (
                row.status == "processing"
                and row.locked_by == worker
                and row.attempts == self.claims[worker][event_id]
            )

        def _all_claims(self) -> list[tuple[str, int, int]]:
            return [(w, i, a) for w, held in self.claims.items() for i, a in sorted(held.items())]

        @staticmethod
        def _pick(pick: int, options: list[T]) -> T | None:
            """Choose by a drawn index: concurrent claims make the set of options vary
            between runs of one example, so it must not decide what hypothesis draws."""
            return options[pick % len(options)] if options else None

        def _claimable(self, rows: dict[int, Row], now: datetime) -> list[Row]:
            ready = [
                r
                for r in rows.values()
                if r.status in ("pending", "retry") and r.available_at <= now
            ]
            return sorted(ready, key=lambda r: (r.available_at, r.id))

        def _now(self) -> datetime:
            value: datetime = world.run(world.conn.fetchval("SELECT now()"))
            return value

        def _check_claimed(
            self, worker: str, got: list[asyncpg.Record], before: dict[int, Row]
        ) -> None:
            after = world.snapshot()
            for record in got:
                event_id = record["id"]
                old, new = before[event_id], after[event_id]
                assert old.status in ("pending", "retry"), f"claimed a {old.status} row"
                assert new.status == "processing" and new.locked_by == worker
                assert new.attempts == old.attempts + 1 == record["attempts"]
                self.claims[worker][event_id] = new.attempts

        # -- rules -----------------------------------------------------------------------
        @rule(n=st.integers(1, 3), max_attempts=st.integers(1, 3))
        def enqueue(self, n: int, max_attempts: int) -> None:
            events = [
                aiooutbox.NewEvent("t", {"i": i}, max_attempts=max_attempts) for i in range(n)
            ]
            ids = world.run(aiooutbox.enqueue_many(world.conn, events))
            assert all(i is not None for i in ids)
            self.enqueued.update(i for i in ids if i is not None)

        @rule(worker=st.sampled_from(WORKERS), limit=st.integers(1, 3))
        def claim(self, worker: str, limit: int) -> None:
            before = world.snapshot()
            got = world.run(
                world.conn.fetch(Q.claim, worker, LEASE, ["t"], limit, MAX_CLAIM_BYTES, 0, 0)
            )
            now = self._now()
            assert len(got) <= limit
            # oldest available first: exactly the head of the claimable queue (nothing
            # else runs, so SKIP LOCKED skips nothing)
            expected = [r.id for r in self._claimable(before, now)][:limit]
            assert sorted(r["id"] for r in got) == sorted(expected)
            self._check_claimed(worker, got, before)

        @rule(workers=st.lists(st.sampled_from(WORKERS), min_size=2, max_size=3, unique=True))
        def claim_concurrently(self, workers: list[str]) -> None:
            before = world.snapshot()

            async def claim_all() -> list[list[asyncpg.Record]]:
                return list(
                    await asyncio.gather(
                        *(
                            world.conns[i].fetch(Q.claim, w, LEASE, ["t"], 2, MAX_CLAIM_BYTES, 0, 0)
                            for i, w in enumerate(workers)
                        )
                    )
                )

            results = world.run(claim_all())
            STEPS["concurrent claims with rows"] += sum(1 for got in results if got)
            seen: set[int] = set()
            for got in results:
                ids = {r["id"] for r in got}
                assert not ids & seen, "two workers claimed the same row"
                seen |= ids
            for worker, got in zip(workers, results, strict=True):
                self._check_claimed(worker, got, before)

        @rule(pick=st.integers(0, 10_000))
        def settle_done(self, pick: int) -> None:
            chosen = self._pick(pick, self._all_claims())
            if chosen is None:
                return
            worker, event_id, attempts = chosen
            before = world.snapshot()
            fresh = self._fresh(before, worker, event_id)
            settled = world.run(world.conn.fetchval(Q.settle_done, [event_id], worker, attempts))
            after = world.snapshot()
            del self.claims[worker][event_id]
            if fresh:
                assert settled == 1
                assert after[event_id].status == "done"
                assert after[event_id].attempts == before[event_id].attempts
                assert after[event_id].lease_expires_at is None
            else:
                STEPS["fenced settlements"] += 1
                assert settled == 0, "a fenced-out settlement changed a row"
                assert after[event_id].as_tuple() == before[event_id].as_tuple()

        @rule(
            pick=st.integers(0, 10_000),
            delay=st.sampled_from([0.0, 1000.0]),
            force_dead=st.booleans(),
            released=st.booleans(),
        )
        def settle_failed(self, pick: int, delay: float, force_dead: bool, released: bool) -> None:
            chosen = self._pick(pick, self._all_claims())
            if chosen is None:
                return
            worker, event_id, attempts = chosen
            self._fail(worker, {event_id: attempts}, delay, force_dead, released)

        @rule(worker=st.sampled_from(WORKERS))
        def stop(self, worker: str) -> None:
            """A graceful stop that had to cancel handlers: release everything held."""
            self._fail(worker, dict(self.claims[worker]), 0.0, False, True)

        def _fail(
            self,
            worker: str,
            held: dict[int, int],
            delay: float,
            force_dead: bool,
            released: bool,
        ) -> None:
            before = world.snapshot()
            fresh = {i for i in held if self._fresh(before, worker, i)}
            by_attempts: dict[int, list[int]] = {}
            for event_id, attempts in held.items():
                by_attempts.setdefault(attempts, []).append(event_id)
            changed = 0
            for attempts, ids in by_attempts.items():  # one statement per attempt, as the settler
                changed += world.run(
                    world.conn.fetchval(
                        Q.settle_failed,
                        ids,
                        [delay] * len(ids),
                        ["failed"] * len(ids),
                        ["dead" if force_dead else "released" if released else "retry"] * len(ids),
                        worker,
                        attempts,
                    )
                )
            now = self._now()
            after = world.snapshot()
            assert changed == len(fresh)
            for event_id in held:
                del self.claims[worker][event_id]
                old, new = before[event_id], after[event_id]
                if event_id not in fresh:
                    STEPS["fenced settlements"] += 1
                    assert new.as_tuple() == old.as_tuple(), "a fenced-out failure changed a row"
                    continue
                dead = force_dead or (old.attempts >= old.max_attempts and not released)
                assert new.status == ("dead" if dead else "retry")
                assert new.attempts == old.attempts and new.last_error == "failed"
                assert new.lease_expires_at is None
                if not dead:
                    assert (new.available_at > now) == (delay > 0)

        @rule(worker=st.sampled_from(WORKERS))
        def heartbeat(self, worker: str) -> None:
            held = sorted(self.claims[worker])
            if not held:
                return
            before = world.snapshot()
            got = world.run(world.conn.fetch(Q.extend_leases, held, worker, LEASE))
            after = world.snapshot()
            expected = {
                i
                for i in held
                if before[i].status == "processing" and before[i].locked_by == worker
            }
            assert {r["id"] for r in got} == expected
            for event_id in set(before) - expected:
                assert after[event_id].as_tuple() == before[event_id].as_tuple()

        @rule(pick=st.integers(0, 10_000), and_recover=st.booleans())
        def expire(self, pick: int, and_recover: bool) -> None:
            """A worker stalls past its lease (then, maybe, another consumer recovers it)."""
            rows = world.snapshot()
            event_id = self._pick(
                pick, sorted(i for i, r in rows.items() if r.status == "processing")
            )
            if event_id is None:
                return
            world.run(
                world.conn.execute(
                    "UPDATE outbox_events SET lease_expires_at = now() - interval '1 second'"
                    " WHERE id = $1",
                    event_id,
                )
            )
            if and_recover:
                self.recover()

        @rule()
        def recover(self) -> None:
            before = world.snapshot()
            got = world.run(world.conn.fetch(Q.recover_expired, 1000))
            now = self._now()
            after = world.snapshot()
            expected = {
                i
                for i, r in before.items()
                if r.status == "processing"
                and r.lease_expires_at is not None
                and r.lease_expires_at < now
            }
            assert {r["id"] for r in got} == expected
            STEPS["recovered"] += len(expected)
            for event_id in expected:
                old, new = before[event_id], after[event_id]
                dead = old.attempts >= old.max_attempts
                assert new.status == ("dead" if dead else "retry")
                assert new.attempts == old.attempts
                assert new.last_error is not None and "lease expired" in new.last_error

        @rule(worker=st.sampled_from(WORKERS))
        def crash(self, worker: str) -> None:
            """The worker's process dies: it forgets its claims and settles nothing."""
            self.claims[worker].clear()

        @rule()
        def operator_redrive(self) -> None:
            """``aiooutbox dead retry``: dead rows back to pending with fresh attempts."""
            before = world.snapshot()
            got = world.run(world.conn.fetch(admin_queries().dead_retry, None, None))
            after = world.snapshot()
            dead = {i for i, r in before.items() if r.status == "dead"}
            assert len(got) == len(dead)
            for event_id in dead:
                assert (after[event_id].status, after[event_id].attempts) == ("pending", 0)
            self.redriven = dead
            STEPS["redriven"] += len(dead)

        # -- invariants --------------------------------------------------------------------
        @invariant()
        def rows_only_move_forward(self) -> None:
            STEPS["steps"] += 1
            now = world.snapshot()
            assert set(now) == self.enqueued, "an event was lost (or appeared)"
            for event_id, old in self.before.items():
                new = now[event_id]
                if event_id in self.redriven:
                    assert old.status == "dead" and new.status == "pending"
                    continue
                assert new.attempts >= old.attempts, "attempts decreased"
                if old.status in ("done", "dead"):
                    assert new.as_tuple() == old.as_tuple(), f"a {old.status} row changed"
            for row in now.values():
                assert (row.status == "processing") == (row.lease_expires_at is not None)
                assert (row.status in ("done", "dead")) == (row.finished_at is not None)
                if row.status == "processing":
                    assert row.locked_by is not None
            self.redriven = set()
            self.before = now

        def teardown(self) -> None:
            """Let time pass until everything is finished: nothing may be stuck."""
            STEPS["examples"] += 1
            STEPS["events"] += len(self.enqueued)
            for _ in range(20):
                world.run(
                    world.conn.execute(
                        "UPDATE outbox_events SET lease_expires_at = now() - interval '1 second'"
                        " WHERE status = 'processing'"
                    )
                )
                world.run(world.conn.fetch(Q.recover_expired, 1000))
                world.run(
                    world.conn.execute(
                        "UPDATE outbox_events SET available_at = now() WHERE status = 'retry'"
                    )
                )
                got = world.run(
                    world.conn.fetch(Q.claim, "finisher", LEASE, ["t"], 1000, MAX_CLAIM_BYTES, 0, 0)
                )
                for attempts in {r["attempts"] for r in got}:
                    ids = [r["id"] for r in got if r["attempts"] == attempts]
                    world.run(world.conn.fetchval(Q.settle_done, ids, "finisher", attempts))
                rows = world.snapshot()
                if all(r.status in ("done", "dead") for r in rows.values()):
                    break
            rows = world.snapshot()
            assert set(rows) == self.enqueued
            stuck = {i: r.status for i, r in rows.items() if r.status not in ("done", "dead")}
            assert not stuck, f"events never finished: {stuck}"

    return OutboxMachine


@pytest.fixture
def machine_dsn(pg_server: str) -> Iterator[str]:
    name = asyncio.run(_new_database(pg_server, TEMPLATE))
    try:
        yield with_database(pg_server, name)
    finally:
        asyncio.run(_drop(pg_server, name))


# 300 examples of 40 steps: about a minute alone, twice that beside a busy suite
@pytest.mark.timeout(360)
def test_row_state_machine(machine_dsn: str) -> None:
    world = World(machine_dsn)
    try:
        run_state_machine_as_test(
            make_machine(world),
            settings=settings(
                max_examples=300,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        world.close()
    print(f"\n[state machine] {dict(STEPS)}")


# -- ordered keys: runs, purges and every other way a head leaves ---------------------------

KEYS = ("a", "b", "c")
ORDERED = (
    "SELECT id, ordering_key, status::text, attempts, locked_by, blocks_key,"
    " lease_expires_at, finished_at FROM outbox_events_all"
)
# per key, what must never be: a claimable head beside processing events, processing
# events held by two workers (two runs at once), two claimable heads
OVERLAPPING_KEYS = """
SELECT ordering_key FROM outbox_events_all WHERE ordering_key IS NOT NULL
GROUP BY ordering_key
HAVING (bool_or(status = 'processing') AND bool_or(status IN ('pending', 'retry')))
    OR count(DISTINCT locked_by) FILTER (WHERE status = 'processing') > 1
    OR count(*) FILTER (WHERE status IN ('pending', 'retry')) > 1
"""
# keys whose events wait with nothing that will ever promote them but the sweep
ORPHANED_KEYS = """
SELECT ordering_key FROM outbox_events_all WHERE ordering_key IS NOT NULL
GROUP BY ordering_key
HAVING bool_or(status = 'waiting')
   AND NOT bool_or(status IN ('pending', 'retry', 'processing') OR blocks_key)
"""
# a waiting event earlier than its key's running or claimable events (out of order),
# other than one an operator redrove behind a head on purpose
JUMPED_AHEAD = """
SELECT w.id FROM outbox_events_all w
WHERE w.status = 'waiting' AND NOT (w.id = ANY ($1::bigint[]))
  AND EXISTS (SELECT 1 FROM outbox_events_all h WHERE h.ordering_key = w.ordering_key
              AND h.status IN ('pending', 'retry', 'processing') AND h.id > w.id)
"""


class OrderedWorld(World):
    """The world, and one more connection: a producer that can hold a key's lock."""

    def __init__(self, dsn: str) -> None:  # not World's: every statement here is bounded
        self.loop = asyncio.new_event_loop()
        self.dsn = dsn
        # a statement that waits for a lock nobody will release fails, and says where
        self.conns = [self.run(asyncpg.connect(dsn, command_timeout=30)) for _ in WORKERS]
        self.producer: asyncpg.Connection = self.run(asyncpg.connect(dsn, command_timeout=30))

    def close(self) -> None:
        self.run(self.producer.close())
        super().close()


def make_ordered_machine(world: OrderedWorld) -> type[RuleBasedStateMachine]:
    a = admin_queries()

    class OrderedMachine(RuleBasedStateMachine):
        """Ordered events through claims with runs, settlements as the executor makes
        them, stalls and lease recovery in small batches, crashes, producers holding a
        key's lock, and the operator's purges, redrives and hand-written DELETEs."""

        def __init__(self) -> None:
            super().__init__()
            if world.producer.is_in_transaction():  # an example that failed mid-step
                world.run(world.producer.execute("ROLLBACK"))
            world.run(
                world.conn.execute("TRUNCATE outbox_events, outbox_events_done RESTART IDENTITY")
            )
            self.expected: set[int] = set()  # ids that must exist
            self.max_attempts: dict[int, int] = {}
            # each worker's runs as it sees them: [(id, attempts), ...], next to run first
            self.runs: dict[str, list[list[tuple[int, int]]]] = {w: [] for w in WORKERS}
            # keys whose promotion a producer's lock deferred (the settler retries them)
            self.promote_later: dict[str, set[str]] = {w: set() for w in WORKERS}
            # keys only the sweep can move on (a DELETE by hand, a promotion lost)
            self.for_the_sweep: set[str] = set()
            self.redriven: set[int] = set()

        # -- helpers ---------------------------------------------------------------------
        def _rows(self) -> dict[int, asyncpg.Record]:
            return {r["id"]: r for r in world.run(world.conn.fetch(ORDERED))}

        def _produce(self, conn: asyncpg.Connection, key: str, max_attempts: int) -> int:
            event_id = world.run(
                aiooutbox.enqueue(
                    conn, "t", {"k": key}, ordering_key=key, max_attempts=max_attempts
                )
            )
            assert event_id is not None
            self.expected.add(event_id)
            self.max_attempts[event_id] = max_attempts
            return event_id

        def _deleted(self, ids: set[int]) -> None:
            self.expected -= ids
            for runs in self.runs.values():
                for run in runs:
                    run[:] = [(i, n) for i, n in run if i not in ids]

        def _absorb(self, worker: str, result: asyncpg.Record) -> None:
            self.promote_later[worker].update(result["skipped"] or ())

        def _settle(self, worker: str, run: list[tuple[int, int]], code: str) -> None:
            """The next event of ``run`` ends with ``code``; as the executor does, a run
            stops at an event that is not finished for good, and the rest goes back."""
            event_id, attempts = run.pop(0)
            exhausted = attempts >= self.max_attempts[event_id]
            finished = code in ("done", "dead") or (code == "retry" and exhausted)
            rest = [] if finished else run[:]
            if not finished:
                run.clear()
            statements: list[tuple[str, tuple[Any, ...]]]
            if code == "done":
                statements = [(Q.settle_done, ([event_id], worker, attempts))]
            else:
                statements = [
                    (Q.settle_failed, ([event_id], [0.0], ["failed"], [code], worker, attempts))
                ]
            for n in sorted({n for _, n in rest}):  # one statement per attempt, as the settler
                ids = [i for i, m in rest if m == n]
                statements.append(
                    (
                        Q.settle_failed,
                        (ids, [0.0] * len(ids), [""] * len(ids), ["unrun"] * len(ids), worker, n),
                    )
                )

            async def flush() -> list[asyncpg.Record]:
                async with world.conn.transaction():
                    return [await world.conn.fetchrow(sql, *args) for sql, args in statements]

            for result in world.run(flush()):
                self._absorb(worker, result)

        def _next(self, worker: str, pick: int) -> list[tuple[int, int]] | None:
            runs = [r for r in self.runs[worker] if r]
            self.runs[worker] = runs
            return runs[pick % len(runs)] if runs else None

        # -- rules -----------------------------------------------------------------------
        @rule(key=st.sampled_from(KEYS), n=st.integers(1, 3), max_attempts=st.integers(1, 2))
        def enqueue(self, key: str, n: int, max_attempts: int) -> None:
            for _ in range(n):
                self._produce(world.conn, key, max_attempts)

        @rule(worker=st.sampled_from(WORKERS), limit=st.integers(1, 3), run=st.integers(0, 3))
        def claim(self, worker: str, limit: int, run: int) -> None:
            before = self._rows()
            got = world.run(
                world.conn.fetch(Q.claim, worker, LEASE, ["t"], limit, MAX_CLAIM_BYTES, 10, run)
            )
            heads = [r for r in got if r["is_head"]]
            for record in got:
                old = before[record["id"]]["status"]
                assert old == ("pending" if record["is_head"] else "waiting") or (
                    record["is_head"] and old == "retry"
                ), (record["id"], old)
            for head in heads:
                members = sorted(
                    r["id"]
                    for r in got
                    if not r["is_head"] and r["ordering_key"] == head["ordering_key"]
                )
                attempts = {r["id"]: r["attempts"] for r in got}
                self.runs[worker].append(
                    [(head["id"], head["attempts"])] + [(i, attempts[i]) for i in members]
                )
            STEPS["ordered claims with a run"] += sum(1 for r in got if not r["is_head"]) > 0

        @rule(
            worker=st.sampled_from(WORKERS),
            pick=st.integers(0, 100),
            code=st.sampled_from(
                ["done", "done", "retry", "retry_block", "dead", "dead_block", "released"]
            ),
        )
        def run_next(self, worker: str, pick: int, code: str) -> None:
            """The worker's next event ends with ``code`` (it claims first if it has no
            run, as an idle consumer would)."""
            if self._next(worker, pick) is None:
                self.claim(worker, 2, 3)
            run = self._next(worker, pick)
            if run is not None:
                self._settle(worker, run, code)

        @rule(worker=st.sampled_from(WORKERS), pick=st.integers(0, 100))
        def done_beside_a_producer(self, worker: str, pick: int) -> None:
            """A producer inserts into the key (holding its lock) while the head is
            settled: the promotion is deferred, then retried by the settler."""
            run = self._next(worker, pick)
            if run is None:
                return
            key = self._rows()[run[0][0]]["ordering_key"]
            tx = world.producer.transaction()
            world.run(tx.start())
            try:
                self._produce(world.producer, key, 2)
                self._settle(worker, run, "done")
            finally:
                world.run(tx.commit())
            STEPS["promotions deferred"] += bool(self.promote_later[worker])

        @rule(worker=st.sampled_from(WORKERS))
        def settler_retries(self, worker: str) -> None:
            keys = sorted(self.promote_later[worker])
            if keys:
                self.promote_later[worker] = set()
                self._absorb(worker, world.run(world.conn.fetchrow(Q.promote, keys)))

        @rule(worker=st.sampled_from(WORKERS))
        def stall(self, worker: str) -> None:
            """The worker stops renewing: every lease it holds expires, and it runs
            none of its runs' events any more (a worker that ran on after losing its
            lease is another matter: a given-back event's attempt repeats its fence)."""
            self.runs[worker] = []
            world.run(
                world.conn.execute(
                    "UPDATE outbox_events SET lease_expires_at = now() - interval '1 second'"
                    " WHERE status = 'processing' AND locked_by = $1",
                    worker,
                )
            )

        @rule(limit=st.integers(1, 3), beside_a_producer=st.sampled_from([None, *KEYS]))
        def recover(self, limit: int, beside_a_producer: str | None) -> None:
            """Lease recovery in small batches (a run may be cut in two); maybe while a
            producer holds a key, whose promotion is then left to the sweep."""
            tx = world.producer.transaction()
            if beside_a_producer is not None:
                world.run(tx.start())
                self._produce(world.producer, beside_a_producer, 2)
            try:
                while len(world.run(world.conn.fetch(Q.recover_expired, limit))) == limit:
                    pass
            finally:
                if beside_a_producer is not None:
                    world.run(tx.commit())
                    self.for_the_sweep.add(beside_a_producer)

        @rule(worker=st.sampled_from(WORKERS))
        def crash(self, worker: str) -> None:
            """The process dies: its runs are forgotten, and so are its deferred
            promotions (only the sweep can make those now)."""
            self.runs[worker] = []
            self.for_the_sweep |= self.promote_later[worker]
            self.promote_later[worker] = set()

        def _any_dead(self) -> bool:
            found: bool = world.run(
                world.conn.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM outbox_events_all WHERE status = 'dead')"
                )
            )
            return found

        @precondition(lambda self: self._any_dead())
        @rule(batch=st.integers(1, 3))
        def purge_dead(self, batch: int) -> None:
            """``purge --status dead``."""
            before = {i for i, r in self._rows().items() if r["status"] == "dead"}
            n = world.run(admin.purge(world.conn, status="dead", older_than=0, batch_size=batch))
            after = self._rows()
            assert n == len(before) and not before & set(after)
            self._deleted(before)
            STEPS["dead purged"] += n
            STEPS["dead purged while a run was under way"] += n * any(
                r for rs in self.runs.values() for r in rs
            )

        @precondition(lambda self: self._any_dead())
        @rule(pick=st.integers(0, 100), beside_a_producer=st.booleans())
        def dead_purge(self, pick: int, beside_a_producer: bool) -> None:
            """``dead purge --id N``, maybe while a producer inserts into the key."""
            dead = sorted(
                (i, r["ordering_key"]) for i, r in self._rows().items() if r["status"] == "dead"
            )
            if not dead:
                return
            event_id, key = dead[pick % len(dead)]

            async def purge() -> int:
                if not beside_a_producer:
                    return await admin.dead_purge(world.conn, ids=[event_id])
                async with world.producer.transaction():
                    produced = await aiooutbox.enqueue(world.producer, "t", {}, ordering_key=key)
                    assert produced is not None
                    self.expected.add(produced)
                    self.max_attempts[produced] = 5
                    task = asyncio.ensure_future(admin.dead_purge(world.conn, ids=[event_id]))
                    await asyncio.sleep(0.02)
                return await task

            assert world.run(purge()) == 1
            self._deleted({event_id})
            STEPS["dead purged beside a producer"] += beside_a_producer

        @precondition(lambda self: self._any_dead())
        @rule()
        def dead_retry(self) -> None:
            got = world.run(world.conn.fetch(a.dead_retry, None, None))
            self.redriven |= {r["id"] for r in got}

        @rule(pick=st.integers(0, 100))
        def delete_by_hand(self, pick: int) -> None:
            """``DELETE FROM outbox_events WHERE id = N`` by an operator, any status but done."""
            rows = sorted(
                (i, r["ordering_key"]) for i, r in self._rows().items() if r["status"] != "done"
            )
            if not rows:
                return
            event_id, key = rows[pick % len(rows)]
            world.run(world.conn.execute("DELETE FROM outbox_events WHERE id = $1", event_id))
            self._deleted({event_id})
            self.for_the_sweep.add(key)

        @rule()
        def sweep(self) -> None:
            """A consumer's orphan sweep."""
            row = world.run(world.conn.fetchrow(Q.promote_orphans))
            assert row["skipped"] == []
            self.for_the_sweep = set()
            STEPS["swept"] += row["promoted"]

        # -- invariants --------------------------------------------------------------------
        @invariant()
        def keys_run_one_at_a_time_in_order_and_never_hang(self) -> None:
            STEPS["ordered steps"] += 1
            rows = self._rows()
            assert set(rows) == self.expected, "an event was lost (or appeared)"
            assert world.run(world.conn.fetch(OVERLAPPING_KEYS)) == [], "two runs of a key"
            jumped = world.run(world.conn.fetch(JUMPED_AHEAD, sorted(self.redriven)))
            assert jumped == [], f"events overtaken: {[r[0] for r in jumped]}"
            allowed = self.for_the_sweep.union(*self.promote_later.values())
            orphans = {r[0] for r in world.run(world.conn.fetch(ORPHANED_KEYS))}
            assert orphans <= allowed, f"keys left without a head: {orphans - allowed}"
            for row in rows.values():
                assert (row["status"] == "processing") == (row["lease_expires_at"] is not None)
                assert (row["status"] in ("done", "dead")) == (row["finished_at"] is not None)
                assert not row["blocks_key"] or row["status"] == "dead"

        def teardown(self) -> None:
            """Time passes: stalled workers' leases expire, the settlers retry, a sweep
            runs, and a finisher drains with runs; an operator purges the dead events
            that block their keys. Nothing may be left unhandled."""
            STEPS["ordered examples"] += 1
            STEPS["ordered events"] += len(self.expected)
            for worker in WORKERS:
                self.settler_retries(worker)
            self.sweep()
            for rounds in range(40):
                world.run(
                    world.conn.execute(
                        "UPDATE outbox_events SET lease_expires_at = now() - interval '1 second'"
                        " WHERE status = 'processing'"
                    )
                )
                world.run(world.conn.fetch(Q.recover_expired, 1000))
                got = world.run(
                    world.conn.fetch(
                        Q.claim, "finisher", LEASE, ["t"], 1000, MAX_CLAIM_BYTES, 10, 1000
                    )
                )
                for attempts in sorted({r["attempts"] for r in got}):
                    ids = [r["id"] for r in got if r["attempts"] == attempts]
                    result = world.run(
                        world.conn.fetchrow(Q.settle_done, ids, "finisher", attempts)
                    )
                    assert result["skipped"] == []
                rows = self._rows()
                if all(r["status"] in ("done", "dead") for r in rows.values()):
                    break
                if not got and rounds % 2:
                    self.purge_dead(1000)  # blocked keys: the operator steps in
            rows = self._rows()
            stuck = {i: r["status"] for i, r in rows.items() if r["status"] not in ("done", "dead")}
            assert not stuck, f"events never handled: {stuck}"

    return OrderedMachine


@pytest.fixture
def ordered_dsn(pg_server: str) -> Iterator[str]:
    name = asyncio.run(_new_database(pg_server, TEMPLATE))
    try:
        yield with_database(pg_server, name)
    finally:
        asyncio.run(_drop(pg_server, name))


@pytest.mark.timeout(600)
def test_ordered_state_machine(ordered_dsn: str) -> None:
    world = OrderedWorld(ordered_dsn)
    try:
        run_state_machine_as_test(
            make_ordered_machine(world),
            settings=settings(
                max_examples=100,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        world.close()
    print(f"\n[ordered state machine] {dict(STEPS)}")
