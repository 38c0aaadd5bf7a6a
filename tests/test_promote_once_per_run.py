"""Migration 0016: a done settlement promotes only the keys of the rows that held them.

A run's head and its other rows settle while the run's last row still holds the key;
promoting their keys found the key busy every time. The settlement must still hand the
key on when its holder is done, a head claimed alone included, in one flush or several.
"""

from __future__ import annotations

import asyncpg

import aiooutbox
from aiooutbox._engine.options import DEFAULT_MAX_CLAIM_BYTES as MAX_BYTES
from aiooutbox._sql.statements import queries

Q = queries()
WORKER = "w-promote"


async def _statuses(conn: asyncpg.Connection, key: str) -> list[str]:
    rows = await conn.fetch(
        "SELECT status::text FROM outbox_events WHERE ordering_key = $1 ORDER BY id", key
    )
    return [r[0] for r in rows]


async def _settle(conn: asyncpg.Connection, ids: list[int], attempts: int = 1) -> tuple[int, int]:
    """Settle ``ids`` done; (rows settled, calls of the promotion) in one transaction."""
    async with conn.transaction():
        await conn.execute("SET LOCAL track_functions = 'pl'")
        row = await conn.fetchrow(Q.settle_done, ids, WORKER, attempts)
        calls = await conn.fetchval(
            "SELECT coalesce(pg_stat_get_xact_function_calls('outbox_events_promote'::regproc), 0)"
        )
    assert row is not None
    return row["settled"], calls


async def test_a_runs_rows_promote_only_once_its_holder_is_done(
    conn: asyncpg.Connection,
) -> None:
    for n in range(4):
        await aiooutbox.enqueue(conn, "t", {"n": n}, ordering_key="k")
    # the head and two rows behind it: the run's last row (id order) holds the key
    claimed = await conn.fetch(Q.claim, WORKER, 30.0, ["t"], 1, MAX_BYTES, 2, 2)
    assert [(r["is_head"], r["ordering_key"]) for r in claimed] == [
        (True, "k"),
        (False, "k"),
        (False, "k"),
    ]
    ids = [r["id"] for r in claimed]
    holders = await conn.fetch("SELECT id FROM outbox_events WHERE holds_key ORDER BY id")
    assert [r["id"] for r in holders] == ids[-1:]

    # the head, then the middle row: settled, and no promotion tried
    assert await _settle(conn, ids[:1]) == (1, 0)
    assert await _settle(conn, ids[1:2]) == (1, 0)
    assert await _statuses(conn, "k") == ["done", "done", "processing", "waiting"]
    # the holder: the key moves on to its next event
    assert await _settle(conn, ids[2:]) == (1, 1)
    assert await _statuses(conn, "k") == ["done", "done", "done", "pending"]


async def test_a_head_claimed_alone_and_a_whole_run_in_one_flush_hand_their_keys_on(
    conn: asyncpg.Connection,
) -> None:
    for key in ("alone", "run"):
        for n in range(3):
            await aiooutbox.enqueue(conn, "t", {"n": n}, ordering_key=key)
    # "alone" is claimed without a run, "run" with one (the run rows limit of 1 lets one
    # row ride behind one head only)
    claimed = await conn.fetch(Q.claim, WORKER, 30.0, ["t"], 2, MAX_BYTES, 1, 1)
    by_key: dict[str, list[int]] = {}
    for r in claimed:
        by_key.setdefault(r["ordering_key"], []).append(r["id"])
    assert sorted(len(v) for v in by_key.values()) == [1, 2], claimed
    settled, calls = await _settle(conn, [r["id"] for r in claimed])
    assert (settled, calls) == (3, 1)  # one promotion, for both keys
    for key, ids in by_key.items():
        assert await _statuses(conn, key) == ["done"] * len(ids) + ["pending"] + ["waiting"] * (
            2 - len(ids)
        ), key


async def test_a_fenced_holder_promotes_nothing(conn: asyncpg.Connection) -> None:
    """A holder's settlement on the wrong attempt changes nothing, its key included."""
    for n in range(2):
        await aiooutbox.enqueue(conn, "t", {"n": n}, ordering_key="f")
    (head,) = await conn.fetch(Q.claim, WORKER, 30.0, ["t"], 1, MAX_BYTES, 0, 0)
    assert await _settle(conn, [head["id"]], attempts=head["attempts"] + 1) == (0, 0)
    assert await _statuses(conn, "f") == ["processing", "waiting"]
