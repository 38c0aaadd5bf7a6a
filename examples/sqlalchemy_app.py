"""The orders service on FastAPI with SQLAlchemy's AsyncSession as the app's database layer.

``POST /orders`` adds an ``Order`` through the session and enqueues ``orders.created``
on the same session: one transaction, committed by ``session.commit()`` (or neither row
exists). The consumer runs in the app's background on its own asyncpg pool and "sends"
the confirmation email (examples/orders.py); ``GET /orders/{id}`` shows its status.

Run it (tables and the outbox schema are created at startup)::

    pip install -e '.[fastapi,sqlalchemy]' uvicorn
    export AIOOUTBOX_DSN=postgresql://postgres@127.0.0.1:5432/test
    uvicorn examples.sqlalchemy_app:app
    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -d '{"email": "ada@example.com", "item": "teapot", "quantity": 2}'
    curl localhost:8000/orders/1
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import asyncpg
from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, Field
from sqlalchemy import BigInteger, Integer, String
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import aiooutbox
from aiooutbox.integrations.fastapi import outbox_lifespan
from examples.orders import TABLES, database_url, email_handlers, fetch_order


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    # the table is examples/orders.py's (an identity column the server fills in)
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    email: Mapped[str] = mapped_column(String)
    item: Mapped[str] = mapped_column(String)
    quantity: Mapped[int] = mapped_column(Integer)


def sqlalchemy_url(dsn: str) -> str:
    return "postgresql+asyncpg://" + dsn.split("://", 1)[1]


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine = create_async_engine(sqlalchemy_url(database_url()))
    app.state.sessions = async_sessionmaker(engine, expire_on_commit=False)
    try:
        # the consumer needs an asyncpg pool of its own; the app keeps using SQLAlchemy
        async with asyncpg.create_pool(database_url(), min_size=1, max_size=4) as pool:
            await aiooutbox.migrate(pool)
            await pool.execute(TABLES)
            app.state.pool = pool
            async with outbox_lifespan(app, pool, email_handlers(pool), shutdown_grace=5):
                yield
    finally:
        await engine.dispose()


app = FastAPI(title="orders (SQLAlchemy)", lifespan=lifespan)


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.sessions() as session:
        yield session


SessionDep = Annotated[AsyncSession, Depends(get_session)]


class NewOrder(BaseModel):
    email: str = Field(min_length=3, max_length=320)
    item: str = Field(min_length=1, max_length=200)
    quantity: int = Field(gt=0, le=1000)


@app.post("/orders", status_code=201)
async def create_order(order: NewOrder, session: SessionDep) -> dict[str, Any]:
    row = Order(email=order.email, item=order.item, quantity=order.quantity)
    session.add(row)
    await session.flush()  # the INSERT runs (the session autobegan its transaction): id known
    await aiooutbox.enqueue(
        session,  # joins the session's transaction
        "orders.created",
        {"order_id": row.id, "email": order.email},
        dedupe_key=f"order-{row.id}-created",
    )
    await session.commit()  # the order and its event, or (on any error before) neither
    return {"id": row.id}


@app.get("/orders/{order_id}")
async def get_order(order_id: int, request: Request) -> dict[str, Any]:
    order = await fetch_order(request.app.state.pool, order_id)
    if order is None:
        raise HTTPException(status_code=404, detail="no such order")
    return order
