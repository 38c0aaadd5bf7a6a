"""A property-based test of the row state machine, on the real SQL and a real server.

Hypothesis interleaves, across three workers: enqueue, claim (one at a time, and several
at once on separate connections), settle done, settle failed (retry, forced dead, release
at stop), lease heartbeat, lease expiry (``lease_expires_at`` moved into the past, as
time would), lease recovery, a worker crash (it forgets its claims) and the operator's
redrive of dead rows. Every statement is the library's own, from `aiooutbox._sql`.

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

A second machine (`make_ordered_machine`) drives ordered keys: two workers claim heads
with the runs behind them and run them one event at a time, each with the library's own
`Leases` and heartbeat on a clock of its own; a worker's event loop may block for part
of the lease or past it (its clock and its leases in the database move on together),
and leases are recovered meanwhile. Before each handler a worker does what the executor
does: starts it only while its lease lasts by its own clock, else gives the run up
(what is still its own comes back through lease recovery). Checked at every start: the database
shows the row as that worker's, on that attempt, with a live lease; no other worker runs
an event of the key (except a handler whose loop blocked past its lease, the one repeat
allowed); every earlier event of the key is finished. After every step: no key has
waiting events and no head.
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
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

import aiooutbox
from aiooutbox._admin_sql import admin_queries
from aiooutbox._dispatcher import runs_of
from aiooutbox._engine import LEASE_MARGIN
from aiooutbox._leases import Leases
from aiooutbox._maintenance import Maintenance
from aiooutbox._options import DEFAULT_MAX_CLAIM_BYTES as MAX_CLAIM_BYTES
from aiooutbox._rows import ClaimedRow
from aiooutbox._sql import queries
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
    " available_at, finished_at, last_error, updated_at FROM outbox_events"
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
            world.run(world.conn.execute("TRUNCATE outbox_events RESTART IDENTITY"))
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


# -- ordered runs, leases and blocked event loops ---------------------------------------------

KEYS = ("k1", "k2")
RUN = 3  # run members a claim takes behind each head


class Worker:
    """One consumer as the ordered machine sees it: the library's own `Leases` and
    heartbeat (`Maintenance.renew_due`) on a clock of its own, the runs it claimed, and
    the handler it runs (one at a time)."""

    def __init__(self, name: str, pool: asyncpg.Pool) -> None:
        self.name = name
        self.clock = 0.0  # its monotonic clock: advanced by a blocked loop, and by nothing else
        self.leases = Leases()
        self.maintenance = Maintenance(
            pool,
            Q,
            name,
            leases=self.leases,
            on_recovered=lambda _n: None,
            lease_timeout=LEASE,
            retention=None,
            statement_timeout=10.0,
        )
        self.runs: list[list[ClaimedRow]] = []  # claimed, not started; runs[0] is current
        self.running: ClaimedRow | None = None
        self.current: list[ClaimedRow] = []  # the members of its run not yet started
        self.blocked = False  # the running handler's lease lapsed while the loop was blocked


def make_ordered_machine(world: World, pool: asyncpg.Pool) -> type[RuleBasedStateMachine]:
    class OrderedLeaseMachine(RuleBasedStateMachine):
        """Ordered keys claimed with their runs by workers whose event loops may block
        past the lease. The property: a worker starts a handler only while the database
        shows the row as its own with a live lease, and never while another worker runs
        an event of the same key (only a handler that was running when its loop blocked
        may overlap what comes after it); a key's events start in order, and no key is
        ever left with waiting events and no head."""

        def __init__(self) -> None:
            super().__init__()
            world.run(world.conn.execute("TRUNCATE outbox_events RESTART IDENTITY"))
            self.workers = {w: Worker(w, pool) for w in WORKERS[:2]}
            self.enqueued = 0

        def _row(self, event_id: int) -> asyncpg.Record:
            record: asyncpg.Record = world.run(
                world.conn.fetchrow(
                    "SELECT status::text, locked_by, attempts, lease_expires_at > now() AS live,"
                    " ordering_key FROM outbox_events WHERE id = $1",
                    event_id,
                )
            )
            return record

        @initialize()
        def some_events(self) -> None:
            for key in KEYS:
                self.enqueue(key, 3)

        @rule(key=st.sampled_from(KEYS), n=st.integers(1, 4))
        def enqueue(self, key: str, n: int) -> None:
            events = [aiooutbox.NewEvent("t", {}, ordering_key=key) for _ in range(n)]
            world.run(aiooutbox.enqueue_many(world.conn, events))
            self.enqueued += n

        @rule(worker=st.sampled_from(WORKERS[:2]), ok=st.booleans())
        def work(self, worker: str, ok: bool) -> None:
            """One step of a consumer: the running handler returns (``ok``) or raises;
            else the next event of its runs starts (or the run is given up); else it
            claims."""
            w = self.workers[worker]
            if w.running is not None:
                self._finish(w, ok)
            elif w.runs:
                self._start(w)
            else:
                self._claim(w)

        @rule(worker=st.sampled_from(WORKERS[:2]), ok=st.booleans())
        def work_too(self, worker: str, ok: bool) -> None:
            """The same (the consumers' own steps come twice as often as the faults)."""
            self.work(worker, ok)

        def _claim(self, w: Worker) -> None:
            worker = w.name
            records = world.run(
                world.conn.fetch(Q.claim, worker, LEASE, ["t"], 2, MAX_CLAIM_BYTES, RUN, 2 * RUN)
            )
            rows = [ClaimedRow.from_record(r) for r in records]
            # the consumer takes its clock before the claim: here nothing passes meanwhile
            w.leases.hold_all(rows, w.clock + LEASE)
            w.runs.extend(runs_of(rows))
            STEPS["ordered rows claimed"] += len(rows)

        def _start(self, w: Worker) -> None:
            """What a worker does before each handler: start it, or give the run up."""
            worker = w.name
            run = w.runs[0]
            row = run[0]
            if not w.leases.startable(row, w.clock + LEASE * LEASE_MARGIN):
                STEPS["runs given up (lease lapsed)"] += 1
                # nothing is written: the rows come back through lease recovery
                w.runs.pop(0)
                for member in run:
                    w.leases.finish(member)
                return
            now = self._row(row.id)
            assert (now["status"], now["locked_by"], now["attempts"]) == (
                "processing",
                worker,
                row.attempts,
            ), f"{worker} started event {row.id} whose lease it no longer holds: {dict(now)}"
            assert now["live"], f"{worker} started event {row.id} on an expired lease"
            for other in self.workers.values():
                if other is not w and other.running is not None and not other.blocked:
                    assert other.running.ordering_key != row.ordering_key, (
                        f"{worker} started event {row.id} while {other.name} runs"
                        f" {other.running.id} of the same key"
                    )
            earlier = world.run(
                world.conn.fetchval(
                    "SELECT count(*) FROM outbox_events WHERE ordering_key = $1 AND id < $2"
                    " AND status NOT IN ('done', 'dead')",
                    row.ordering_key,
                    row.id,
                )
            )
            assert earlier == 0, f"event {row.id} started before an earlier event of its key"
            run.pop(0)
            if not run:
                w.runs.pop(0)
            w.running, w.current = row, run
            STEPS["handlers started"] += 1

        def _finish(self, w: Worker, ok: bool) -> None:
            """The running handler returns (done) or raises (retry at once; the rest of
            its run goes back to waiting), as the executor settles them."""
            worker = w.name
            row = w.running
            assert row is not None
            # as the executor: an outcome is written only for the claim still held (a
            # claim taken again since by this worker settles its row itself)
            mine = [row] if w.leases.holds(row) else []
            if ok:
                for r in mine:
                    world.run(world.conn.fetchrow(Q.settle_done, [r.id], worker, r.attempts))
            else:
                self._settle(worker, mine, "retry")
                rest = list(w.current)
                if w.runs and w.runs[0] is w.current:
                    w.runs.pop(0)
                self._settle(worker, [r for r in rest if w.leases.holds(r)], "unrun")
                for member in rest:
                    w.leases.finish(member)
            w.leases.finish(row)
            w.running, w.current = None, []
            w.blocked = False

        def _settle(self, worker: str, rows: list[ClaimedRow], outcome: str) -> None:
            for attempts in {r.attempts for r in rows}:
                ids = [r.id for r in rows if r.attempts == attempts]
                world.run(
                    world.conn.fetchrow(
                        Q.settle_failed, ids, [0.0] * len(ids), ["failed"] * len(ids),
                        [outcome] * len(ids), worker, attempts,
                    )
                )  # fmt: skip

        @rule(worker=st.sampled_from(WORKERS[:2]))
        def heartbeat(self, worker: str) -> None:
            w = self.workers[worker]
            world.run(w.maintenance.renew_due(w.clock))

        @rule(worker=st.sampled_from(WORKERS[:2]), share=st.sampled_from([0.5, 0.9, 1.5]))
        def block(self, worker: str, share: float) -> None:
            """The worker's event loop is blocked for ``share`` of the lease: its clock
            moves on, and so do its leases in the database; nothing of it runs meanwhile
            (the others are not blocked: their heartbeats keep their leases)."""
            w = self.workers[worker]
            seconds = LEASE * share
            w.clock += seconds
            world.run(
                world.conn.execute(
                    "UPDATE outbox_events SET lease_expires_at = lease_expires_at"
                    " - make_interval(secs => $2) WHERE status = 'processing' AND locked_by = $1",
                    worker,
                    seconds,
                )
            )
            if w.running is not None and not self._row(w.running.id)["live"]:
                w.blocked = True
                STEPS["handlers blocked past their lease"] += 1

        @rule()
        def recover(self) -> None:
            got = world.run(world.conn.fetch(Q.recover_expired, 1000))
            STEPS["ordered rows recovered"] += len(got)

        @invariant()
        def no_key_without_a_head(self) -> None:
            stuck = world.run(
                world.conn.fetch(
                    "SELECT DISTINCT w.ordering_key FROM outbox_events w"
                    " WHERE w.status = 'waiting' AND NOT EXISTS ("
                    "  SELECT 1 FROM outbox_events h WHERE h.ordering_key = w.ordering_key"
                    "  AND h.status IN ('pending', 'retry', 'processing'))"
                )
            )
            assert not stuck, f"keys with waiting events and no head: {stuck}"
            for row in world.snapshot().values():
                assert (row.status == "processing") == (row.lease_expires_at is not None)

        def teardown(self) -> None:
            """Time passes, every worker stops; a finisher drains the keys in order."""
            for _ in range(50):
                world.run(
                    world.conn.execute(
                        "UPDATE outbox_events SET lease_expires_at = now() - interval '1 second'"
                        " WHERE status = 'processing'"
                    )
                )
                world.run(world.conn.fetch(Q.recover_expired, 1000))
                got = world.run(
                    world.conn.fetch(
                        Q.claim, "finisher", LEASE, ["t"], 100, MAX_CLAIM_BYTES, RUN, 2 * RUN
                    )
                )
                for run in runs_of([ClaimedRow.from_record(r) for r in got]):
                    for row in run:
                        world.run(
                            world.conn.fetchrow(Q.settle_done, [row.id], "finisher", row.attempts)
                        )
                counts = world.run(
                    world.conn.fetch("SELECT status::text, count(*) FROM outbox_events GROUP BY 1")
                )
                if {r[0] for r in counts} <= {"done"}:
                    break
            left = world.run(
                world.conn.fetchval("SELECT count(*) FROM outbox_events WHERE status <> 'done'")
            )
            assert left == 0, "events never finished"
            assert world.run(world.conn.fetchval("SELECT count(*) FROM outbox_events")) == (
                self.enqueued
            )

    return OrderedLeaseMachine


@pytest.mark.timeout(600)  # about 80 s on a busy shared 2-core machine
def test_ordered_runs_through_blocked_event_loops(machine_dsn: str) -> None:
    world = World(machine_dsn)

    async def new_pool() -> asyncpg.Pool:
        return await asyncpg.create_pool(machine_dsn, min_size=1, max_size=2)

    pool = world.run(new_pool())
    try:
        run_state_machine_as_test(
            make_ordered_machine(world, pool),
            settings=settings(
                max_examples=100,
                stateful_step_count=30,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        world.run(pool.close())
        world.close()
    print(f"\n[ordered lease machine] {dict(STEPS)}")
