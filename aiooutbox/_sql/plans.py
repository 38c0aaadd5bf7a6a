"""The plans PostgreSQL actually runs for the consumer's hot-path statements.

The claim and the settlements run inside PL/pgSQL functions (migration 0002), where a
plain ``EXPLAIN`` of the call shows only a function scan. ``auto_explain`` with nested
statements reports the plans of the statements inside, including plans the function
had already cached on this connection. Used by the test suite and the benchmarks to
check that the claim stays on the claimable index; it needs a superuser (``LOAD``).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import asyncpg

from ..errors import OutboxError
from .statements import Queries

__all__ = ["hot_path_plans", "nested_plans"]

_WORKER = "aiooutbox-plans"
_BYTES = 1 << 40


async def hot_path_plans(
    conn: asyncpg.Connection,
    q: Queries,
    topics: list[str],
    *,
    analyze: bool = False,
    generic: bool = True,
) -> dict[str, str]:
    """Plans of ``claim``, ``claim_after``, ``claim_marked``, ``recover_after``,
    ``settle_done`` and ``settle_failed``.

    The statements run in a transaction that is rolled back, so nothing changes.
    ``generic`` forces generic plans (what a consumer's connection settles on after a
    few calls); ``generic=False`` leaves the connection's plan cache as it is.
    """
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    none: list[None] = [None] * len(topics)  # no marks yet: from the start
    return await nested_plans(
        conn,
        q,
        [
            ("claim", q.claim, (_WORKER, 30.0, topics, 100, _BYTES, 100, 100)),
            (
                "claim_after",
                q.claim_after,
                (_WORKER, 30.0, topics, 100, _BYTES, 100, 100, epoch, 0),
            ),
            (
                "claim_marked",
                q.claim_marked,
                (
                    *(_WORKER, 30.0, topics, 100, _BYTES, 100, 100, none, none, [], 0.05),
                    *(None, 32, none, none, [0] * len(topics), 512),
                ),
            ),
            ("recover_after", q.recover_after, (100, epoch)),
            ("settle_done", q.settle_done_text, ("{0}", _WORKER, 1)),
            ("settle_failed", q.settle_failed, ([0], [0.0], ["plans"], ["retry"], _WORKER, 1)),
        ],
        analyze=analyze,
        generic=generic,
    )


async def nested_plans(
    conn: asyncpg.Connection,
    q: Queries,
    statements: list[tuple[str, str, tuple[Any, ...]]],
    *,
    analyze: bool = False,
    generic: bool = True,
) -> dict[str, str]:
    """The plans of the statements each of ``statements`` ran on the outbox table.

    ``(name, sql, args)`` each; run in a transaction that is rolled back.
    """
    try:
        await conn.execute("LOAD 'auto_explain'")
    except asyncpg.InsufficientPrivilegeError as exc:
        raise OutboxError("reading the claim's plans needs a superuser connection") from exc
    messages: list[str] = []

    def collect(_: Any, message: asyncpg.PostgresLogMessage) -> None:
        messages.append(message.message)

    conn.add_log_listener(collect)
    plans: dict[str, str] = {}
    transaction = conn.transaction()
    await transaction.start()
    try:
        await conn.execute(
            "SET LOCAL auto_explain.log_min_duration = 0;"
            " SET LOCAL auto_explain.log_nested_statements = on;"
            f" SET LOCAL auto_explain.log_analyze = {'on' if analyze else 'off'};"
            f" SET LOCAL auto_explain.log_buffers = {'on' if analyze else 'off'};"
            " SET LOCAL client_min_messages = log"
        )
        if generic:
            await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        for name, sql, args in statements:
            messages.clear()
            await conn.fetch(sql, *args)
            # the call itself is logged last, after the statements inside it
            for attempt in range(50):  # log listeners run in a later loop iteration
                await asyncio.sleep(0.01 if attempt else 0)
                if any(f"Query Text: {sql}" in m for m in messages):
                    break
            # the claim picks its rows in one statement and updates them in another:
            # every statement the function ran on the outbox table, in order
            inner = [
                m
                for m in messages
                if "Query Text:" in m and q.qualified in m and f"Query Text: {sql}" not in m
            ]
            if not inner:
                raise OutboxError(f"auto_explain reported no plan for {name}")
            plans[name] = "\n".join(m.split("\n", 1)[1] for m in inner)
    finally:
        # nothing the statements did is kept
        await transaction.rollback()
        conn.remove_log_listener(collect)
    return plans
