"""Ordered keys and batch handlers against a real PostgreSQL: a key whose events span
topics handled by different handlers, and an event of a key that cannot be decoded
behind earlier events of its key in the same batch."""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest

import aiooutbox
from aiooutbox import Handler
from tests.helpers import running, wait_until
from tests.test_batch import consumer_of, finished, rows


def as_kind(kind: str, func: Any) -> Any:
    return Handler(func, batch=10) if kind == "batch" else func


@pytest.mark.parametrize(
    ("topics", "a", "b"),
    [
        ("abab", "batch", "per event"),  # the key's first event on the batch topic
        ("baab", "batch", "per event"),  # ... on the per-event topic
        ("abab", "batch", "batch"),  # two batch handlers
    ],
)
async def test_a_key_spanning_topics_reaches_each_topics_handler_in_order(
    pool: asyncpg.Pool, topics: str, a: str, b: str
) -> None:
    events = [aiooutbox.NewEvent(t, {"n": i}, ordering_key="k") for i, t in enumerate(topics)]
    events += [aiooutbox.NewEvent(t, {"n": 10 + i}) for i, t in enumerate("ab")]  # unordered
    await aiooutbox.enqueue_many(pool, events)
    seen: list[tuple[str, str, int]] = []  # (handler, topic, n), as handled

    def handler(name: str, kind: str) -> Any:
        async def one(event: aiooutbox.Event) -> None:
            assert isinstance(event, aiooutbox.Event), event
            seen.append((name, event.topic, event.payload["n"]))

        async def many(batch: list[aiooutbox.Event]) -> None:
            assert isinstance(batch, list), batch
            seen.extend((name, e.topic, e.payload["n"]) for e in batch)

        return as_kind(kind, many if kind == "batch" else one)

    consumer = consumer_of(pool, concurrency=20)
    async with consumer, running(consumer, {"a": handler("a", a), "b": handler("b", b)}):
        await wait_until(finished(pool, len(events)))
    # each handler had only its own topic's events, every event once, the key's in order
    assert all(name == topic for name, topic, _ in seen), seen
    assert sorted(n for _, _, n in seen) == [0, 1, 2, 3, 10, 11]
    assert [n for _, _, n in seen if n < 10] == [0, 1, 2, 3]
    assert set((await rows(pool)).values()) == {("done", 1, None)}


async def test_one_handler_for_every_topic_takes_a_key_spanning_topics_in_one_run(
    pool: asyncpg.Pool,
) -> None:
    # the relay's shape: one batch handler for all topics; the run is not split
    await aiooutbox.enqueue_many(
        pool, [aiooutbox.NewEvent(t, {"n": i}, ordering_key="k") for i, t in enumerate("abab")]
    )
    calls: list[list[tuple[str, int]]] = []

    async def handle(batch: list[aiooutbox.Event]) -> None:
        calls.append([(e.topic, e.payload["n"]) for e in batch])

    consumer = consumer_of(pool, concurrency=20)
    async with consumer, running(consumer, {"*": Handler(handle, batch=10)}):
        await wait_until(finished(pool, 4))
    assert [n for call in calls for _, n in call] == [0, 1, 2, 3]
    assert len(calls) == 1, calls
    assert set((await rows(pool)).values()) == {("done", 1, None)}


async def test_an_event_that_fails_to_decode_waits_behind_its_keys_earlier_events(
    pool: asyncpg.Pool,
) -> None:
    """The second of a key's four events fails to decode once: the first is handled
    first, the second only after it (its attempt given back, not spent), then the rest."""
    await aiooutbox.enqueue_many(
        pool, [aiooutbox.NewEvent("t", {"n": i}, ordering_key="k") for i in range(4)]
    )
    failed: list[int] = []

    def decode(text: str | bytes) -> Any:
        value = json.loads(text)
        if value == {"n": 1} and not failed:
            failed.append(1)
            raise ValueError("not today")
        return value

    seen: list[int] = []

    async def handle(batch: list[aiooutbox.Event]) -> None:
        seen.extend(e.payload["n"] for e in batch)

    consumer = consumer_of(pool, concurrency=20, decoder=decode)
    async with consumer, running(consumer, {"t": Handler(handle, batch=10)}):
        await wait_until(finished(pool, 4))
    assert failed == [1]
    assert seen == [0, 1, 2, 3]
    assert set((await rows(pool)).values()) == {("done", 1, None)}


async def test_an_event_that_never_decodes_stops_its_key_after_its_earlier_events(
    pool: asyncpg.Pool,
) -> None:
    """A raw SQL producer stored a number no decoder can read (``1e400``) as a key's
    second event; the key blocks on a dead event: its first event is done, the second
    dead after its attempts, the later ones wait behind it."""
    insert = (
        "INSERT INTO outbox_events (topic, payload, ordering_key, max_attempts)"
        " VALUES ('t', $1::jsonb, 'k', 2) RETURNING id"
    )
    ids = [await pool.fetchval(insert, p) for p in ('{"n": 0}', "1e400", '{"n": 2}', '{"n": 3}')]
    seen: list[int] = []

    async def handle(batch: list[aiooutbox.Event]) -> None:
        seen.extend(e.payload["n"] for e in batch)

    consumer = consumer_of(pool, concurrency=20)
    async with consumer, running(consumer, {"t": Handler(handle, batch=10, on_dead="block")}):
        await wait_until(finished(pool, 2))
    found = await rows(pool)
    assert seen == [0]
    assert [found[i][:2] for i in ids] == [("done", 1), ("dead", 2), ("waiting", 0), ("waiting", 0)]
    assert "infinity" in (found[ids[1]][2] or "")
