"""The relay against its limit, the kit every broker's measurement shares: the messages
the bare loops publish, the committed events the relay drains (`fill`, `drain`), the
bare claim+settle loop over the same events (`ClaimSettle`), and the rounds that
alternate them all (`alternate`).

The relay is a consumer of every topic with a sink, draining N committed events, at the
relay command's defaults (`Relay`, `at_defaults`). A bare client loop publishes the same
messages (the same JSON bodies, the same headers, keys and message ids, encoded per
message as the relay must) with acks awaited, 256 in flight. On one machine the relay's
PostgreSQL half and its broker half share the CPU, so its **limit** is doing both
halves' bare work one after the other: ``1 / (1/client + 1/claim_settle)``, *client*
the best of the broker client's own loops, *claim_settle* the bare asyncpg claim+settle
loop (2 connections x claims of 1,000, as `benchmarks.systems.peers`) over as many rows
with the same payloads. Each round runs every step, the order reversed every other
round; medians are compared. Unordered events, and events over ``KEYS`` ordering keys
(the Kafka record key; a header or field elsewhere), each against its own limit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg

import aiooutbox
from aiooutbox.relay import Sink

from ..harness.rounds import alternated
from ..harness.stats import median, ratio, summarize_ms

TOPICS = ("orders.created", "orders.paid")
IN_FLIGHT = 256
#: the ordering keys of the keyed variants
KEYS = 1000
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
Log = Callable[[str], None]
#: one bare loop: publishes messages[0:n] with acks, returns when all are acked
Bare = Callable[[], Awaitable[None]]


def _payload(i: int) -> dict[str, Any]:
    return {"order_id": i, "customer": f"c{i % 977}", "total_cents": 1999 + i % 100}


def key_of(i: int, keys: int | None) -> str | None:
    """The ordering key of event ``i`` (None: unordered)."""
    return None if keys is None else f"k{i % keys}"


class Messages:
    """What the bare loops publish: the relay's messages, minus the database.

    The topic, payload (a dict, encoded per publish as the sink encodes it), message id,
    event id and ordering key of every event; the headers are built per publish, as the
    sink does.
    """

    def __init__(self, n: int, keys: int | None = None) -> None:
        self.n = n
        self.rows = [(TOPICS[i % 2], _payload(i), str(uuid.uuid4()), str(i + 1)) for i in range(n)]
        self.keys = [key_of(i, keys) for i in range(n)]

    def headers(self, i: int) -> dict[str, str]:
        topic, _, message_id, event_id = self.rows[i]
        headers = {
            "traceparent": TRACEPARENT,
            "outbox-topic": topic,
            "outbox-event-id": event_id,
            "outbox-message-id": message_id,
        }
        key = self.keys[i]
        if key is not None:
            headers["outbox-ordering-key"] = key
        return headers


async def fill(
    pool: asyncpg.Pool, n: int, topics: tuple[str, ...] = TOPICS, keys: int | None = None
) -> None:
    for start in range(0, n, 5000):
        batch = [
            aiooutbox.NewEvent(
                topics[i % len(topics)],
                _payload(i),
                headers={"traceparent": TRACEPARENT},
                ordering_key=key_of(i, keys),
            )
            for i in range(start, min(start + 5000, n))
        ]
        async with pool.acquire() as conn:
            await aiooutbox.enqueue_many(conn, batch)


@dataclass(frozen=True)
class Relay:
    """A relay variant: the handler its consumer runs under ``"*"``, the consumer's
    concurrency and claim size (``batch_size``), and the ordering keys of the events it
    drains (None: unordered)."""

    handler: Any
    concurrency: int
    keys: int | None = None
    batch_size: int | None = None


def at_defaults(sink: Sink, keys: int | None = None) -> Relay:
    """The relay as ``python -m aiooutbox relay`` runs it: its batch handler over the
    sink, its consumer's concurrency and claim size."""
    from aiooutbox.relay._runner import (
        RELAY_BATCH,
        RELAY_CONCURRENCY,
        relay_claim_size,
        relay_handler,
    )

    claim = relay_claim_size(RELAY_BATCH, RELAY_CONCURRENCY)
    return Relay(relay_handler(sink), RELAY_CONCURRENCY, keys, claim)


def with_whole_claims(relays: dict[str, Relay]) -> dict[str, Relay]:
    """``relays`` and, beside ``relay`` and ``relay_keyed``, each again claiming up to its
    concurrency at a time (``*_whole_claims``), as the relay did before its claims of a
    batch: the A/B of that default, in the same rounds."""
    out = dict(relays)
    for variant in ("relay", "relay_keyed"):
        if variant in relays:
            out[f"{variant}_whole_claims"] = dataclasses.replace(relays[variant], batch_size=None)
    return out


async def drain(
    pool: asyncpg.Pool,
    handlers: dict[str, Any],
    n: int,
    concurrency: int = IN_FLIGHT,
    batch_size: int | None = None,
) -> float:
    """Seconds for a consumer to settle ``n`` events, from when it is consuming (schema
    checked, LISTEN connection up: a relay's start-up, like the bare loops' connect, is
    not timed) to the last one."""
    consumer = aiooutbox.OutboxConsumer(
        pool, concurrency=concurrency, batch_size=batch_size, retention=None,
        poll_interval=0.2, topics=None if "*" in handlers else list(handlers),
    )  # fmt: skip
    async with consumer:
        task = asyncio.ensure_future(consumer.run(handlers))
        await consumer.wait_started()
        started = time.perf_counter()
        while consumer.stats.done < n:
            if task.done():
                task.result()  # the consumer stopped: its error
                raise RuntimeError(f"the consumer stopped at {consumer.stats.done} of {n}")
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - started
        consumer.stop()
        await task
    return elapsed


_JOBS = """
DROP TABLE IF EXISTS bench_jobs;
CREATE TABLE bench_jobs (
    id bigserial PRIMARY KEY,
    payload jsonb NOT NULL,
    status text NOT NULL DEFAULT 'pending',
    locked_at timestamptz
);
CREATE INDEX bench_jobs_pending_idx ON bench_jobs (id) WHERE status = 'pending';
"""
_CLAIM = (
    "UPDATE bench_jobs SET status = 'running', locked_at = now() WHERE id IN ("
    " SELECT id FROM bench_jobs WHERE status = 'pending' ORDER BY id LIMIT $1"
    " FOR UPDATE SKIP LOCKED) RETURNING id, payload"
)
_SETTLE = "UPDATE bench_jobs SET status = 'done' WHERE id = ANY($1::bigint[])"


class ClaimSettle:
    """The bare asyncpg claim+settle loop (`benchmarks.systems.peers`' bare reference:
    per connection, claim up to 1,000 rows ``FOR UPDATE SKIP LOCKED``, settle them in
    one ``UPDATE``; 2 connections) over ``n`` rows with the relay's payloads, in the
    relay's database: the PostgreSQL half of the relay's limit."""

    def __init__(self, dsn: str, connections: int = 2, batch: int = 1000) -> None:
        self.dsn = dsn
        self.connections = connections
        self.batch = batch

    async def run(self, n: int) -> float:
        """Fill ``n`` rows, then drain them: the drain's seconds."""
        setup = await asyncpg.connect(self.dsn)
        try:
            await setup.execute(_JOBS)
            payloads = json.dumps([_payload(i) for i in range(n)])
            await setup.execute(
                "INSERT INTO bench_jobs (payload) SELECT x FROM jsonb_array_elements($1::jsonb) x",
                payloads,
            )
            await setup.execute("VACUUM (ANALYZE) bench_jobs")
        finally:
            await setup.close()
        conns = [await asyncpg.connect(self.dsn) for _ in range(self.connections)]
        settled = 0

        async def loop(conn: asyncpg.Connection) -> None:
            nonlocal settled
            claim, settle = await conn.prepare(_CLAIM), await conn.prepare(_SETTLE)
            while settled < n:
                rows = await claim.fetch(self.batch)
                if not rows:
                    return
                for row in rows:
                    _ = row[1]  # the handler: nothing
                await settle.fetch([row[0] for row in rows])
                settled += len(rows)

        try:
            started = time.perf_counter()
            await asyncio.gather(*(loop(c) for c in conns))
            elapsed = time.perf_counter() - started
        finally:
            for conn in conns:
                await conn.close()
        assert settled == n, (settled, n)
        return elapsed


async def steady(
    pool: asyncpg.Pool, sink: Sink, rate: float, seconds: float
) -> tuple[list[float], float]:
    """Commit ``rate`` events/s for ``seconds`` (10 ms ticks) while the relay at its
    defaults publishes them; the commit -> broker-ack latency of each (when the batch
    handler returned), and the rate actually offered."""
    latencies: list[float] = []
    relay = at_defaults(sink)
    inner = relay.handler.func if isinstance(relay.handler, aiooutbox.Handler) else relay.handler

    async def timed(arg: Any) -> Any:
        result = await inner(arg)
        now = time.perf_counter()
        failed = result or {}
        for event in arg if isinstance(arg, list) else [arg]:
            if event.id not in failed:
                latencies.append(now - event.payload["t"])
        return result

    handler: Any = timed
    if isinstance(relay.handler, aiooutbox.Handler):
        handler = dataclasses.replace(relay.handler, func=timed)
    await reset(pool)
    total = int(rate * seconds)
    consumer = aiooutbox.OutboxConsumer(
        pool, concurrency=relay.concurrency, batch_size=relay.batch_size, retention=None
    )
    async with consumer:
        task = asyncio.ensure_future(consumer.run({"*": handler}))
        await consumer.wait_started()
        await asyncio.sleep(0.5)
        tick = 0.01
        sent, started = 0, time.perf_counter()
        while sent < total:
            due = min(total, int((time.perf_counter() - started) * rate) + 1)
            if due > sent:
                # stamped as the committing INSERT starts (the relay may see the row before
                # enqueue_many returns): the latency includes the commit itself
                now = time.perf_counter()
                batch = [aiooutbox.NewEvent(TOPICS[i % 2], {"t": now}) for i in range(sent, due)]
                async with pool.acquire() as conn:
                    await aiooutbox.enqueue_many(conn, batch)
                sent = due
            await asyncio.sleep(tick)
        offered = total / (time.perf_counter() - started)
        while consumer.stats.done < total:
            await asyncio.sleep(0.01)
        consumer.stop()
        await task
    return latencies, offered


async def timed_latency(
    pool: asyncpg.Pool, sink: Sink, rate: float, seconds: float, name: str, log: Log
) -> dict[str, Any]:
    """`steady`'s latencies summarized (p50/p99 ms), logged."""
    latencies, offered = await steady(pool, sink, rate, seconds)
    summary = summarize_ms(latencies)
    log(
        f"  latency commit -> {name} ack at {offered:,.0f}/s: "
        f"p50 {summary['p50']:.1f} ms, p99 {summary['p99']:.1f} ms"
    )
    return {
        "rate": rate,
        "offered_per_s": round(offered),
        "seconds": seconds,
        "events": len(latencies),
        **summary,
    }


async def in_tasks(n: int, publish: Callable[[int], Awaitable[Any]]) -> None:
    """``IN_FLIGHT`` tasks, each publishing the next message and awaiting its ack."""
    todo = iter(range(n))

    async def worker() -> None:
        for i in todo:
            await publish(i)

    await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))


async def reset(pool: asyncpg.Pool) -> None:
    await pool.execute("TRUNCATE outbox_events, outbox_events_done")


def limit(client: float, claim_settle: float) -> float:
    """Both halves' bare work one after the other: ``1 / (1/client + 1/claim_settle)``."""
    return 1 / (1 / client + 1 / claim_settle) if client and claim_settle else float("nan")


async def alternate(
    pool: asyncpg.Pool,
    n: int,
    rounds: int,
    bares: Mapping[str, Bare],
    relays: Mapping[str, Relay],
    name: str,
    log: Log,
    between: Callable[[], Awaitable[Any]] | None = None,
    *,
    claim_settle: ClaimSettle,
    keyed_bares: Mapping[str, Bare] | None = None,
) -> dict[str, Any]:
    """Every bare loop, the claim+settle loop and every relay variant once a round, the
    order reversed every other round. ``bares`` publish unordered messages,
    ``keyed_bares`` the keyed ones; the relay variants ``relay`` (unordered) and
    ``relay_keyed`` are compared with their limits."""
    keyed_bares = keyed_bares or {}
    every = {**bares, **keyed_bares}
    rates: dict[str, list[float]] = {variant: [] for variant in [*every, "claim_settle", *relays]}

    async def relay(variant: str) -> None:
        await reset(pool)
        chosen = relays[variant]
        await fill(pool, n, keys=chosen.keys)
        handlers = {"*": chosen.handler}
        rates[variant].append(
            n / await drain(pool, handlers, n, chosen.concurrency, chosen.batch_size)
        )

    async def bare(variant: str) -> None:
        started = time.perf_counter()
        await every[variant]()
        rates[variant].append(n / (time.perf_counter() - started))

    async def claims() -> None:
        rates["claim_settle"].append(n / await claim_settle.run(n))

    steps: list[Callable[[], Awaitable[None]]] = [functools.partial(bare, v) for v in every]
    steps.append(claims)
    steps += [functools.partial(relay, v) for v in relays]
    for r in range(rounds):
        for step in alternated(steps, r):
            await step()
            if between:
                await between()
        shown = ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in rates.items())
        log(f"  {name} round {r + 1}: {shown}")
    medians = {k: median(v) for k, v in rates.items()}
    best = max(bares, key=lambda v: medians[v])
    out: dict[str, Any] = {
        "events": n,
        "in_flight": IN_FLIGHT,
        "rounds": rounds,
        **{f"{k}_per_s": [round(x) for x in v] for k, v in rates.items()},
        "bare_per_s": [round(x) for x in rates[best]],
        "bare_loop": best,
        "ratio": round(ratio(medians["relay"], medians[best]), 3),
        "ratios": {v: round(ratio(medians["relay"], medians[v]), 3) for v in bares},
        "relay_concurrency": relays["relay"].concurrency,
        "relay_batch_size": relays["relay"].batch_size,
    }
    limits: dict[str, Any] = {}
    for mode, variant, clients in (
        ("unordered", "relay", bares),
        ("keyed", "relay_keyed", keyed_bares),
    ):
        if variant not in relays or not clients:
            continue
        client = max(medians[v] for v in clients)
        bound = limit(client, medians["claim_settle"])
        limits[mode] = {
            "keys": relays[variant].keys,
            "client_loop": max(clients, key=lambda v: medians[v]),
            "client_per_s": round(client),
            "claim_settle_per_s": round(medians["claim_settle"]),
            "limit_per_s": round(bound),
            "relay_per_s": round(medians[variant]),
            "ratio": round(ratio(medians[variant], bound), 3),
        }
        whole = f"{variant}_whole_claims"
        if whole in relays:  # claims of a batch / of the concurrency
            limits[mode]["claims_of_a_batch"] = round(ratio(medians[variant], medians[whole]), 3)
    out["limits"] = limits
    shown = f"  {name}: relay / bare ({best}) = {out['ratio']:.2f}" + "".join(
        f"; / {v} {r:.2f}" for v, r in out["ratios"].items() if v != best
    )
    for mode, row in limits.items():
        shown += (
            f"; {mode}: relay {row['relay_per_s']:,}/s / limit {row['limit_per_s']:,}/s "
            f"(client {row['client_per_s']:,}, claim+settle {row['claim_settle_per_s']:,}) "
            f"= {row['ratio']:.2f}"
        )
        if "claims_of_a_batch" in row:
            shown += f", claims of a batch / whole {row['claims_of_a_batch']:.2f}"
    log(shown)
    return out
