"""A RabbitMQ consumer that processes with the inbox, for tests/test_inbox.py.

    python -m tests.inbox_worker DSN AMQP_URL QUEUE [--hang-after-commit N]

For each message: in one transaction, record its message id and (first delivery only)
insert an effect row; commit; print "committed <id> <first>"; ack. With
``--hang-after-commit N`` the N-th message is committed but never acked: the worker
prints "hanging <id>" and sleeps, for the test to SIGKILL it in that window.
"""

from __future__ import annotations

import argparse
import asyncio

import aio_pika
import asyncpg

from aiooutbox import inbox


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dsn")
    parser.add_argument("url")
    parser.add_argument("queue")
    parser.add_argument("--hang-after-commit", type=int, default=0)
    args = parser.parse_args()
    async with asyncpg.create_pool(args.dsn, min_size=1, max_size=2) as pool:
        connection = await aio_pika.connect(args.url)
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=1)
        queue = await channel.get_queue(args.queue)
        handled = 0
        async with queue.iterator() as messages:
            async for message in messages:
                assert message.message_id is not None
                async with pool.acquire() as conn, conn.transaction():
                    first = await inbox.record(conn, message.message_id, consumer="test")
                    if first:
                        await conn.execute(
                            "INSERT INTO effects (message_id) VALUES ($1)", message.message_id
                        )
                handled += 1
                if handled == args.hang_after_commit:
                    print("hanging", message.message_id, flush=True)
                    await asyncio.sleep(3600)
                await message.ack()
                print("committed", message.message_id, first, flush=True)


if __name__ == "__main__":
    asyncio.run(main())
