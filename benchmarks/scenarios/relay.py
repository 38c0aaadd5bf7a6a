"""``relay``: the relay at its defaults against its limit, in one run, alternated rounds
(part of every default run, last: it needs the machine's NATS (JetStream) at
127.0.0.1:4222, RabbitMQ at 127.0.0.1:5672 and Redis at 127.0.0.1:6379; Kafka is a
private Tansu broker). On a database of its own: JetStream and RabbitMQ, the consumer of
every topic against a topic list (benchmarks/brokers/nats_rabbitmq.py); Kafka and Redis
Streams with read-back on and off (benchmarks/brokers/streams.py); commit -> ack
latency into each. The limit is the best bare client loop and the bare claim+settle
loop one after the other (`brokers.bare.limit`), unordered and over 1,000 ordering
keys; the load averages at the start and end are kept.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Any

import asyncpg

import aiooutbox

from ..brokers import nats_rabbitmq, streams
from ..brokers.bare import IN_FLIGHT, ClaimSettle, Log
from ..harness.bench import Bench
from ..harness.databases import drop_database, recreate_database
from ..harness.markdown import at_least, fmt, table, target
from ..harness.scenario import Scenario, sizes_of
from ..harness.stats import median


@dataclass
class Sizes:
    relay_events: int = 20_000
    relay_rounds: int = 5
    relay_latency_rate: float = 2000.0
    relay_latency_seconds: float = 10.0


async def run(bench: Bench) -> None:
    config = sizes_of(bench.config, Sizes)
    bench.results["relay"] = await measure(
        bench.admin_dsn,
        prefix=bench.prefix,
        events=config.relay_events,
        rounds=config.relay_rounds,
        latency_rate=config.relay_latency_rate,
        latency_seconds=config.relay_latency_seconds,
        log=bench.log,
    )


async def measure(
    admin_dsn: str,
    *,
    prefix: str,
    events: int,
    rounds: int,
    latency_rate: float,
    latency_seconds: float,
    log: Log = print,
) -> dict[str, Any]:
    """All relay measurements on a database of their own; the results document."""
    name = prefix + "relay"
    dsn = await recreate_database(admin_dsn, name)
    results: dict[str, Any] = {"load_average": {"start": _load()}}
    latency = (latency_rate, latency_seconds)
    try:
        async with asyncpg.create_pool(dsn, min_size=2, max_size=8) as pool:
            await aiooutbox.migrate(pool)
            claims = ClaimSettle(dsn)
            log(f"relay: {events:,} events, {rounds} alternated rounds, {IN_FLIGHT} in flight")
            results["jetstream"] = await nats_rabbitmq.jetstream(pool, events, rounds, log, claims)
            results["rabbitmq"] = await nats_rabbitmq.rabbitmq(pool, events, rounds, log, claims)
            results["kafka"] = await streams.kafka(
                pool, events, rounds, log, claim_settle=claims, latency=latency
            )
            results["redis"] = await streams.redis(
                pool, events, rounds, log, claim_settle=claims, latency=latency
            )
            results["all_topics"] = await nats_rabbitmq.all_topics(pool, events, rounds, log)
            results["latency"] = await nats_rabbitmq.latency(pool, *latency, log)
            for broker in ("kafka", "redis"):  # not `name`: the finally drops that
                results["latency"][broker] = results[broker].pop("latency")
    finally:
        await drop_database(admin_dsn, name)
    results["load_average"]["end"] = _load()
    return results


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


BROKERS = ("jetstream", "rabbitmq", "kafka", "redis")


def section(results: dict[str, Any]) -> list[str]:
    relay = results.get("relay")
    if not relay:
        return []
    median = statistics.median
    lines = limits_lines(relay)
    lines += table(
        f"Relay vs bare client loops ({relay['jetstream']['events']:,} events, "
        f"{relay['jetstream']['in_flight']} in flight, alternated rounds, medians)",
        "| broker | bare loop | bare/s | relay/s | relay / bare "
        "| relay at concurrency 256 /s | / bare |",
        "|---|---|---:|---:|---:|---:|---:|",
    )
    for name in ("jetstream", "rabbitmq"):
        row = relay[name]
        variants = row.get("ratios") or {row.get("bare_loop", "bare"): row["ratio"]}
        c256 = row.get("relay_c256_per_s")
        for variant, value in variants.items():
            base = median(row.get(f"{variant}_per_s", row["bare_per_s"]))
            tail = f"{fmt(median(c256))} | {fmt(median(c256) / base, 2)} |" if c256 else "| |"
            lines.append(
                f"| {name} | {variant} | {fmt(base)} | "
                f"{fmt(median(row['relay_per_s']))} | {fmt(value, 2)} | {tail}"
            )
    star, lat = relay["all_topics"], relay["latency"]
    lines += [
        "",
        f'All-topics claim (`"*"`) / topic-list claim drain rate: {fmt(star["ratio"], 2)}.',
    ]
    clients = lat.get("clients", {})
    for name, row in lat.items() if "rate" not in lat else [("jetstream", lat)]:
        if name == "clients":
            continue
        lines.append(
            f"Commit → {name} ack at a steady {fmt(row.get('offered_per_s', row['rate']))}"
            f" events/s: p50 {fmt(row['p50'], 1)} ms, p99 {fmt(row['p99'], 1)} ms."
        )
    for name, row in clients.items():
        lines.append(
            f"{name}'s own client at {fmt(row['offered_per_s'])} events/s (its confirming "
            f"publishes as they are due, no database): p50 {fmt(row['p50'], 1)} ms, "
            f"p99 {fmt(row['p99'], 1)} ms."
        )
    return lines


def limits_lines(relay: dict[str, Any]) -> list[str]:
    """The relay at its defaults against its limit, per broker, unordered and keyed
    (none for results without limits)."""
    rows = [(n, mode, row) for n in BROKERS for mode, row in relay[n].get("limits", {}).items()]
    if not rows:
        return []
    first = relay["jetstream"]
    loads = relay.get("load_average", {})
    lines = table(
        f"Relay at its defaults against its limit ({first['events']:,} events, "
        f"{first['rounds']} alternated rounds, medians; load average "
        f"{loads.get('start', ['?'])[0]} at the start, {loads.get('end', ['?'])[0]} at the end)",
        "| broker | events | client loop | client/s | claim+settle/s | limit/s | relay/s "
        "| relay / limit | target | claims of a batch / whole |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|",
    )
    for name, mode, row in rows:
        keys = f"{row['keys']:,} keys" if row.get("keys") else "unordered"
        floor = _FLOORS[mode]
        ok = "ok" if row["ratio"] >= floor else "missed"
        claims = fmt(row["claims_of_a_batch"], 2) if "claims_of_a_batch" in row else ""
        lines.append(
            f"| {name} | {keys} | {row['client_loop']} | {fmt(row['client_per_s'])} "
            f"| {fmt(row['claim_settle_per_s'])} | {fmt(row['limit_per_s'])} "
            f"| {fmt(row['relay_per_s'])} | {fmt(row['ratio'], 2)} | >= {floor} ({ok}) "
            f"| {claims} |"
        )
    lines += [
        "",
        "limit = 1 / (1/client + 1/claim+settle): the broker client's own loop and the bare "
        "asyncpg claim+settle loop (2 connections x 1,000) over the same events, both "
        "measured in the same rounds. Claims of a batch / whole: the relay at its defaults "
        "(claims of one --batch) against the same relay claiming up to --concurrency at a "
        "time, in the same rounds.",
    ]
    return lines


#: the relay at its defaults / its limit, at least
_FLOORS = {"unordered": 0.7, "keyed": 0.6}


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    relay = results.get("relay")
    if not relay:
        return []
    out = []
    for name in BROKERS:
        for mode, row in relay.get(name, {}).get("limits", {}).items():
            what = f"relay into {name} at its defaults / its limit, " + (
                f"{row['keys']:,} ordering keys" if row.get("keys") else "unordered"
            )
            out.append(at_least(what, _FLOORS[mode], row["ratio"]))
    for name, row in relay.get("latency", {}).items():
        if isinstance(row, dict) and "p99" in row:
            out.append(
                target(
                    f"relay commit -> {name} ack p99 at {fmt(row['offered_per_s'])} events/s (ms)",
                    "<= 50",
                    row["p99"],
                    row["p99"] <= 50,
                )
            )
    return out


def streams_lines(relay: dict[str, Any]) -> list[str]:
    """The Kafka and Redis Streams tables (none for older results); also what
    ``python -m benchmarks.relay_streams`` writes."""
    names = [name for name in ("kafka", "redis") if name in relay]
    if not names:
        return []
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
        if "ratios" not in row:  # the relays alone (`relay_streams.read_back_only`)
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
    return lines


def streams_section(results: dict[str, Any]) -> list[str]:
    return streams_lines(results["relay"]) if "relay" in results else []


SCENARIO = Scenario(
    "relay",
    run,
    sizes=Sizes,
    quick={"relay_events": 5_000, "relay_rounds": 2, "relay_latency_seconds": 3.0},
    brokers=True,
    sections=((100, section), (180, streams_section)),
    targets=((100, targets),),
)
