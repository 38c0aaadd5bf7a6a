"""Relay the outbox to a Redis stream; read back its entries.

    export AIOOUTBOX_DSN=postgresql://postgres@127.0.0.1:5432/test
    python -m examples.relay_redis           # REDIS_URL, default redis://127.0.0.1:6379/0

Commits three events and relays them with `RedisSink` into the stream ``outbox:orders``
(``XADD`` with ``MAXLEN ~ 100000``): each entry holds ``message_id``, ``payload`` (JSON),
``topic``, ``event_id`` and ``headers``. Needs the ``redis`` extra, from the clone:
``pip install -e '.[redis]'``.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import asyncpg

import aiooutbox
from aiooutbox.relay import RedisSink


async def main(
    dsn: str, url: str = "redis://127.0.0.1:6379/0", stream: str = "outbox:orders"
) -> list[Any]:
    import redis.asyncio as redis

    async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
        await aiooutbox.migrate(pool)
        async with pool.acquire() as conn, conn.transaction():
            for order in (1, 2, 3):
                await aiooutbox.enqueue(conn, "orders.created", {"order_id": order})
        sink = RedisSink(url, destination=stream, maxlen=100_000)
        async with sink, aiooutbox.OutboxConsumer(pool) as consumer:
            task = asyncio.ensure_future(consumer.run({"*": sink}))
            while consumer.stats.done < 3:  # noqa: ASYNC110 - a demo, not a library
                await asyncio.sleep(0.05)
            consumer.stop()
            await task
    client = redis.Redis.from_url(url)
    entries = await client.xrange(stream)
    for entry_id, fields in entries:
        print(entry_id.decode(), fields[b"message_id"].decode(), fields[b"payload"].decode())
    await client.delete(stream)
    await client.aclose()
    return entries


if __name__ == "__main__":
    asyncio.run(
        main(os.environ["AIOOUTBOX_DSN"], os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    )
