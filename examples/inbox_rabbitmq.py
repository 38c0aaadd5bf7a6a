"""Consume from RabbitMQ exactly once with the inbox; a redelivered message is skipped.

    export AIOOUTBOX_DSN=postgresql://postgres@127.0.0.1:5432/test
    python -m examples.inbox_rabbitmq        # AMQP_URL, default amqp://guest:guest@127.0.0.1/

A relay publishes each outbox event with ``message_id`` = the event's message id, at
least once. This consumer records that id with `aiooutbox.inbox.record` in the same
transaction as its own write (an invoice row) and acknowledges after the commit: a copy
delivered again (a relay or consumer crash) finds the id and is skipped. The example
publishes one message twice, as a relay crash would, and bills it once.
Needs the ``rabbitmq`` extra, from the clone: ``pip install -e '.[rabbitmq]'``.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import asyncpg

import aiooutbox
from aiooutbox import inbox


async def handle(pool: asyncpg.Pool, message: object) -> bool:
    """Bill the order in ``message`` once; True if this delivery did the work."""
    import aio_pika

    assert isinstance(message, aio_pika.abc.AbstractIncomingMessage)
    if message.message_id is None:  # not from an aiooutbox relay: nothing to dedupe on
        await message.reject()
        return False
    async with pool.acquire() as conn, conn.transaction():
        first = await inbox.record(conn, message.message_id, consumer="billing")
        if first:
            order = json.loads(message.body)
            await conn.execute("INSERT INTO invoices (order_id) VALUES ($1)", order["order_id"])
    await message.ack()  # after the commit: a crash before it means a redelivery
    return first


async def main(dsn: str, url: str = "amqp://guest:guest@127.0.0.1:5672/") -> int:
    import aio_pika

    async with asyncpg.create_pool(dsn, min_size=1, max_size=2) as pool:
        await aiooutbox.migrate(pool)  # makes the inbox table beside the outbox
        await pool.execute("CREATE TABLE IF NOT EXISTS invoices (order_id int NOT NULL)")
        async with await aio_pika.connect(url) as connection:
            channel = await connection.channel()
            queue = await channel.declare_queue(f"billing-{uuid.uuid4().hex[:8]}", auto_delete=True)
            copy = aio_pika.Message(b'{"order_id": 42}', message_id=str(uuid.uuid4()))
            for _ in range(2):  # the same message twice, as after a relay crash
                await channel.default_exchange.publish(copy, routing_key=queue.name)
            for _ in range(2):
                message = await queue.get(timeout=5)
                assert message is not None
                print("billed" if await handle(pool, message) else "skipped a redelivery")
        billed: int = await pool.fetchval("SELECT count(*) FROM invoices WHERE order_id = 42")
        print("invoices for order 42:", billed)
        return billed


if __name__ == "__main__":
    asyncio.run(
        main(
            os.environ.get("AIOOUTBOX_DSN", "postgresql://postgres@127.0.0.1/test"),
            os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
        )
    )
