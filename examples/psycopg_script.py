"""Produce from psycopg 3, blocking and async, in the caller's transaction.

A script (a cron job, a data fix, a management task) that writes orders with psycopg
and enqueues ``orders.created`` for each in the same transaction. Run it beside any
consumer of that topic, e.g. the FastAPI example or the Django site's worker::

    pip install -e '.[psycopg]'
    export AIOOUTBOX_DSN=postgresql://postgres@127.0.0.1:5432/test
    python -m aiooutbox migrate
    python examples/psycopg_script.py
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiooutbox
import aiooutbox.sync
from examples.orders import TABLES, database_url


def blocking(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:  # commits at the end of the block, rolls back on error
        conn.execute(TABLES)
        order_id = conn.execute(
            "INSERT INTO orders (email, item, quantity) VALUES (%s, %s, %s) RETURNING id",
            ("ada@example.com", "teapot", 1),
        ).fetchone()[0]  # type: ignore[index]
        event_id = aiooutbox.sync.enqueue(
            conn,
            "orders.created",
            {"order_id": order_id, "email": "ada@example.com"},
            dedupe_key=f"order-{order_id}-created",
        )
        print(f"blocking: order {order_id}, event {event_id}")

        # a savepoint that rolls back takes its event with it
        with conn.transaction(force_rollback=True):
            aiooutbox.sync.enqueue(conn, "orders.created", {"order_id": -1}, dedupe_key="never")
        print("blocking: the rolled-back savepoint's event is gone")


async def asynchronous(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        async with conn.transaction():
            ids = []
            for email, item in [("grace@example.com", "compiler"), ("edsger@example.com", "lock")]:
                cursor = await conn.execute(
                    "INSERT INTO orders (email, item, quantity) VALUES (%s, %s, 1) RETURNING id",
                    (email, item),
                )
                ids.append(((await cursor.fetchone()) or [0])[0])
            events = await aiooutbox.enqueue_many(
                conn,
                [
                    aiooutbox.NewEvent(
                        "orders.created",
                        {"order_id": order_id, "email": email},
                        dedupe_key=f"order-{order_id}-created",
                    )
                    for order_id, email in zip(
                        ids, ["grace@example.com", "edsger@example.com"], strict=True
                    )
                ],
            )
        print(f"async: orders {ids}, events {events}")


if __name__ == "__main__":
    dsn = database_url()
    blocking(dsn)
    asyncio.run(asynchronous(dsn))
