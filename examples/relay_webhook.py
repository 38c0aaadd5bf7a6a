"""Relay the outbox to a webhook signed per Standard Webhooks; a receiver verifies it.

    export AIOOUTBOX_DSN=postgresql://postgres@127.0.0.1:5432/test
    python -m examples.relay_webhook

Starts a tiny aiohttp receiver that checks ``webhook-signature`` (HMAC-SHA256 over
``"{webhook-id}.{webhook-timestamp}.{body}"``) and answers 204, commits three events and
relays them with `WebhookSink`. Needs the ``webhook`` extra, from the clone:
``pip install -e '.[webhook]'`` (and aiohttp for the receiver).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import os
import socket
from typing import Any

import asyncpg

import aiooutbox
from aiooutbox.relay import WebhookSink

SECRET = "whsec_" + base64.b64encode(b"example secret, keep it elsewhere").decode()


def verified(headers: Any, body: bytes) -> bool:
    key = base64.b64decode(SECRET.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return any(
        hmac.compare_digest(expected, sig.partition(",")[2])
        for sig in headers["webhook-signature"].split()
    )


async def main(dsn: str) -> list[tuple[str, bytes]]:
    from aiohttp import web

    received: list[tuple[str, bytes]] = []

    async def receive(request: web.Request) -> web.Response:
        body = await request.read()
        if not verified(request.headers, body):
            return web.Response(status=401)
        received.append((request.headers["webhook-id"], body))
        print("verified", request.headers["webhook-id"], body.decode())
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hooks/{topic}", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
            await aiooutbox.migrate(pool)
            async with pool.acquire() as conn, conn.transaction():
                for order in (1, 2, 3):
                    await aiooutbox.enqueue(conn, "orders.created", {"order_id": order})
            sink = WebhookSink(f"http://127.0.0.1:{port}/hooks/{{topic}}", secret=SECRET)
            async with sink, aiooutbox.OutboxConsumer(pool) as consumer:
                task = asyncio.ensure_future(consumer.run({"*": sink}))
                while consumer.stats.done < 3:  # noqa: ASYNC110 - a demo, not a library  # noqa: ASYNC110 - a demo, not a library
                    await asyncio.sleep(0.05)
                consumer.stop()
                await task
    finally:
        await runner.cleanup()
    return received


if __name__ == "__main__":
    asyncio.run(main(os.environ["AIOOUTBOX_DSN"]))
