"""Producers against a consumer, the measurements several scenarios share: paced
producers and the latency from COMMIT to handler (`steady_once`: the steady state, the
light loads of isolation), one event at a time into an idle consumer (`wakeup_once`),
and the commit rate of one-event transactions (`commit_rate`: the producers' cost, the
producer's tax)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg

from .bench import Bench, fmt_seconds
from .cpu import BackendCpu
from .processes import child_process
from .rounds import alternated
from .stats import summarize_ms


def _load(fraction: float | None) -> str:
    return f"{fraction:.0%} of max" if fraction is not None else "fixed rate"


async def steady_once(
    bench: Bench,
    system: Any,
    fraction: float | None,
    rate: float,
    *,
    seconds: float | None = None,
    catch_up_timeout: float | None = None,
) -> dict[str, Any]:
    """Producers at ``rate`` events/s (``fraction`` of the system's maximum, if set)."""
    config = bench.config
    seconds = config.steady_seconds if seconds is None else seconds
    if catch_up_timeout is None:
        catch_up_timeout = config.catch_up_timeout
    await system.reset()
    spec = bench.spec(system, "serve", bench.settings[system.name], latency=True)
    async with child_process(spec) as child:
        await child.wait_ready()
        await asyncio.sleep(config.settle)
        async with BackendCpu(bench.admin_dsn, system.database) as cpu:
            produced, statement, committing = await paced_producers(bench, system, rate, seconds)
        t_stop = time.time()
        # a consumer that fell far behind gets a bounded time to catch up
        child.send(
            stop_after=produced,
            timeout=catch_up_timeout,
            committing=list(committing.items()),
        )
        result = await child.result(timeout=catch_up_timeout + 60)
    catch_up = max(0.0, result["t_last"] - t_stop) if result["handled"] else None
    run = {
        "system": system.name,
        "fraction": fraction,
        "offered_rate": round(rate, 1),
        "achieved_offered_rate": round(produced / seconds, 1),
        "produced": produced,
        "handled": result["handled"],
        # from the producer sending COMMIT to the handler starting
        "latency_ms": result.get("latency_from_commit", {}),
        # from before the producer's BEGIN: adds its BEGIN and INSERT round trips
        "latency_from_begin_ms": result.get("latency", {}),
        "producer_statement_ms": statement,
        "catch_up_s": round(catch_up, 3) if catch_up is not None else None,
        "keeps_up": bool(
            result["handled"] >= produced
            and catch_up is not None
            and catch_up <= 1.0
            and not result.get("timed_out")
        ),
        "client_cpu_s": result["cpu_s"],
        # producers' and consumer's backends together, while producers ran
        "db_cpu_s": cpu.seconds,
        "latency_series": result.get("latency_series", []),
    }
    if result["handled"] and not run["latency_ms"].get("n"):
        run["error"] = "the consumer reported no latencies from COMMIT"
    lat = run["latency_ms"]
    bench.log(
        f"  {system.name:9} {_load(fraction)} = {rate:,.0f}/s: p50 {lat.get('p50')} ms, "
        f"p95 {lat.get('p95')} ms, p99 {lat.get('p99')} ms, catch-up {run['catch_up_s']}s, "
        f"keeps up: {run['keeps_up']}; db cpu {fmt_seconds(run['db_cpu_s'])}"
    )
    return run


async def paced_producers(
    bench: Bench, system: Any, rate: float, seconds: float
) -> tuple[int, dict[str, float], dict[float, float]]:
    """Open-loop producers: each tick, insert what the schedule says is due, in one
    transaction through the system's own batch API. Returns the count, the
    transactions' durations, and when each batch's COMMIT was sent (by send time)."""
    producers = bench.config.steady_producers
    tick = bench.config.steady_tick
    per = rate / producers
    conns = [await system.connect() for _ in range(producers)]
    statement: list[float] = []
    committing: dict[float, float] = {}
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def produce(index: int, conn: asyncpg.Connection) -> int:
        sent = 0
        await asyncio.sleep(tick * index / producers)
        while True:
            elapsed = loop.time() - t0
            if elapsed >= seconds:
                break
            due = int(per * elapsed) - sent
            if due > 0:
                t = time.time()
                committing[t] = await system.produce_many(conn, due, t)
                statement.append(time.time() - t)
                sent += due
            # to the next tick, or later when the next event is due later: at light
            # rates a producer that woke every tick for nothing (400 times a second
            # for 5 events) loaded the two cores it measures on
            now = loop.time() - t0
            next_due = (sent + 1) / per
            await asyncio.sleep(max(tick - now % tick, next_due - now))
        return sent

    try:
        counts = await asyncio.gather(*(produce(i, c) for i, c in enumerate(conns)))
    finally:
        for conn in conns:
            await conn.close()
    return sum(counts), summarize_ms(statement), committing


async def wakeup_once(bench: Bench, system: Any, settings: dict[str, Any]) -> dict[str, Any]:
    config = bench.config
    await system.reset()
    spec = bench.spec(system, "serve", settings, latency=True, raw=True)
    rng = random.Random(7)
    statement: list[float] = []
    committing: dict[float, float] = {}
    async with child_process(spec) as child:
        await child.wait_ready()
        await asyncio.sleep(config.settle)  # let it go idle
        conn = await system.connect()
        try:
            for _ in range(config.wakeup_samples):
                await asyncio.sleep(rng.uniform(*config.wakeup_gap))
                t = time.time()
                committing[t] = await system.produce_one(conn, t)
                statement.append(time.time() - t)
        finally:
            await conn.close()
        child.send(stop_after=config.wakeup_samples, timeout=config.poll_only_interval * 2 + 10)
        result = await child.result(timeout=60)
    from_commit = [began - committing[sent] for sent, began in result.get("raw", [])]
    return {
        "settings": settings,
        # from the producer sending COMMIT (the event becomes visible and NOTIFY
        # goes out during that COMMIT) to the handler starting: the target's measure
        "latency_ms": summarize_ms(from_commit),
        # from before the producer's BEGIN: adds its BEGIN and INSERT round trips
        "latency_from_begin_ms": result.get("latency", {}),
        "producer_transaction_ms": summarize_ms(statement),
        "handled": result["handled"],
        "gap_s": list(config.wakeup_gap),
    }


async def commit_rate(bench: Bench, system: Any, level: int) -> tuple[float, int, float]:
    """Commits per second of ``level`` connections looping one-event transactions,
    and the notifications per second they caused (counted by a LISTEN connection)."""
    conns = await asyncio.gather(*(system.connect() for _ in range(level)))
    listener = await system.connect()
    notified = 0

    def count(*_: object) -> None:
        nonlocal notified
        notified += 1

    await listener.add_listener(system.channel, count)
    done = 0
    stop = asyncio.Event()

    async def producer(conn: asyncpg.Connection) -> None:
        nonlocal done
        while not stop.is_set():
            await system.produce_one(conn, time.time())
            done += 1

    tasks = [asyncio.ensure_future(producer(c)) for c in conns]
    try:
        await asyncio.sleep(0.3)  # warm-up
        start, first, t0 = done, notified, time.perf_counter()
        await asyncio.sleep(bench.config.producer_seconds)
        counted, elapsed = done - start, time.perf_counter() - t0
        notes = notified - first
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        for conn in [*conns, listener]:
            await conn.close()
    return counted / elapsed, done, notes / elapsed


async def trigger_rounds(system: Any, rounds: int) -> AsyncIterator[str]:
    """``rounds`` rounds of ``"on"`` and ``"off"``, in turn first: the system's wake-up
    trigger enabled or disabled as each is yielded (the caller enables it after)."""
    for r in range(rounds):
        for trigger in alternated(("on", "off"), r):
            await system.set_wakeup_trigger(trigger == "on")
            yield trigger
