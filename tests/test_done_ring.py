"""The ring of finished events (migration 0022) against a real PostgreSQL: a settled
event leaves the outbox table for the ring's current slot, a keyed one stays (its key
keeps deduplicating), retention empties whole slots only once every event in them is
past it, a reader holding a slot delays only that slot, and a consumer draining while
slots are emptied and rotated handles every event once."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid

import asyncpg
import pytest

import aiooutbox
from aiooutbox import admin
from tests.helpers import running, truthy, wait_until

RETIRE = "SELECT * FROM outbox_events_retire_done($1::float8)"


async def _claim(
    pool: asyncpg.Pool | asyncpg.Connection, ids: list[int], worker: str = "w"
) -> None:
    await pool.execute(
        "UPDATE outbox_events SET status = 'processing', locked_by = $2, attempts = 1,"
        " locked_at = now(), lease_expires_at = now() + interval '1 minute'"
        " WHERE id = ANY ($1::bigint[])",
        ids,
        worker,
    )


async def _settle(pool: asyncpg.Pool, ids: list[int], worker: str = "w") -> int:
    row = await pool.fetchrow("SELECT * FROM outbox_events_settle_done_v5($1, $2, 1)", ids, worker)
    assert row is not None
    return int(row["settled"])


async def _events(pool: asyncpg.Pool | asyncpg.Connection, n: int) -> list[int]:
    ids = await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", i) for i in range(n)])
    return [i for i in ids if i is not None]


async def _slots(pool: asyncpg.Pool) -> dict[int, int]:
    rows = await pool.fetch("SELECT slot, count(*) FROM outbox_events_done GROUP BY 1")
    return {int(r[0]): int(r[1]) for r in rows}


async def test_a_settled_event_moves_to_the_ring_and_a_keyed_one_stays(
    pool: asyncpg.Pool,
) -> None:
    plain = await aiooutbox.enqueue(pool, "t", {"n": "<b>\u00e9</b>"}, ordering_key="k")
    keyed = await aiooutbox.enqueue(pool, "t", {"n": 2}, dedupe_key="once")
    assert plain is not None and keyed is not None
    await _claim(pool, [plain, keyed])
    await pool.execute(
        "UPDATE outbox_events SET failures = '[{\"attempt\": 0}]' WHERE id = $1", plain
    )
    before = await pool.fetchrow("SELECT * FROM outbox_events WHERE id = $1", plain)
    assert await _settle(pool, [plain, keyed]) == 2

    # the plain event left the outbox table; the keyed one is done in place
    left = await pool.fetch("SELECT id, status::text FROM outbox_events ORDER BY id")
    assert [tuple(r) for r in left] == [(keyed, "done")]
    ring = await pool.fetchrow("SELECT * FROM outbox_events_done WHERE id = $1", plain)
    assert ring is not None and ring["slot"] == 0
    # the view shows both with the outbox's columns, the moved one as it was
    seen = await pool.fetchrow("SELECT * FROM outbox_events_all WHERE id = $1", plain)
    assert seen is not None and seen["status"] == "done" and seen["finished_at"] is not None
    for column in (
        "topic",
        "payload",
        "headers",
        "attempts",
        "max_attempts",
        "message_id",
        "ordering_key",
        "created_at",
        "available_at",
        "locked_by",
        "failures",
    ):
        assert seen[column] == before[column], column
    # the keyed event's key still deduplicates a producer's repeat
    assert await aiooutbox.enqueue(pool, "t", {"n": 3}, dedupe_key="once") is None
    assert await pool.fetchval("SELECT count(*) FROM outbox_events_all") == 2
    # and the operator's tools find it
    assert (await admin.event_statuses(pool, [plain, keyed])) == {plain: "done", keyed: "done"}
    stats = await admin.stats(pool)
    assert [t.counts["done"] for t in stats.topics] == [2]


async def test_a_stale_settlement_moves_nothing(pool: asyncpg.Pool) -> None:
    ids = await _events(pool, 3)
    await _claim(pool, ids, worker="owner")
    assert await _settle(pool, ids, worker="someone-else") == 0
    rows = await pool.fetch("SELECT status::text FROM outbox_events")
    assert [r[0] for r in rows] == ["processing"] * 3
    assert await pool.fetchval("SELECT count(*) FROM outbox_events_done") == 0


async def _backdate(pool: asyncpg.Pool, where: str = "true") -> None:
    """Make ring events finished two minutes ago (past a minute's retention)."""
    await pool.execute(
        f"UPDATE outbox_events_done SET finished_at = now() - interval '2 minutes' WHERE {where}"
    )


async def test_retention_empties_a_slot_only_once_every_event_in_it_is_past_it(
    pool: asyncpg.Pool,
) -> None:
    age = 60.0
    ids = await _events(pool, 6)
    await _claim(pool, ids)
    await _settle(pool, ids[:3])  # into slot 0
    await _backdate(pool)
    # the current slot is never emptied, however old; it moves on after age / 6
    await pool.execute("UPDATE outbox_events_done_ring SET since = now() - interval '11 s'")
    assert tuple(await pool.fetchrow(RETIRE, age)) == (0, True)
    assert await _slots(pool) == {0: 3}
    await _settle(pool, ids[3:])  # into slot 1, young
    # slot 0 is past the retention: emptied whole; slot 1 is current; no rotation yet
    assert tuple(await pool.fetchrow(RETIRE, age)) == (1, False)
    assert await _slots(pool) == {1: 3}
    # a slot no longer current that holds one young event is kept whole
    await pool.execute("UPDATE outbox_events_done_ring SET slot = 2, since = now()")
    await _backdate(pool, f"id <> {ids[5]}")
    assert tuple(await pool.fetchrow(RETIRE, age)) == (0, False)
    assert await _slots(pool) == {1: 3}
    await _backdate(pool)
    assert tuple(await pool.fetchrow(RETIRE, age)) == (1, False)
    assert await _slots(pool) == {}
    # the current slot does not move on while the next one still holds events
    await _settle_one(pool)  # into slot 2
    await pool.execute(
        "UPDATE outbox_events_done_ring SET slot = 1, since = now() - interval '1 h'"
    )
    assert tuple(await pool.fetchrow(RETIRE, age)) == (0, False)
    assert await pool.fetchval("SELECT slot FROM outbox_events_done_ring") == 1


async def _settle_one(pool: asyncpg.Pool) -> int:
    event_id = await aiooutbox.enqueue(pool, "t", {})
    assert event_id is not None
    await _claim(pool, [event_id])
    assert await _settle(pool, [event_id]) == 1
    return event_id


async def test_a_reader_holding_a_slot_delays_only_that_slot(pool: asyncpg.Pool, dsn: str) -> None:
    ids = await _events(pool, 4)
    await _claim(pool, ids)
    await _settle(pool, ids[:2])  # slot 0
    await pool.execute("UPDATE outbox_events_done_ring SET slot = 1")
    await _settle(pool, ids[2:])  # slot 1
    await pool.execute("UPDATE outbox_events_done_ring SET slot = 2, since = now()")
    await _backdate(pool)
    reader = await asyncpg.connect(dsn)
    try:
        # a long transaction that read slot 0 (as pg_dump does) and holds its lock
        tx = reader.transaction(isolation="repeatable_read")
        await tx.start()
        assert await reader.fetchval("SELECT count(*) FROM outbox_events_done_0") == 2
        started = time.monotonic()
        row = await pool.fetchrow(RETIRE, 60.0)
        took = time.monotonic() - started
        assert tuple(row) == (1, False), row  # slot 1 only
        assert took < 10, f"retire waited {took:.1f}s behind the reader"
        assert await _slots(pool) == {0: 2}
        # settlements went on meanwhile
        await _settle_one(pool)
        await tx.rollback()
    finally:
        await reader.close()
    assert tuple(await pool.fetchrow(RETIRE, 60.0)) == (1, False)
    assert await _slots(pool) == {2: 1}


#: each slot's BRIN index (a partition of the ring's): its name, its slot, its options
SLOT_BRINS = (
    "SELECT c.relname, x.indrelid::regclass::text AS slot, c.reloptions"
    " FROM pg_inherits AS h JOIN pg_class AS c ON c.oid = h.inhrelid"
    " JOIN pg_index AS x ON x.indexrelid = h.inhrelid"
    " WHERE h.inhparent = 'outbox_events_done_finished_idx'::regclass ORDER BY 1"
)


async def test_inserts_into_the_ring_ask_autovacuum_for_nothing(pool: asyncpg.Pool) -> None:
    """With `autosummarize` on, every insert that starts a page range asked autovacuum for
    a work item, and past 256 waiting (a fast drain, or autovacuum off) each refused one
    wrote a line to the server log."""
    options = await pool.fetch(SLOT_BRINS)
    assert len(options) == 8, options  # one a slot
    for row in options:
        assert "autosummarize=off" in row["reloptions"], row


async def test_retention_summarizes_a_slot_before_it_reads_it(pool: asyncpg.Pool, dsn: str) -> None:
    # slot 0 no longer current, holding young events over 2+ whole page ranges (32 pages)
    await pool.execute(
        "INSERT INTO outbox_events_done (slot, id, topic, payload, headers, attempts,"
        " max_attempts, available_at, created_at, finished_at, message_id)"
        " SELECT 0, g, 't', '{}', '{}', 1, 5, now(), now(), now(), gen_random_uuid()"
        " FROM generate_series(1, 6000) AS g"
    )
    await pool.execute("UPDATE outbox_events_done_ring SET slot = 1, since = now()")
    index = next(r["relname"] for r in await pool.fetch(SLOT_BRINS) if r["slot"].endswith("_0"))
    # a VACUUM of the slot holds the lock a summary takes: the slot is read unsummarized
    vacuum = await asyncpg.connect(dsn)
    try:
        async with vacuum.transaction():
            await vacuum.execute("LOCK TABLE outbox_events_done_0 IN SHARE UPDATE EXCLUSIVE MODE")
            assert tuple(await pool.fetchrow(RETIRE, 60.0)) == (0, False)
    finally:
        await vacuum.close()
    # the next run summarizes it: nothing is left to summarize after it
    assert tuple(await pool.fetchrow(RETIRE, 60.0)) == (0, False)
    assert await pool.fetchval("SELECT brin_summarize_new_values($1::regclass)", index) == 0
    await _backdate(pool)
    assert tuple(await pool.fetchrow(RETIRE, 60.0)) == (1, False)
    assert await _slots(pool) == {}


@pytest.mark.parametrize("age", [0.0, -1.0, None, float("nan"), float("inf"), 1e300])
async def test_retire_refuses_an_age_that_is_not_a_positive_number(
    pool: asyncpg.Pool, age: float | None
) -> None:
    with pytest.raises(asyncpg.InvalidParameterValueError, match="positive number of seconds"):
        await pool.fetchrow(RETIRE, age)


async def test_a_consumer_drains_once_while_slots_rotate_and_are_emptied(
    pool: asyncpg.Pool,
) -> None:
    total = 4000
    seen: list[int] = []
    retired = {"truncated": 0, "rotated": 0}

    async def handle(event: aiooutbox.Event) -> None:
        seen.append(event.id)

    async def retire_often() -> None:
        # retention of 0.3 s run every 20 ms: slots move on and are emptied under the
        # settlements writing to them
        while True:
            row = await pool.fetchrow(RETIRE, 0.3)
            retired["truncated"] += row["truncated"]
            retired["rotated"] += row["rotated"]
            await asyncio.sleep(0.02)

    consumer = aiooutbox.OutboxConsumer(pool, retention=None, concurrency=50)
    retirer = asyncio.ensure_future(retire_often())
    try:
        async with running(consumer, {"t": handle}):
            for start in range(0, total, 200):
                await aiooutbox.enqueue_many(
                    pool, [aiooutbox.NewEvent("t", {"i": i}) for i in range(start, start + 200)]
                )
                await asyncio.sleep(0.1)
            await wait_until(truthy(lambda: len(seen) >= total), timeout=120)
            # the last settlements may still be on their way (or waiting out a slot's
            # TRUNCATE): every event leaves the outbox soon after its handler returned
            unsettled = [-1]

            async def all_settled() -> bool:
                unsettled[0] = await pool.fetchval("SELECT count(*) FROM outbox_events")
                return unsettled[0] == 0

            try:
                await wait_until(all_settled, timeout=60)
            except AssertionError:
                left = unsettled[0]
                raise AssertionError(f"{left} handled events still unsettled after 60 s") from None
    finally:
        retirer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await retirer
    assert len(seen) == total and len(set(seen)) == total
    assert retired["rotated"] >= 3 and retired["truncated"] >= 1, retired
    # slots were emptied under the drain (which slot keeps which event is the unit test's)
    left = await pool.fetchval("SELECT count(*) FROM outbox_events_done")
    assert left < total, left


async def test_purge_deletes_finished_events_of_the_ring_and_the_outbox(pool: asyncpg.Pool) -> None:
    ids = await _events(pool, 5)
    keyed = await aiooutbox.enqueue(pool, "t", {}, dedupe_key="k")
    assert keyed is not None
    await _claim(pool, [*ids, keyed])
    await _settle(pool, [*ids, keyed])
    await pool.execute(
        "UPDATE outbox_events_done SET finished_at = now() - interval '2 days'"
        " WHERE id = ANY ($1::bigint[])",
        ids[:3],
    )
    await pool.execute("UPDATE outbox_events SET finished_at = now() - interval '2 days'")
    assert await admin.purge(pool, older_than=86400, batch_size=2) == 4
    left = await pool.fetch("SELECT id FROM outbox_events_all ORDER BY id")
    assert [r[0] for r in left] == ids[3:]


async def test_the_dashboard_shows_finished_events_of_the_ring(pool: asyncpg.Pool) -> None:
    httpx = pytest.importorskip("httpx")
    from aiooutbox.web import create_app

    event_id = await aiooutbox.enqueue(pool, "t", {"note": "<script>alert(1)</script>\u00e9"})
    assert event_id is not None
    await _claim(pool, [event_id])
    await _settle(pool, [event_id])
    app = create_app(pool=pool, read_only=True)
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            page = await client.get(f"/events/{event_id}")
            listed = await client.get("/events", params={"status": "done"})
            overview = await client.get("/")
    finally:
        await app.state.dashboard.aclose()
    assert page.status_code == 200, page.text
    assert "<script>alert" not in page.text and "&lt;script&gt;" in page.text
    assert "done" in page.text
    assert listed.status_code == 200 and f"/events/{event_id}" in listed.text
    assert overview.status_code == 200 and "ring-unreadable" not in overview.text


async def test_a_viewer_without_the_ring_grant_sees_the_overview_and_is_told(
    pool: asyncpg.Pool, dsn: str
) -> None:
    httpx = pytest.importorskip("httpx")
    from aiooutbox.web import create_app
    from tests.test_roles import as_user

    role = f"aiooutbox_noring_{uuid.uuid4().hex[:10]}"
    await pool.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        await pool.execute(f'GRANT USAGE ON SCHEMA public TO "{role}"')
        await pool.execute(
            "GRANT SELECT ON outbox_events, outbox_events_idle, outbox_events_audit,"
            " outbox_events_migrations, outbox_events_migrations_compat, outbox_events_flow,"
            f' outbox_events_consumers, outbox_events_rollups TO "{role}"'
        )
        await _settle_one(pool)
        viewer = await asyncpg.create_pool(as_user(dsn, role), min_size=1, max_size=2)
        app = create_app(pool=viewer, read_only=True)
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                overview = await client.get("/")
                events = await client.get("/events")
        finally:
            await app.state.dashboard.aclose()
            await viewer.close()
    finally:
        await pool.execute(f'DROP OWNED BY "{role}"')
        await pool.execute(f'DROP ROLE IF EXISTS "{role}"')
    assert overview.status_code == 200, overview.text
    assert 'id="ring-unreadable"' in overview.text and "outbox_events_done" in overview.text
    # a page that needs the ring says which grant is missing, not a bare 500
    assert events.status_code == 503 and "outbox_events_all" in events.text, events.text


async def test_the_settlement_finds_its_rows_through_the_primary_key(
    conn: asyncpg.Connection,
) -> None:
    """The generic plan of a table analyzed while nearly empty (a healthy outbox) must
    not answer "no dedupe key" from the dedupe index, whose entries for dead versions a
    pinned horizon keeps: the rows come through the primary key, whatever is dead."""
    from aiooutbox._sql.plans import nested_plans
    from aiooutbox._sql.statements import queries

    await conn.execute("ANALYZE outbox_events")  # empty: reltuples 0
    # dead versions of keyless events, as a pinned horizon keeps them (no vacuum)
    await conn.execute(
        "INSERT INTO outbox_events (topic, payload) SELECT 't', '{}' FROM generate_series(1, 5000)"
    )
    await conn.execute("DELETE FROM outbox_events")
    ids = await _events(conn, 20)
    await _claim(conn, ids)
    q = queries()
    plans = await nested_plans(
        conn, q, [("settle_done", q.settle_done, (ids, "w", 1))], analyze=True
    )
    plan = plans["settle_done"]
    assert "Index Scan using outbox_events_pkey on outbox_events e" in plan, plan
    assert "dedupe_key_idx" not in plan, plan
    assert re.search(r"Delete on outbox_events e .*rows=20(?:\.00)? loops=1\)", plan), plan
