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
    level = isolation.replace("_", " ").upper()
    for _ in range(tries):
        async with pool.acquire() as conn:
            await conn.execute(f"BEGIN ISOLATION LEVEL {level}")
            try:
                # the snapshot: the first statement of the transaction takes it
                await conn.fetchval(
                    "SELECT count(*) FROM outbox_events_all WHERE ordering_key = $1", key
                )
                if after_snapshot is not None:
                    await after_snapshot()
                    after_snapshot = None
                ids = await insert_ordered(conn, how, topic, key, payloads)
                # SERIALIZABLE may refuse at COMMIT too (the server then rolls back)
                await conn.execute("COMMIT")
                return ids, refused
            except REFUSALS as exc:
                refused.append(exc)
            finally:
                if conn.is_in_transaction():
                    await conn.execute("ROLLBACK")
        await asyncio.sleep(random.random() * 0.01)
    raise AssertionError(f"{key}: refused {tries} times in a row: {refused[-3:]}")


# every status a raw INSERT may name: only pending goes in
STATUSES = ("pending", "retry", "processing", "waiting", "done", "dead")


class SideTraffic:
    """Ordered producers beside a consumer test, until ``stop`` is set.

    For each of ``keys`` keys, three producers write at once: one at READ COMMITTED,
    one at REPEATABLE READ, one at SERIALIZABLE. Each is sequential (its events carry
    its own ``seq`` and ``src``, so their order can be checked per producer), takes its
    snapshot, waits a little while consumers claim and settle the key (every other time
    a READ COMMITTED partner inserts an event of the key meanwhile, so the snapshot is
    stale for sure), then inserts one event or two, in turn with `enqueue`,
    `enqueue_many` and raw SQL. Two more keys replay the issue's case over and over
    (`_stale`), one at each of the two levels. Beside them a raw SQL producer names
    every status: only ``pending`` may go in. ``accepted`` counts the events that went
    in; ``refusals`` the refused tries per producer; ``kinds`` the refusals by cause:
    ``head`` (the one-head index: the key got a claimable or running event after the
    snapshot), ``snapshot`` (every unfinished event the snapshot showed
    had changed since) and ``ssi`` (SERIALIZABLE's own conflicts between producers);
    ``unexpected`` what should have been refused and was not.
    """

    LEVELS = (("rc", "read_committed"), ("rr", "repeatable_read"), ("ser", "serializable"))

    def __init__(self, pool: asyncpg.Pool, keys: int = 4, topic: str = "t") -> None:
        self.pool = pool
        self.keys = [f"iso-{k}" for k in range(keys)]
        self.topic = topic
        self.accepted = 0
        self.refusals: dict[str, int] = {src: 0 for src, _ in self.LEVELS}
        self.kinds: dict[str, int] = {"head": 0, "snapshot": 0, "ssi": 0}
        self.raw_refused = 0
        self.unexpected: list[str] = []

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(
            *(
                self._producer(stop, key, src, isolation)
                for key in self.keys
                for src, isolation in self.LEVELS
            ),
            *(
                self._stale(stop, f"stale-{src}", src, isolation)
                for src, isolation in self.LEVELS[1:]
            ),
            self._raw(stop),
        )

    async def _stale(self, stop: asyncio.Event, key: str, src: str, isolation: str) -> None:
        """The issue's case, over and over: the snapshot shows the key idle, then a READ
        COMMITTED partner's event of the key is inserted and claimed, then this producer
        inserts. The outbox must refuse it (the partner's run holds the key) or, once the
        partner's event is done, take it as the head."""
        seq = 0
        mate = 0
        turn = 0
        busy = "SELECT count(*) FROM outbox_events_all WHERE ordering_key = $1 AND status <> 'done'"
        while not stop.is_set():
            if await self.pool.fetchval(busy, key):
                await asyncio.sleep(0.01)
                continue
            how = HOWS[turn % len(HOWS)]
            turn += 1

            async def meanwhile() -> None:
                nonlocal mate
                event_id = await aiooutbox.enqueue(
                    self.pool, self.topic, {"seq": mate, "src": f"{src}-mate"}, ordering_key=key
                )
                mate += 1
                self.accepted += 1
                status = "SELECT status::text FROM outbox_events_all WHERE id = $1"
                while await self.pool.fetchval(status, event_id) == "pending":
                    await asyncio.sleep(0.002)

            ids, refused = await produce(
                self.pool, isolation, how, key, [{"seq": seq, "src": src}], after_snapshot=meanwhile
            )
            seq += len(ids)
            self.accepted += len(ids)
            self._count(src, refused)

    async def _producer(self, stop: asyncio.Event, key: str, src: str, isolation: str) -> None:
        seq = 0
        mate = 0  # a READ COMMITTED partner's events, inserted after this one's snapshot
        turn = 0
        while not stop.is_set():
            how = HOWS[turn % len(HOWS)]
            turn += 1
            count = 2 if how == "enqueue_many" else 1
            payloads = [{"seq": seq + n, "src": src} for n in range(count)]

            async def meanwhile(partner: bool = src != "rc" and turn % 2 == 1) -> None:
                nonlocal mate
                if partner:
                    # the key changes under the snapshot for sure: a partner's event
                    await aiooutbox.enqueue(
                        self.pool, self.topic, {"seq": mate, "src": f"{src}-mate"}, ordering_key=key
                    )
                    mate += 1
                    self.accepted += 1
                await asyncio.sleep(random.random() * 0.1)

            ids, refused = await produce(
                self.pool, isolation, how, key, payloads, after_snapshot=meanwhile
            )
            seq += len(ids)
            self.accepted += len(ids)
            self._count(src, refused)

    def _count(self, src: str, refused: list[BaseException]) -> None:
        self.refusals[src] += len(refused)
        for exc in refused:
            if isinstance(exc, asyncpg.UniqueViolationError):
                self.kinds["head"] += 1
            elif "ordering key" in str(exc):
                self.kinds["snapshot"] += 1
            else:
                self.kinds["ssi"] += 1
        if src == "rc" and refused:
            self.unexpected.append(f"READ COMMITTED refused: {refused[0]!r}")

    async def _raw(self, stop: asyncio.Event) -> None:
        seq = 0
        turn = 0
        while not stop.is_set():
            status = STATUSES[turn % len(STATUSES)]
            turn += 1
            try:
                await self.pool.execute(
                    "INSERT INTO outbox_events (topic, payload, ordering_key, status)"
                    " VALUES ($1, $2::jsonb, 'raw', $3::outbox_events_status)",
                    self.topic,
                    json.dumps({"seq": seq, "src": "raw"}),
                    status,
                )
            except asyncpg.CheckViolationError:
                if status == "pending":
                    raise
                self.raw_refused += 1
            else:
                if status != "pending":
                    self.unexpected.append(f"a raw insert of a {status} event went in")
                    continue  # (a seq no handler will see as this producer's next)
                seq += 1
                self.accepted += 1
            await asyncio.sleep(random.random() * 0.01)
