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

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import asyncpg
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

import aiooutbox
from aiooutbox.integrations.fastapi import PoolDep, TransactionDep, outbox_lifespan

logger = logging.getLogger("examples.fastapi_app")

TABLES = """
CREATE TABLE IF NOT EXISTS orders (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    email      TEXT        NOT NULL,
    item       TEXT        NOT NULL,
    quantity   INT         NOT NULL CHECK (quantity > 0),
    created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS emails (
    order_id  BIGINT      PRIMARY KEY REFERENCES orders (id),
    recipient TEXT        NOT NULL,
    subject   TEXT        NOT NULL,
    sent_at   TIMESTAMPTZ NOT NULL DEFAULT now()
);
"""


def database_url() -> str:
    dsn = os.environ.get("AIOOUTBOX_DSN") or os.environ.get("DATABASE_URL")
    if not dsn:
        raise RuntimeError("set AIOOUTBOX_DSN (or DATABASE_URL) to a PostgreSQL DSN")
    return dsn


def email_handlers(pool: asyncpg.Pool) -> aiooutbox.Router:
    router = aiooutbox.Router()

    @router.handler("orders.created", timeout=10)
    async def send_confirmation(event: aiooutbox.Event) -> None:
        order_id = event.payload["order_id"]
        # a real service would call its email provider here; the event can arrive twice
        # (at-least-once), so the write is idempotent
        await pool.execute(
            "INSERT INTO emails (order_id, recipient, subject) VALUES ($1, $2, $3)"
            " ON CONFLICT (order_id) DO NOTHING",
            order_id,
            event.payload["email"],
            f"Your order #{order_id} is confirmed",
        )
        logger.info("confirmation email for order %d sent", order_id)

    return router


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
    row = await pool.fetchrow(
        "SELECT o.id, o.email, o.item, o.quantity, o.created_at, e.sent_at"
        " FROM orders o LEFT JOIN emails e ON e.order_id = o.id WHERE o.id = $1",
        order_id,
    )
    if row is None:
        raise HTTPException(status_code=404, detail="no such order")
    sent_at: datetime | None = row["sent_at"]
    return {
        "id": row["id"],
        "email": row["email"],
        "item": row["item"],
        "quantity": row["quantity"],
        "created_at": row["created_at"].isoformat(),
        "confirmation_email": {
            "status": "sent" if sent_at else "pending",
            "sent_at": sent_at.isoformat() if sent_at else None,
        },
    }
