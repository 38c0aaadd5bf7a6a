"""``wakeup``: idle wake-up latency, one event at a time into an idle consumer, from the
producer's COMMIT to the handler's start: aiooutbox woken by NOTIFY, aiooutbox polling
only, PgQueuer woken by NOTIFY."""

from __future__ import annotations

from typing import Any

from ..harness.bench import AIO, PGQ, Bench
from ..harness.load import wakeup_once
from ..harness.markdown import fmt, table, target
from ..harness.scenario import Scenario


async def run(bench: Bench) -> None:
    bench.log("idle wake-up latency")
    aio = bench.systems[AIO]
    modes = [
        ("aiooutbox_notify", aio, bench.settings[AIO]),
        (
            "aiooutbox_poll_only",
            aio,
            {
                **bench.settings[AIO],
                "listen": False,
                "poll_interval": bench.config.poll_only_interval,
            },
        ),
        ("pgqueuer_notify", bench.systems[PGQ], bench.settings[PGQ]),
    ]
    out: dict[str, Any] = {}
    for label, system, settings in modes:
        out[label] = await wakeup_once(bench, system, settings)
        lat = out[label]["latency_ms"]
        bench.log(
            f"  {label:20} p50 {lat.get('p50')} ms, p95 {lat.get('p95')} ms, "
            f"p99 {lat.get('p99')} ms (n={lat.get('n')})"
        )
    bench.results["wakeup"] = out


def section(results: dict[str, Any]) -> list[str]:
    wake = results.get("wakeup", {})
    if not wake:
        return []
    lines = table(
        "Idle wake-up (one event into an idle consumer; ms from the producer's COMMIT)",
        "| mode | n | p50 | p95 | p99 | max | p50 from BEGIN | producer tx p50 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    )
    for mode, row in wake.items():
        lat = row["latency_ms"]
        lines.append(
            f"| {mode} | {lat.get('n', 0)} | {fmt(lat.get('p50'), 1)} "
            f"| {fmt(lat.get('p95'), 1)} | {fmt(lat.get('p99'), 1)} "
            f"| {fmt(lat.get('max'), 1)} "
            f"| {fmt(row.get('latency_from_begin_ms', {}).get('p50'), 1)} "
            f"| {fmt(row['producer_transaction_ms'].get('p50'), 1)} |"
        )
    return lines


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    wake = results.get("wakeup", {}).get("aiooutbox_notify", {}).get("latency_ms", {})
    if not wake.get("n"):
        return []
    return [
        target("idle wake-up p50 (ms, COMMIT -> handler)", "<= 3", wake["p50"], wake["p50"] <= 3),
        target("idle wake-up p99 (ms, COMMIT -> handler)", "<= 15", wake["p99"], wake["p99"] <= 15),
    ]


SCENARIO = Scenario("wakeup", run, sections=((50, section),), targets=((30, targets),))
