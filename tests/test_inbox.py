"""The inbox: a message id recorded in the consumer's transaction makes a redelivery a
no-op — after a crash between commit and ack, and when two copies race."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import sys
import uuid
from pathlib import Path

import asyncpg
import psycopg
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import aiooutbox
from aiooutbox import inbox
from tests.programs import needs
from tests.relay.brokers import AMQP_URL, tansu
from tests.relay.common import kafka_topic, unique

ROOT = Path(__file__).resolve().parent.parent


async def count(conn: asyncpg.Connection | asyncpg.Pool, sql: str = "") -> int:
    return int(await conn.fetchval(sql or "SELECT count(*) FROM outbox_events_inbox"))


async def test_the_first_delivery_records_and_a_copy_is_skipped(conn: asyncpg.Connection) -> None:
    async with conn.transaction():
        assert await inbox.record(conn, "m-1") is True
    async with conn.transaction():
        assert await inbox.record(conn, "m-1") is False
        # the same id for another consumer is another delivery
        assert await inbox.record(conn, "m-1", consumer="audit") is True
    assert await count(conn) == 2


async def test_a_rolled_back_record_leaves_the_message_unprocessed(
    conn: asyncpg.Connection,
) -> None:
    async def work_that_fails() -> None:
        async with conn.transaction():
            assert await inbox.record(conn, "m-2") is True
            raise RuntimeError("the work failed")

    with pytest.raises(RuntimeError):
        await work_that_fails()
    async with conn.transaction():
        assert await inbox.record(conn, "m-2") is True


async def test_concurrent_copies_are_processed_once(dsn: str) -> None:
    """Eight transactions record the same id at once, each doing its work before it
    commits: exactly one does it, whichever commits; the others wait and skip."""
    async with asyncpg.create_pool(dsn, min_size=8, max_size=8) as pool:
        await pool.execute("CREATE TABLE effects (message_id text NOT NULL)")
        started = asyncio.Barrier(8)

        async def deliver() -> bool:
            async with pool.acquire() as conn, conn.transaction():
                await started.wait()
                first = await inbox.record(conn, "m-race")
                if first:
                    await conn.execute("INSERT INTO effects VALUES ('m-race')")
                    await asyncio.sleep(0.2)  # the others are blocked on the key meanwhile
                return first

        results = await asyncio.gather(*(deliver() for _ in range(8)))
        assert sorted(results) == [False] * 7 + [True]
        assert await count(pool, "SELECT count(*) FROM effects") == 1


async def test_a_copy_waiting_on_a_rolled_back_first_does_the_work(dsn: str) -> None:
    async with asyncpg.create_pool(dsn, min_size=2, max_size=2) as pool:
        first_in = asyncio.Event()

        async def crashes_before_commit() -> None:
            async with pool.acquire() as conn, conn.transaction():
                assert await inbox.record(conn, "m-3") is True
                first_in.set()
                await asyncio.sleep(0.3)
                raise RuntimeError("crashed before commit")

        async def fails() -> None:
            with pytest.raises(RuntimeError):
                await crashes_before_commit()

        async def second() -> bool:
            await first_in.wait()
            async with pool.acquire() as conn, conn.transaction():
                return await inbox.record(conn, "m-3")

        _, took_over = await asyncio.gather(fails(), second())
        assert took_over is True


async def test_every_driver_records_in_its_transaction(dsn: str) -> None:
    # SQLAlchemy's AsyncSession (asyncpg underneath): commit decides
    engine = create_async_engine(dsn.replace("postgresql://", "postgresql+asyncpg://"))
    try:
        async with AsyncSession(engine) as session:
            assert await inbox.record(session, "d-1") is True
            await session.rollback()
        async with AsyncSession(engine) as session:
            assert await inbox.record(session, "d-1") is True
            await session.commit()
        async with AsyncSession(engine) as session:
            assert await inbox.record(session, "d-1") is False
    finally:
        await engine.dispose()
    # psycopg, async and blocking
    async with await psycopg.AsyncConnection.connect(dsn) as aconn:
        assert await inbox.record(aconn, "d-2") is True
        await aconn.commit()
        assert await inbox.record(aconn, "d-2") is False
    with psycopg.connect(dsn) as sconn:
        assert inbox.record_sync(sconn, "d-3") is True
        sconn.commit()
        assert inbox.record_sync(sconn, "d-3") is False
        assert inbox.record_sync(sconn, "d-2") is False


async def test_bad_input_is_refused_before_anything_is_written(dsn: str) -> None:
    async with asyncpg.create_pool(dsn, min_size=1, max_size=2) as pool:
        with pytest.raises(aiooutbox.InvalidArgument, match="inside the transaction"):
            await inbox.record(pool, "x")
        async with pool.acquire() as conn:
            with pytest.raises(aiooutbox.InvalidArgument, match="inside the transaction"):
                await inbox.record(conn, "x")  # autocommit: the id would commit alone
            async with conn.transaction():
                for bad in ("", "a\x00b", "x" * 1001):
                    with pytest.raises(aiooutbox.InvalidArgument, match="message_id"):
                        await inbox.record(conn, bad)
                with pytest.raises(aiooutbox.InvalidArgument, match="consumer"):
                    await inbox.record(conn, "x", consumer="")
                with pytest.raises(TypeError, match="message_id must be a str"):
                    await inbox.record(conn, 42)  # type: ignore[arg-type]
                with pytest.raises(aiooutbox.InvalidArgument, match="table"):
                    await inbox.record(conn, "x", table='x"; DROP TABLE t; --')
            not_a_connection = r"cannot record an inbox message on a builtins\.str:"
            with pytest.raises(TypeError, match=not_a_connection):
                await inbox.record("not a connection", "x")
        with (
            psycopg.connect(dsn, autocommit=True) as sconn,
            pytest.raises(aiooutbox.InvalidArgument, match="inside the transaction"),
        ):
            inbox.record_sync(sconn, "x")
        for older_than in (-1, 0, float("nan")):
            with pytest.raises(aiooutbox.InvalidArgument, match="older_than"):
                await inbox.purge(pool, older_than)
        assert await count(pool) == 0


async def test_blank_ids_and_consumers_are_refused_before_anything_is_written(dsn: str) -> None:
    """An id or a consumer of whitespace only is refused like an empty one, by both
    drivers, the transaction still usable and nothing recorded."""
    blanks = ("", " ", "   ", "\t", "\n", "\r\n", " \t\n", "\u00a0", "\u3000")
    async with asyncpg.create_pool(dsn, min_size=1, max_size=1) as pool:
        async with pool.acquire() as conn, conn.transaction():
            for blank in blanks:
                with pytest.raises(aiooutbox.InvalidArgument, match=r"message_id .*not blank"):
                    await inbox.record(conn, blank)
                with pytest.raises(aiooutbox.InvalidArgument, match=r"consumer .*not blank"):
                    await inbox.record(conn, "id-1", consumer=blank)
            assert await count(conn) == 0
            # whitespace inside or around an id with something else in it is the id's own
            assert await inbox.record(conn, " id 2\t") is True
        with psycopg.connect(dsn) as sconn:
            for blank in blanks:
                with pytest.raises(aiooutbox.InvalidArgument, match=r"message_id .*not blank"):
                    inbox.record_sync(sconn, blank)
                with pytest.raises(aiooutbox.InvalidArgument, match=r"consumer .*not blank"):
                    inbox.record_sync(sconn, "id-3", consumer=blank)
            assert inbox.record_sync(sconn, "id-3") is True
            sconn.rollback()
        assert await pool.fetchval("SELECT array_agg(message_id) FROM outbox_events_inbox") == [
            " id 2\t"
        ]


def random_text(seed: int, count: int, low: int, high: int) -> str:
    """``count`` characters drawn from ``low..high``: text the index cannot compress."""
    rnd = random.Random(seed)
    return "".join(chr(rnd.randint(low, high)) for _ in range(count))


async def test_ids_the_server_or_driver_would_refuse_are_refused_first(dsn: str) -> None:
    """Within the character limits but over the primary key's 2,704-byte entry (which
    would abort the transaction), or not encodable as UTF-8 (the driver's error): refused
    with `InvalidArgument` before anything is sent, the transaction still usable."""
    cjk = random_text(1, 1000, 0x4E00, 0x9FFF)  # 1,000 characters, 3,000 bytes
    emoji = random_text(2, 200, 0x1F300, 0x1F5FF)  # 200 characters, 800 bytes
    cases = [
        (cjk, "default", "message_id must be at most 1800 bytes in UTF-8, got 3000"),
        (cjk[:601], emoji, "message_id must be at most 1800 bytes in UTF-8, got 1803"),
        ("id-\udc80", "default", "message_id is not valid Unicode text"),
        ("id-1", "\ud800", "consumer is not valid Unicode text"),
    ]
    async with asyncpg.create_pool(dsn, min_size=1, max_size=1) as pool:
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("CREATE TEMP TABLE work (x int)")
            for message_id, consumer, message in cases:
                with pytest.raises(aiooutbox.InvalidArgument, match=re.escape(message)):
                    await inbox.record(conn, message_id, consumer=consumer)
                await conn.execute("INSERT INTO work VALUES (1)")  # the transaction works
            assert await count(conn) == 0
            # the largest accepted: 1,800 bytes beside a 200-emoji consumer fit the index
            for seed, low, high, chars in ((3, 0x4E00, 0x9FFF, 600), (4, 0x10000, 0x10FFF, 450)):
                widest = random_text(seed, chars, low, high)
                assert len(widest.encode()) == 1800
                assert await inbox.record(conn, widest, consumer=emoji) is True
            assert await count(conn) == 2
            assert await conn.fetchval("SELECT count(*) FROM work") == len(cases)
        with psycopg.connect(dsn) as sconn:
            for message_id, consumer, message in cases:
                with pytest.raises(aiooutbox.InvalidArgument, match=re.escape(message)):
                    inbox.record_sync(sconn, message_id, consumer=consumer)
            assert inbox.record_sync(sconn, "after", consumer=emoji) is True
            sconn.rollback()


async def test_retention_purges_old_ids_in_batches(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn, conn.transaction():
        for i in range(25):
            await inbox.record(conn, f"old-{i}")
        await inbox.record(conn, "new")
    await pool.execute(
        "UPDATE outbox_events_inbox SET received_at = now() - interval '8 days'"
        " WHERE message_id LIKE 'old-%'"
    )
    assert await inbox.purge(pool, 7 * 86400, batch=10) == 25
    assert await count(pool) == 1
    plan = "\n".join(
        r[0]
        for r in await pool.fetch(
            "EXPLAIN SELECT ctid FROM outbox_events_inbox WHERE received_at < now()"
            " - make_interval(secs => 1) ORDER BY received_at LIMIT 10"
        )
    )
    assert "outbox_events_inbox_received_idx" in plan, plan


@pytest.mark.slow
async def test_a_consumer_killed_between_commit_and_ack_processes_once(dsn: str) -> None:
    """A RabbitMQ consumer commits its work and is SIGKILLed before the ack; the broker
    redelivers the message to the next consumer, which skips it: every message's
    effect exactly once, counted in SQL."""
    import aio_pika

    total = 30
    queue_name = unique("inbox-")
    async with asyncpg.create_pool(dsn, min_size=1, max_size=2) as pool:
        await pool.execute("CREATE TABLE effects (message_id text NOT NULL)")
        connection = await aio_pika.connect(AMQP_URL)
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(queue_name, durable=False, auto_delete=False)
            ids = [str(uuid.uuid4()) for _ in range(total)]
            for mid in ids:
                await channel.default_exchange.publish(
                    aio_pika.Message(b"{}", message_id=mid), routing_key=queue_name
                )
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            argv = [sys.executable, "-m", "tests.inbox_worker", dsn, AMQP_URL, queue_name]
            first = await asyncio.create_subprocess_exec(
                *argv, "--hang-after-commit", "10", stdout=asyncio.subprocess.PIPE, env=env
            )
            assert first.stdout is not None
            line = await asyncio.wait_for(first.stdout.readline(), 60)
            while not line.startswith(b"hanging"):
                line = await asyncio.wait_for(first.stdout.readline(), 60)
            hung = line.split()[1].decode()
            first.send_signal(signal.SIGKILL)  # committed, never acked
            await first.wait()
            second = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, env=env
            )
            assert second.stdout is not None
            seen: dict[str, list[str]] = {}
            try:
                while sum(len(v) for v in seen.values()) < total - 9:
                    line = await asyncio.wait_for(second.stdout.readline(), 60)
                    assert line, "the second consumer exited"
                    _, mid, was_first = line.decode().split()
                    seen.setdefault(mid, []).append(was_first)
            finally:
                second.send_signal(signal.SIGKILL)
                await second.wait()
            await queue.delete(if_unused=False, if_empty=False)
        finally:
            await connection.close()
        assert seen[hung] == ["False"], f"the redelivered message was processed again: {seen[hung]}"
        effects = await pool.fetch("SELECT message_id, count(*) FROM effects GROUP BY 1")
        assert {r[0]: r[1] for r in effects} == dict.fromkeys(ids, 1)


async def test_inbox_rabbitmq_example(dsn: str) -> None:
    from examples.inbox_rabbitmq import main

    assert await main(dsn, AMQP_URL) == 1


@pytest.mark.slow
@needs("tansu")
async def test_inbox_kafka_example(dsn: str) -> None:
    from examples.inbox_kafka import main

    with tansu() as broker:
        topic = unique("orders-")
        await kafka_topic(broker.bootstrap, topic, partitions=1)
        assert await main(dsn, broker.bootstrap, topic) == 1
