"""The settler writes a large flush as several statements, each committed on its own, so
an ordered key's next event is promoted (and claimable) before the rest are written."""

from __future__ import annotations

from collections import Counter
from typing import Any

import anyio
import asyncpg

import aiooutbox
from aiooutbox._engine.rows import Outcome, Settlement
from aiooutbox._engine.settlements import WRITE_ROWS, Pending
from aiooutbox._engine.settler import Settler
from aiooutbox._sql.statements import queries

Q = queries()
KEYS = 600  # more than one statement's worth of heads


def _pending() -> Pending:
    pending = Pending()
    for i in range(700):
        pending.done[1 + i % 3].append(i)
    for i in range(700, 760):
        pending.failed[2].append(Settlement(i, 2, Outcome.RETRY, 1.0, "boom"))
    pending.size = 760
    return pending


def test_a_split_keeps_every_outcome_once_done_ones_first() -> None:
    whole = _pending()
    first, rest = whole.split(512)
    assert (first.size, rest.size) == (512, 248)
    assert not first.failed, "done outcomes are written first, as in one flush"
    assert sorted(first.ids() + rest.ids()) == list(range(760))
    assert first.by_attempt().keys() == {1, 2, 3}
    assert len(rest.ids()) == rest.size and len(first.ids()) == first.size
    again, nothing = rest.split(512)
    assert again is rest and nothing.size == 0 and not nothing


async def test_a_flush_of_many_heads_promotes_their_keys_statement_by_statement(
    dsn: str,
) -> None:
    """600 heads settled in one flush: two statements of at most the cap, each one
    promoting its keys' next events, which end up claimable; nothing written twice."""
    sizes: list[int] = []

    def logged(record: Any) -> None:
        if "settle_done" in record.query:
            sizes.append(record.args[0].count(",") + 1)  # the ids go as array text

    async def log(conn: asyncpg.Connection) -> None:
        conn.add_query_logger(logged)

    async with asyncpg.create_pool(dsn, min_size=1, max_size=4, init=log) as pool:
        for key in range(KEYS):
            for seq in range(2):
                await aiooutbox.enqueue(pool, "t", {"seq": seq}, ordering_key=f"k{key}")
        heads = await pool.fetch(Q.claim, "w", 30.0, ["t"], KEYS, 1 << 30, 0, 0)
        assert len(heads) == KEYS and all(h["is_head"] for h in heads)
        promoted: list[int] = []
        settler = Settler(
            pool,
            Q,
            "w",
            flush_interval=60,
            flush_size=10_000,
            statement_timeout=30,
            on_promoted=lambda: promoted.append(1),
        )
        for head in heads:
            settler.done(head["id"], head["attempts"], "t")
        with anyio.fail_after(30):
            await settler.close(timeout=20)
        assert sizes == [WRITE_ROWS, KEYS - WRITE_ROWS]
        assert len(promoted) == 2, "each statement promoted its own keys"
        assert settler.promoted == KEYS and settler.fenced == 0
        states = await pool.fetch(
            "SELECT status::text AS status, count(*) AS n FROM outbox_events_all GROUP BY 1"
        )
        assert Counter({r["status"]: r["n"] for r in states}) == Counter(
            {"done": KEYS, "pending": KEYS}
        )


async def test_a_failed_statement_is_written_again_without_the_ones_before(dsn: str) -> None:
    """The second statement of a flush meets a cut connection (raised in its place): the first stays
    committed, the second is retried, and every outcome is written once."""
    failures = 0

    async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
        ids = [await aiooutbox.enqueue(pool, "t", {"i": i}) for i in range(700)]
        claimed = await pool.fetch(Q.claim, "w", 30.0, ["t"], 700, 1 << 30, 0, 0)
        assert len(claimed) == 700
        settler = Settler(pool, Q, "w", flush_interval=60, flush_size=10_000, statement_timeout=30)
        write = settler._write

        async def flaky(batch: Pending) -> None:
            nonlocal failures
            if batch.size < WRITE_ROWS and failures == 0:
                failures += 1
                raise asyncpg.exceptions.ConnectionDoesNotExistError("cut mid-flush")
            await write(batch)

        settler._write = flaky  # type: ignore[method-assign]
        for row in claimed:
            settler.done(row["id"], row["attempts"], "t")
        with anyio.fail_after(30):
            await settler.close(timeout=20)
        assert failures == 1
        assert settler.fenced == 0, "the first statement was not written again"
        done = await pool.fetchval(
            "SELECT count(*) FROM outbox_events_all WHERE status = 'done' AND id = ANY ($1)",
            ids,
        )
        assert done == 700
