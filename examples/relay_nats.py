"""Relay the outbox to NATS JetStream; read back what the stream holds.

    export AIOOUTBOX_DSN=postgresql://postgres@127.0.0.1:5432/test
    python -m examples.relay_nats            # NATS_URL, default nats://127.0.0.1:4222

Creates a stream ORDERS on ``orders.>`` (streams are the operator's to create; a subject
no stream captures is an event failure, not a silent drop), commits three order events,
relays them with `NatsSink` under a consumer of every topic, and prints each stored
message with its ``Nats-Msg-Id``, the event's ``message_id``. Needs the ``nats``
extra, from the clone: ``pip install -e '.[nats]'``.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import asyncpg

import aiooutbox
from aiooutbox.relay import NatsSink


async def main(
    dsn: str, url: str = "nats://127.0.0.1:4222", stream: str = "ORDERS", prefix: str = "orders"
) -> list[Any]:
    import nats
    from nats.js.api import StreamConfig

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=stream, subjects=[f"{prefix}.>"]))
        try:
            async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
                await aiooutbox.migrate(pool)
                async with pool.acquire() as conn, conn.transaction():
                    for order in (1, 2, 3):
                        await aiooutbox.enqueue(conn, f"{prefix}.created", {"order_id": order})
                async with NatsSink(url) as sink, aiooutbox.OutboxConsumer(pool) as consumer:
                    task = asyncio.ensure_future(consumer.run({"*": sink}))  # "*": every topic
                    while consumer.stats.done < 3:  # noqa: ASYNC110 - a demo, not a library
                        await asyncio.sleep(0.05)
                    consumer.stop()
                    await task
            sub = await js.pull_subscribe(f"{prefix}.>", stream=stream)
            messages = await sub.fetch(3, timeout=5)
            for msg in messages:
                print(msg.subject, msg.headers["Nats-Msg-Id"], msg.data.decode())
                await msg.ack()
        finally:
            await js.delete_stream(stream)
    finally:
        await nc.close()
    return messages


if __name__ == "__main__":
    asyncio.run(
        main(os.environ["AIOOUTBOX_DSN"], os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    )
