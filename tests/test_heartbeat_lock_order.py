"""The lease heartbeat locks its rows in id order, as the settlements do, so the two
never deadlock over rows of the same consumer."""

from __future__ import annotations

import asyncio

import asyncpg

from aiooutbox._sql.statements import queries

from .helpers import wait_until

Q = queries()


async def test_a_heartbeat_locks_in_id_order_and_never_deadlocks_a_settlement(
    dsn: str,
) -> None:
    # three claimed rows, the first moved to the heap's end, and the heartbeat's session
    # pushed to a bitmap scan (heap order: second, third, first). A settlement holds the
    # first and then wants the third: a heartbeat that took the third first and waited
    # for the first deadlocked with it (SQLSTATE 40P01, one of the two aborted)
    worker = "w"
    settler, beat, watch = [await asyncpg.connect(dsn) for _ in range(3)]
    try:
        ids = [
            r[0]
            for r in await watch.fetch(
                "INSERT INTO outbox_events (topic, payload)"
                " SELECT 't', '{}' FROM generate_series(1, 3) RETURNING id"
            )
        ]
        first, last = min(ids), max(ids)
        assert len(await watch.fetch(Q.claim, worker, 30.0, ["t"], 10, 1 << 30, 0, 0)) == 3
        # an indexed column, so not a HOT update: the index then points at the new end
        await watch.execute(
            "UPDATE outbox_events SET lease_expires_at = lease_expires_at + interval '1 second'"
            " WHERE id = $1",
            first,
        )
        order = [r[0] for r in await watch.fetch("SELECT id FROM outbox_events ORDER BY ctid")]
        assert order[-1] == first, order
        await beat.execute("SET enable_indexscan = off; SET enable_seqscan = off")
        pid = beat.get_server_pid()

        async def waiting() -> bool:
            return bool(
                await watch.fetchval(
                    "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
                )
            )

        async with settler.transaction():
            await settler.execute("SELECT 1 FROM outbox_events WHERE id = $1 FOR UPDATE", first)
            extending = asyncio.ensure_future(beat.fetch(Q.extend_leases, ids, worker, 30.0))
            await wait_until(waiting, 10)
            await settler.execute("SELECT 1 FROM outbox_events WHERE id = $1 FOR UPDATE", last)
        kept = await asyncio.wait_for(extending, 10)
        assert sorted(r["id"] for r in kept) == sorted(ids)
    finally:
        for conn in (settler, beat, watch):
            await conn.close()
