"""Consume from Kafka exactly once with the inbox; a redelivered record is skipped.

    export AIOOUTBOX_DSN=postgresql://postgres@127.0.0.1:5432/test
    python -m examples.inbox_kafka           # KAFKA_BOOTSTRAP, default 127.0.0.1:9092

A relay publishes each event with its message id in the ``outbox-message-id`` header.
This consumer reads a batch, records each id with `aiooutbox.inbox.record` in the
transaction that does the work, and commits the Kafka offsets only after the database
commit: a crash in between replays the batch, and the replayed records are skipped. The
example produces one record twice, as a relay crash would, and bills it once.
Needs the ``kafka`` extra, from the clone: ``pip install -e '.[kafka]'``.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import asyncpg

import aiooutbox
from aiooutbox import inbox

HEADER = "outbox-message-id"


def message_id(record: object) -> str | None:
    for key, value in getattr(record, "headers", None) or ():
        if key == HEADER:
            return bytes(value).decode()
    return None


async def main(dsn: str, bootstrap: str = "127.0.0.1:9092", topic: str = "orders") -> int:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    async with asyncpg.create_pool(dsn, min_size=1, max_size=2) as pool:
        await aiooutbox.migrate(pool)  # makes the inbox table beside the outbox
        await pool.execute("CREATE TABLE IF NOT EXISTS invoices (order_id int NOT NULL)")
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
        await producer.start()
        try:
            headers = [(HEADER, str(uuid.uuid4()).encode())]
            for _ in range(2):  # the same record twice, as after a relay crash
                await producer.send_and_wait(topic, b'{"order_id": 42}', headers=headers)
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=bootstrap,
            group_id=f"billing-{uuid.uuid4().hex[:8]}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        await consumer.start()
        try:
            seen = 0
            while seen < 2:
                batch = await consumer.getmany(timeout_ms=1000)
                for records in batch.values():
                    for record in records:
                        seen += 1
                        mid = message_id(record)
                        if mid is None:
                            continue  # not from an aiooutbox relay
                        async with pool.acquire() as conn, conn.transaction():
                            if await inbox.record(conn, mid, consumer="billing"):
                                order = json.loads(record.value)
                                await conn.execute(
                                    "INSERT INTO invoices (order_id) VALUES ($1)", order["order_id"]
                                )
                                print("billed", mid)
                            else:
                                print("skipped a redelivery of", mid)
                await consumer.commit()  # offsets after the database commit
        finally:
            await consumer.stop()
        billed: int = await pool.fetchval("SELECT count(*) FROM invoices WHERE order_id = 42")
        print("invoices for order 42:", billed)
        return billed


if __name__ == "__main__":
    asyncio.run(
        main(
            os.environ.get("AIOOUTBOX_DSN", "postgresql://postgres@127.0.0.1/test"),
            os.environ.get("KAFKA_BOOTSTRAP", "127.0.0.1:9092"),
        )
    )
