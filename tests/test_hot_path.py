"""What the per-event hot path relies on: the claim's column order, the cheap `Event`
builder, the hot functions' pinned generic plans (migration 0007) and the claim's
head flags (migration 0008)."""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

import aiooutbox
from aiooutbox._engine.claim_window import ClaimWindow
from aiooutbox._engine.rows import ClaimedRow, from_epoch
from aiooutbox._sql.plans import nested_plans
from aiooutbox._sql.statements import id_array, queries
from aiooutbox.events import Event, build_event

Q = queries()


async def test_claim_columns_come_in_claimed_row_field_order(conn: asyncpg.Connection) -> None:
    # ClaimedRow.from_record reads the claim's columns by position
    fields = list(ClaimedRow._fields)
    for sql in (Q.claim, Q.claim_after, Q.claim_marked):
        columns = [a.name for a in (await conn.prepare(sql)).get_attributes()]
        assert columns == fields, sql


async def test_claimed_row_from_a_real_claim(conn: asyncpg.Connection) -> None:
    await conn.execute(
        "INSERT INTO outbox_events (topic, payload, headers, dedupe_key, ordering_key)"
        " VALUES ('t', '{\"a\": 1}', '{\"h\": \"x\"}', 'd-1', 'k-1')"
    )
    records = await conn.fetch(Q.claim, "w", 30.0, ["t"], 10, 1 << 30, 10, 20)
    row = ClaimedRow.from_record(records[0])
    assert (row.topic, row.payload, row.headers, row.dedupe_key) == (
        "t",
        '{"a": 1}',
        '{"h": "x"}',
        "d-1",
    )
    assert (row.attempts, row.max_attempts, row.ordering_key, row.is_head) == (1, 5, "k-1", True)
    # the claim returns created_at and available_at as epoch seconds
    created = await conn.fetchval("SELECT created_at FROM outbox_events WHERE id = $1", row.id)
    assert from_epoch(row.created_at) == created
    stored = await conn.fetchval("SELECT available_at FROM outbox_events WHERE id = $1", row.id)
    assert isinstance(row.available_at, float)
    assert abs(row.available_at - stored.timestamp()) < 1e-5
    assert row.message_id == str(records[0]["message_id"])


async def test_created_at_survives_the_epoch_seconds_exactly(conn: asyncpg.Connection) -> None:
    # what a raw SQL producer may store: the handler's Event.created_at is the stored
    # value to the microsecond (the claim clamps infinities to the years 1 and 9999)
    values = [
        "1999-12-31 23:59:59.999999+00",
        "1970-01-01 00:00:00.000001+00",
        "1969-12-31 23:59:59.999999+00",
        "1700-03-01 12:34:56.789012+00",
        "2038-01-19 03:14:07.654321+00",
        "2242-03-16 12:56:31.999999+00",
        "-infinity",
        "infinity",
    ]
    await conn.executemany(
        "INSERT INTO outbox_events (topic, payload, created_at)"
        " VALUES ('t', '{}', $1::text::timestamptz)",
        [(v,) for v in values],
    )
    stored = dict(await conn.fetch("SELECT id, created_at FROM outbox_events"))
    records = await conn.fetch(Q.claim, "w", 30.0, ["t"], 10, 1 << 30, 0, 0)
    assert len(records) == len(values)
    clamps = {
        datetime.min: datetime(1, 1, 1, tzinfo=UTC),  # asyncpg's -infinity
        datetime.max: datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC),
    }
    for record in records:
        row = ClaimedRow.from_record(record)
        expected = stored[row.id]
        assert from_epoch(row.created_at) == clamps.get(expected, expected), record


async def test_the_watermark_reads_available_at_as_epoch_seconds(
    conn: asyncpg.Connection,
) -> None:
    await conn.execute(
        "INSERT INTO outbox_events (topic, payload, available_at)"
        " VALUES ('t', '{}', now() - interval '1 hour'), ('t', '{}', now())"
    )
    records = await conn.fetch(Q.claim, "w", 30.0, ["t"], 10, 1 << 30, 0, 0)
    ats = sorted(ClaimedRow.from_record(r).available_at for r in records)
    window = ClaimWindow(10)
    window.claimed(ats, full=True, started=0.0, ended=0.001)
    assert window.watermark is not None
    # it trails the oldest row by the lag, as a timestamptz the claim takes back
    lag = datetime.fromtimestamp(ats[0], UTC) - window.watermark[0]
    assert timedelta(milliseconds=9) < lag < timedelta(milliseconds=11), lag
    await conn.fetch(Q.claim_after, "w", 30.0, ["t"], 10, 1 << 30, 0, 0, *window.watermark)


def test_the_watermark_skips_rows_at_infinity_and_the_dawn_of_time() -> None:
    window = ClaimWindow(10)
    window.claimed([-math.inf, 1e9, math.inf], full=True, started=0.0, ended=0.001)
    assert window.watermark is not None
    assert window.watermark[0] < datetime.fromtimestamp(1e9, UTC)
    # a row in year 1 (what the table keeps of -infinity) leaves the watermark as it was
    before = window.watermark
    window.claimed([-62135596800.0], full=True, started=0.0, ended=0.001)
    assert window.watermark == before


def test_build_event_makes_an_ordinary_frozen_event() -> None:
    values = (7, "t", {"a": 1}, "d", {"h": 1}, 2, 5, datetime.now(UTC), "m", "k", True, "g")
    built = build_event(*values)
    assert type(built) is Event
    assert built == Event(*values)
    assert repr(built) == repr(Event(*values))
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.id = 8  # type: ignore[misc]
    assert dataclasses.replace(built, id=8).id == 8
    assert pickle.loads(pickle.dumps(built)) == built
    assert copy.copy(built) == built and built.is_last_attempt is False


async def test_hot_functions_always_run_generic_plans(conn: asyncpg.Connection) -> None:
    names = ["claim_v6", "claim_v7", "claim_v8", "claim_v9", "claim_v10", "claim_v11"]
    names += ["fair_rows", "settle_done_v5"]
    names += ["settle_failed_v5", "promote"]
    names += ["requeue_v5", "requeue_v6"]
    configs = dict(
        await conn.fetch(
            "SELECT p.proname, p.proconfig FROM pg_proc p"
            " WHERE p.pronamespace = 'public'::regnamespace AND p.proname = ANY ($1::text[])",
            [f"outbox_events_{n}" for n in names],
        )
    )
    assert sorted(configs) == sorted(f"outbox_events_{n}" for n in names)
    for name, config in configs.items():
        assert "plan_cache_mode=force_generic_plan" in config, (name, config)
        assert "enable_seqscan=off" in config, (name, config)


async def test_a_claim_with_runs_flags_its_heads_and_stays_on_indexes(
    pool: asyncpg.Pool,
) -> None:
    """The claim tells heads from run rows by a join (migration 0008), not by a scan
    of the heads array per row; its plans stay on indexes."""
    events = [
        aiooutbox.NewEvent("t", {"seq": seq}, ordering_key=f"k{k}")
        for seq in range(4)
        for k in range(20)
    ]
    ids = await aiooutbox.enqueue_many(pool, events)
    first = {ids[k] for k in range(20)}  # seq 0 of each key: the heads
    await pool.execute("ANALYZE outbox_events")
    async with pool.acquire() as conn:
        plans = await nested_plans(
            conn, Q, [("claim", Q.claim, ("w", 30.0, ["t"], 100, 1 << 40, 256, 200))]
        )
    assert "Seq Scan" not in plans["claim"], plans["claim"]
    assert "outbox_events_pkey" in plans["claim"], plans["claim"]
    rows = await pool.fetch(Q.claim, "w", 30.0, ["t"], 100, 1 << 40, 256, 200)
    assert len(rows) == 80  # every head and the three events behind each
    assert {r["id"] for r in rows if r["is_head"]} == first
    assert all(not r["is_head"] for r in rows if r["id"] not in first)


async def test_the_settlements_ids_go_as_array_text(conn: asyncpg.Connection) -> None:
    # the settler sends a done batch's ids as the text of a bigint[] (`id_array`)
    for ids in ([], [1], [2**63 - 1, -(2**63), 0], list(range(10_000, 12_000))):
        got = await conn.fetchval("SELECT $1::text::bigint[]", id_array(ids))
        assert got == ids
    assert id_array((5,)) == "{5}"  # any sequence, one element included
    await conn.execute("INSERT INTO outbox_events (topic, payload) VALUES ('t', '{}')")
    records = await conn.fetch(Q.claim, "w", 30.0, ["t"], 10, 1 << 30, 0, 0)
    ids = [r["id"] for r in records]
    settled = await conn.fetchrow(Q.settle_done_text, id_array(ids), "w", 1)
    assert settled["settled"] == 1
