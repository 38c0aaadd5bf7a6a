"""An outcome of a lapsed claim must not settle the same consumer's next claim of the row.

Lease recovery gives a run member its attempt back, so when the consumer whose lease
lapsed claims the key again, its new claim of that member has the same worker and
attempt as the old one: an outcome of the old claim still waiting in the settler would
pass the settlement's fence and settle a row that is about to run (seen once in sixteen
runs of the ordering SIGKILL test with a frozen event loop: a stale `done` landed on the
new claim, which then ran the event on a row already `done`; a stale retry would have
let a second consumer take the key while the first ran it). The claim drops such
outcomes before they are written (`Settler.drop_stale`), and does not start a row whose
stale outcome is being written, or was written while the claim was under way: the
settle's UPDATE waits for the claim's row locks, lands on the new claim, and its reply
may be read before the claim's (`Settler.claiming`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import asyncpg
import pytest

import aiooutbox
from aiooutbox._engine.dispatcher import Dispatcher
from aiooutbox._engine.rows import ClaimedRow
from aiooutbox._engine.settler import Settler
from aiooutbox._sql.statements import queries
from tests.helpers import running, wait_until

Q = queries()


async def _claim(pool: asyncpg.Pool) -> dict[int, int]:
    """Claim the key's run as worker "w": {id: attempts}."""
    rows = await pool.fetch(Q.claim, "w", 30.0, ["t"], 10, 1 << 30, 10, 20)
    return {r["id"]: r["attempts"] for r in rows}


async def _row(pool: asyncpg.Pool, event_id: int) -> tuple[str, str | None, int]:
    row = await pool.fetchrow(
        "SELECT status::text, locked_by, attempts FROM outbox_events_all WHERE id = $1", event_id
    )
    assert row is not None
    return row["status"], row["locked_by"], row["attempts"]


@pytest.mark.parametrize("drop", [True, False])
async def test_a_stale_outcome_is_dropped_when_the_row_is_claimed_again(
    pool: asyncpg.Pool, drop: bool
) -> None:
    head = await aiooutbox.enqueue(pool, "t", {"seq": 0}, ordering_key="k")
    member = await aiooutbox.enqueue(pool, "t", {"seq": 1}, ordering_key="k")
    assert head is not None and member is not None
    first = await _claim(pool)
    assert first == {head: 1, member: 1}
    # the member ran under the first claim; its outcome waits in the settler (unwritten)
    settler = Settler(pool, Q, "w", flush_interval=60, flush_size=1000, statement_timeout=5)
    settler.done(member, first[member])
    # the first claim's lease lapses (a frozen loop) and recovery takes the run back,
    # giving the member its attempt back
    await pool.execute(
        "UPDATE outbox_events SET lease_expires_at = now() - interval '1 second'"
        " WHERE id = ANY ($1::bigint[])",
        [head, member],
    )
    await pool.fetch(Q.recover_expired, 100)
    await pool.execute("UPDATE outbox_events SET available_at = now() WHERE id = $1", head)
    rows = await pool.fetch(Q.claim, "w", 30.0, ["t"], 10, 1 << 30, 10, 20)
    again = {r["id"]: r["attempts"] for r in rows}
    assert again == {head: 2, member: 1}, "the member's fence is the same as before"
    # the dispatcher asks the settler only about rows that may have been claimed before
    assert all(ClaimedRow.from_record(r).claimed_before() for r in rows)
    if drop:
        assert settler.drop_stale(list(again.items())) == set()  # not being written: dropped
        assert settler.dropped == 1
    with anyio.fail_after(10):
        await settler.close(timeout=5)
    if drop:
        # the new claim still holds the member: it runs it and settles it itself
        assert await _row(pool, member) == ("processing", "w", 1)
        assert settler.fenced == 0
    else:
        # what the fence alone lets through: the old outcome settles the new claim
        assert await _row(pool, member) == ("done", "w", 1)


async def test_an_outcome_being_written_is_reported_not_dropped(
    pool: asyncpg.Pool, dsn: str
) -> None:
    """A stale outcome already sent to the database may land on the new claim or not:
    `drop_stale` names its row (the dispatcher then does not start it) and leaves the
    write alone."""
    event_id = await aiooutbox.enqueue(pool, "t", {"seq": 0})
    assert event_id is not None
    assert await _claim(pool) == {event_id: 1}
    settler = Settler(pool, Q, "w", flush_interval=0.001, flush_size=1, statement_timeout=30)
    locker = await asyncpg.connect(dsn)  # not the pool's: the settler needs that one
    lock = locker.transaction()
    await lock.start()
    try:
        # the flush's UPDATE waits for this row lock: the outcome is being written
        await locker.execute("SELECT 1 FROM outbox_events WHERE id = $1 FOR UPDATE", event_id)
        async with anyio.create_task_group() as tg:
            tg.start_soon(settler.run)
            settler.done(event_id, 1)
            try:
                with anyio.fail_after(10):
                    while settler._writing.ids() != [event_id]:
                        await anyio.sleep(0.01)
                assert settler.drop_stale([(event_id, 1)]) == {event_id}
                # the same row claimed again at the next attempt (a retry just written
                # and due at once): not the earlier claim's fence, nothing to fear
                assert settler.drop_stale([(event_id, 2)]) == set()
                assert settler.dropped == 0 and settler.backlog == 1
            finally:
                await lock.rollback()  # the write goes through now (or the test ends)
            with anyio.fail_after(10):
                while settler.backlog:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
    finally:
        await locker.close()  # a transaction still open ends with it
    assert await _row(pool, event_id) == ("done", "w", 1)


async def test_a_stale_outcome_written_during_the_claim_does_not_start_the_row(
    pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stale outcome's write is under way when the claim is sent, lands on the new
    claim just after it commits (the settle's UPDATE waits for the claim's row locks),
    and its reply is read before the claim's: when the claim's rows are handed out the
    outcome is neither waiting nor being written, but the row is already settled. Seen
    once in sixteen runs of the ordering SIGKILL test as a run started on a ``done``
    row. Forced here with a real consumer: the settler's write is held until the claim
    has committed, and the claim's rows are handed out once the write's reply is read."""
    head = await aiooutbox.enqueue(pool, "t", {"seq": 0}, ordering_key="k")
    member = await aiooutbox.enqueue(pool, "t", {"seq": 1}, ordering_key="k")
    assert head is not None and member is not None
    first = await _claim(pool)  # an earlier claim of this consumer ("w")
    assert first == {head: 1, member: 1}
    # its lease lapsed (a frozen loop) and recovery took the run back: the head to
    # retry, the member to waiting with its attempt given back
    await pool.execute(
        "UPDATE outbox_events SET lease_expires_at = now() - interval '1 second'"
        " WHERE id = ANY ($1::bigint[])",
        [head, member],
    )
    await pool.fetch(Q.recover_expired, 100)
    assert await _row(pool, member) == ("waiting", "w", 0)

    writing, landed = asyncio.Event(), asyncio.Event()
    execute = Settler._execute

    async def held_write(self: Settler, conn: asyncpg.Connection, statements: Any) -> Any:
        if member in self._writing.ids() and not landed.is_set():
            writing.set()
            await landed.wait()  # until the claim has committed
        return await execute(self, conn, statements)

    claim_open = Dispatcher._claim_open
    forced = False

    async def claim_while_writing(self: Dispatcher, *args: Any) -> list[ClaimedRow]:
        nonlocal forced
        if forced:
            return await claim_open(self, *args)
        forced = True
        # the earlier claim's outcome of the member (it ran before the freeze ended),
        # its write sent before this claim
        self._settler.done(member, first[member])
        self._settler.hurry()
        await asyncio.wait_for(writing.wait(), 10)
        rows = await claim_open(self, *args)  # the key again: the member at attempt 1
        landed.set()
        with anyio.fail_after(10):  # the write's reply is read before the claim's
            while self._settler.backlog:
                await asyncio.sleep(0.005)
        return rows

    monkeypatch.setattr(Settler, "_execute", held_write)
    monkeypatch.setattr(Dispatcher, "_claim_open", claim_while_writing)
    started: list[tuple[int, int, str]] = []

    async def handle(event: aiooutbox.Event) -> None:
        seen = await pool.fetchval(
            "SELECT status::text || ' ' || coalesce(locked_by, '-') FROM outbox_events_all"
            " WHERE id = $1",
            event.id,
        )
        started.append((event.id, event.attempts, seen))

    consumer = aiooutbox.OutboxConsumer(pool, worker_id="w", concurrency=2, poll_interval=0.2)
    async with running(consumer, {"t": handle}):
        await wait_until(lambda: _done(pool, head, member), timeout=20)
        await asyncio.sleep(0.2)  # a handler started on the settled member would show now
    print(f"handlers started: {started}")
    assert forced and landed.is_set()
    # the stale outcome settled the member (it ran under the earlier claim); the new
    # claim ran the head, and never started the member on a row it no longer held
    assert await _row(pool, member) == ("done", "w", 1)
    assert started == [(head, 2, "processing w")], started


async def _done(pool: asyncpg.Pool, *ids: int) -> bool:
    done: int = await pool.fetchval(
        "SELECT count(*) FROM outbox_events_all WHERE id = ANY ($1::bigint[]) AND status = 'done'",
        list(ids),
    )
    return done == len(ids)


async def test_only_writes_that_end_during_the_claim_leave_it_unsure(pool: asyncpg.Pool) -> None:
    """A write that ended before the claim was sent committed before it (fenced off, or
    the row was not claimable): the claim may start the row. One that ended after (or
    failed: its commit may have been lost with the reply) may have landed on it."""
    event_id = await aiooutbox.enqueue(pool, "t", {"seq": 0})
    assert event_id is not None
    settler = Settler(pool, Q, "w", flush_interval=0.001, flush_size=1, statement_timeout=30)
    async with anyio.create_task_group() as tg:
        tg.start_soon(settler.run)
        settler.done(event_id, 1)  # the row is not ours: fenced off
        with anyio.fail_after(10):
            while settler.backlog:
                await anyio.sleep(0.01)
        with settler.claiming():
            assert not settler.stale_possible()
            assert settler.drop_stale([(event_id, 1)]) == set()
            settler.done(event_id, 1)
            with anyio.fail_after(10):
                while settler.backlog:
                    await anyio.sleep(0.01)
            assert settler.stale_possible()
            assert settler.drop_stale([(event_id, 1)]) == {event_id}
            assert settler.drop_stale([(event_id, 2)]) == set()  # another attempt
        assert not settler.stale_possible()  # the claim's rows were handed out
        assert settler.fenced == 2
        tg.cancel_scope.cancel()


async def test_a_write_that_ends_while_the_claim_awaits_its_connection_came_before(
    pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write whose reply was read before the claim's connection was taken committed
    before the claim was sent: the claim may start the row it wrote. Regression: the
    dispatcher began keeping ended writes before it awaited a connection from the pool,
    so a dead outcome written during that wait, and a `dead_retry` before the claim,
    left the retried head unstarted ("its lease lapsed first") for a whole lease."""
    from aiooutbox import admin
    from aiooutbox._sql.db import HeldConnection

    head = await aiooutbox.enqueue(pool, "t", {"seq": 0}, ordering_key="k", max_attempts=1)
    assert head is not None
    theirs: list[HeldConnection] = []
    init = Dispatcher.__init__

    def remember(self: Dispatcher, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        theirs.append(self._conn)

    gate, waiting = asyncio.Event(), asyncio.Event()
    use = HeldConnection.use

    @contextlib.asynccontextmanager
    async def slow_acquire(self: HeldConnection) -> AsyncIterator[asyncpg.Connection]:
        if self in theirs and not gate.is_set():
            waiting.set()
            await gate.wait()  # the pool has no connection to spare yet
        async with use(self) as conn:
            yield conn

    execute = Settler._execute

    async def write_while_the_claim_waits(
        self: Settler, conn: asyncpg.Connection, statements: Any
    ) -> Any:
        if head in self._writing.ids() and not gate.is_set():
            await asyncio.wait_for(waiting.wait(), 20)  # a claim awaits its connection
        return await execute(self, conn, statements)

    monkeypatch.setattr(Dispatcher, "__init__", remember)
    monkeypatch.setattr(HeldConnection, "use", slow_acquire)
    monkeypatch.setattr(Settler, "_execute", write_while_the_claim_waits)
    runs: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        runs.append(event.attempts)
        if len(runs) == 1:
            gate.clear()  # from now on a claim waits for its connection
            raise RuntimeError("poison")

    consumer = aiooutbox.OutboxConsumer(pool, worker_id="w", poll_interval=0.1)
    gate.set()
    async with running(consumer, {"t": aiooutbox.Handler(handle, on_dead="block")}):
        # the dead outcome is written while a claim waits, and ends before it is sent
        await wait_until(lambda: _status_is(pool, head, "dead"), timeout=20)
        assert waiting.is_set() and not gate.is_set()
        assert await admin.dead_retry(pool, ids=[head]) == {"t": 1}
        gate.set()
        took = await wait_until(lambda: _done(pool, head), timeout=25)
        print(f"the retried head was done {took:.2f} s after its connection was given")
    assert runs == [1, 1]
    assert took < 10, took  # not a lease (30 s) later


async def _status_is(pool: asyncpg.Pool, event_id: int, status: str) -> bool:
    got = await pool.fetchval("SELECT status::text FROM outbox_events_all WHERE id = $1", event_id)
    return bool(got == status)
