"""Retention against a real PostgreSQL: rounds of back-to-back batches purge a backlog of
due ``done`` rows, and nothing else."""

from __future__ import annotations

from datetime import timedelta

import asyncpg
import pytest

import aiooutbox
from aiooutbox._engine.leases import Leases
from aiooutbox._engine.maintenance import _PURGE_BATCH, Maintenance
from aiooutbox._sql.statements import queries
from tests.helpers import insert_unchecked, running, wait_until

DAY = 86400.0
DUE = 12_500  # finished two days ago: past a one-day retention


def _maintenance(pool: asyncpg.Pool) -> Maintenance:
    return Maintenance(
        pool,
        queries(),
        "test-worker",
        leases=Leases(),
        on_recovered=lambda n: None,
        lease_timeout=30.0,
        retention=DAY,
        statement_timeout=30.0,
        orphan_sweep_interval=60.0,
    )


async def _history(pool: asyncpg.Pool, rows: int, age: str, topic: str = "old") -> None:
    await insert_unchecked(  # a history of finished rows, as a restore writes them
        pool,
        "INSERT INTO outbox_events (topic, payload, status, attempts, finished_at)"
        " SELECT $1, jsonb_build_object('i', g), 'done', 1,"
        f" now() - interval '{age}' - g * interval '1 millisecond'"
        " FROM generate_series(1, $2) g",
        topic,
        rows,
    )


async def _keepers(pool: asyncpg.Pool) -> set[int]:
    """Rows retention must leave alone, all with a finished_at past the retention:
    unfinished ones of every status, and a dead head its key is blocked on."""
    old = "now() - interval '3 days'"
    ids = await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("keep", i) for i in range(4)])
    for event_id, status in zip(ids, ("pending", "retry", "processing", "dead"), strict=True):
        await pool.execute(
            f"UPDATE outbox_events SET status = '{status}', finished_at = {old} WHERE id = $1",
            event_id,
        )
    head = await aiooutbox.enqueue(pool, "keep", {"k": 0}, ordering_key="k")
    behind = await aiooutbox.enqueue(pool, "keep", {"k": 1}, ordering_key="k")
    await pool.execute(
        "UPDATE outbox_events SET status = 'dead', blocks_key = true,"
        f" finished_at = {old} WHERE id = $1",
        head,
    )
    assert await pool.fetchval(
        "SELECT status::text FROM outbox_events_all WHERE id = $1", behind
    ) == ("waiting")
    keep = {i for i in (*ids, head, behind) if i is not None}
    assert len(keep) == 6
    return keep


async def test_rounds_purge_a_backlog_and_nothing_else(pool: asyncpg.Pool) -> None:
    await _history(pool, DUE, "2 days")
    await _history(pool, 700, "1 hour", topic="recent")  # within the retention
    keep = await _keepers(pool)
    kept = await pool.fetchval("SELECT count(*) FROM outbox_events_all") - DUE
    maintenance = _maintenance(pool)
    rounds, deleted = [], 0
    while True:
        n, behind, _ = await maintenance.purge_round(DAY)
        rounds.append((n, behind))
        deleted += n
        if not behind:
            break
        # a round that stops with rows due has deleted at least one full batch
        assert n >= _PURGE_BATCH, rounds
        assert len(rounds) <= DUE // _PURGE_BATCH + 1, rounds
    assert deleted == DUE, rounds
    left = await pool.fetch("SELECT id, topic FROM outbox_events_all")
    assert len(left) == kept
    assert {r["topic"] for r in left} == {"recent", "keep"}
    assert keep <= {r["id"] for r in left}
    # caught up: the next round finds nothing
    assert (await maintenance.purge_round(DAY))[:2] == (0, False)


@pytest.mark.slow
async def test_a_consumer_purges_more_than_one_old_round_at_start(pool: asyncpg.Pool) -> None:
    # 60,000 due rows: the old schedule (50 batches a minute) left 10,000 for a minute
    # later; now rounds follow each other while rows are due (a generous bound, printed)
    due = 60_000
    await _history(pool, due, "2 days")
    await pool.execute("ANALYZE outbox_events")

    async def _noop(event: aiooutbox.Event) -> None:
        return None

    async def purged() -> bool:
        left = await pool.fetchval("SELECT count(*) FROM outbox_events_all")
        return bool(left == 0)

    consumer = aiooutbox.OutboxConsumer(pool, retention=timedelta(days=1), poll_interval=1.0)
    async with running(consumer, {"x": _noop}):
        await wait_until(purged, timeout=50, interval=0.5)
