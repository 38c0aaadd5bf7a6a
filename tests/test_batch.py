"""Batch handlers against a real PostgreSQL: every outcome shape, order inside batches,
the concurrency cap, the timeout, a trickle and a linger, and bad registrations."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import asyncpg
import pytest

import aiooutbox
from aiooutbox import Dead, Handler, Retry
from tests.helpers import running, truthy, wait_until

FAST = aiooutbox.RetryPolicy(base=0.01, max_delay=0.02)


def consumer_of(pool: asyncpg.Pool, **options: Any) -> aiooutbox.OutboxConsumer:
    options.setdefault("poll_interval", 0.1)
    options.setdefault("retry", FAST)
    return aiooutbox.OutboxConsumer(pool, **options)


async def rows(pool: asyncpg.Pool) -> dict[int, tuple[str, int, str | None]]:
    """id -> (status, attempts, last_error)."""
    found = await pool.fetch("SELECT id, status::text, attempts, last_error FROM outbox_events_all")
    return {r[0]: (r[1], r[2], r[3]) for r in found}


def finished(pool: asyncpg.Pool, total: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        n = await pool.fetchval(
            "SELECT count(*) FROM outbox_events_all WHERE status IN ('done', 'dead')"
        )
        return bool(n == total)

    return check


async def enqueue(pool: asyncpg.Pool, n: int, topic: str = "t", **kw: Any) -> list[int]:
    ids = await aiooutbox.enqueue_many(
        pool, [aiooutbox.NewEvent(topic, {"n": i}, **kw) for i in range(n)]
    )
    return [i for i in ids if i is not None]


# -- None: every event done ----------------------------------------------------------------


async def test_none_settles_every_event_of_each_call_done(pool: asyncpg.Pool) -> None:
    ids = await enqueue(pool, 250)
    calls: list[list[int]] = []

    async def handle(events: list[aiooutbox.Event]) -> None:
        calls.append([e.id for e in events])

    consumer = consumer_of(pool, concurrency=100)
    async with consumer, running(consumer, {"t": Handler(handle, batch=60)}):
        await wait_until(finished(pool, 250))
    assert sorted(i for call in calls for i in call) == sorted(ids)  # each event once
    assert all(1 <= len(call) <= 60 for call in calls)
    assert max(len(call) for call in calls) > 1  # events came together, not one by one
    assert set((await rows(pool)).values()) == {("done", 1, None)}
    assert consumer.stats.done == 250 and consumer.stats.in_flight == 0


async def test_a_batch_gets_whole_ordinary_events(pool: asyncpg.Pool) -> None:
    # the engine builds a batch's events slot by slot: every field set, each an Event
    await aiooutbox.enqueue_many(
        pool,
        [
            aiooutbox.NewEvent(
                "t", {"n": 1}, dedupe_key="d1", headers={"h": "v"}, max_attempts=3, group="g"
            ),
            aiooutbox.NewEvent("t", {"n": 2}, ordering_key="k"),
        ],
    )
    got: list[aiooutbox.Event] = []

    async def handle(events: list[aiooutbox.Event]) -> None:
        got.extend(events)

    consumer = consumer_of(pool)
    async with consumer, running(consumer, {"t": Handler(handle, batch=10)}):
        await wait_until(finished(pool, 2))
    names = {f.name for f in dataclasses.fields(aiooutbox.Event)}
    for event in got:
        assert type(event) is aiooutbox.Event
        assert set(dataclasses.asdict(event)) == names  # an unset field would raise
        assert event == dataclasses.replace(event)  # equal to an Event built as usual
        assert event.attempts == 1 and not event.redelivered and event.message_id
        assert event.created_at is not None and event.created_at.tzinfo is not None
    one, two = sorted(got, key=lambda e: e.payload["n"])
    assert (one.topic, one.dedupe_key, one.headers, one.max_attempts) == ("t", "d1", {"h": "v"}, 3)
    assert (one.ordering_key, one.group, two.ordering_key, two.headers) == (None, "g", "k", {})


async def test_router_batch_registers_a_batch_handler(pool: asyncpg.Pool) -> None:
    await enqueue(pool, 20)
    router = aiooutbox.Router()
    sizes: list[int] = []

    @router.batch("t", size=7)
    async def handle(events: list[aiooutbox.Event]) -> None:
        sizes.append(len(events))

    assert router["t"].batch == 7
    consumer = consumer_of(pool)
    async with consumer, running(consumer, router):
        await wait_until(finished(pool, 20))
    assert sum(sizes) == 20 and max(sizes) <= 7


# -- a raise: every event's attempt fails ---------------------------------------------------


@pytest.mark.parametrize(
    ("raised", "status", "error"),
    [
        (ValueError("boom"), "dead", "ValueError: boom"),  # max_attempts=1: dead at once
        (Dead("no point"), "dead", "Dead: no point"),
    ],
)
async def test_a_raise_fails_every_event_of_the_batch(
    pool: asyncpg.Pool, raised: BaseException, status: str, error: str
) -> None:
    await enqueue(pool, 30, max_attempts=1 if isinstance(raised, ValueError) else 5)

    async def handle(events: list[aiooutbox.Event]) -> None:
        raise raised

    consumer = consumer_of(pool)
    async with consumer, running(consumer, {"t": Handler(handle, batch=50)}):
        await wait_until(finished(pool, 30))
    found = list((await rows(pool)).values())
    assert {(s, a) for s, a, _ in found} == {(status, 1)}
    assert all(e is not None and error in e for _, _, e in found)


async def test_a_retry_raised_for_the_batch_applies_to_each_event(pool: asyncpg.Pool) -> None:
    await enqueue(pool, 30)
    seen: list[int] = []

    async def handle(events: list[aiooutbox.Event]) -> None:
        seen.extend(e.attempts for e in events)
        if events[0].attempts == 1:
            raise Retry(delay=0.05, reason="later")

    consumer = consumer_of(pool)
    async with consumer, running(consumer, {"t": Handler(handle, batch=50)}):
        await wait_until(finished(pool, 30))
    assert sorted(seen) == [1] * 30 + [2] * 30
    assert {(s, a) for s, a, _ in (await rows(pool)).values()} == {("done", 2)}
    assert consumer.stats.retried == 30


# -- a mapping: only those fail ---------------------------------------------------------------


async def test_a_mapping_fails_only_the_events_it_names(pool: asyncpg.Pool) -> None:
    ids = await enqueue(pool, 20)
    retried, dead, failed = ids[3], ids[7], ids[11]

    async def handle(events: list[aiooutbox.Event]) -> Mapping[int, BaseException] | None:
        first = [e.id for e in events if e.attempts == 1]
        out: dict[int, BaseException] = {}
        if retried in first:
            out[retried] = Retry(delay=0.01)
        if dead in first:
            out[dead] = Dead("bad payload")
        if failed in first:
            out[failed] = KeyError("missing")
        return out

    consumer = consumer_of(pool)
    async with consumer, running(consumer, {"t": Handler(handle, batch=50)}):
        await wait_until(finished(pool, 20))
    found = await rows(pool)
    assert found[dead][:2] == ("dead", 1) and found[dead][2] == "Dead: bad payload"
    assert found[retried][:2] == ("done", 2) and found[failed][:2] == ("done", 2)
    assert "KeyError" in (found[failed][2] or "")  # the failed attempt's error is kept
    others = [found[i] for i in ids if i not in (retried, dead, failed)]
    assert {(s, a) for s, a, _ in others} == {("done", 1)}


# -- results that are refused: never a silent success ----------------------------------------


class _Raising:
    """A key whose comparison raises (a user's odd key type)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparing me")

    def __hash__(self) -> int:
        return hash(self.value)


class _RaisingClass:
    """A value whose ``__class__`` raises (an unbound lazy proxy, say)."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        raise RuntimeError("unbound proxy")


@pytest.mark.parametrize(
    ("result", "says"),
    [
        ("foreign", "not in the batch"),
        ("a string", "not exception instances"),
        (ValueError, "not exception instances"),  # the class, not an instance
        (None, "not exception instances"),
        ([1, 2], "returned list"),
        (True, "returned bool"),
        ("float id", "not in the batch"),  # 1.0 == 1, but an id is an int
        ("raising key", "not in the batch"),
        ("raising value", "could not be read"),
    ],
)
async def test_a_result_that_is_not_the_contract_fails_the_whole_batch(
    pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture, result: Any, says: str
) -> None:
    ids = await enqueue(pool, 10, max_attempts=1)

    async def handle_orders(events: list[aiooutbox.Event]) -> Any:
        if result == "foreign":
            return {max(ids) + 1000: ValueError("x")}
        if result == "float id":
            return {float(events[0].id): ValueError("x")}
        if result == "raising key":
            return {_Raising(events[0].id): ValueError("x")}
        if result == "raising value":
            return {events[0].id: _RaisingClass()}
        if isinstance(result, list | bool):
            return result
        return {events[0].id: result}

    consumer = consumer_of(pool)
    with caplog.at_level(logging.ERROR, "aiooutbox.consumer"):
        async with consumer, running(consumer, {"t": Handler(handle_orders, batch=50)}):
            await wait_until(finished(pool, 10))
    found = list((await rows(pool)).values())
    assert {s for s, _, _ in found} == {"dead"}  # one attempt each: every event failed
    assert all(e is not None and "TypeError" in e and says in e for _, _, e in found)
    logged = [r for r in caplog.records if says in r.getMessage()]
    assert logged and "handle_orders" in logged[0].getMessage()
    assert "'t'" in logged[0].getMessage()


@pytest.mark.parametrize("how", ["raised", "returned"])
@pytest.mark.parametrize("fatal", [KeyboardInterrupt, SystemExit])
async def test_a_base_exception_settles_then_stops_the_consumer(
    pool: asyncpg.Pool, how: str, fatal: type[BaseException]
) -> None:
    """As with a per-event handler: the attempt is failed (retry), the consumer stops
    gracefully, and run() raises it."""
    ids = await enqueue(pool, 5)

    async def handle(events: list[aiooutbox.Event]) -> Any:
        if how == "raised":
            raise fatal()
        return {events[0].id: fatal()}

    consumer = consumer_of(pool)
    async with consumer:
        # awaited here, not in a task: asyncio re-raises SystemExit and KeyboardInterrupt
        # escaping a task out of the event loop
        with pytest.raises(fatal):
            await consumer.run({"t": Handler(handle, batch=50)})
    found = await rows(pool)
    if how == "raised":
        assert {found[i][:2] for i in ids} == {("retry", 1)}
    else:
        assert found[ids[0]][:2] == ("retry", 1) and fatal.__name__ in (found[ids[0]][2] or "")
        assert {found[i][:2] for i in ids[1:]} == {("done", 1)}


async def test_a_cancelled_error_of_the_handlers_own_is_a_failure(pool: asyncpg.Pool) -> None:
    ids = await enqueue(pool, 5)

    async def handle(events: list[aiooutbox.Event]) -> Any:
        if events[0].attempts == 1:
            return {events[0].id: asyncio.CancelledError()}
        return None

    consumer = consumer_of(pool)
    async with consumer, running(consumer, {"t": Handler(handle, batch=50)}):
        await wait_until(finished(pool, 5))
    found = await rows(pool)
    assert found[ids[0]][:2] == ("done", 2)  # a failure like any other, then done
    assert {found[i][:2] for i in ids[1:]} == {("done", 1)}


async def test_a_handler_that_changes_its_list_changes_nothing_settled(
    pool: asyncpg.Pool,
) -> None:
    ids = await enqueue(pool, 40)
    victims: set[int] = set()

    async def handle(events: list[aiooutbox.Event]) -> Mapping[int, BaseException]:
        victim = events[-1]
        events.clear()  # what it does to its list settles nothing more or less
        events.append(aiooutbox.Event(10**9, "t", {}, None))
        if victim.attempts > 1:
            return {}
        victims.add(victim.id)
        return {victim.id: Retry(delay=0.01)}

    consumer = consumer_of(pool)
    async with consumer, running(consumer, {"t": Handler(handle, batch=50)}):
        await wait_until(finished(pool, 40))
    found = await rows(pool)
    assert set(found) == set(ids)  # the foreign event it appended is nobody's
    assert {s for s, _, _ in found.values()} == {"done"}
    assert {i for i, (_, a, _) in found.items() if a == 2} == victims  # the rest: done at once


# -- ordering keys inside a batch --------------------------------------------------------------


async def test_a_failing_event_sends_its_keys_later_events_back_to_wait(
    pool: asyncpg.Pool,
) -> None:
    """Key a fails at its head, key b in its middle, key c dies (on_dead skip): a's and
    b's later events in the same batch go back to waiting (their attempt given back) and
    come again after the failed one, in order; c moves on in the same batch."""
    events = [
        aiooutbox.NewEvent("t", {"k": k, "seq": s}, ordering_key=k)
        for s in range(5)
        for k in ("a", "b", "c")
    ] + [aiooutbox.NewEvent("t", {"k": None, "seq": s}) for s in range(5)]
    await aiooutbox.enqueue_many(pool, events)
    calls: list[list[tuple[str | None, int, int]]] = []

    async def handle(batch: list[aiooutbox.Event]) -> Mapping[int, BaseException]:
        calls.append([(e.ordering_key, e.payload["seq"], e.attempts) for e in batch])
        out: dict[int, BaseException] = {}
        for e in batch:
            if e.attempts == 1 and (e.ordering_key, e.payload["seq"]) == ("a", 0):
                out[e.id] = RuntimeError("a0 fails once")
            if e.attempts == 1 and (e.ordering_key, e.payload["seq"]) == ("b", 2):
                out[e.id] = Retry(delay=0.01)
            if (e.ordering_key, e.payload["seq"]) == ("c", 1):
                out[e.id] = Dead("c1 is poison")
        return out

    consumer = consumer_of(pool, concurrency=50)
    async with consumer, running(consumer, {"t": Handler(handle, batch=50)}):
        await wait_until(finished(pool, 20))
    first = calls[0]
    # every key's run came whole and in order in the first call
    for key in ("a", "b", "c"):
        assert [s for k, s, _ in first if k == key] == [0, 1, 2, 3, 4]
    # what each key's events got: a0 twice, a1-a4 again after it (attempt given back)
    delivered: dict[str, list[tuple[int, int]]] = {"a": [], "b": [], "c": []}
    for call in calls:
        for okey, seq, attempts in call:
            if okey is not None:
                delivered[okey].append((seq, attempts))
    assert delivered["a"] == [(s, 1) for s in range(5)] + [(0, 2)] + [(s, 1) for s in range(1, 5)]
    assert delivered["b"] == [(s, 1) for s in range(5)] + [(2, 2), (3, 1), (4, 1)]
    assert delivered["c"] == [(s, 1) for s in range(5)]  # skip: the key moved on at once
    found = {
        (r[0], r[1]): (r[2], r[3])
        for r in await pool.fetch(
            "SELECT ordering_key, (payload->>'seq')::int, status::text, attempts"
            " FROM outbox_events_all WHERE ordering_key IS NOT NULL"
        )
    }
    assert found[("a", 0)] == ("done", 2) and found[("b", 2)] == ("done", 2)
    assert found[("c", 1)] == ("dead", 1)
    assert all(found[(k, s)] == ("done", 1) for k, s in [("a", 1), ("a", 4), ("b", 3), ("c", 4)])


async def test_a_run_longer_than_the_batch_goes_on_in_the_next_batch_in_order(
    pool: asyncpg.Pool,
) -> None:
    await aiooutbox.enqueue_many(
        pool, [aiooutbox.NewEvent("t", {"seq": s}, ordering_key="k") for s in range(23)]
    )
    calls: list[list[int]] = []

    async def handle(batch: list[aiooutbox.Event]) -> None:
        calls.append([e.payload["seq"] for e in batch])

    consumer = consumer_of(pool, concurrency=20)
    async with consumer, running(consumer, {"t": Handler(handle, batch=5)}):
        await wait_until(finished(pool, 23))
    assert [s for call in calls for s in call] == list(range(23))
    assert all(len(call) <= 5 for call in calls)


# -- concurrency counts events ------------------------------------------------------------------


async def test_a_batch_larger_than_concurrency_is_capped_and_slots_count_events(
    pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    await enqueue(pool, 120, "bulk")
    await enqueue(pool, 60, "single")
    running_now = peak = 0
    sizes: list[int] = []

    async def occupy(n: int) -> None:
        nonlocal running_now, peak
        running_now += n
        peak = max(peak, running_now)
        await asyncio.sleep(0.02)
        running_now -= n

    async def bulk(events: list[aiooutbox.Event]) -> None:
        sizes.append(len(events))
        await occupy(len(events))

    async def single(event: aiooutbox.Event) -> None:
        await occupy(1)

    consumer = consumer_of(pool, concurrency=8)
    with caplog.at_level(logging.WARNING, "aiooutbox.consumer"):
        async with (
            consumer,
            running(consumer, {"bulk": Handler(bulk, batch=100), "single": single}),
        ):
            await wait_until(finished(pool, 180))
    warnings = [r.getMessage() for r in caplog.records if "more than concurrency" in r.getMessage()]
    assert len(warnings) == 1 and "raise concurrency" in warnings[0]
    assert max(sizes) <= 8 and sum(sizes) == 120
    assert peak <= 8  # never more events in handlers than concurrency


# -- the timeout, a trickle, a linger ---------------------------------------------------------


async def test_handler_timeout_applies_to_the_whole_call(pool: asyncpg.Pool) -> None:
    await enqueue(pool, 10)

    async def handle(events: list[aiooutbox.Event]) -> None:
        if events[0].attempts == 1:
            await asyncio.sleep(30)

    consumer = consumer_of(pool, handler_timeout=0.3)
    started = time.monotonic()
    async with consumer, running(consumer, {"t": Handler(handle, batch=50)}):
        await wait_until(finished(pool, 10))
    assert time.monotonic() - started < 20
    found = list((await rows(pool)).values())
    assert {(s, a) for s, a, _ in found} == {("done", 2)}
    assert all("TimeoutError" in (e or "") for _, _, e in found)


async def test_a_trickle_is_handled_at_once(pool: asyncpg.Pool) -> None:
    got = asyncio.Event()

    async def handle(events: list[aiooutbox.Event]) -> None:
        got.set()

    consumer = consumer_of(pool, poll_interval=30)
    async with consumer, running(consumer, {"t": Handler(handle, batch=500)}):
        await wait_until(truthy(lambda: consumer.listening))
        sent = time.monotonic()
        await enqueue(pool, 1)
        await asyncio.wait_for(got.wait(), 10)
    # woken by its notification and called with the one event, not waiting to fill
    assert time.monotonic() - sent < 5


async def test_a_linger_waits_for_the_batch_to_fill(pool: asyncpg.Pool) -> None:
    sizes: list[int] = []

    async def handle(events: list[aiooutbox.Event]) -> None:
        sizes.append(len(events))

    consumer = consumer_of(pool, poll_interval=30)
    async with consumer, running(consumer, {"t": Handler(handle, batch=5, linger=20)}):
        await wait_until(truthy(lambda: consumer.listening))
        for _ in range(5):  # five commits, one at a time
            await enqueue(pool, 1)
            await asyncio.sleep(0.05)
        await wait_until(finished(pool, 5))
    assert sizes == [5]  # one call, once full: long before the linger ran out


# -- registration -----------------------------------------------------------------------------


async def fn(events: list[aiooutbox.Event]) -> None:
    return None


@pytest.mark.parametrize(
    ("make", "error", "says"),
    [
        (lambda: Handler(fn, batch=0), aiooutbox.InvalidArgument, "batch must be between 1 and"),
        (lambda: Handler(fn, batch=True), TypeError, "batch must be an int"),
        (lambda: Handler(fn, batch=2.5), TypeError, "must be an int"),  # type: ignore[arg-type]
        (lambda: Handler(fn, batch=10, linger=-1), aiooutbox.InvalidArgument, "linger"),
        (lambda: Handler(fn, batch=10, linger=math.nan), aiooutbox.InvalidArgument, "linger"),
        (lambda: Handler(fn, batch=10, linger="1"), TypeError, "linger"),  # type: ignore[arg-type]
        (lambda: Handler(fn, linger=0.5), aiooutbox.InvalidArgument, "batch handlers only"),
        # not async
        (lambda: Handler(lambda events: None, batch=10), TypeError, "handler\\(events\\)"),  # type: ignore[arg-type, return-value]
        # in a router, or given to run as a plain function: the messages name the topic
        (
            lambda: aiooutbox.Router().batch("t", size=0)(fn),
            aiooutbox.InvalidArgument,
            "batch for 't'",
        ),
        (
            lambda: aiooutbox.Router().batch("t", size=5, linger=99)(fn),
            aiooutbox.InvalidArgument,
            "linger for 't'",
        ),
    ],
)
def test_bad_batch_handlers_are_refused_when_made(
    make: Callable[[], object], error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=says):
        make()


async def test_a_plain_function_that_is_not_async_is_refused_by_run_before_anything_is_written(
    pool: asyncpg.Pool,
) -> None:
    def not_async(events: list[aiooutbox.Event]) -> None:
        return None

    consumer = consumer_of(pool)
    async with consumer:
        with pytest.raises(TypeError, match="the handler for 't' must be an async function"):
            await consumer.run({"t": not_async})  # type: ignore[dict-item]
    assert await pool.fetchval("SELECT count(*) FROM outbox_events_all") == 0


def test_router_batch_checks_its_size() -> None:
    router = aiooutbox.Router()
    with pytest.raises(TypeError):
        router.batch("t", size="5")(fn)  # type: ignore[arg-type]
    with pytest.raises(aiooutbox.InvalidArgument):
        router.batch("t", size=-1)(fn)
    assert "t" not in router
