"""What a handler's timeout and a decoder's fatal exception do, per-event and batch,
against a real PostgreSQL: a handler that blocks the event loop past its timeout fails
its attempt; a decoder that raises ``SystemExit`` or another `BaseException` fails the
event and stops the consumer gracefully, as a handler raising it does."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import asyncpg
import pytest

import aiooutbox
from aiooutbox import Handler
from tests.helpers import wait_until
from tests.test_batch import consumer_of, finished, rows


class Fatal(BaseException):
    """Not an `Exception`: what a decoder's ``SystemExit`` or ``KeyboardInterrupt`` is."""


def as_kind(kind: str, one: Any, many: Any) -> Any:
    return Handler(many, batch=10) if kind == "batch" else one


@pytest.mark.parametrize("kind", ["per event", "batch"])
async def test_a_handler_that_blocks_past_its_timeout_fails_its_attempt(
    pool: asyncpg.Pool, kind: str
) -> None:
    event_id = await aiooutbox.enqueue(pool, "t", {"n": 1}, max_attempts=1)
    assert event_id is not None

    async def one(event: aiooutbox.Event) -> None:
        time.sleep(0.5)  # synchronous work: nothing can cancel it meanwhile

    async def many(events: list[aiooutbox.Event]) -> None:
        time.sleep(0.5)

    consumer = consumer_of(pool, handler_timeout=0.1)
    task = asyncio.ensure_future(consumer.run({"t": as_kind(kind, one, many)}))
    try:
        await wait_until(finished(pool, 1))
    finally:
        consumer.stop()
        await asyncio.wait_for(task, 60)
    status, attempts, error = (await rows(pool))[event_id]
    assert (status, attempts) == ("dead", 1)
    assert error is not None and "TimeoutError" in error and "after its timeout of 0.1s" in error


@pytest.mark.parametrize("kind", ["per event", "batch"])
async def test_a_decoder_raising_a_base_exception_fails_the_event_and_stops_gracefully(
    pool: asyncpg.Pool, kind: str
) -> None:
    made = await aiooutbox.enqueue_many(
        pool,
        [aiooutbox.NewEvent("t", {"n": n, "poison": n == 2}, max_attempts=1) for n in range(5)],
    )
    ids = [i for i in made if i is not None]
    poison = ids[2]

    def decode(text: str | bytes) -> Any:
        value = json.loads(text)
        if value["poison"]:
            raise Fatal("the decoder gave up")
        return value

    handled: list[int] = []

    async def one(event: aiooutbox.Event) -> None:
        await asyncio.sleep(0.3)  # running when the consumer is told to stop
        handled.append(event.payload["n"])

    async def many(events: list[aiooutbox.Event]) -> None:
        await asyncio.sleep(0.3)
        handled.extend(e.payload["n"] for e in events)

    consumer = consumer_of(pool, decoder=decode, concurrency=10, shutdown_grace=10)
    with pytest.raises(Fatal):
        await asyncio.wait_for(consumer.run({"t": as_kind(kind, one, many)}), 60)
    found = await rows(pool)
    # the poison event failed (its one attempt: dead); the handlers already running
    # ran to the end; events not started yet were released for the next consumer
    status, attempts, error = found[poison]
    assert (status, attempts) == ("dead", 1)
    assert error is not None and "the decoder gave up" in error
    assert handled and set(handled) <= {0, 1, 3, 4}
    for n, event_id in enumerate(ids):
        if event_id != poison:
            assert found[event_id][0] == ("done" if n in handled else "retry"), (n, found)
