"""An orders service on FastAPI with a transactional outbox.

``POST /orders`` writes the order and an ``orders.created`` event in one transaction; a
handler running in the app's background "sends" the confirmation email by recording it
in the ``emails`` table; ``GET /orders/{id}`` shows the order with its email status.

Run it (tables and the outbox schema are created at startup)::

    export AIOOUTBOX_DSN=postgresql://postgres@127.0.0.1:5432/test
    uvicorn examples.fastapi_app:app
    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -d '{"email": "ada@example.com", "item": "teapot", "quantity": 2}'
    curl localhost:8000/orders/1
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

import aiooutbox
from aiooutbox.integrations.fastapi import PoolDep, TransactionDep, outbox_lifespan
from examples.orders import TABLES, database_url, email_handlers, fetch_order


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with asyncpg.create_pool(database_url(), min_size=2, max_size=10) as pool:
        await aiooutbox.migrate(pool)
        await pool.execute(TABLES)
        async with outbox_lifespan(app, pool, email_handlers(pool), shutdown_grace=5):
            yield


app = FastAPI(title="orders", lifespan=lifespan)


class NewOrder(BaseModel):
    email: str = Field(min_length=3, max_length=320)
    item: str = Field(min_length=1, max_length=200)
    quantity: int = Field(gt=0, le=1000)


@app.post("/orders", status_code=201)
async def create_order(order: NewOrder, conn: TransactionDep) -> dict[str, Any]:
    # one transaction: the order and its event commit together, or neither does
    order_id = await conn.fetchval(
        "INSERT INTO orders (email, item, quantity) VALUES ($1, $2, $3) RETURNING id",
        order.email,
        order.item,
        order.quantity,
    )
    await aiooutbox.enqueue(
        conn,
        "orders.created",
        {"order_id": order_id, "email": order.email},
        dedupe_key=f"order-{order_id}-created",
    )
    return {"id": order_id}


@app.get("/orders/{order_id}")
async def get_order(order_id: int, pool: PoolDep) -> dict[str, Any]:
    order = await fetch_order(pool, order_id)
    if order is None:
        raise HTTPException(status_code=404, detail="no such order")
    return order
