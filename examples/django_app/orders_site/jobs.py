"""The consumer that runs beside the site, as the standalone runner::

    python -m aiooutbox run examples.django_app.orders_site.jobs:handlers --migrate

It needs no Django: it reads the same database through asyncpg and "sends" the
confirmation email by recording it in the ``emails`` table (idempotently: delivery is
at-least-once).
"""

from __future__ import annotations

import logging

import asyncpg

import aiooutbox
from examples.orders import database_url

logger = logging.getLogger("examples.django_app.jobs")


async def send_confirmation(event: aiooutbox.Event) -> None:
    order_id = event.payload["order_id"]
    conn = await asyncpg.connect(database_url())
    try:
        await conn.execute(
            "INSERT INTO emails (order_id, recipient, subject) VALUES ($1, $2, $3)"
            " ON CONFLICT (order_id) DO NOTHING",
            order_id,
            event.payload["email"],
            f"Your order #{order_id} is confirmed",
        )
    finally:
        await conn.close()
    logger.info("confirmation email for order %d sent", order_id)


handlers = {"orders.created": send_confirmation}
