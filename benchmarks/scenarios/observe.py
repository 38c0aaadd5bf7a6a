"""``observe``: the cost of observability. A drain with each observability setting of the
consumer, rounds rotating the order, medians: rates and consumer CPU per event; and the
same hooks timed in this process, per event, with no database or event loop in the way.

The variants (``observe`` in the child's settings, benchmarks/systems/observers.py):
``off`` no observer; ``metrics`` OutboxMetrics + ConsumerHealth + the queue gauges;
``tracing`` TracingObserver on an SDK provider whose exporter drops spans (batched, as
deployed), every event's traceparent sampled; ``tracing_sampled`` the same with one event
in ten sampled (head sampling at 10%: the SDK's default ParentBased sampler drops the
other nine); ``otel_api`` TracingObserver on the API's no-op provider; ``otel_absent``
no observer and opentelemetry made unimportable. ``off`` and ``otel_absent`` run the same
code (nothing imports opentelemetry in ``off`` either): their ratio is the A/A spread.
Events carry a ``traceparent`` header in every variant.

The rate is the drain's events over the time to its last handler (the child's startup
and shutdown left out); the CPU is the consumer process's, all threads (the span
processor's included), over the same stretch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..harness.bench import AIO, Bench
from ..harness.databases import TOPIC
from ..harness.markdown import at_least, fmt
from ..harness.rounds import rotated
from ..harness.scenario import Scenario, sizes_of
from ..harness.stats import median, ratio
from ..systems.observers import sdk_provider

VARIANTS = ["off", "metrics", "tracing", "tracing_sampled", "otel_api", "otel_absent"]


@dataclass
class Sizes:
    observe_size: int = 50_000
    observe_rounds: int = 5


async def run(bench: Bench) -> None:
    """Drain rate and consumer CPU per observability setting (see the module doc)."""
    config = sizes_of(bench.config, Sizes)
    n, variants = config.observe_size, VARIANTS
    bench.log(f"cost of observability: drain of {n:,}, {config.observe_rounds} round(s)")
    aio = bench.systems[AIO]

    async def one_in_ten_sampled() -> None:
        await aio.insert_series(
            n,
            "topic, payload, headers",
            "'bench', jsonb_build_object('i', g), jsonb_build_object('traceparent',"
            " '00-' || md5(g::text) || '-' || left(md5(g::text || 's'), 16)"
            " || CASE WHEN g % 10 = 0 THEN '-01' ELSE '-00' END)",
        )

    runs: list[dict[str, Any]] = []
    for r in range(config.observe_rounds):
        for variant in rotated(variants, r, reverse_odd=True):
            settings = {**bench.settings[AIO], "observe": variant}
            run = await bench.drain_once(
                aio,
                n,
                settings,
                label=f"{variant:15} ",
                traceparent=True,
                loader=one_in_ten_sampled if variant == "tracing_sampled" else None,
            )
            run["observe"] = variant
            run["round"] = r
            run["drain_rate"] = round(n / run["to_last_s"], 1) if run["to_last_s"] else 0.0
            if run.get("drain_cpu_s") is not None:
                run["cpu_us_per_event"] = round(run["drain_cpu_s"] / n * 1e6, 2)
            runs.append({k: v for k, v in run.items() if k != "rss"})
    ok = [x for x in runs if "error" not in x]
    rates = {v: median([x["drain_rate"] for x in ok if x["observe"] == v]) for v in variants}
    cpu = {
        v: median([x.get("cpu_us_per_event", math.nan) for x in ok if x["observe"] == v])
        for v in variants
    }
    pairs = {
        "metrics_vs_off": ("metrics", "off"),
        "tracing_vs_off": ("tracing", "off"),
        "tracing_sampled_vs_off": ("tracing_sampled", "off"),
        "otel_api_vs_absent": ("otel_api", "otel_absent"),
        "absent_vs_off": ("otel_absent", "off"),  # the same code: the A/A spread
    }

    # each round's ratio, then the median over rounds: a pair drained minutes apart
    # on a shared machine differs by the load as much as by the variant
    def paired(a: str, b: str) -> float:
        by = {(x["observe"], x["round"]): x["drain_rate"] for x in ok}
        return median(
            [
                ratio(by[a, r], by[b, r])
                for r in range(config.observe_rounds)
                if (a, r) in by and (b, r) in by
            ]
        )

    ratios = {k: paired(a, b) for k, (a, b) in pairs.items()}
    # off's CPU per event over the variant's: the drain ratio the consumer's own cost
    # implies were it the only bottleneck; far less disturbed by the other processes
    # of a shared machine than a rate
    cpu_ratios = {k: ratio(cpu[b], cpu[a]) for k, (a, b) in pairs.items()}
    # the same hooks timed in this process, per event, with no database or event loop
    # in the way
    hooks = {v: hook_cost_us(v) for v in ("metrics", "tracing", "tracing_sampled", "otel_api")}
    per_event_us = 1e6 / rates["off"] if rates["off"] else math.nan
    implied = {v: per_event_us / (per_event_us + us) for v, us in hooks.items()}
    bare = bare_span_us()
    bench.results["observe"] = {
        "size": n,
        "rounds": config.observe_rounds,
        "runs": runs,
        "rates": {k: round(v, 1) for k, v in rates.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "cpu_us_per_event": {k: round(v, 2) for k, v in cpu.items()},
        "cpu_ratios": {k: round(v, 3) for k, v in cpu_ratios.items()},
        "hook_us_per_event": {k: round(v, 2) for k, v in hooks.items()},
        "implied_ratios": {k: round(v, 3) for k, v in implied.items()},
        "sdk_bare_span_us": round(bare, 2),
    }
    bench.log("  drain ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    bench.log(
        "  CPU per event: "
        + ", ".join(f"{k} {v:.1f} us" for k, v in cpu.items())
        + f"; the SDK's bare span {bare:.1f} us"
    )
    bench.log(
        "  hooks per event: "
        + ", ".join(f"{v} {us:.1f} us (implied ratio {implied[v]:.3f})" for v, us in hooks.items())
    )


def _cpu_us(step: Callable[[int], object], n: int) -> float:
    """Process CPU (all threads: the span processor's too) per call of ``step(i)``, the
    best of three; a ``sleep(0)`` every 100 calls lets other threads run, as a claim's
    round trip does in a drain."""
    best = float("inf")
    for _ in range(3):
        started = time.process_time()
        for i in range(n):
            step(i)
            if i % 100 == 0:
                time.sleep(0)
        best = min(best, (time.process_time() - started) / n * 1e6)
    return best


def bare_span_us(n: int = 20_000) -> float:
    """CPU per ``tracer.start_span("a").end()`` on `sdk_provider`: the SDK's own floor."""
    provider = sdk_provider()
    tracer = provider.get_tracer("bench")
    try:
        return _cpu_us(lambda i: tracer.start_span("a").end(), n)
    finally:
        provider.shutdown()


def hook_cost_us(variant: str, n: int = 20_000) -> float:
    """CPU microseconds per event that a variant's observers add, timed in this process:
    the calls a consumer makes per event (claimed once per 100 events), through the
    same fan-out and the same per-event gate as the executor, on events carrying a
    traceparent (``tracing_sampled``: one in ten sampled), less the same loop without
    observers."""
    import uuid

    from aiooutbox.events import Event
    from aiooutbox.observe import Observers

    observers: list[Any]
    provider: Any = None
    if variant == "metrics":
        from prometheus_client import CollectorRegistry

        from aiooutbox.health import ConsumerHealth
        from aiooutbox.metrics import OutboxMetrics

        observers = [OutboxMetrics(CollectorRegistry()), ConsumerHealth()]
    else:
        from opentelemetry import trace

        from aiooutbox.tracing import TracingObserver

        if variant in ("tracing", "tracing_sampled"):
            provider = sdk_provider()
            observers = [TracingObserver(provider)]
        else:
            observers = [TracingObserver(trace.ProxyTracerProvider())]
    every = 10 if variant == "tracing_sampled" else 1
    events = [
        Event(
            i,
            TOPIC,
            {},
            None,
            {
                "traceparent": f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-"
                + ("01" if i % every == 0 else "00")
            },
            1,
            5,
            None,
            str(uuid.uuid4()),
        )
        for i in range(100)
    ]

    def stepper(fan_out: Observers) -> Callable[[int], None]:
        def step(i: int) -> None:
            if i % 100 == 0:
                fan_out.claimed(100, 0.001)
            event = events[i % 100]
            if fan_out.per_event:  # as the executor does
                token = fan_out.handler_started(event)
                fan_out.settled(TOPIC, "done")
                fan_out.handler_finished(event, token, "done", 0.001, None)

        return step

    try:
        # less the same loop with no observer: only what the observers add
        return _cpu_us(stepper(Observers(observers)), n) - _cpu_us(stepper(Observers([])), n)
    finally:
        if provider is not None:
            provider.shutdown()


def section(results: dict[str, Any]) -> list[str]:
    observe = results.get("observe")
    if not observe:
        return []
    return [
        "",
        f"## Cost of observability (drain of {observe['size']:,}, median of "
        f"{observe['rounds']} round(s))",
        "",
        "Drain rate to the last handler, and the consumer's CPU per event (all its"
        " threads, startup and shutdown left out):",
        "",
        "| variant | drain/s | CPU us/event |",
        "|---|---:|---:|",
        *(
            f"| {k} | {fmt(v)} | {fmt(observe.get('cpu_us_per_event', {}).get(k), 2)} |"
            for k, v in observe["rates"].items()
        ),
        "",
        "| ratio | drain | CPU (off's CPU / the variant's) |",
        "|---|---:|---:|",
        *(
            f"| {k} | {fmt(v, 3)} | {fmt(observe.get('cpu_ratios', {}).get(k), 3)} |"
            for k, v in observe["ratios"].items()
        ),
        "",
        "Hook CPU per event, timed in-process (best of 3), and the drain ratio it"
        " implies at the `off` rate:",
        "",
        "| variant | us/event | implied ratio |",
        "|---|---:|---:|",
        *(
            f"| {k} | {fmt(v, 2)} | {fmt(observe['implied_ratios'].get(k), 3)} |"
            for k, v in observe.get("hook_us_per_event", {}).items()
        ),
        "",
        "The SDK's own span (`tracer.start_span('a').end()`, BatchSpanProcessor):"
        f" {fmt(observe.get('sdk_bare_span_us'), 2)} us of CPU.",
    ]


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    observe = results.get("observe", {})
    out = []
    for field, how in (("ratios", "drain"), ("cpu_ratios", "consumer CPU per event")):
        measured = observe.get(field)
        if not measured:
            continue
        for key, what, floor in (
            ("metrics_vs_off", "Prometheus metrics on / off", 0.95),
            ("tracing_vs_off", "tracing (SDK, no-op exporter) on / off", 0.85),
            ("otel_api_vs_absent", "opentelemetry-api, no SDK / not installed", 0.98),
        ):
            out.append(at_least(f"{what} ({how})", floor, measured.get(key)))
    return out


SCENARIO = Scenario(
    "observe",
    run,
    sizes=Sizes,
    quick={"observe_size": 20_000, "observe_rounds": 3},
    sections=((120, section),),
    targets=((60, targets),),
)
