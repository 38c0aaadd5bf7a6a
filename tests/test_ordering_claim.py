"""The ordered claim and promotion functions of migration 0006, called directly.

The consumer-level guarantees are in ``test_ordering.py``; these pin down what the SQL
hands out: runs behind every head (shared fairly, inside the byte cap), promotions
that skip a key whose producer holds its lock, and an orphan sweep that visits keys.
"""

from __future__ import annotations

import asyncpg

import aiooutbox
from aiooutbox._engine.options import MAX_RUN, RUN_ROWS_PER_HEAD, run_length
from aiooutbox._sql.plans import nested_plans
from aiooutbox._sql.statements import queries
from tests.helpers import insert_unchecked

Q = queries()
WORKER = "test-claim"


async def _insert(pool: asyncpg.Pool, key: str, status: str, *, payload: str = "{}") -> int:
    """A raw row of ``key`` with the status given: no trigger decides it."""
    rows = await insert_unchecked(
        pool,
        "INSERT INTO outbox_events (topic, payload, ordering_key, status)"
        " VALUES ('t', $1::jsonb, $2, $3::outbox_events_status) RETURNING id",
        payload,
        key,
        status,
    )
    event_id: int = rows[0]["id"]
    return event_id


async def _interleaved(pool: asyncpg.Pool, keys: int, per_key: int) -> dict[int, tuple[str, int]]:
    """``per_key`` events of each of ``keys`` keys, interleaved; id -> (key, seq)."""
    names = [(f"k{k}", seq) for seq in range(per_key) for k in range(keys)]
    events = [aiooutbox.NewEvent("t", {"seq": seq}, ordering_key=key) for key, seq in names]
    ids = await aiooutbox.enqueue_many(pool, events)
    return {i: name for i, name in zip(ids, names, strict=True) if i is not None}


async def _claim(
    pool: asyncpg.Pool, limit: int, run_rows: int, *, max_bytes: int = 1 << 40
) -> list[asyncpg.Record]:
    rows: list[asyncpg.Record] = await pool.fetch(
        Q.claim, WORKER, 30.0, ["t"], limit, max_bytes, 256, run_rows
    )
    return rows


async def test_a_claim_takes_runs_behind_every_head_shared_fairly(pool: asyncpg.Pool) -> None:
    names = await _interleaved(pool, keys=4, per_key=4)
    rows = await _claim(pool, limit=4, run_rows=6)
    got = sorted((names[r["id"]], r["is_head"]) for r in rows)
    # every head, then every key's second event, then the third of the two oldest heads
    assert got == sorted(
        [((f"k{k}", 0), True) for k in range(4)]
        + [((f"k{k}", 1), False) for k in range(4)]
        + [(("k0", 2), False), (("k1", 2), False)]
    )
    statuses = await pool.fetch(
        "SELECT status::text, count(*) FROM outbox_events_all GROUP BY 1 ORDER BY 1"
    )
    assert [tuple(s) for s in statuses] == [("processing", 10), ("waiting", 6)]


def test_a_keys_run_is_twice_its_share_of_the_budget() -> None:
    """The consumer's run length: twice each head's share of the runs' budget (by the
    last claim's heads), at least eight, never more than the claim asks for or
    `MAX_RUN`; one key gets the whole budget."""
    assert run_length(want=2048, heads=1000) == 2 * (RUN_ROWS_PER_HEAD * 2048 // 1000)
    assert run_length(want=2048, heads=1) == MAX_RUN
    assert run_length(want=100, heads=1) == 100
    assert run_length(want=10, heads=5000) == 2 * RUN_ROWS_PER_HEAD
    assert run_length(want=1, heads=0) == 1


async def test_a_run_length_bounds_each_key_and_leaves_the_rest_waiting(
    pool: asyncpg.Pool,
) -> None:
    """Over many keys the run length, not the budget, bounds a key's run: 20 keys with
    30 events each, a budget of 200 and runs of 8 take 20 heads and 8 of each key;
    the rest of each key stays waiting, in order, for the next claim."""
    names = await _interleaved(pool, keys=20, per_key=30)
    rows = await pool.fetch(Q.claim, WORKER, 30.0, ["t"], 20, 1 << 40, 8, 200)
    by_key: dict[str, list[int]] = {}
    for r in rows:
        key, seq = names[r["id"]]
        by_key.setdefault(key, []).append(seq)
    assert len(by_key) == 20
    assert all(sorted(seqs) == list(range(9)) for seqs in by_key.values()), by_key
    waiting = await pool.fetchval("SELECT count(*) FROM outbox_events WHERE status = 'waiting'")
    assert waiting == 20 * (30 - 9)


async def test_a_claim_without_a_run_budget_takes_heads_only(pool: asyncpg.Pool) -> None:
    names = await _interleaved(pool, keys=3, per_key=3)
    rows = await _claim(pool, limit=10, run_rows=0)
    assert sorted(names[r["id"]] for r in rows) == [("k0", 0), ("k1", 0), ("k2", 0)]
    assert all(r["is_head"] for r in rows)


async def test_runs_count_towards_the_byte_cap(pool: asyncpg.Pool) -> None:
    payload = '"' + "x" * 1000 + '"'
    ids = {key: [await _insert(pool, key, "pending", payload=payload)] for key in ("a", "b")}
    for key in ("a", "b"):
        ids[key] += [await _insert(pool, key, "waiting", payload=payload) for _ in range(2)]
    size: int = await pool.fetchval("SELECT pg_column_size(payload) FROM outbox_events_all LIMIT 1")
    # both heads, and room for one run row (the oldest head's next event), not two
    rows = await _claim(pool, limit=2, run_rows=10, max_bytes=3 * size + size // 2)
    assert sorted(r["id"] for r in rows) == sorted([ids["a"][0], ids["b"][0], ids["a"][1]])


async def test_a_promotion_skips_a_key_whose_producer_holds_its_lock(pool: asyncpg.Pool) -> None:
    head = await _insert(pool, "held", "done")
    waiting = await _insert(pool, "held", "waiting")
    assert head < waiting
    lock = "SELECT pg_advisory_xact_lock(hashtextextended('public.outbox_events:' || $1, 0))"
    async with pool.acquire() as producer, producer.transaction():
        await producer.execute(lock, "held")
        row = await pool.fetchrow(Q.promote, ["held", "held", None])
        assert (row["promoted"], row["skipped"]) == (0, ["held"])
        assert await _status(pool, waiting) == "waiting"
    row = await pool.fetchrow(Q.promote, ["held"])
    assert (row["promoted"], row["skipped"]) == (1, [])
    assert await _status(pool, waiting) == "pending"


async def test_a_promotion_leaves_keys_with_a_head_or_a_block(pool: asyncpg.Pool) -> None:
    busy = [await _insert(pool, "busy", s) for s in ("processing", "waiting")]
    blocked = [await _insert(pool, "blocked", s) for s in ("dead", "waiting")]
    await pool.execute("UPDATE outbox_events SET blocks_key = true WHERE id = $1", blocked[0])
    free = [await _insert(pool, "free", s) for s in ("done", "waiting", "waiting")]
    row = await pool.fetchrow(Q.promote, ["busy", "blocked", "free"])
    assert (row["promoted"], row["skipped"]) == (1, [])
    assert [await _status(pool, i) for i in busy + blocked + free] == [
        "processing",
        "waiting",
        "dead",
        "waiting",
        "done",
        "pending",  # the lowest waiting id of the key, and only it
        "waiting",
    ]


async def test_the_orphan_sweep_promotes_only_keys_left_without_a_head(pool: asyncpg.Pool) -> None:
    orphan = [await _insert(pool, "orphan", "waiting") for _ in range(3)]
    headed = [await _insert(pool, "headed", s) for s in ("pending", "waiting")]
    blocked = [await _insert(pool, "blocked", s) for s in ("dead", "waiting")]
    await pool.execute("UPDATE outbox_events SET blocks_key = true WHERE id = $1", blocked[0])
    plain = await pool.fetchval(
        "INSERT INTO outbox_events (topic, payload) VALUES ('t', '{}') RETURNING id"
    )
    row = await pool.fetchrow(Q.promote_orphans)
    assert (row["promoted"], row["skipped"]) == (1, [])
    assert [await _status(pool, i) for i in orphan + headed + blocked + [plain]] == [
        "pending",
        "waiting",
        "waiting",
        "pending",
        "waiting",
        "dead",
        "waiting",
        "pending",
    ]
    # nothing left to do: a second sweep promotes nothing
    assert (await pool.fetchrow(Q.promote_orphans))["promoted"] == 0


async def test_a_blocker_after_a_keys_first_waiting_row_still_holds_the_key(
    pool: asyncpg.Pool,
) -> None:
    """Promotion and the orphan sweep start at a key's first row by id (migration 0021):
    a waiting row whose id comes before its key's blocker (a producer whose id was
    drawn first but whose insert came second) is not promoted; nor is one before a
    dead row that blocks its key. A key whose first waiting row has only done rows
    before it moves on."""
    late = [await _insert(pool, "late", "waiting") for _ in range(2)]
    # the insert trigger makes a row behind a waiting one wait too: the head comes after
    await pool.execute("UPDATE outbox_events SET status = 'pending' WHERE id = $1", late[1])
    held = [await _insert(pool, "held", s) for s in ("waiting", "processing")]
    blocked = [await _insert(pool, "blocked", s) for s in ("waiting", "dead")]
    await pool.execute("UPDATE outbox_events SET blocks_key = true WHERE id = $1", blocked[1])
    free = [await _insert(pool, "free", s) for s in ("done", "waiting", "done", "waiting")]
    ids = late + held + blocked
    before = [await _status(pool, i) for i in ids]
    assert before == ["waiting", "pending", "waiting", "processing", "waiting", "dead"]
    for _ in range(2):
        row = await pool.fetchrow(Q.promote, ["late", "held", "blocked"])
        assert (row["promoted"], row["skipped"]) == (0, [])
    assert [await _status(pool, i) for i in ids] == before
    row = await pool.fetchrow(Q.promote, ["free", "late"])
    assert (row["promoted"], row["skipped"]) == (1, [])
    assert [await _status(pool, i) for i in free] == ["done", "pending", "done", "waiting"]
    # the sweep: "free" has its head now, the others their blockers
    assert (await pool.fetchrow(Q.promote_orphans))["promoted"] == 0
    await pool.execute("UPDATE outbox_events SET status = 'done' WHERE id = $1", free[1])
    row = await pool.fetchrow(Q.promote_orphans)
    assert (row["promoted"], row["skipped"]) == (1, [])
    assert [await _status(pool, i) for i in ids] == before
    assert [await _status(pool, i) for i in free] == ["done", "done", "done", "pending"]


async def test_promotion_and_the_orphan_sweep_read_the_key_index_beside_a_big_key(
    pool: asyncpg.Pool,
) -> None:
    """Beside one key with a large backlog (the statistics then say it fills the
    table), the generic plans must still probe the key index per key."""
    await insert_unchecked(
        pool,
        "INSERT INTO outbox_events (topic, payload, ordering_key, status)"
        " SELECT 't', '{}', 'big', 'waiting' FROM generate_series(1, 5000)",
    )
    for k in range(50):
        await _insert(pool, f"small{k}", "done")
        await _insert(pool, f"small{k}", "waiting")
    await pool.execute("ANALYZE outbox_events")
    keys = [f"small{k}" for k in range(50)]
    # promoted first: the heads a promotion makes are placed at its clock_timestamp()
    # (migration 0019), after the now() of a claim in the same transaction
    await pool.fetchrow(Q.promote, keys)
    async with pool.acquire() as conn:
        plans = await nested_plans(
            conn,
            Q,
            [
                ("promote", Q.promote, (keys,)),
                ("orphans", Q.promote_orphans, ()),
                ("claim", Q.claim, (WORKER, 30.0, ["t"], 100, 1 << 40, 256, 200)),
            ],
        )
    for name, plan in plans.items():
        assert "Seq Scan" not in plan, (name, plan)
        assert "outbox_events_key_idx" in plan, (name, plan)


async def _status(pool: asyncpg.Pool, event_id: int) -> str:
    status: str = await pool.fetchval(
        "SELECT status::text FROM outbox_events_all WHERE id = $1", event_id
    )
    return status
