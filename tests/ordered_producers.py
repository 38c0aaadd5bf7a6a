"""Producers of ordered events at every isolation level, for the ordering tests.

A producer at REPEATABLE READ or SERIALIZABLE reads its key through its transaction's
snapshot, which can be older than the key's events. The outbox then refuses the insert
(a serialization failure, or the one-head index's unique violation) rather than run two
events of the key at once or leave one waiting for nobody; such a producer retries the
transaction, as those isolation levels ask of every application. `produce` does that.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

import aiooutbox

ISOLATIONS = ("repeatable_read", "serializable")
# the three ways a producer inserts: one call per event, one statement for several, SQL
HOWS = ("enqueue", "enqueue_many", "raw_sql")
# what the outbox answers a producer whose snapshot is too old for its key
REFUSALS = (asyncpg.SerializationError, asyncpg.UniqueViolationError)
RAW_INSERT = (
    "INSERT INTO outbox_events (topic, payload, ordering_key) VALUES ($1, $2::jsonb, $3)"
    " RETURNING id"
)


async def insert_ordered(
    conn: asyncpg.Connection, how: str, topic: str, key: str, payloads: list[dict[str, Any]]
) -> list[int]:
    """Insert ``payloads`` as events of ``key``, in order, the way ``how`` says."""
    if how == "enqueue":
        ids = [await aiooutbox.enqueue(conn, topic, p, ordering_key=key) for p in payloads]
    elif how == "enqueue_many":
        events = [aiooutbox.NewEvent(topic, p, ordering_key=key) for p in payloads]
        ids = await aiooutbox.enqueue_many(conn, events)
    elif how == "raw_sql":
        ids = [await conn.fetchval(RAW_INSERT, topic, json.dumps(p), key) for p in payloads]
    else:
        raise ValueError(how)
    assert all(i is not None for i in ids)
    return [i for i in ids if i is not None]


async def produce(
    pool: asyncpg.Pool,
    isolation: str,
    how: str,
    key: str,
    payloads: list[dict[str, Any]],
    *,
    topic: str = "t",
    after_snapshot: Callable[[], Awaitable[None]] | None = None,
    tries: int = 50,
) -> tuple[list[int], list[BaseException]]:
    """One transaction at ``isolation`` that inserts ``payloads`` for ``key``.

    Its snapshot is taken first, then ``after_snapshot`` runs (the key may change
    meanwhile: that is the point), then the events are inserted. A refusal rolls the
    transaction back and the whole transaction is tried again (without the wait).
    Returns the ids and the refusals seen.
    """
    refused: list[BaseException] = []
    for _ in range(tries):
        async with pool.acquire() as conn:
            transaction = conn.transaction(isolation=isolation)  # type: ignore[arg-type]
            await transaction.start()
            try:
                # the snapshot: the first statement of the transaction takes it
                await conn.fetchval(
                    "SELECT count(*) FROM outbox_events WHERE ordering_key = $1", key
                )
                if after_snapshot is not None:
                    await after_snapshot()
                    after_snapshot = None
                ids = await insert_ordered(conn, how, topic, key, payloads)
                await transaction.commit()
                return ids, refused
            except REFUSALS as exc:
                await transaction.rollback()
                refused.append(exc)
                await asyncio.sleep(random.random() * 0.01)
            except BaseException:
                await transaction.rollback()
                raise
    raise AssertionError(f"{key}: refused {tries} times in a row: {refused[-3:]}")
