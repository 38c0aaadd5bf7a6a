"""Relay the outbox to RabbitMQ with publisher confirms; read back the queue.

    export AIOOUTBOX_DSN=postgresql://postgres@127.0.0.1:5432/test
    python -m examples.relay_rabbitmq        # AMQP_URL, default amqp://guest:guest@127.0.0.1/

Declares a topic exchange ``orders`` and a durable queue bound to ``orders.#`` (both the
operator's; a message no queue takes comes back as a failure), commits three events and
relays them with `RabbitMQSink` (persistent, mandatory, ``message_id`` = the event's).
Needs the ``rabbitmq`` extra, from the clone: ``pip install -e '.[rabbitmq]'``.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import asyncpg

import aiooutbox
from aiooutbox.relay import RabbitMQSink


async def main(
    dsn: str, url: str = "amqp://guest:guest@127.0.0.1:5672/", queue: str = "orders-audit"
) -> list[Any]:
    import aio_pika

    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        exchange = await channel.declare_exchange("orders", aio_pika.ExchangeType.TOPIC)
        q = await channel.declare_queue(queue, durable=True)
        await q.bind(exchange, "orders.#")
        async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
            await aiooutbox.migrate(pool)
            async with pool.acquire() as conn, conn.transaction():
                for order in (1, 2, 3):
                    await aiooutbox.enqueue(conn, "orders.created", {"order_id": order})
            sink = RabbitMQSink(url, exchange="orders")  # routing key: the topic
            async with sink, aiooutbox.OutboxConsumer(pool) as consumer:
                task = asyncio.ensure_future(consumer.run({"*": sink}))
                while consumer.stats.done < 3:  # noqa: ASYNC110 - a demo, not a library  # noqa: ASYNC110 - a demo, not a library
                    await asyncio.sleep(0.05)
                consumer.stop()
                await task
        messages = []
        while len(messages) < 3:
            message = await q.get(timeout=5, no_ack=True)
            print(message.routing_key, message.message_id, message.body.decode())
            messages.append(message)
        await q.delete()
        await exchange.delete()
    return messages


if __name__ == "__main__":
    url = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    asyncio.run(main(os.environ["AIOOUTBOX_DSN"], url))
