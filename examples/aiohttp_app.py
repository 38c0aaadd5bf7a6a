"""The orders service of ``fastapi_app.py``, on aiohttp.

``POST /orders`` writes the order and an ``orders.created`` event in one transaction; a
handler running in the app's background "sends" the confirmation email by recording it
in the ``emails`` table; ``GET /orders/{id}`` shows the order with its email status.

Run it (tables and the outbox schema are created at startup)::

    export AIOOUTBOX_DSN=postgresql://postgres@127.0.0.1:5432/test
    python -m examples.aiohttp_app            # http://localhost:8080
    curl -X POST localhost:8080/orders -H 'content-type: application/json' \\
         -d '{"email": "ada@example.com", "item": "teapot", "quantity": 2}'
    curl localhost:8080/orders/1
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator

import asyncpg
from aiohttp import web

import aiooutbox
from aiooutbox.integrations.aiohttp import POOL, outbox_ctx, transaction
from examples.orders import TABLES, database_url, email_handlers, fetch_order


async def database(app: web.Application) -> AsyncIterator[None]:
    async with asyncpg.create_pool(database_url(), min_size=2, max_size=10) as pool:
        await aiooutbox.migrate(pool)
        await pool.execute(TABLES)
        app[POOL] = pool
        yield


async def create_order(request: web.Request) -> web.Response:
    try:
        body = await request.json()
        email, item, quantity = str(body["email"]), str(body["item"]), int(body["quantity"])
    except (KeyError, TypeError, ValueError):
        raise web.HTTPUnprocessableEntity(text="expected email, item and quantity") from None
    if not 0 < quantity <= 1000:
        raise web.HTTPUnprocessableEntity(text="quantity must be between 1 and 1000")
    # one transaction: the order and its event commit together, or neither does
    async with transaction(request) as conn:
        order_id = await conn.fetchval(
            "INSERT INTO orders (email, item, quantity) VALUES ($1, $2, $3) RETURNING id",
            email,
            item,
            quantity,
        )
        await aiooutbox.enqueue(
            conn,
            "orders.created",
            {"order_id": order_id, "email": email},
            dedupe_key=f"order-{order_id}-created",
        )
    return web.json_response({"id": order_id}, status=201)


async def get_order(request: web.Request) -> web.Response:
    try:
        order_id = int(request.match_info["order_id"])
    except ValueError:
        raise web.HTTPNotFound(text="no such order") from None
    order = await fetch_order(request.app[POOL], order_id)
    if order is None:
        raise web.HTTPNotFound(text="no such order")
    return web.json_response(order)


def create_app() -> web.Application:
    app = web.Application()
    app.cleanup_ctx.append(database)
    # handlers as a function of the app: called at startup, once the pool exists
    app.cleanup_ctx.append(outbox_ctx(lambda app: email_handlers(app[POOL]), shutdown_grace=5))
    app.router.add_post("/orders", create_order)
    app.router.add_get("/orders/{order_id}", get_order)
    return app


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    web.run_app(create_app(), port=int(os.environ.get("PORT", "8080")))
