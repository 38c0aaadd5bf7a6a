"""Lease recovery never hands a key on while the rest of its run is still held.

A worker runs an ordered key's run one event after another and records each outcome in
its settler; the heartbeat renews only the claims still held, so the lease of an event
that has finished, whose outcome waits to be written, keeps its old end. When that
write is late (a slow or retried flush on a loaded machine), the finished event's lease
expires while the later events of its run, renewed, still run. Recovery then put the
finished event back to `retry`: the key had a claimable head again while its run was
under way, and the next claim took it with the waiting events *after* the run, which
ran before the run's own later events (seen as one run out of order in the SIGKILL
ordering test). SQL-level steps, no timing: the expired lease is set by hand.
"""

from __future__ import annotations

import asyncpg

import aiooutbox
from aiooutbox._engine.options import DEFAULT_MAX_CLAIM_BYTES as MAX_BYTES
from aiooutbox._sql.statements import queries

Q = queries()


async def _statuses(pool: asyncpg.Pool, ids: list[int]) -> list[tuple[str, str | None]]:
    rows = await pool.fetch(
        "SELECT status::text, locked_by FROM outbox_events_all WHERE id = ANY($1) ORDER BY id", ids
    )
    return [(r[0], r[1]) for r in rows]


async def _run_claimed_by_a(pool: asyncpg.Pool) -> list[int]:
    ids = await aiooutbox.enqueue_many(
        pool, [aiooutbox.NewEvent("t", {"seq": n}, ordering_key="k") for n in range(5)]
    )
    # worker A claims the head with two events behind it: e1, e2, e3; e4, e5 wait
    got = await pool.fetch(Q.claim, "A", 30.0, ["t"], 1, MAX_BYTES, 2, 2)
    assert [r["id"] for r in got] == ids[:3]
    return [i for i in ids if i is not None]


async def test_recovery_leaves_a_finished_head_whose_run_is_still_held(
    pool: asyncpg.Pool,
) -> None:
    e = await _run_claimed_by_a(pool)
    # A ran e1 (its outcome not yet written) and runs e2; e1's lease was not renewed
    await pool.execute(
        "UPDATE outbox_events SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
        e[0],
    )
    await pool.fetch(Q.recover_expired, 1000)
    # e1 stays A's: the rest of its run is still held, so nothing of the key moves
    assert await _statuses(pool, e) == [("processing", "A")] * 3 + [("waiting", None)] * 2
    # no other worker can claim any event of the key meanwhile
    assert await pool.fetch(Q.claim, "B", 30.0, ["t"], 10, MAX_BYTES, 10, 10) == []
    # A's late outcome for e1 is still written, and the run goes on in order
    done = await pool.fetchrow(Q.settle_done, [e[0]], "A", 1)
    assert done["settled"] == 1


async def test_recovery_takes_a_run_whole_once_every_lease_of_it_expired(
    pool: asyncpg.Pool,
) -> None:
    e = await _run_claimed_by_a(pool)
    await pool.execute(
        "UPDATE outbox_events SET lease_expires_at = now() - interval '1 second'"
        " WHERE id = ANY($1)",
        e[:3],
    )
    # a batch limit that cuts the run: the key's other expired rows come with it
    await pool.fetch(Q.recover_expired, 1)
    assert [s for s, _ in await _statuses(pool, e)] == ["retry"] + ["waiting"] * 4
    # B gets the key from its first event, in order
    got = await pool.fetch(Q.claim, "B", 30.0, ["t"], 1, MAX_BYTES, 10, 10)
    assert [r["id"] for r in got] == e


async def test_recovery_leaves_a_run_another_recovery_holds_part_of(pool: asyncpg.Pool) -> None:
    """Two consumers recover at once after a SIGKILL: each locks what the other has
    not (SKIP LOCKED), so one run's rows can be split between them. The one that took
    the head put it back to `retry` while the other's rows were still `processing`:
    the next claim ran the waiting events after them first."""
    e = await _run_claimed_by_a(pool)
    await pool.execute(
        "UPDATE outbox_events SET lease_expires_at = now() - interval '1 second'"
        " WHERE id = ANY($1)",
        e[:3],
    )
    async with pool.acquire() as other, other.transaction():
        # the other recovery holds e2 (locked, not yet written)
        await other.execute("SELECT 1 FROM outbox_events WHERE id = $1 FOR UPDATE", e[1])
        assert await pool.fetch(Q.recover_expired, 1000) == []
        assert [s for s, _ in await _statuses(pool, e)] == ["processing"] * 3 + ["waiting"] * 2
    # once nobody holds any of it, the run goes back whole, in order
    await pool.fetch(Q.recover_expired, 1000)
    got = await pool.fetch(Q.claim, "B", 30.0, ["t"], 1, MAX_BYTES, 10, 10)
    assert [r["id"] for r in got] == e
