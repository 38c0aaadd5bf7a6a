"""aiohttp integration: a ``cleanup_ctx`` helper, typed ``AppKey`` s and a transaction helper.

Create the pool in a cleanup context of your own, store it under `POOL`, then append
`outbox_ctx` after it:

```python
async def database(app: web.Application) -> AsyncIterator[None]:
    async with asyncpg.create_pool(DSN) as pool:
        app[POOL] = pool
        yield

app = web.Application()
app.cleanup_ctx.append(database)
app.cleanup_ctx.append(outbox_ctx(handlers))

async def create_order(request: web.Request) -> web.Response:
    async with transaction(request) as conn:
        order_id = await conn.fetchval("INSERT INTO orders DEFAULT VALUES RETURNING id")
        await aiooutbox.enqueue(conn, "orders.created", {"order_id": order_id})
    return web.json_response({"id": order_id}, status=201)
```

Cleanup contexts exit in reverse order, so the consumer stops before the pool closes.
Needs the ``aiohttp`` extra (``pip install -e '.[aiohttp]'`` in a clone of aiooutbox).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
from aiohttp import web

from ..consumer import OutboxConsumer
from ..handlers import resolve_handlers
from ..migrations import check_schema
from .background import run_consumer

__all__ = ["CONSUMER", "POOL", "outbox_ctx", "transaction"]

logger = logging.getLogger("aiooutbox.integrations.aiohttp")

POOL = web.AppKey("aiooutbox.pool", asyncpg.Pool)
"""Where `outbox_ctx` and `transaction` find the pool (unless given another key)."""

CONSUMER = web.AppKey("aiooutbox.consumer", OutboxConsumer)
"""Where `outbox_ctx` stores the running consumer (only when it runs one)."""

Handlers = Mapping[str, Any] | Callable[[web.Application], Mapping[str, Any]]


def outbox_ctx(
    handlers: Handlers | None = None,
    *,
    pool_key: web.AppKey[asyncpg.Pool] = POOL,
    **consumer_options: Any,
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context that runs an `OutboxConsumer` on ``app[pool_key]``.

    ``handlers`` is a mapping (or `aiooutbox.Router`), or a function of the app returning
    one, called at startup so handlers can use what earlier contexts created (the pool,
    an HTTP client). The consumer is ready when startup completes (a missing schema or an
    unreachable database fails it), is stored under `CONSUMER`, and stops gracefully at
    cleanup (see `aiooutbox.integrations.background.run_consumer`, which gets
    ``consumer_options``). Without ``handlers`` the app only produces: the schema is
    checked at startup and no consumer runs.
    """
    if handlers is None:
        unused = sorted(set(consumer_options) - {"schema", "table"})
        if unused:
            raise TypeError(f"consumer options {unused} need handlers to run a consumer")
    elif isinstance(handlers, Mapping):
        handlers = resolve_handlers(handlers)  # fail while building the app, not at startup
    elif not callable(handlers):
        raise TypeError(
            "handlers must be a mapping of topic to async handler, or a function of the app "
            f"returning one, not {type(handlers).__name__}"
        )

    async def aiooutbox_ctx(app: web.Application) -> AsyncIterator[None]:
        try:
            pool = app[pool_key]
        except KeyError:
            raise RuntimeError(
                f"no asyncpg pool under {pool_key!r}: create it in a cleanup context "
                "appended before outbox_ctx(...) and store it there"
            ) from None
        if not isinstance(pool, asyncpg.Pool):
            raise TypeError(
                f"app[{pool_key!r}] must be an asyncpg.Pool (asyncpg.create_pool(...)), "
                f"not {type(pool).__name__}"
            )
        if handlers is None:
            await check_schema(pool, **consumer_options)
            yield
            return
        resolved = handlers if isinstance(handlers, Mapping) else handlers(app)
        async with run_consumer(pool, resolved, **consumer_options) as consumer:
            app[CONSUMER] = consumer
            yield

    return aiooutbox_ctx


@asynccontextmanager
async def transaction(
    request: web.Request, *, pool_key: web.AppKey[asyncpg.Pool] = POOL
) -> AsyncIterator[asyncpg.Connection]:
    """A pooled connection in a transaction: commits when the block ends, rolls back if it raises.

    Enqueue on it so the event commits with the request's writes or not at all.
    """
    pool = request.config_dict[pool_key]
    async with pool.acquire() as conn, conn.transaction():
        yield conn
