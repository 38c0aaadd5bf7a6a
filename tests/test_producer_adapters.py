"""enqueue/enqueue_many on every kind of connection: asyncpg, SQLAlchemy, psycopg, Django.

Each test runs once per kind (tests/producer_kinds.py) against the real server and checks
what the caller's transaction decides: rollback leaves no row, commit exactly one, a
savepoint that rolls back removes its event, dedupe and batch results are the same as on
asyncpg, bad input raises before anything is written, an idle consumer wakes at commit.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import sys
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

import asyncpg
import pytest

import aiooutbox
import aiooutbox.sync
from aiooutbox import NewEvent
from tests.helpers import running, wait_until
from tests.producer_kinds import KINDS, Kind, configure_django, sqlalchemy_url
from tests.test_bad_input import BAD_EVENTS, assert_clear, event_kwargs

KIND_PARAMS = [pytest.param(k, id=k.name) for k in KINDS]


@pytest.fixture(params=KIND_PARAMS)
async def kind(request: pytest.FixtureRequest, dsn: str) -> AsyncIterator[Kind]:
    producer: Kind = request.param()
    await producer.open(dsn)
    try:
        yield producer
    finally:
        await producer.close()


async def committed(conn: asyncpg.Connection) -> list[tuple[Any, ...]]:
    """What other sessions see: the committed rows."""
    rows = await conn.fetch(
        "SELECT topic, payload::text, dedupe_key FROM outbox_events_all ORDER BY id"
    )
    return [tuple(r) for r in rows]


async def test_rollback_leaves_no_row_and_commit_exactly_one(
    kind: Kind, conn: asyncpg.Connection
) -> None:
    await kind.begin()
    rolled = await kind.enqueue("orders.created", {"n": 1})
    assert isinstance(rolled, int)
    assert await kind.fetchval("SELECT count(*) FROM outbox_events_all") == 1
    assert await committed(conn) == [], "not visible before commit"
    await kind.rollback()
    assert await committed(conn) == []

    await kind.begin()
    kept = await kind.enqueue("orders.created", {"n": 2, "text": "ż 😀 %s %(x)s $1"})
    await kind.commit()
    assert await committed(conn) == [
        ("orders.created", '{"n": 2, "text": "ż 😀 %s %(x)s $1"}', None)
    ]
    assert await conn.fetchval("SELECT id FROM outbox_events_all") == kept


async def test_a_repeated_dedupe_key_returns_none(kind: Kind, conn: asyncpg.Connection) -> None:
    await kind.begin()
    first = await kind.enqueue("t", 1, dedupe_key="k")
    again = await kind.enqueue("t", 2, dedupe_key="k")
    await kind.commit()
    assert isinstance(first, int)
    assert again is None
    await kind.begin()
    assert await kind.enqueue("t", 3, dedupe_key="k") is None
    await kind.commit()
    assert await committed(conn) == [("t", "1", "k")]


async def test_enqueue_many_results_in_input_order(kind: Kind, conn: asyncpg.Connection) -> None:
    await kind.begin()
    existing = await kind.enqueue("t", "old", dedupe_key="old")
    batch = [
        NewEvent("t", "z first", dedupe_key="z"),
        NewEvent("t", "unkeyed 1", headers={"h": "v"}),
        NewEvent("t", "a first", dedupe_key="a", max_attempts=2),
        NewEvent("t", "z again", dedupe_key="z"),
        NewEvent("t", "old again", dedupe_key="old"),
        NewEvent("t", "unkeyed 2", delay=60),
        NewEvent("t", "at", available_at=datetime(2030, 1, 1, tzinfo=timezone.utc)),
    ]
    ids = await kind.enqueue_many(batch)
    assert await kind.enqueue_many([]) == []
    await kind.commit()
    assert isinstance(existing, int)
    assert [i is None for i in ids] == [False, False, False, True, True, False, False]
    for event, event_id in zip(batch, ids, strict=True):
        if event_id is not None:
            row = await conn.fetchrow(
                "SELECT payload #>> '{}' AS payload, dedupe_key, max_attempts, headers::text"
                " FROM outbox_events_all WHERE id = $1",
                event_id,
            )
            assert (row["payload"], row["dedupe_key"]) == (event.payload, event.dedupe_key)
            assert row["max_attempts"] == (event.max_attempts or 5)
            assert row["headers"] == ('{"h": "v"}' if event.headers else "{}")
    scheduled = await conn.fetchval(
        "SELECT available_at FROM outbox_events_all WHERE id = $1", ids[6]
    )
    assert scheduled == datetime(2030, 1, 1, tzinfo=timezone.utc)
    assert await conn.fetchval(
        "SELECT available_at > now() + interval '50 seconds' FROM outbox_events_all WHERE id = $1",
        ids[5],
    )
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_all") == 6


async def test_a_rolled_back_savepoint_removes_its_event(
    kind: Kind, conn: asyncpg.Connection
) -> None:
    await kind.begin()
    await kind.enqueue("t", "before", dedupe_key="before")
    await kind.savepoint()
    await kind.enqueue("t", "inside", dedupe_key="inside")
    await kind.enqueue_many([NewEvent("t", "inside many")])
    assert await kind.fetchval("SELECT count(*) FROM outbox_events_all") == 3
    await kind.rollback_savepoint()
    await kind.enqueue("t", "after", dedupe_key="after")
    # the savepoint's dedupe key is free again
    assert isinstance(await kind.enqueue("t", "inside again", dedupe_key="inside"), int)
    await kind.commit()
    assert [r[1] for r in await committed(conn)] == ['"before"', '"after"', '"inside again"']


async def test_every_bad_input_raises_before_anything_is_written(kind: Kind) -> None:
    await kind.begin()
    for case_id, case, exc, message in BAD_EVENTS:
        with pytest.raises(exc, match=re.escape(message)) as info:
            await kind.enqueue(**event_kwargs(case))
        assert_clear(info.value)
        batch = [NewEvent("t", 1, dedupe_key="first"), NewEvent(**event_kwargs(case))]
        with pytest.raises(exc, match=re.escape(message)) as info:
            await kind.enqueue_many(batch)
        assert str(info.value).startswith("events[1]."), case_id
    for name, value in [("schema", 'x"; drop'), ("table", "Upper")]:
        with pytest.raises(aiooutbox.InvalidArgument, match=f"invalid {name} name"):
            await kind.enqueue("t", 1, **{name: value})
    with pytest.raises(TypeError, match=r"iterable of aiooutbox\.NewEvent"):
        await kind.enqueue_many(NewEvent("t", 1))
    # nothing was written, and the caller's transaction is still usable
    assert await kind.fetchval("SELECT count(*) FROM outbox_events_all") == 0
    assert isinstance(await kind.enqueue("t", 1, dedupe_key="first"), int)
    await kind.rollback()


async def test_a_missing_schema_raises_schema_not_ready(empty_dsn: str) -> None:
    for kind_class in KINDS:
        kind = kind_class()
        await kind.open(empty_dsn)
        try:
            await kind.begin()
            with pytest.raises(aiooutbox.SchemaNotReady, match=r"aiooutbox migrate") as info:
                await kind.enqueue("t", 1)
            assert '"public"."outbox_events"' in str(info.value), kind.name
            await kind.rollback()
            await kind.begin()
            with pytest.raises(aiooutbox.SchemaNotReady, match=r"aiooutbox migrate"):
                await kind.enqueue_many([NewEvent("t", 1)], schema="nosuch")
            await kind.rollback()
        finally:
            await kind.close()


async def test_an_idle_consumer_handles_each_kinds_event_at_commit(
    kind: Kind, pool: asyncpg.Pool
) -> None:
    """Commit -> handler latency with the wake-up trigger (the poll is 60 s, so only the
    notification can explain a quick delivery). Printed, not asserted."""
    seen: dict[int, float] = {}
    arrived = asyncio.Event()

    async def handler(event: aiooutbox.Event) -> None:
        seen[event.id] = time.perf_counter()
        arrived.set()

    consumer = aiooutbox.OutboxConsumer(pool, poll_interval=60, concurrency=4)
    latencies = []
    async with running(consumer, {"wake": handler}):
        for n in range(5):
            # advertised idle; an insert racing the advertisement is covered by the
            # consumer's check for open writers (docs/guarantees.md, "Wake-ups")
            await wait_until(
                lambda: pool.fetchval("SELECT count(*) > 0 FROM outbox_events_idle"), timeout=30
            )
            arrived.clear()
            await kind.begin()
            event_id = await kind.enqueue("wake", {"n": n})
            await kind.commit()
            committed_at = time.perf_counter()
            await asyncio.wait_for(arrived.wait(), 30)
            latencies.append((seen[event_id] - committed_at) * 1000)
    assert len(seen) == 5
    print(
        f"\n{kind.name}: commit -> handler median {statistics.median(latencies):.2f} ms, "
        f"max {max(latencies):.2f} ms over {len(latencies)}",
        file=sys.stderr,
    )


# -- what is not accepted ------------------------------------------------------------------


async def test_unsupported_connections_get_a_type_error_listing_the_accepted(
    dsn: str, tmp_path: Any
) -> None:
    import sqlite3

    import psycopg
    from sqlalchemy import create_engine
    from sqlalchemy.ext.asyncio import create_async_engine
    from sqlalchemy.orm import Session

    with pytest.raises(TypeError, match="pass an asyncpg Connection or Pool, a SQLAlchemy"):
        await aiooutbox.enqueue(object(), "t", 1)
    with pytest.raises(TypeError, match="pass a psycopg Connection, a psycopg2 connection"):
        aiooutbox.sync.enqueue("postgresql://x", "t", 1)
    lite = sqlite3.connect(":memory:")
    with pytest.raises(TypeError, match=r"cannot enqueue on a sqlite3\.Connection"):
        aiooutbox.sync.enqueue_many(lite, [NewEvent("t", 1)])
    lite.close()

    # the wrong half of the API says which half to use
    conn = await asyncpg.connect(dsn)
    with pytest.raises(TypeError, match=r"await aiooutbox.enqueue"):
        aiooutbox.sync.enqueue(conn, "t", 1)
    await conn.close()
    sync_conn = psycopg.connect(dsn)
    with pytest.raises(TypeError, match=r"aiooutbox\.sync\.enqueue"):
        await aiooutbox.enqueue(sync_conn, "t", 1)
    sync_conn.close()
    async_engine = create_async_engine(sqlalchemy_url(dsn, "asyncpg"))
    with pytest.raises(TypeError, match="pass an asyncpg Connection"):
        await aiooutbox.enqueue(async_engine, "t", 1)  # an engine has no transaction to join
    await async_engine.dispose()
    sqlite_engine = create_engine(f"sqlite:///{tmp_path}/x.db")
    with (
        Session(sqlite_engine) as session,
        pytest.raises(TypeError, match="SQLAlchemy sqlite connection: PostgreSQL only"),
    ):
        aiooutbox.sync.enqueue(session, "t", 1)
    sqlite_engine.dispose()


def test_the_core_imports_no_optional_library() -> None:
    import subprocess

    code = (
        "import asyncio, sys, aiooutbox, aiooutbox.sync\n"
        "for call in (lambda: aiooutbox.sync.enqueue(object(), 't', 1),\n"
        "             lambda: asyncio.run(aiooutbox.enqueue(object(), 't', 1))):\n"
        "    try:\n"
        "        call()\n"
        "    except TypeError:\n"
        "        pass\n"
        "libraries = ('sqlalchemy', 'psycopg', 'psycopg2', 'django')\n"
        "loaded = [m for m in libraries if m in sys.modules]\n"
        "print(loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


async def test_django_outside_atomic_commits_on_its_own(dsn: str, conn: asyncpg.Connection) -> None:
    loop = asyncio.get_running_loop()

    def produce() -> Any:
        connection = configure_django(dsn)
        try:
            return aiooutbox.sync.enqueue(connection, "t", {"auto": True})
        finally:
            connection.close()

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as thread:
        event_id = await loop.run_in_executor(thread, produce)
    assert await conn.fetchval("SELECT id FROM outbox_events_all") == event_id


# -- producers sharing dedupe keys ---------------------------------------------------------

DEDUPE_RACE = r"""
import asyncio, json, random, sys
import aiooutbox, aiooutbox.sync
from aiooutbox import NewEvent

dsn, driver, seed, keys = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
events = [NewEvent("race", {"k": k, "by": seed}, dedupe_key=f"key-{k}") for k in range(keys)]
random.Random(seed).shuffle(events)
events += [NewEvent("race", {"unkeyed": seed})] * 3

def report(ids):
    print(json.dumps({"inserted": sum(i is not None for i in ids), "n": len(ids),
                      "order": [e.dedupe_key for e in events][:5]}), flush=True)

async def with_asyncpg():
    import asyncpg
    conn = await asyncpg.connect(dsn)
    print("ready", flush=True)
    sys.stdin.readline()
    async with conn.transaction():
        ids = await aiooutbox.enqueue_many(conn, events)
        await conn.execute("SELECT pg_sleep(0.3)")  # hold the keys' locks a while
    report(ids)

def with_psycopg():
    import psycopg
    with psycopg.connect(dsn) as conn:
        print("ready", flush=True)
        sys.stdin.readline()
        ids = aiooutbox.sync.enqueue_many(conn, events)
        conn.execute("SELECT pg_sleep(0.3)")
        conn.commit()
    report(ids)

if driver == "asyncpg":
    asyncio.run(with_asyncpg())
else:
    with_psycopg()
"""


@pytest.mark.slow  # four producer processes, 30,000 keys each
async def test_producers_sharing_dedupe_keys_in_different_orders_do_not_deadlock(
    dsn: str, conn: asyncpg.Connection
) -> None:
    import json

    keys = 30_000
    drivers = ["asyncpg", "psycopg", "asyncpg", "psycopg"]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            DEDUPE_RACE,
            dsn,
            driver,
            str(seed),
            str(keys),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for seed, driver in enumerate(drivers)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line == b"ready\n", line
        for proc in procs:  # all four start their batch at once
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
        outputs = [await asyncio.wait_for(p.communicate(), 120) for p in procs]
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    errors = [err.decode() for _, err in outputs if err]
    assert all(p.returncode == 0 for p in procs), "\n".join(errors)
    assert not any("Deadlock" in e for e in errors)
    results = [json.loads(out) for out, _ in outputs]
    orders = {tuple(r["order"]) for r in results}
    assert len(orders) == 4, "each producer shuffled the keys its own way"
    # every key exactly once, whoever won it; each producer's unkeyed events all went in
    assert sum(r["inserted"] for r in results) == keys + 4 * 3
    assert await conn.fetchval("SELECT count(DISTINCT dedupe_key) FROM outbox_events_all") == keys
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_all") == keys + 4 * 3


def test_one_statement_definition_renders_for_each_paramstyle() -> None:
    from aiooutbox._sql.statements import for_paramstyle, queries

    q = queries()
    for sql, count in ((q.insert_one, 9), (q.insert_many, 9)):
        assert for_paramstyle(sql, "numeric_dollar") == sql
        rendered = for_paramstyle(sql, "format")
        assert rendered == for_paramstyle(sql, "pyformat")
        assert rendered.count("%s") == count and "$" not in rendered
        assert rendered.replace("%s", "$?") == re.sub(r"\$\d+", "$?", sql)
    assert for_paramstyle("SELECT '%' || $1", "format") == "SELECT '%%' || %s"
    with pytest.raises(ValueError, match="once each, in order"):
        for_paramstyle("SELECT $2, $1", "format")
    with pytest.raises(ValueError, match="unsupported paramstyle"):
        for_paramstyle("SELECT $1", "qmark")


async def test_the_apps_own_json_codecs_cannot_double_encode(
    dsn: str, conn: asyncpg.Connection
) -> None:
    """Payloads go as text cast in SQL, whatever JSON adapters the app installed."""
    import json

    import psycopg
    from psycopg.types.json import set_json_dumps
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    def broken(_: Any) -> str:
        raise AssertionError("the driver's JSON adapter was used")

    codec_conn = await asyncpg.connect(dsn)
    await codec_conn.set_type_codec(
        "jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog"
    )
    await aiooutbox.enqueue(codec_conn, "codec", {"via": "asyncpg"})
    await codec_conn.close()

    pg = await psycopg.AsyncConnection.connect(dsn)
    set_json_dumps(broken, pg)
    await aiooutbox.enqueue(pg, "codec", {"via": "psycopg"})
    await pg.commit()
    await pg.close()

    engine = create_async_engine(sqlalchemy_url(dsn, "psycopg"), json_serializer=broken)
    async with AsyncSession(engine) as session:
        await aiooutbox.enqueue(session, "codec", {"via": "sqlalchemy"})
        await session.commit()
    await engine.dispose()

    rows = await conn.fetch("SELECT payload::text FROM outbox_events_all ORDER BY id")
    assert [r[0] for r in rows] == [
        '{"via": "asyncpg"}',
        '{"via": "psycopg"}',
        '{"via": "sqlalchemy"}',
    ]
