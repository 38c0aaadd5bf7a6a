"""Claims from low marks (migration 0019): positions taken after their writer is visible,
marks that never pass a position an open transaction can still fill, and a forgotten
transaction that holds nobody back and loses nothing.

The SQL tests call the claim directly (`Queries.claim_marked`) to pin what each call
returns; the others run real consumers. No timing asserts: "promptly" means while the
consumers' fallback poll (30 s) could not have found the row.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

import aiooutbox
from aiooutbox._engine.claim_window import Marks
from aiooutbox._engine.dispatcher import Dispatcher
from aiooutbox._engine.groups import PROBE_GROUPS
from aiooutbox._sql.statements import queries
from tests.helpers import all_in, running, wait_until

Q = queries()
_SLOW_POLL = 30.0  # the fallback poll never helps within these tests' waits


async def _claim(
    conn: asyncpg.Connection,
    topics: list[str],
    marks: Marks,
    *,
    grace: float = 10.0,
    limit: int = 100,
    cursor: str | None = None,
    probe: int = PROBE_GROUPS,
) -> list[int]:
    """One claim of ``topics`` from ``marks``; updates them; returns the ids claimed."""
    us, ids = marks.of(topics)
    records = await conn.fetch(
        Q.claim_marked, "w", 30.0, topics, limit, 1 << 30, 0, 0, us, ids, marks.awaited, grace,
        cursor, 32, *marks.sweeps(topics), probe,
    )  # fmt: skip
    assert records[-1]["id"] is None, "the last record holds the marks"
    marks.update(topics, records[-1]["payload"])
    return [r["id"] for r in records[:-1]]


def _position(mark: tuple[int | None, int] | None) -> tuple[datetime, int]:
    assert mark is not None and mark[0] is not None
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=mark[0]), mark[1]


async def test_marks_pass_what_was_claimed(conn: asyncpg.Connection) -> None:
    ids = [await aiooutbox.enqueue(conn, "m", {"i": i}) for i in range(5)]
    # a mark never passes its claim's reading minus 10 ms (a transaction may still take
    # a key just after the reading): read later than that, it passes every row claimed
    await asyncio.sleep(0.05)
    marks = Marks()
    assert marks.mark("m") is None  # a first claim starts at the start
    assert sorted(await _claim(conn, ["m"], marks)) == ids
    last = await conn.fetchval("SELECT max(available_at) FROM outbox_events_all")
    assert _position(marks.mark("m")) >= (last, 0)
    # nothing left: the next claim is empty and its mark does not go back
    before = marks.mark("m")
    assert await _claim(conn, ["m"], marks) == []
    mark = marks.mark("m")
    assert before is not None and mark is not None and mark >= before
    # a row written later is after the mark
    later = await aiooutbox.enqueue(conn, "m", {"i": 5})
    assert await _claim(conn, ["m"], marks) == [later]


async def test_mark_stays_before_a_row_another_claim_holds(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    other = await asyncpg.connect(dsn)
    try:
        first, second = [await aiooutbox.enqueue(conn, "h", {"i": i}) for i in range(2)]
        tx = other.transaction()
        await tx.start()
        await other.execute("SELECT 1 FROM outbox_events WHERE id = $1 FOR UPDATE", first)
        marks = Marks()
        assert await _claim(conn, ["h"], marks) == [second]  # the first one is skipped
        mark = _position(marks.mark("h"))
        at = await conn.fetchval("SELECT available_at FROM outbox_events_all WHERE id = $1", first)
        assert mark < (at, first), "the locked row still counts as live"
        await tx.rollback()  # that claim never happened: the row is claimed next
        assert await _claim(conn, ["h"], marks) == [first]
    finally:
        await other.close()
        await conn.close()


async def test_an_open_producer_holds_the_mark_within_the_grace(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    producer = await asyncpg.connect(dsn)
    try:
        tx = producer.transaction()
        await tx.start()
        late = await aiooutbox.enqueue(producer, "g", {"late": True})
        early = [await aiooutbox.enqueue(conn, "g", {"i": i}) for i in range(3)]
        marks = Marks()
        assert sorted(await _claim(conn, ["g"], marks, grace=60.0)) == early
        # the open transaction's key holds the mark before its row's position
        at = await producer.fetchval(
            "SELECT available_at FROM outbox_events_all WHERE id = $1", late
        )
        assert _position(marks.mark("g")) < (at, late)
        assert marks.awaited == []
        await tx.commit()
        assert await _claim(conn, ["g"], marks, grace=60.0) == [late]
    finally:
        await producer.close()
        await conn.close()


async def test_a_forgotten_producer_is_awaited_then_claimed_once_it_commits(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    producer = await asyncpg.connect(dsn)
    try:
        tx = producer.transaction()
        await tx.start()
        late = await aiooutbox.enqueue(producer, "f", {"late": True})
        at = await producer.fetchval(
            "SELECT available_at FROM outbox_events_all WHERE id = $1", late
        )
        marks = Marks()
        await asyncio.sleep(0.05)
        # past the grace (0 here): the key is awaited, and no longer holds the mark back
        assert await _claim(conn, ["f"], marks, grace=0.0) == []
        assert len(marks.awaited) == 1
        after = [await aiooutbox.enqueue(conn, "f", {"i": i}) for i in range(3)]
        assert sorted(await _claim(conn, ["f"], marks, grace=0.0)) == after
        assert _position(marks.mark("f")) > (at, late), "the mark moved past the open row"
        await tx.commit()
        # the key left pg_locks: the claim goes back to it once and takes the row
        assert await _claim(conn, ["f"], marks, grace=0.0) == [late]
        assert marks.awaited == []
        assert _position(marks.mark("f")) > (at, late)
    finally:
        await producer.close()
        await conn.close()


async def test_rows_made_claimable_get_a_position_after_their_writer(
    conn: asyncpg.Connection,
) -> None:
    """A raw INSERT with available_at in the past, a retry, a promotion and a redrive
    all land after the mark of a claim that ran before them."""
    marks = Marks()
    old = datetime(2001, 1, 1, tzinfo=UTC)
    first = await aiooutbox.enqueue(conn, "p", {"i": 0}, ordering_key="k")
    second = await aiooutbox.enqueue(conn, "p", {"i": 1}, ordering_key="k")
    assert await _claim(conn, ["p"], marks) == [first]  # the head; the next one waits
    raw = await conn.fetchval(
        "INSERT INTO outbox_events (topic, payload, available_at) VALUES ('p', '{}', $1)"
        " RETURNING id",
        old,
    )
    assert await conn.fetchval(
        "SELECT available_at > $1 FROM outbox_events_all WHERE id = $2", old, raw
    )
    assert await _claim(conn, ["p"], marks) == [raw]
    # the head is done: its key's next event is promoted, after the mark
    await conn.fetch(Q.settle_done, [first], "w", 1)
    assert await _claim(conn, ["p"], marks) == [second]
    # a failure to retry at once
    await conn.fetch(Q.settle_failed, [second], [0.0], ["boom"], ["retry"], "w", 1)
    assert await _claim(conn, ["p"], marks) == [second]
    # dead, then redriven by an operator
    await conn.fetch(Q.settle_failed, [raw], [0.0], ["no"], ["dead"], "w", 1)
    await conn.fetch(
        'SELECT * FROM "public"."outbox_events_requeue_dead"($1::bigint[], NULL)', [raw]
    )
    assert await _claim(conn, ["p"], marks) == [raw]


async def test_a_late_commit_with_an_older_position_is_handled(pool: asyncpg.Pool) -> None:
    """A producer inserts, others commit after it and are handled (the consumer's marks
    pass its position), then it commits: its event is handled too, long before the
    fallback poll."""
    handled: set[int] = set()

    async def handler(event: aiooutbox.Event) -> None:
        handled.add(event.id)

    consumer = aiooutbox.OutboxConsumer(pool, poll_interval=_SLOW_POLL, retention=None)
    async with running(consumer, {"late": handler}):
        async with pool.acquire() as producer:
            tx = producer.transaction()
            await tx.start()
            late = await aiooutbox.enqueue(producer, "late", {"late": True})
            others: list[int | None] = []
            for _ in range(20):  # a second of other producers' commits
                others.extend(
                    await aiooutbox.enqueue_many(
                        pool, [aiooutbox.NewEvent("late", {"i": i}) for i in range(10)]
                    )
                )
                await asyncio.sleep(0.05)
            await wait_until(lambda: _all(handled, others), timeout=20)
            assert late not in handled
            await tx.commit()
        await wait_until(lambda: _all(handled, [late]), timeout=10)


async def test_a_commit_between_the_last_claim_and_the_idle_probe_is_handled(
    pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer that inserted before the consumer was idle (its insert notified
    nobody) commits after the consumer's last claim read its key as awaited and before
    the consumer's idle probe: the probe sees no writer any more, and the row lies
    behind the marks. The interleaving is forced by committing from inside the
    consumer's idle step; the probe must look from the released key, not wait for the
    fallback poll."""
    handled: set[int] = set()
    committed = asyncio.Event()

    async def handler(event: aiooutbox.Event) -> None:
        handled.add(event.id)

    async with pool.acquire() as producer:
        tx = producer.transaction()
        await tx.start()
        event_id = await aiooutbox.enqueue(producer, "raced", {})  # nobody idle yet
        await asyncio.sleep(2 * Marks.grace)  # held past the grace: awaited, not a bound
        probe = Dispatcher._idle_timeout

        async def commit_then_probe(self: Dispatcher, advertised: bool) -> float:
            if advertised and self.marks.awaited and not committed.is_set():
                await tx.commit()  # after the claim that read the key as held
                committed.set()
            return await probe(self, advertised)

        monkeypatch.setattr(Dispatcher, "_idle_timeout", commit_then_probe)
        consumer = aiooutbox.OutboxConsumer(pool, poll_interval=_SLOW_POLL, retention=None)
        async with running(consumer, {"raced": handler}):
            await wait_until(lambda: _is_set(committed), timeout=20)
            start = time.monotonic()
            await wait_until(lambda: _all(handled, [event_id]), timeout=10)
    print(f"handled {time.monotonic() - start:.3f}s after the forced commit")


async def _is_set(event: asyncio.Event) -> bool:
    return event.is_set()


async def test_a_forgotten_transaction_stalls_nobody_and_loses_nothing(
    pool: asyncpg.Pool,
) -> None:
    handled: list[int] = []

    async def handler(event: aiooutbox.Event) -> None:
        handled.append(event.id)

    consumers = [
        aiooutbox.OutboxConsumer(pool, poll_interval=_SLOW_POLL, retention=None) for _ in range(2)
    ]
    async with running(consumers[0], {"t": handler}), running(consumers[1], {"t": handler}):
        async with pool.acquire() as console:
            tx = console.transaction()
            await tx.start()
            forgotten = await console.fetchval(
                "INSERT INTO outbox_events (topic, payload) VALUES ('t', '{}') RETURNING id"
            )
            ids: list[int | None] = []
            for _ in range(10):
                ids.extend(
                    await aiooutbox.enqueue_many(
                        pool, [aiooutbox.NewEvent("t", {"i": i}) for i in range(20)]
                    )
                )
                await asyncio.sleep(0.2)  # past the grace: the key is awaited
            await wait_until(lambda: _all(set(handled), ids), timeout=20)
            await tx.commit()
        await wait_until(lambda: _all(set(handled), [forgotten]), timeout=10)
    assert sorted(handled) == sorted([*ids, forgotten])


async def test_many_producers_and_consumers_lose_nothing(pool: asyncpg.Pool, dsn: str) -> None:
    """Producers of every kind (enqueue, enqueue_many, raw INSERTs with and without a
    past available_at, transactions that sleep before they commit, some that roll back)
    beside three consumers with retries: every committed event is handled, and only
    those."""
    rng = random.Random(37)
    seen: dict[int, int] = {}

    async def handler(event: aiooutbox.Event) -> None:
        seen[event.id] = seen.get(event.id, 0) + 1
        if event.attempts == 1 and event.id % 7 == 0:
            raise aiooutbox.Retry(delay=0)

    committed: list[int] = []

    async def produce(n: int) -> None:
        async with pool.acquire() as conn:
            for _ in range(n):
                kind = rng.randrange(4)
                async with conn.transaction():
                    if kind == 0:
                        new = [await aiooutbox.enqueue(conn, "c", {"k": kind})]
                    elif kind == 1:
                        new = await aiooutbox.enqueue_many(
                            conn, [aiooutbox.NewEvent("c", {"k": kind}) for _ in range(5)]
                        )
                    else:
                        at = "now() - interval '1 hour'" if kind == 2 else "now()"
                        new = [
                            r[0]
                            for r in await conn.fetch(
                                "INSERT INTO outbox_events (topic, payload, available_at)"
                                f" SELECT 'c', '{{}}', {at} FROM generate_series(1, 3)"
                                " RETURNING id"
                            )
                        ]
                    await asyncio.sleep(rng.choice((0, 0, 0.001, 0.02, 0.1)))
                    if rng.random() < 0.05:
                        raise _RolledBack
                committed.extend(i for i in new if i is not None)

    async def producer(n: int) -> None:
        for _ in range(n):
            with contextlib.suppress(_RolledBack):
                await produce(1)

    consumers = [
        aiooutbox.OutboxConsumer(pool, poll_interval=_SLOW_POLL, retention=None, concurrency=8)
        for _ in range(3)
    ]
    async with (
        running(consumers[0], {"c": handler}),
        running(consumers[1], {"c": handler}),
        running(consumers[2], {"c": handler}),
    ):
        await asyncio.gather(*(producer(40) for _ in range(8)))
        await wait_until(all_in(pool, "done", len(committed)), timeout=60)
    assert sorted(seen) == sorted(committed)
    rows = await pool.fetch("SELECT status::text, count(*) FROM outbox_events_all GROUP BY 1")
    assert {r[0]: r[1] for r in rows} == {"done": len(committed)}


class _RolledBack(Exception):
    pass


async def _all(handled: set[int] | list[int], ids: list[int | None]) -> bool:
    return all(i in handled for i in ids)


def test_marks_keep_what_the_claim_returned() -> None:
    marks = Marks()
    assert marks.of(["a", "b"]) == ([None, None], [None, None])
    marks.update(["a", "b"], json.dumps({"us": [5, None], "id": [3, 0], "awaited": [17]}))
    assert marks.of(["b", "a", "c"]) == ([None, 5, None], [0, 3, None])
    assert marks.awaited == [17]
    marks.update(["a"], json.dumps({"us": [9], "id": [0], "awaited": None}))
    assert marks.of(["a", "b"]) == ([9, None], [0, 0])
    assert marks.awaited == []


def test_marks_are_read_anew_only_when_due() -> None:
    """Between two reads of the marks (pg_locks and a probe, every 20 ms at most) a claim
    starts at the lowest mark it has, through the plain claim: lower marks stay valid."""
    marks = Marks()
    sql, args, marked = marks.claim(Q, ["a"], 0.0)
    assert (sql, marked) == (Q.claim_marked, True)  # no mark yet
    marks.update(["a", "b"], json.dumps({"us": [5_000_001, 7], "id": [3, 0], "awaited": []}))
    now = time.monotonic()
    sql, args, marked = marks.claim(Q, ["a", "b"], now)
    assert (sql, marked) == (Q.claim_in_turn, False)
    assert args == (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=7), 0)
    # a topic without a mark, or one from the start: read them anew
    assert marks.claim(Q, ["a", "c"], now)[2] is True
    marks.update(["b"], json.dumps({"us": [None], "id": [0], "awaited": []}))
    assert marks.claim(Q, ["a", "b"], time.monotonic())[2] is True
    # and once they are due
    assert marks.claim(Q, ["a"], now + 1.0)[2] is True


def test_a_sweep_under_way_is_kept_and_paced() -> None:
    """Migration 0020: a topic's sweep of its groups goes on at the next reading of the
    marks, which comes no sooner than any other; meanwhile a topic whose first sweep is
    under way is claimed from the start."""
    marks = Marks()
    assert marks.sweeps(["a"]) == ([None], [None], [0])
    assert marks.claim(Q, ["a"], time.monotonic())[0] == Q.claim_marked  # no mark yet
    found = {"us": [None], "id": [0], "awaited": [], "after": ["g5"], "low_us": [7], "low_id": [3]}
    marks.update(["a"], json.dumps(found))
    assert marks.sweeps(["a", "b"]) == (["g5", None], [7, None], [3, 0])
    assert marks.claim(Q, ["a"], time.monotonic()) == (Q.claim_in_turn, (None, None), False)
    assert marks.claim(Q, ["a"], time.monotonic() + 1.0)[2] is True  # due: read anew
    found = {"us": [9], "id": [1], "awaited": [], "after": [None], "low_us": [None]}
    marks.update(["a"], json.dumps({**found, "low_id": [None]}))
    assert marks.sweeps(["a"]) == ([None], [None], [0]) and marks.mark("a") == (9, 1)


async def test_the_claim_from_marks_takes_groups_in_turn(conn: asyncpg.Connection) -> None:
    """`claim_v9` (as `claim_v8`) claims through the groups' claim (0018): a group with a
    backlog takes one turn per claim, and the marks stay before the oldest row of any group."""
    await conn.execute(
        "INSERT INTO outbox_events (topic, payload, grp)"
        " SELECT 'f', '{}', CASE WHEN g <= 20 THEN 'big' ELSE 'small' END"
        " FROM generate_series(1, 22) AS g"
    )
    marks = Marks()
    us, ids = marks.of(["f"])
    # the cursor after the ungrouped rows: this claim visits the groups
    args: tuple[object, ...] = (
        "w", 30.0, ["f"], 2, 1 << 30, 0, 0, us, ids, [], 10.0, "", 32, *marks.sweeps(["f"]), 512,
    )  # fmt: skip
    records = await conn.fetch(Q.claim_marked, *args)
    marks.update(["f"], records[-1]["payload"])
    assert sorted(r["group"] for r in records[:-1]) == ["big", "small"]
    small_left = await conn.fetchrow(
        "SELECT available_at, id FROM outbox_events_all WHERE grp = 'small' AND status = 'pending'"
    )
    # the mark is before the small group's second row, though the big group's are older
    mark = marks.mark("f")
    assert mark is not None and mark[0] is not None
    at = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=mark[0])
    assert (at, mark[1]) < (small_left["available_at"], small_left["id"])


async def test_a_mark_swept_over_many_groups_passes_no_claimable_row(
    conn: asyncpg.Connection,
) -> None:
    """`claim_v9` (0020) probes a few groups per call and moves a topic's mark only once
    a sweep has probed every group: rows left in groups probed early, rows added to them
    during the sweep and rows of groups not probed yet all stay after the mark, and
    every row is claimed. The claims take a few rows from a group cursor that runs
    ahead of the probe's, so rows are left behind in groups the sweep already passed."""
    rng = random.Random(21)
    groups = [f"g{i:02d}" for i in range(40)]

    async def add(n: int) -> None:
        for _ in range(n):
            await conn.execute(
                "INSERT INTO outbox_events (topic, payload, grp) VALUES ('s', '{}', $1)",
                rng.choice([*groups, None]),
            )

    await add(200)
    marks, claimed, sweeps_ended, cursor = Marks(), [], 0, None
    for _ in range(400):
        before = marks.sweeps(["s"])[0][0]
        taken = await _claim(conn, ["s"], marks, limit=3, cursor=cursor, probe=4)
        claimed += taken
        if taken:
            cursor = await conn.fetchval(
                "SELECT coalesce(max(grp), '') FROM outbox_events_all WHERE id = ANY ($1)", taken
            )
        if before is not None and marks.sweeps(["s"])[0][0] is None:
            sweeps_ended += 1
        first = await conn.fetchrow(
            "SELECT available_at, id FROM outbox_events_all WHERE topic = 's'"
            " AND status IN ('pending', 'retry') ORDER BY available_at, id LIMIT 1"
        )
        mark = marks.mark("s")
        if first is not None and mark is not None and mark[0] is not None:
            assert _position(mark) < (first["available_at"], first["id"]), (mark, dict(first))
        if len(claimed) < 260 and rng.random() < 0.3:
            await add(rng.randint(1, 5))
        total = await conn.fetchval("SELECT count(*) FROM outbox_events_all WHERE topic = 's'")
        if len(claimed) == total and total >= 260:
            break
    assert sorted(claimed) == sorted(
        await conn.fetchval("SELECT array_agg(id) FROM outbox_events_all WHERE topic = 's'")
    )
    assert len(set(claimed)) == len(claimed)
    assert sweeps_ended >= 3, "the sweeps ended and moved the mark"
    assert _position(marks.mark("s")) > (datetime(2000, 1, 1, tzinfo=UTC), 0)


async def test_the_dashboards_run_now_places_the_event_after_every_mark(
    pool: asyncpg.Pool,
) -> None:
    """The dashboard's "run now" in a transaction open for a second (its `now()` long
    passed by the consumer's marks, which other events moved on meanwhile): the event
    is placed when the statement runs, after its position lock, and is handled long
    before the fallback poll."""
    from aiooutbox.web._sql import web_queries

    handled: set[int] = set()

    async def handler(event: aiooutbox.Event) -> None:
        handled.add(event.id)

    q = queries("public", "outbox_events")
    consumer = aiooutbox.OutboxConsumer(pool, poll_interval=_SLOW_POLL, retention=None)
    async with running(consumer, {"later": handler}):
        scheduled = await aiooutbox.enqueue(pool, "later", {"s": 1}, delay=3600)
        async with pool.acquire() as operator, operator.transaction():
            await operator.fetchval("SELECT now()")  # the transaction's clock starts
            others: list[int | None] = []
            for _ in range(20):  # a second of other events, handled: the marks move on
                others.extend(
                    await aiooutbox.enqueue_many(
                        pool, [aiooutbox.NewEvent("later", {"i": i}) for i in range(10)]
                    )
                )
                await asyncio.sleep(0.05)
            await wait_until(lambda: _all(handled, others), timeout=20)
            ran = await operator.fetch(web_queries().run_now, [scheduled])
            assert [r[0] for r in ran] == [scheduled]
            await operator.execute(q.notify, q.channel, ["later"])
        await wait_until(lambda: _all(handled, [scheduled]), timeout=10)
