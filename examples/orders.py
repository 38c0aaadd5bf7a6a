"""What the two orders examples share: their tables, DSN lookup and the email handler."""

from __future__ import annotations

import logging
import os
from datetime import datetime
from typing import Any

import asyncpg

import aiooutbox

logger = logging.getLogger("examples.orders")

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


async def fetch_order(
    db: asyncpg.Pool | asyncpg.Connection, order_id: int
) -> dict[str, Any] | None:
    """The order with the status of its confirmation email, or None."""
    row = await db.fetchrow(
        "SELECT o.id, o.email, o.item, o.quantity, o.created_at, e.sent_at"
        " FROM orders o LEFT JOIN emails e ON e.order_id = o.id WHERE o.id = $1",
        order_id,
    )
    if row is None:
        return None
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
