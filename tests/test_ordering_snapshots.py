"""Ordered delivery whatever the producer's isolation level (migration 0013).

A producer at REPEATABLE READ or SERIALIZABLE decides head-or-waiting through its
transaction's snapshot, which can predate the key's events. Two ways that went wrong:
a snapshot from before the key's head existed inserted a second head while the first
ran (two events of one key at once), and a snapshot that still showed a finished head
put the new event behind it, waiting for a promotion that had already happened (never
handled). Here each is staged with a real consumer and a handler that holds the head,
and the run log is checked with SQL; then the SQL that keeps one run per key is called
directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import asyncpg
import pytest

import aiooutbox
from aiooutbox._sql.statements import queries
from tests.faults.ordered_proc import RUNS_DDL
from tests.helpers import all_in, running, wait_until
from tests.ordered_producers import HOWS, ISOLATIONS, insert_ordered, produce

Q = queries()
WORKER = "snapshots"

OVERLAPS = """
SELECT count(*) FROM runs a JOIN runs b ON a.okey = b.okey AND a.run < b.run
WHERE a.started < coalesce(b.ended, 'infinity') AND b.started < coalesce(a.ended, 'infinity')
"""


@pytest.fixture
async def runs(pool: asyncpg.Pool) -> asyncpg.Pool:
    await pool.execute(RUNS_DDL)
    return pool


def _holding(pool: asyncpg.Pool, release: asyncio.Event) -> aiooutbox.HandlerFunc:
    """Records every run; the run of seq 0 waits for ``release``."""

    async def handle(event: aiooutbox.Event) -> None:
        run = await pool.fetchval(
            "INSERT INTO runs (event_id, okey, seq, worker, attempt) VALUES ($1, $2, $3, 'w', $4)"
            " RETURNING run",
            event.id,
            event.ordering_key,
            event.payload["seq"],
            event.attempts,
        )
        if event.payload["seq"] == 0:
            await release.wait()
        await pool.execute(
            "UPDATE runs SET ended = clock_timestamp(), outcome = 'ok' WHERE run = $1", run
        )

    return handle


def _started(pool: asyncpg.Pool, seq: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return bool(await pool.fetchval("SELECT count(*) FROM runs WHERE seq = $1", seq))

    return check


def _payloads(how: str) -> list[dict[str, int]]:
    return [{"seq": 1}, {"seq": 2}] if how == "enqueue_many" else [{"seq": 1}]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("isolation", ISOLATIONS)
async def test_a_snapshot_from_before_the_head_never_starts_a_second_run_of_the_key(
    runs: asyncpg.Pool, isolation: str, how: str
) -> None:
    release = asyncio.Event()
    consumer = aiooutbox.OutboxConsumer(runs, concurrency=8, poll_interval=0.1)
    async with running(consumer, {"t": _holding(runs, release)}):

        async def meanwhile() -> None:
            # after the producer's snapshot: a READ COMMITTED producer's event of the key
            # is claimed and starts (its handler holds it)
            await aiooutbox.enqueue(runs, "t", {"seq": 0}, ordering_key="k")
            await wait_until(_started(runs, 0), timeout=20)

        ids, refused = await produce(
            runs, isolation, how, "k", _payloads(how), after_snapshot=meanwhile
        )
        await asyncio.sleep(0.5)  # time enough for a wrongly claimable event to start
        started = await runs.fetchval("SELECT count(*) FROM runs")
        release.set()
        await wait_until(all_in(runs, "done", 1 + len(ids)), timeout=20)
    assert started == 1, "an event of the key started while its head ran"
    assert await runs.fetchval(OVERLAPS) == 0
    order = [r[0] for r in await runs.fetch("SELECT seq FROM runs ORDER BY started")]
    assert order == [0, *range(1, 1 + len(ids))]
    # the stale snapshot was refused (then tried again), not trusted
    assert refused and all(isinstance(e, asyncpg.UniqueViolationError) for e in refused), refused
    assert "outbox_events_key_head_idx" in str(refused[0])


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("isolation", ISOLATIONS)
async def test_a_snapshot_that_shows_a_finished_head_does_not_leave_the_event_waiting(
    runs: asyncpg.Pool, isolation: str, how: str
) -> None:
    release = asyncio.Event()
    consumer = aiooutbox.OutboxConsumer(runs, concurrency=8, poll_interval=0.1)
    async with running(consumer, {"t": _holding(runs, release)}):
        await aiooutbox.enqueue(runs, "t", {"seq": 0}, ordering_key="k")
        await wait_until(_started(runs, 0), timeout=20)

        async def meanwhile() -> None:
            # after the snapshot (which shows the head running): the head finishes and
            # its settlement finds nothing to promote
            release.set()
            await wait_until(all_in(runs, "done", 1), timeout=20)

        ids, refused = await produce(
            runs, isolation, how, "k", _payloads(how), after_snapshot=meanwhile
        )
        await wait_until(all_in(runs, "done", 1 + len(ids)), timeout=10)
    assert refused and all(isinstance(e, asyncpg.SerializationError) for e in refused), refused
    assert "ordering key 'k'" in str(refused[0])
    assert await runs.fetchval(OVERLAPS) == 0


@pytest.mark.parametrize("isolation", ISOLATIONS)
async def test_a_snapshot_that_still_holds_is_not_refused(
    pool: asyncpg.Pool, isolation: str
) -> None:
    """No needless refusals: a key whose events the snapshot shows as they are, an idle
    key, and several events of one key in one statement all go in at the first try."""
    head = await aiooutbox.enqueue(pool, "t", {"seq": 0}, ordering_key="busy")
    await pool.fetch(Q.claim, WORKER, 60.0, ["t"], 10, 1 << 30, 0, 0)  # the head runs

    async def meanwhile() -> None:
        await aiooutbox.enqueue(pool, "t", {"seq": 0}, ordering_key="other")

    for key, how in (("busy", "enqueue"), ("busy", "raw_sql"), ("idle", "enqueue_many")):
        payloads = [{"seq": n} for n in range(1, 4)]
        ids, refused = await produce(pool, isolation, how, key, payloads, after_snapshot=meanwhile)
        assert refused == [], (key, how, refused)
        statuses = [
            r[0]
            for r in await pool.fetch(
                "SELECT status::text FROM outbox_events_all WHERE id = ANY ($1) ORDER BY id", ids
            )
        ]
        assert statuses == (["waiting"] * 3 if key == "busy" else ["pending", "waiting", "waiting"])
    assert head is not None


async def test_one_row_stands_for_each_running_key(pool: asyncpg.Pool) -> None:
    """The claim flags one processing row per key in the one-head index: a head claimed
    alone, else the highest row of the run claimed behind it (it runs last). A failure
    and a lease recovery hand the key on without ever holding two rows of it there."""
    per_key = {"alone": 1, "run": 4, "other": 3}
    # producers whose snapshots predate every event of these keys
    stale = [await pool.acquire() for _ in per_key]
    try:
        for conn in stale:
            await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            await conn.fetchval("SELECT count(*) FROM outbox_events_all")
        ids = {
            key: await aiooutbox.enqueue_many(
                pool,
                [aiooutbox.NewEvent("t", {"seq": n}, ordering_key=key) for n in range(count)],
            )
            for key, count in per_key.items()
        }
        rows = await pool.fetch(Q.claim, WORKER, 60.0, ["t"], 10, 1 << 30, 256, 20)
        assert len(rows) == 8
        flagged = dict(
            await pool.fetch(
                "SELECT ordering_key, array_agg(id) FROM outbox_events_all"
                " WHERE status = 'processing' AND holds_key GROUP BY 1"
            )
        )
        assert flagged == {
            "alone": [ids["alone"][0]],
            "run": [ids["run"][3]],
            "other": [ids["other"][2]],
        }
        # a head from a stale snapshot is refused beside every one of them
        for key, conn in zip(per_key, stale, strict=True):
            with pytest.raises(asyncpg.UniqueViolationError, match="outbox_events_key_head_idx"):
                await aiooutbox.enqueue(conn, "t", {"seq": 9}, ordering_key=key)
    finally:
        for conn in stale:
            await conn.execute("ROLLBACK")
            await pool.release(conn)

    # "run": its head done, its second row fails, the rest given back unrun
    run = ids["run"]
    assert (await pool.fetchrow(Q.settle_done, [run[0]], WORKER, 1))["settled"] == 1
    failed = await pool.fetchrow(
        Q.settle_failed,
        run[1:],
        [0.0, 0.0, 0.0],
        ["boom", "", ""],
        ["retry", "unrun", "unrun"],
        WORKER,
        1,
    )
    assert failed["settled"] == 3
    statuses = dict(
        await pool.fetch("SELECT id, status::text FROM outbox_events_all WHERE id = ANY ($1)", run)
    )
    assert [statuses[i] for i in run] == ["done", "retry", "waiting", "waiting"]

    # "other": its lease expires; recovery puts its lowest row back, the rest waits
    await pool.execute(
        "UPDATE outbox_events SET lease_expires_at = now() - interval '1 second'"
        " WHERE ordering_key = 'other'"
    )
    recovered = await pool.fetch(Q.recover_expired, 1000)
    assert sorted(r["status"] for r in recovered) == ["retry", "waiting", "waiting"]
    remaining = await pool.fetch(
        "SELECT ordering_key FROM outbox_events_all WHERE holds_key AND status = 'processing'"
    )
    assert [r[0] for r in remaining] == ["alone"]

    # and everything drains, in order, from there
    assert (await pool.fetchrow(Q.settle_done, ids["alone"], WORKER, 1))["settled"] == 1
    seen: list[tuple[str, int]] = []

    async def handle(event: aiooutbox.Event) -> None:
        seen.append((event.ordering_key or "", event.payload["seq"]))

    async with running(aiooutbox.OutboxConsumer(pool, poll_interval=0.1), {"t": handle}):
        await wait_until(all_in(pool, "done", 8), timeout=20)
    assert [s for k, s in seen if k == "run"] == [1, 2, 3]
    assert [s for k, s in seen if k == "other"] == [0, 1, 2]


async def test_insert_ordered_covers_every_way_in(pool: asyncpg.Pool) -> None:
    # the helper the ordering tests build on inserts, in order, whichever way it is asked
    for how in HOWS:
        async with pool.acquire() as conn:
            ids = await insert_ordered(conn, how, "t", f"k-{how}", [{"seq": 0}, {"seq": 1}])
        assert ids == sorted(ids) and len(ids) == 2
