"""An outcome of a lapsed claim must not settle the same consumer's next claim of the row.

Lease recovery gives a run member its attempt back, so when the consumer whose lease
lapsed claims the key again, its new claim of that member has the same worker and
attempt as the old one: an outcome of the old claim still waiting in the settler would
pass the settlement's fence and settle a row that is about to run (seen once in sixteen
runs of the ordering SIGKILL test with a frozen event loop: a stale `done` landed on the
new claim, which then ran the event on a row already `done`; a stale retry would have
let a second consumer take the key while the first ran it). The claim drops such
outcomes before they are written (`Settler.drop_stale`).
"""

from __future__ import annotations

import anyio
import asyncpg
import pytest

import aiooutbox
from aiooutbox._engine.rows import ClaimedRow
from aiooutbox._engine.settler import Settler
from aiooutbox._sql.statements import queries

Q = queries()


async def _claim(pool: asyncpg.Pool) -> dict[int, int]:
    """Claim the key's run as worker "w": {id: attempts}."""
    rows = await pool.fetch(Q.claim, "w", 30.0, ["t"], 10, 1 << 30, 10, 20)
    return {r["id"]: r["attempts"] for r in rows}


async def _row(pool: asyncpg.Pool, event_id: int) -> tuple[str, str | None, int]:
    row = await pool.fetchrow(
        "SELECT status::text, locked_by, attempts FROM outbox_events WHERE id = $1", event_id
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
