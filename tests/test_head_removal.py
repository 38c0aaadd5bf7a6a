"""Every way a key's head can leave leads to its next event, on a real PostgreSQL.

An ordered key moves on when its head (the one claimable or running event of the key,
or a dead one that blocks it) is settled or removed: the next waiting event is promoted.
Each path that removes or settles a head is driven here with a consumer running:
purges of dead events (`purge --status dead`, `dead purge`), with and without a
producer holding the key's lock at that moment; lease recovery; settlements whose
promotion a producer's lock deferred until the consumer stopped; and an operator's own
`DELETE` in SQL. The orphan sweep (`orphan_sweep_interval`) heals what no path could.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest

import aiooutbox
from aiooutbox import admin
from aiooutbox._sql.plans import nested_plans
from aiooutbox._sql.statements import queries
from aiooutbox.errors import InvalidArgument
from tests.helpers import insert_unchecked, running, status_counts, wait_until

Q = queries()
FAST = aiooutbox.RetryPolicy(base=0.02, max_delay=0.1)
BOUND = 15.0  # generous: every heal below takes well under a second when it works
SWEEP = 0.3  # the consumers' orphan sweep in the tests that rely on it


async def _statuses(pool: asyncpg.Pool, ids: list[int]) -> list[str]:
    rows = await pool.fetch(
        "SELECT id, status::text FROM outbox_events_all WHERE id = ANY ($1::bigint[])", ids
    )
    got = {r["id"]: r["status"] for r in rows}
    return [got.get(i, "deleted") for i in ids]


def _statuses_are(pool: asyncpg.Pool, ids: list[int], status: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return all(s == status for s in await _statuses(pool, ids))

    return check


async def _healed(pool: asyncpg.Pool, ids: list[int], seen: list[int], what: str) -> None:
    """Wait for ``ids`` to be handled, in order; say how long it took (or how it stuck)."""
    start = time.monotonic()
    try:
        took = await wait_until(_statuses_are(pool, ids, "done"), timeout=BOUND)
    except AssertionError:
        raise AssertionError(
            f"{what}: after {time.monotonic() - start:.1f}s the key's events are "
            f"{await _statuses(pool, ids)} (seen {seen}; all: {await status_counts(pool)})"
        ) from None
    print(f"{what}: the key moved on after {took:.2f}s")
    assert [i for i in seen if i in ids] == ids


def _recorder(seen: list[int], poison: set[int]) -> aiooutbox.Handler:
    async def handle(event: aiooutbox.Event) -> None:
        if event.id in poison:
            raise aiooutbox.Dead("bad data")
        seen.append(event.id)

    return aiooutbox.Handler(handle, on_dead="block")


async def _ordered(pool: asyncpg.Pool, n: int, key: str = "k", **kwargs: object) -> list[int]:
    ids = []
    for seq in range(n):
        event_id = await aiooutbox.enqueue(pool, "t", {"seq": seq}, ordering_key=key, **kwargs)  # type: ignore[arg-type]
        assert event_id is not None
        ids.append(event_id)
    return ids


async def _block(pool: asyncpg.Pool, event_id: int) -> None:
    """Make ``event_id`` a dead head that blocks its key (as ``on_dead="block"`` does)."""
    await pool.execute(
        "UPDATE outbox_events SET status = 'dead', blocks_key = true, finished_at = now()"
        " - interval '1 hour' WHERE id = $1",
        event_id,
    )


class Producer:
    """A producer's open transaction that has enqueued one event of ``key``: it holds
    the key's lock (taken by the insert trigger) until `commit`."""

    def __init__(self, conn: asyncpg.Connection, tx: object, event_id: int) -> None:
        self.conn = conn
        self._tx = tx
        self.event_id = event_id

    async def commit(self) -> None:
        await self._tx.commit()  # type: ignore[attr-defined]


@pytest.fixture
async def producer(pool: asyncpg.Pool) -> AsyncIterator[Callable[[str], Awaitable[Producer]]]:
    held: list[tuple[asyncpg.Connection, object]] = []

    async def start(key: str) -> Producer:
        conn = await pool.acquire()
        tx = conn.transaction()
        await tx.start()
        held.append((conn, tx))
        event_id = await aiooutbox.enqueue(conn, "t", {"seq": 99}, ordering_key=key)
        assert event_id is not None
        # the key's lock is held by this open transaction
        locks = await pool.fetchval(
            # the key's lock (the insert's position lock, migration 0019, is shared)
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = $1"
            " AND mode = 'ExclusiveLock'",
            await conn.fetchval("SELECT pg_backend_pid()"),
        )
        assert locks == 1
        return Producer(conn, tx, event_id)

    yield start
    for conn, tx in held:
        if not conn.is_closed() and conn.is_in_transaction():
            await tx.rollback()  # type: ignore[attr-defined]
        await pool.release(conn)


# -- purges of dead events ---------------------------------------------------------------


async def test_purge_status_dead_of_a_blocking_head_lets_the_key_move_on(
    pool: asyncpg.Pool,
) -> None:
    """`purge --status dead` deleted a blocking dead head and never promoted the next
    event: the key stayed `waiting` with a consumer running."""
    poison, *later = await _ordered(pool, 3)
    seen: list[int] = []
    consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.1, retry=FAST)
    async with running(consumer, {"t": _recorder(seen, {poison})}):
        await wait_until(_statuses_are(pool, [poison], "dead"), timeout=BOUND)
        await asyncio.sleep(0.3)
        assert await _statuses(pool, later) == ["waiting", "waiting"]  # blocked, as asked
        assert await admin.purge(pool, status="dead", older_than=0) == 1
        await _healed(pool, later, seen, "purge --status dead")


@pytest.mark.parametrize("how", ["dead purge", "purge --status dead"])
async def test_purging_a_blocking_head_while_a_producer_holds_the_key_lock(
    pool: asyncpg.Pool, producer: Callable[[str], Awaitable[Producer]], how: str
) -> None:
    """`dead purge` promoted with a try-lock and dropped the keys a producer's lock made
    it skip: the key hung. The purge now waits for that producer (a few milliseconds in
    practice: the lock lives as long as the producer's transaction) and promotes."""
    head, waiting = await _ordered(pool, 2)
    await _block(pool, head)
    seen: list[int] = []
    consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.1, retry=FAST)
    async with running(consumer, {"t": _recorder(seen, set())}):
        busy = await producer("k")  # a producer inserts into the key and has not committed
        if how == "dead purge":
            purge = asyncio.ensure_future(admin.dead_purge(pool, ids=[head]))
        else:
            purge = asyncio.ensure_future(admin.purge(pool, status="dead", older_than=60))
        await asyncio.sleep(0.5)
        await busy.commit()
        assert await asyncio.wait_for(purge, BOUND) == 1
        await _healed(pool, [waiting, busy.event_id], seen, f"{how} beside a producer")


async def test_dead_purge_of_non_blocking_dead_events_leaves_live_keys_alone(
    pool: asyncpg.Pool,
) -> None:
    """A dead event that does not block is not a head: purging it never promotes past
    the key's real head."""
    dead, head, waiting = await _ordered(pool, 3)
    await pool.execute(
        "UPDATE outbox_events SET status = 'dead', finished_at = now() WHERE id = $1", dead
    )
    assert await _statuses(pool, [head, waiting]) == ["waiting", "waiting"]
    await pool.fetchrow(Q.promote, ["k"])  # the key moved on past the dead event
    assert await _statuses(pool, [head, waiting]) == ["pending", "waiting"]
    assert await admin.dead_purge(pool, everything=True) == 1
    assert await _statuses(pool, [dead, head, waiting]) == ["deleted", "pending", "waiting"]


# -- lease recovery -----------------------------------------------------------------------


async def test_lease_recovery_to_dead_beside_a_producer_holding_the_key_lock(
    pool: asyncpg.Pool, producer: Callable[[str], Awaitable[Producer]]
) -> None:
    """A head whose worker died on its last attempt goes `dead` through lease recovery,
    which promotes with a try-lock and dropped the key a producer held: the key hung
    until a consumer restarted. The sweep heals it."""
    head = (await _ordered(pool, 1, max_attempts=1))[0]
    claimed = await pool.fetch(Q.claim, "ghost", 30.0, ["t"], 10, 1 << 40, 0, 0)
    assert [r["id"] for r in claimed] == [head]
    waiting = (await _ordered(pool, 1))[0]
    await pool.execute(
        "UPDATE outbox_events SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
        head,
    )
    busy = await producer("k")
    seen: list[int] = []
    consumer = aiooutbox.OutboxConsumer(
        pool, poll_interval=0.1, retry=FAST, lease_timeout=2, orphan_sweep_interval=SWEEP
    )
    async with running(consumer, {"t": _recorder(seen, set())}):
        await wait_until(_statuses_are(pool, [head], "dead"), timeout=BOUND)
        await busy.commit()
        await _healed(pool, [waiting, busy.event_id], seen, "lease recovery to dead")


async def test_lease_recovery_split_across_batches_keeps_one_head_in_order(
    pool: asyncpg.Pool,
) -> None:
    """A crashed consumer's run (head and the events behind it) cut by the recovery's
    batch limit: the head went back to `retry` in the first batch, and the second sent
    the rest of the run to `retry` too (a unique violation that failed every later
    recovery) or, after a dead head, let a later event jump ahead of an earlier one.
    Since 0015 a batch that takes part of a run takes the rest of it too, when its
    leases expired as well (a key whose rows are still running is left whole: the next
    claim would otherwise have taken its head while the rest of its run was held)."""
    for max_attempts, head_after in ((5, "retry"), (1, "dead")):
        await pool.execute("TRUNCATE outbox_events, outbox_events_done")
        ids = await _ordered(pool, 4, key=f"k{max_attempts}", max_attempts=max_attempts)
        claimed = await pool.fetch(Q.claim, "ghost", 30.0, ["t"], 10, 1 << 40, 10, 10)
        assert sorted(r["id"] for r in claimed) == ids
        # the head and the first event behind it expire first: a batch of two cuts there
        await pool.execute(
            "UPDATE outbox_events SET lease_expires_at = now() - interval '10 seconds'"
            " + id * interval '1 millisecond'"
        )
        first = await pool.fetch(Q.recover_expired, 2)
        assert sorted(r["id"] for r in first) == ids  # the rest of the run came with them
        assert await pool.fetch(Q.recover_expired, 10) == []
        if head_after == "retry":
            expected = ["retry", "waiting", "waiting", "waiting"]
        else:  # the dead head's key moves on to its next event, not a later one
            expected = ["dead", "pending", "waiting", "waiting"]
        assert await _statuses(pool, ids) == expected, max_attempts
        attempts = await pool.fetch(
            "SELECT attempts FROM outbox_events_all WHERE id = ANY ($1::bigint[]) ORDER BY id", ids
        )
        assert [r[0] for r in attempts] == [1, 0, 0, 0]  # given back behind the head


async def test_lease_recovery_of_runs_reads_the_key_and_primary_key_indexes(
    pool: asyncpg.Pool,
) -> None:
    """Recovering runs looks at the earlier events of each key through the key index
    and updates through the primary key, beside a key with a large backlog."""
    await insert_unchecked(
        pool,
        "INSERT INTO outbox_events (topic, payload, ordering_key, status)"
        " SELECT 't', '{}', 'big', 'waiting' FROM generate_series(1, 5000)",
    )
    await aiooutbox.enqueue_many(
        pool,
        [aiooutbox.NewEvent("t", {}, ordering_key=f"k{k}") for _ in range(4) for k in range(50)],
    )
    claimed = await pool.fetch(Q.claim, "ghost", 30.0, ["t"], 100, 1 << 40, 10, 200)
    assert len(claimed) == 200
    await pool.execute(
        "UPDATE outbox_events SET lease_expires_at = now() - interval '1 second'"
        " WHERE status = 'processing'"
    )
    await pool.execute("ANALYZE outbox_events")
    async with pool.acquire() as conn:
        plans = await nested_plans(conn, Q, [("recover", Q.recover_expired, (1000,))])
    plan = plans["recover"]
    assert "Seq Scan" not in plan, plan
    assert "outbox_events_key_idx" in plan and "outbox_events_pkey" in plan, plan


# -- settlements ----------------------------------------------------------------------------


async def test_a_promotion_a_producer_deferred_is_retried_while_the_consumer_runs(
    pool: asyncpg.Pool, producer: Callable[[str], Awaitable[Producer]]
) -> None:
    gate = asyncio.Event()
    seen: list[int] = []
    head = (await _ordered(pool, 1))[0]

    async def handle(event: aiooutbox.Event) -> None:
        if event.id == head:
            await gate.wait()
        seen.append(event.id)

    consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.1)
    async with running(consumer, {"t": handle}):
        await wait_until(_statuses_are(pool, [head], "processing"), timeout=BOUND)
        waiting = (await _ordered(pool, 1))[0]
        busy = await producer("k")
        gate.set()
        await wait_until(_statuses_are(pool, [head], "done"), timeout=BOUND)
        await asyncio.sleep(0.3)
        assert await _statuses(pool, [waiting]) == ["waiting"]  # deferred: the lock is held
        await busy.commit()
        await _healed(pool, [head, waiting, busy.event_id], seen, "deferred promotion")


async def test_a_promotion_deferred_past_a_consumers_stop_is_made_by_another_consumer(
    pool: asyncpg.Pool, producer: Callable[[str], Awaitable[Producer]]
) -> None:
    """Consumer A finishes a head while a producer holds the key's lock, and stops
    before the lock is released: its deferred promotion was dropped, and consumer B,
    running all along, never promoted the key (only a consumer's start looked)."""
    gate = asyncio.Event()
    seen: list[int] = []
    head = (await _ordered(pool, 1))[0]

    async def handle(event: aiooutbox.Event) -> None:
        if event.id == head:
            await gate.wait()
        seen.append(event.id)

    a = aiooutbox.OutboxConsumer(pool, poll_interval=0.1, worker_id="a")
    b = aiooutbox.OutboxConsumer(
        pool, poll_interval=0.1, worker_id="b", orphan_sweep_interval=SWEEP
    )
    task_a = asyncio.ensure_future(a.run({"t": handle}))
    try:
        await wait_until(_statuses_are(pool, [head], "processing"), timeout=BOUND)
        waiting = (await _ordered(pool, 1))[0]  # behind the running head, not in its run
        async with running(b, {"t": handle}):
            await asyncio.sleep(0.3)  # b has started (and looked for orphans: none)
            busy = await producer("k")
            gate.set()
            await wait_until(_statuses_are(pool, [head], "done"), timeout=BOUND)
            a.stop()
            await asyncio.wait_for(task_a, 30)  # its last flush could not promote either
            assert await _statuses(pool, [waiting]) == ["waiting"]
            await busy.commit()
            await _healed(pool, [head, waiting, busy.event_id], seen, "promotion lost at stop")
    finally:
        a.stop()
        await asyncio.wait_for(task_a, 30)


async def test_a_settler_closed_with_a_deferred_promotion_gives_its_connection_back(
    pool: asyncpg.Pool, producer: Callable[[str], Awaitable[Producer]]
) -> None:
    """The consumer closes its settler (the final flush) while the settler's loop still
    runs; a promotion a producer's lock deferred used to be retried after that, on a
    connection taken again and never given back: the pool's close() then waited for it
    for ever (a teardown timeout in one run of three of the test above)."""
    import anyio

    from aiooutbox._engine.settler import Settler

    head, _waiting = await _ordered(pool, 2)
    q = queries()
    claimed = await pool.fetch(q.claim, "w", 30.0, ["t"], 1, 1 << 30, 0, 0)
    assert [r["id"] for r in claimed] == [head]
    busy = await producer("k")  # holds the key's lock: the promotion is deferred
    in_use = pool.get_size() - pool.get_idle_size()
    settler = Settler(pool, q, "w", flush_interval=0.001, flush_size=100, statement_timeout=5)
    async with anyio.create_task_group() as tg:
        tg.start_soon(settler.run)
        settler.done(head, 1)
        await wait_until(_statuses_are(pool, [head], "done"), timeout=BOUND)
        await settler.close(timeout=5)
        # many retry periods of the deferred promotion pass before the loop is cancelled
        with anyio.move_on_after(0.5):
            await anyio.sleep_forever()
        tg.cancel_scope.cancel()
    assert settler.is_closed()
    assert pool.get_size() - pool.get_idle_size() == in_use, "the settler kept a connection"
    await busy.commit()


# -- an operator's own SQL --------------------------------------------------------------------


@pytest.mark.parametrize("head_is", ["pending", "blocking dead"])
async def test_an_operator_deleting_a_head_in_sql_is_healed_by_the_sweep(
    pool: asyncpg.Pool, head_is: str
) -> None:
    """`DELETE FROM outbox_events WHERE id = <head>` by hand: nothing promotes in the
    statement itself; a running consumer's sweep does, within its interval."""
    head, waiting = await _ordered(pool, 2)
    if head_is == "pending":  # a head due in an hour: nobody holds it
        await pool.execute(
            "UPDATE outbox_events SET available_at = now() + interval '1 hour' WHERE id = $1",
            head,
        )
    else:
        await _block(pool, head)
    seen: list[int] = []
    consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.1, orphan_sweep_interval=SWEEP)
    async with running(consumer, {"t": _recorder(seen, set())}):
        await asyncio.sleep(0.3)
        assert await _statuses(pool, [head, waiting]) == [
            "pending" if head_is == "pending" else "dead",
            "waiting",
        ]
        await pool.execute("DELETE FROM outbox_events WHERE id = $1", head)
        await _healed(pool, [waiting], seen, f"DELETE of a {head_is} head")


# -- the sweep ------------------------------------------------------------------------------


async def test_the_orphan_sweep_reads_each_key_once_not_each_waiting_event(
    pool: asyncpg.Pool,
) -> None:
    """The periodic sweep's cost is one probe per key with unfinished events: beside a
    key with 20,000 waiting events, its plans stay on the key index and the buffers it
    touches do not grow with that backlog."""
    await insert_unchecked(
        pool,
        "INSERT INTO outbox_events (topic, payload, ordering_key, status)"
        " SELECT 't', '{}', 'big', 'waiting' FROM generate_series(1, 20000)",
    )
    await pool.execute(
        "UPDATE outbox_events SET status = 'dead', blocks_key = true"
        " WHERE id = (SELECT min(id) FROM outbox_events_all)"
    )
    for k in range(100):
        await insert_unchecked(
            pool,
            "INSERT INTO outbox_events (topic, payload, ordering_key, status)"
            " VALUES ('t', '{}', $1, 'pending'), ('t', '{}', $1, 'waiting')",
            f"small{k}",
        )
    await pool.execute("VACUUM ANALYZE outbox_events")
    async with pool.acquire() as conn:
        plans = await nested_plans(conn, Q, [("sweep", Q.orphan_sweep, ())], analyze=True)
    plan = plans["sweep"]
    assert "Seq Scan" not in plan and "Bitmap" not in plan, plan
    assert "outbox_events_key_idx" in plan, plan
    buffers = sum(int(n) for n in re.findall(r"shared hit=(\d+)", plan))
    # ~101 keys, a few buffers each; the big key alone would be 20,000 heap fetches
    assert buffers < 5000, (buffers, plan)


async def test_orphan_sweep_interval_is_checked(pool: asyncpg.Pool) -> None:
    for bad in (0, -1, 0.01):
        with pytest.raises(InvalidArgument, match="orphan_sweep_interval"):
            aiooutbox.OutboxConsumer(pool, orphan_sweep_interval=bad)
    with pytest.raises(TypeError, match="orphan_sweep_interval"):
        aiooutbox.OutboxConsumer(pool, orphan_sweep_interval="5")  # type: ignore[arg-type]
    assert aiooutbox.OutboxConsumer(pool).options.orphan_sweep_interval == 30.0


async def test_run_takes_the_orphan_sweep_interval_and_names_the_flag_when_bad(dsn: str) -> None:
    from aiooutbox.cli import build_parser
    from aiooutbox.cli.consumer_flags import build_options
    from tests.clirunner import cli

    handlers = "tests.cli_handlers:handlers"
    args = build_parser().parse_args(["run", handlers, "--orphan-sweep-interval", "2m"])
    assert build_options(args).orphan_sweep_interval == 120.0
    default = build_parser().parse_args(["run", handlers])
    assert build_options(default).orphan_sweep_interval == 30.0
    bad = await cli("run", handlers, "--orphan-sweep-interval", "0s", "--dsn", dsn)
    assert bad.rc == 2 and "Traceback" not in bad.err, bad.err
    assert "--orphan-sweep-interval must be" in bad.err, bad.err
