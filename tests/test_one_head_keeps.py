"""Migration 0013 restates the claim, flow control's limited claim, failed settlements
and lease recovery. Each restatement must keep what the migrations before it added
(flow control's held topics, 0009's recovery of runs cut by batches and its promotions,
purges that move keys on), and the defect it fixes must stay fixed: a run whose head
died on its last attempt while the rest of the run was given back in a statement of its
own (another attempt count: the consumer's settler writes one statement per count) left
the key with waiting events and no head until an orphan sweep.
"""

from __future__ import annotations

import asyncpg
import pytest

import aiooutbox
from aiooutbox import admin
from aiooutbox._engine.options import DEFAULT_MAX_CLAIM_BYTES as MAX_BYTES
from aiooutbox._sql.statements import queries
from tests.helpers import all_in, running, wait_until

Q = queries()


async def _key(pool: asyncpg.Pool, key: str) -> list[str]:
    rows = await pool.fetch(
        "SELECT status::text FROM outbox_events_all WHERE ordering_key = $1 ORDER BY id", key
    )
    return [r[0] for r in rows]


async def _heads(pool: asyncpg.Pool) -> dict[str, int]:
    """Per key: how many events stand for it (claimable, or a running run's flag)."""
    rows = await pool.fetch(
        "SELECT ordering_key, count(*) FILTER (WHERE status IN ('pending', 'retry')"
        " OR (status = 'processing' AND holds_key)) FROM outbox_events_all"
        " WHERE ordering_key IS NOT NULL GROUP BY 1"
    )
    return {r[0]: r[1] for r in rows}


async def test_the_restated_bodies_keep_what_earlier_migrations_added(pool: asyncpg.Pool) -> None:
    """A cheap guard against a restatement from an older body: the installed functions
    carry both 0013's flag and what 0009/0010 put there."""
    bodies = {
        r[0]: r[1]
        for r in await pool.fetch(
            "SELECT p.proname, pg_get_functiondef(p.oid) FROM pg_proc p"
            " WHERE p.proname LIKE 'outbox_events%'"
        )
    }
    # 0018: claim_v6 runs claim_v7, restated from its body
    assert "outbox_events_claim_v7" in bodies["outbox_events_claim_v6"]
    assert "flow_held" in bodies["outbox_events_claim_v7"]  # 0010: held topics left out
    assert "advisory_xact_lock_shared" in bodies["outbox_events_claim_v7"]
    assert "flow_counted" in bodies["outbox_events_claim_limited"]  # 0010
    # 0019: requeue_v5 calls requeue_v6, which carries its body
    assert "outbox_events_requeue_v6" in bodies["outbox_events_requeue_v5"]
    assert "bool_or(r2.status = 'retry')" in bodies["outbox_events_requeue_v6"]  # 0009
    for name in ("claim_v7", "claim_limited", "claim_limited_v3", "settle_failed_v5", "requeue_v6"):
        assert "holds_key" in bodies[f"outbox_events_{name}"], name


async def test_flow_control_still_holds_after_0013(pool: asyncpg.Pool) -> None:
    for topic in ("paused", "limited", "open"):
        for key in ("k", "other"):
            await aiooutbox.enqueue(pool, topic, {}, ordering_key=f"{topic}-{key}")
            await aiooutbox.enqueue(pool, topic, {}, ordering_key=f"{topic}-{key}")
    await admin.pause_topic(pool, "paused")
    await admin.limit_topic(pool, "limited", max_running=1)
    for topics in (None, ["paused", "limited", "open"]):
        got = await pool.fetch(Q.claim, "w", 30.0, topics, 1, MAX_BYTES, 0, 0)
        assert [r["topic"] for r in got] == ["open"], topics
    # the limited topic through its own claim: one row (its limit), which holds its key
    limited = await pool.fetch(
        "SELECT * FROM outbox_events_claim_limited('w', 30.0, '{limited}', '{5}', $1)", MAX_BYTES
    )
    assert [(r["topic"], r["held"]) for r in limited] == [("limited", None), ("limited", "running")]
    flagged = await pool.fetch(
        "SELECT status::text FROM outbox_events_all WHERE ordering_key = 'limited-k' AND holds_key"
    )
    assert [r[0] for r in flagged] == ["processing"]
    assert set((await _heads(pool)).values()) == {1}


async def test_a_purged_blocking_dead_head_still_moves_its_key_on_after_0013(
    pool: asyncpg.Pool,
) -> None:
    for _ in range(3):
        await aiooutbox.enqueue(pool, "t", {}, ordering_key="k")
    [head] = await pool.fetch(Q.claim, "w", 30.0, ["t"], 1, MAX_BYTES, 0, 0)
    await pool.fetchrow(Q.settle_failed, [head["id"]], [0.0], ["boom"], ["dead_block"], "w", 1)
    assert await _key(pool, "k") == ["dead", "waiting", "waiting"]
    assert await admin.purge(pool, status="dead", older_than=0) == 1
    assert await _key(pool, "k") == ["pending", "waiting"]


async def test_recovery_cut_through_a_run_keeps_one_head_after_0013(pool: asyncpg.Pool) -> None:
    """0009's fix: a run recovered one row per batch made a second head (a unique
    violation that failed every later recovery round)."""
    for _ in range(5):
        await aiooutbox.enqueue(pool, "t", {}, ordering_key="k")
    got = await pool.fetch(Q.claim, "ghost", 30.0, ["t"], 1, MAX_BYTES, 10, 10)
    assert len(got) == 5
    await pool.execute(
        "UPDATE outbox_events SET lease_expires_at = now() - interval '1 second'"
        " WHERE status = 'processing'"
    )
    for _ in range(6):
        await pool.fetch(Q.recover_expired, 1)  # never raises
        assert (await _heads(pool)).get("k", 0) == 1
    assert await _key(pool, "k") == ["retry"] + ["waiting"] * 4


@pytest.mark.parametrize("order", ["dead first", "unrun first"])
async def test_a_head_dead_on_its_last_attempt_and_its_run_given_back_apart_leave_a_head(
    pool: asyncpg.Pool, order: str
) -> None:
    """The defect the ordered lease machine found: the head's settlement (its second
    attempt: dead) found the rest of its run still processing, so it promoted nothing;
    the run's settlement (first attempt: back to waiting) promoted nothing either."""
    await aiooutbox.enqueue(pool, "t", {"n": 0}, ordering_key="k", max_attempts=2)
    for n in (1, 2):
        await aiooutbox.enqueue(pool, "t", {"n": n}, ordering_key="k")
    for attempt in (1, 2):
        got = await pool.fetch(Q.claim, "w", 30.0, ["t"], 1, MAX_BYTES, 10, 10)
        head, *run = [r["id"] for r in got]
        assert [r["attempts"] for r in got] == [attempt, 1, 1]
        steps = [([head], "retry", attempt), (run, "unrun", 1)]
        if attempt == 2 and order == "unrun first":
            steps.reverse()
        for ids, outcome, attempts in steps:
            await pool.fetchrow(
                Q.settle_failed, ids, [0.0] * len(ids), ["x"] * len(ids),
                [outcome] * len(ids), "w", attempts,
            )  # fmt: skip
    assert await _key(pool, "k") == ["dead", "pending", "waiting"]


async def test_a_consumer_moves_on_past_a_head_that_dies_in_a_run_without_a_sweep(
    pool: asyncpg.Pool,
) -> None:
    """The same through a real consumer (no orphan sweep to hide it): the head fails
    twice and dies; the events behind it still run, in order, at once."""
    await aiooutbox.enqueue(pool, "t", {"n": 0}, ordering_key="k", max_attempts=2)
    for n in range(1, 6):
        await aiooutbox.enqueue(pool, "t", {"n": n}, ordering_key="k")
    seen: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        if event.payload["n"] == 0:
            raise RuntimeError("always")
        seen.append(event.payload["n"])

    consumer = aiooutbox.OutboxConsumer(
        pool,
        poll_interval=0.1,
        retry=aiooutbox.RetryPolicy(base=0.01, max_delay=0.01),
        orphan_sweep_interval=3600.0,
    )
    async with running(consumer, {"t": handle}):
        await wait_until(all_in(pool, "done", 5), timeout=20)
    assert seen == [1, 2, 3, 4, 5]
