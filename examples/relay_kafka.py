"""Relay the outbox to Kafka, keyed per order; read back the topic.

    export AIOOUTBOX_DSN=postgresql://postgres@127.0.0.1:5432/test
    python -m examples.relay_kafka           # KAFKA=127.0.0.1:9092

Commits six events of two orders and relays them with `KafkaSink` (``acks="all"``): the
record key is the event's ``ordering_key`` when it has one, else ``default_key`` (here:
the order id from the payload), so one order's events share a partition and keep their
order. Needs the ``kafka`` extra, from the clone: ``pip install -e '.[kafka]'``;
``KAFKA_IDEMPOTENCE=0`` for brokers without idempotent producers (Tansu, which the
tests use).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import asyncpg

import aiooutbox
from aiooutbox.relay import KafkaSink


def order_key(event: aiooutbox.Event) -> str:
    return f"order-{event.payload['order_id']}"


async def main(
    dsn: str, bootstrap: str = "127.0.0.1:9092", idempotence: bool = True, topic: str = "orders"
) -> list[Any]:
    import aiokafka

    async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
        await aiooutbox.migrate(pool)
        async with pool.acquire() as conn, conn.transaction():
            for step in ("created", "paid", "shipped"):
                for order in (1, 2):
                    await aiooutbox.enqueue(conn, f"orders.{step}", {"order_id": order})
        sink = KafkaSink(
            bootstrap, destination=topic, default_key=order_key, enable_idempotence=idempotence
        )
        async with sink, aiooutbox.OutboxConsumer(pool) as consumer:
            task = asyncio.ensure_future(consumer.run({"*": sink}))
            while consumer.stats.done < 6:  # noqa: ASYNC110 - a demo, not a library
                await asyncio.sleep(0.05)
            consumer.stop()
            await task
    reader = aiokafka.AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None
    )
    await reader.start()
    records: list[Any] = []
    try:
        while len(records) < 6:
            for batch in (await reader.getmany(timeout_ms=1000)).values():
                records.extend(batch)
    finally:
        await reader.stop()
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        print(r.partition, r.key.decode(), dict(r.headers)["outbox-topic"].decode())
    return records


if __name__ == "__main__":
    asyncio.run(
        main(
            os.environ["AIOOUTBOX_DSN"],
            os.environ.get("KAFKA", "127.0.0.1:9092"),
            os.environ.get("KAFKA_IDEMPOTENCE", "1") != "0",
        )
    )
