"""A state machine for ordered runs under leases that lapse while an event loop is blocked.

Two workers claim heads with the runs behind them and run them one event at a time, each
with the library's own `Leases` and heartbeat on a clock of its own; a worker's event
loop may block for part of the lease or past it (its clock and its leases in the
database move on together), and leases are recovered meanwhile. Before each handler a
worker does what the executor does: starts it only while its lease lasts by its own
clock, else gives the run up (what is still its own comes back through lease recovery).
Beside them, the producers the outbox must stand up to: transactions at REPEATABLE READ
or SERIALIZABLE whose snapshot was taken steps earlier (`enqueue`, `enqueue_many` and a
raw SQL INSERT; a refusal is a unique violation or a serialization failure, and the
transaction is rolled back), raw SQL inserts of every status (all but `pending`
refused), unordered events, and operators purging dead events while runs go on (the
handler of k2 blocks its key when its event dies, so a purge is what moves it on).
Checked at every start: the database shows the row as that worker's, on that attempt,
with a live lease; no other worker runs an event of the key (except a handler whose loop
blocked past its lease, the one repeat allowed); every earlier event of the key is
finished. After every step: no key has waiting events and no head, and at most one event
stands for each key. At the end every event was handled (done, or dead and maybe purged).
"""

from __future__ import annotations

import asyncpg
import pytest
from asyncpg.transaction import Transaction
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
from aiooutbox import admin
from aiooutbox._engine.engine import LEASE_MARGIN
from aiooutbox._engine.handoff import runs_of
from aiooutbox._engine.leases import Leases
from aiooutbox._engine.maintenance import Maintenance
from aiooutbox._engine.options import DEFAULT_MAX_CLAIM_BYTES as MAX_CLAIM_BYTES
from aiooutbox._engine.rows import ClaimedRow
from tests.test_state_machine import (  # machine_dsn: the fixture, used by name
    LEASE,
    STEPS,
    WORKERS,
    Q,
    World,
    machine_dsn,  # noqa: F401
)

# -- ordered runs, leases and blocked event loops ---------------------------------------------

KEYS = ("k1", "k2")
BLOCKING = "k2"  # its handler keeps the key blocked when its event dies (on_dead="block")
RUN = 3  # run members a claim takes behind each head
STATUSES = ("pending", "retry", "processing", "waiting", "done", "dead")


def as_lists(rows: list[ClaimedRow]) -> list[list[ClaimedRow]]:
    """The consumer's units of work, each as a list (a lone unordered row is handed
    out as itself)."""
    return [run if isinstance(run, list) else [run] for run in runs_of(rows)]


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
            orphan_sweep_interval=3600.0,  # the machine's steps never need it
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
            world.run(
                world.conn.execute("TRUNCATE outbox_events, outbox_events_done RESTART IDENTITY")
            )
            self.workers = {w: Worker(w, pool) for w in WORKERS[:2]}
            self.enqueued = 0
            self.purged = 0
            self.producer = world.conns[2]  # a producer's own connection
            self.snapshot: Transaction | None = None  # its open transaction, if any

        def _row(self, event_id: int) -> asyncpg.Record:
            record: asyncpg.Record = world.run(
                world.conn.fetchrow(
                    "SELECT status::text, locked_by, attempts, lease_expires_at > now() AS live,"
                    " ordering_key FROM outbox_events_all WHERE id = $1",
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
            # two attempts: events die within a few failures, and k2's block their key
            events = [
                aiooutbox.NewEvent("t", {}, ordering_key=key, max_attempts=2) for _ in range(n)
            ]
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
            w.runs.extend(as_lists(rows))
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
                if (
                    row.ordering_key is not None
                    and other is not w
                    and other.running is not None
                    and not other.blocked
                ):
                    assert other.running.ordering_key != row.ordering_key, (
                        f"{worker} started event {row.id} while {other.name} runs"
                        f" {other.running.id} of the same key"
                    )
            earlier = world.run(
                world.conn.fetchval(
                    "SELECT count(*) FROM outbox_events_all WHERE ordering_key = $1 AND id < $2"
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
                self._settle(
                    worker, mine, "retry_block" if row.ordering_key == BLOCKING else "retry"
                )
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

        @rule(level=st.sampled_from(["repeatable_read", "serializable"]))
        def open_snapshot(self, level: str) -> None:
            """A producer's transaction at ``level`` takes its snapshot now; it inserts
            steps later (``insert_in_snapshot``), when the key may have moved on."""
            if self.snapshot is not None:
                return
            tx = self.producer.transaction(isolation=level)
            world.run(tx.start())
            world.run(self.producer.fetchval("SELECT count(*) FROM outbox_events_all"))
            self.snapshot = tx

        @rule(
            key=st.sampled_from(KEYS),
            n=st.integers(1, 3),
            how=st.sampled_from(["enqueue", "enqueue_many", "raw_sql"]),
        )
        def insert_in_snapshot(self, key: str, n: int, how: str) -> None:
            if self.snapshot is None:
                return
            tx, self.snapshot, conn = self.snapshot, None, self.producer
            try:
                if how == "enqueue":
                    for _ in range(n):
                        world.run(aiooutbox.enqueue(conn, "t", {}, ordering_key=key))
                elif how == "enqueue_many":
                    events = [aiooutbox.NewEvent("t", {}, ordering_key=key) for _ in range(n)]
                    world.run(aiooutbox.enqueue_many(conn, events))
                else:
                    world.run(
                        conn.execute(
                            "INSERT INTO outbox_events (topic, payload, ordering_key)"
                            " SELECT 't', '{}', $1 FROM generate_series(1, $2)",
                            key,
                            n,
                        )
                    )
                world.run(tx.commit())
            except (asyncpg.UniqueViolationError, asyncpg.SerializationError) as exc:
                world.run(tx.rollback())
                STEPS[f"stale snapshots refused ({type(exc).__name__})"] += 1
            else:
                self.enqueued += n
                STEPS["snapshot inserts committed"] += 1

        @rule(status=st.sampled_from(STATUSES), key=st.sampled_from((*KEYS, None)))
        def raw_insert(self, status: str, key: str | None) -> None:
            """A plain SQL producer that sets ``status``: only ``pending`` gets in."""
            try:
                world.run(
                    world.conn.execute(
                        "INSERT INTO outbox_events (topic, payload, ordering_key, status)"
                        " VALUES ('t', '{}', $1, $2::outbox_events_status)",
                        key,
                        status,
                    )
                )
            except asyncpg.CheckViolationError:
                assert status != "pending"
                STEPS["raw inserts refused"] += 1
            else:
                assert status == "pending", f"a raw insert of a {status} event got in"
                self.enqueued += 1

        @rule()
        def purge_dead(self) -> None:
            """An operator purges the dead events while runs go on: a key a dead event
            blocked moves on to its next event."""
            gone = world.run(admin.purge(world.conn, status="dead", older_than=0))
            self.purged += gone
            STEPS["dead events purged"] += gone

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
                    "SELECT DISTINCT w.ordering_key FROM outbox_events_all w"
                    " WHERE w.status = 'waiting' AND NOT EXISTS ("
                    "  SELECT 1 FROM outbox_events_all h WHERE h.ordering_key = w.ordering_key"
                    "  AND (h.status IN ('pending', 'retry', 'processing') OR h.blocks_key))"
                )
            )
            assert not stuck, f"keys with waiting events and no head: {stuck}"
            doubled = world.run(
                world.conn.fetch(
                    "SELECT ordering_key, array_agg(id ORDER BY id) FROM outbox_events_all"
                    " WHERE ordering_key IS NOT NULL AND (status IN ('pending', 'retry')"
                    "  OR (status = 'processing' AND holds_key))"
                    " GROUP BY 1 HAVING count(*) > 1"
                )
            )
            assert not doubled, f"keys with two heads: {[tuple(r) for r in doubled]}"
            unkeyed = world.run(
                world.conn.fetchval(
                    "SELECT count(*) FROM outbox_events_all WHERE ordering_key IS NULL"
                    " AND status NOT IN ('pending', 'retry', 'processing', 'done', 'dead')"
                )
            )
            assert unkeyed == 0, "an unordered event waits (nothing would ever promote it)"
            for row in world.snapshot().values():
                assert (row.status == "processing") == (row.lease_expires_at is not None)

        def teardown(self) -> None:
            """Time passes, every worker stops; a finisher drains the keys in order (and
            an operator purges the dead events that block keys)."""
            if self.snapshot is not None:
                world.run(self.snapshot.rollback())
                self.snapshot = None
            for _ in range(50):
                self.purge_dead()
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
                for run in as_lists([ClaimedRow.from_record(r) for r in got]):
                    for row in run:
                        world.run(
                            world.conn.fetchrow(Q.settle_done, [row.id], "finisher", row.attempts)
                        )
                counts = world.run(
                    world.conn.fetch(
                        "SELECT status::text, count(*) FROM outbox_events_all GROUP BY 1"
                    )
                )
                if {r[0] for r in counts} <= {"done", "dead"}:
                    break
            # every event handled: done, or dead once its attempts were spent (a key moves
            # on past a dead event: no handler here blocks its key)
            left = world.run(
                world.conn.fetch(
                    "SELECT id, status::text, ordering_key FROM outbox_events_all"
                    " WHERE status NOT IN ('done', 'dead') ORDER BY id"
                )
            )
            assert not left, f"events never finished: {[tuple(r) for r in left]}"
            assert world.run(world.conn.fetchval("SELECT count(*) FROM outbox_events_all")) == (
                self.enqueued - self.purged
            )

    return OrderedLeaseMachine


@pytest.mark.slow
@pytest.mark.timeout(300)  # about 50 s on a busy shared 2-core machine
def test_ordered_runs_through_blocked_event_loops(machine_dsn: str) -> None:  # noqa: F811
    world = World(machine_dsn)

    async def new_pool() -> asyncpg.Pool:
        return await asyncpg.create_pool(machine_dsn, min_size=1, max_size=2)

    pool = world.run(new_pool())
    try:
        run_state_machine_as_test(
            make_ordered_machine(world, pool),
            settings=settings(
                max_examples=40,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        world.run(pool.close())
        world.close()
    print(f"\n[ordered lease machine] {dict(STEPS)}")
