"""FastAPI (and Starlette) integration: a lifespan helper and request dependencies.

Enter `outbox_lifespan` inside your own lifespan, after creating the pool:

```python
@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with asyncpg.create_pool(DSN) as pool:
        async with outbox_lifespan(app, pool, handlers):
            yield

app = FastAPI(lifespan=lifespan)

@app.post("/orders")
async def create_order(conn: TransactionDep) -> dict[str, int]:
    order_id = await conn.fetchval("INSERT INTO orders DEFAULT VALUES RETURNING id")
    await aiooutbox.enqueue(conn, "orders.created", {"order_id": order_id})
    return {"id": order_id}
```

`TransactionDep` is a pooled connection inside a transaction that commits when the
endpoint returns, before the response is sent, and rolls back if it raises (an
``HTTPException`` too): the order and its event commit together or not at all.
Needs the ``fastapi`` extra (``pip install -e '.[fastapi]'`` in a clone of aiooutbox).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Annotated, Any

import asyncpg
from fastapi import Depends
from starlette.applications import Starlette
from starlette.requests import HTTPConnection

from ..consumer import OutboxConsumer
from ..migrations import check_schema
from .background import run_consumer

__all__ = ["PoolDep", "TransactionDep", "get_pool", "get_transaction", "outbox_lifespan"]

logger = logging.getLogger("aiooutbox.integrations.fastapi")

_POOL = "aiooutbox_pool"
_CONSUMER = "aiooutbox_consumer"


@asynccontextmanager
async def outbox_lifespan(
    app: Starlette,
    pool: asyncpg.Pool,
    handlers: Mapping[str, Any] | None = None,
    **consumer_options: Any,
) -> AsyncIterator[OutboxConsumer | None]:
    """Make ``pool`` available to `get_pool`/`get_transaction` and run a consumer with it.

    With ``handlers``, an `OutboxConsumer` runs in the background while the block runs
    (see `aiooutbox.integrations.background.run_consumer`, which gets
    ``consumer_options``) and is yielded. Without, the app only produces: the schema is
    checked and ``None`` is yielded. Either way a missing schema fails the app's startup.
    On exit the consumer stops gracefully before the block returns, so the pool can be
    closed right after.
    """
    if not isinstance(pool, asyncpg.Pool):
        raise TypeError(
            "outbox_lifespan needs an asyncpg.Pool (asyncpg.create_pool(...)), "
            f"not {type(pool).__name__}"
        )
    if handlers is None:
        unused = sorted(set(consumer_options) - {"schema", "table"})
        if unused:
            raise TypeError(f"consumer options {unused} need handlers to run a consumer")
        await check_schema(pool, **consumer_options)
    state = app.state
    setattr(state, _POOL, pool)
    try:
        if handlers is None:
            yield None
        else:
            async with run_consumer(pool, handlers, **consumer_options) as consumer:
                setattr(state, _CONSUMER, consumer)
                yield consumer
    finally:
        for name in (_CONSUMER, _POOL):
            if hasattr(state, name):
                delattr(state, name)


def get_pool(connection: HTTPConnection) -> asyncpg.Pool:
    """Dependency: the pool given to `outbox_lifespan`."""
    pool = getattr(connection.app.state, _POOL, None)
    if pool is None:
        raise RuntimeError(
            "no pool for aiooutbox on this app: enter "
            "aiooutbox.integrations.fastapi.outbox_lifespan(app, pool) in its lifespan"
        )
    return pool


async def get_transaction(
    pool: Annotated[asyncpg.Pool, Depends(get_pool)],
) -> AsyncIterator[asyncpg.Connection]:
    """Dependency: a connection in a transaction that commits when the endpoint returns.

    Anything raised by the endpoint (``HTTPException`` included) rolls it back.
    """
    async with pool.acquire() as conn, conn.transaction():
        yield conn


def _around_the_endpoint(dependency: Callable[..., Any]) -> Any:
    # scope="function" (FastAPI >= 0.121) commits before the response is sent; older
    # versions have no scope and exit dependencies around the response (0.106-0.117:
    # before it is sent, 0.118-0.120: after)
    try:
        return Depends(dependency, scope="function")
    except TypeError:  # pragma: no cover - old FastAPI
        return Depends(dependency)


PoolDep = Annotated[asyncpg.Pool, Depends(get_pool)]
"""The app's pool: ``async def endpoint(pool: PoolDep)``; ``enqueue(pool, ...)`` commits alone."""

TransactionDep = Annotated[asyncpg.Connection, _around_the_endpoint(get_transaction)]
"""A connection in a transaction around the endpoint: ``async def f(conn: TransactionDep)``."""
