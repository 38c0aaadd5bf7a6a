"""The observers of the observability scenario's variants, child side: what each
aiooutbox consumer child runs with for ``settings["observe"]`` (``off``, ``metrics``,
``tracing``, ``tracing_sampled``, ``otel_api``, ``otel_absent``;
benchmarks/scenarios/observe.py says what each measures)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg


class _NoOtel:
    """A meta path finder that makes opentelemetry unimportable, as if not installed."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}")


@contextlib.asynccontextmanager
async def observing(variant: str, pool: asyncpg.Pool) -> AsyncIterator[Callable[[], list[Any]]]:
    """Child side: a factory of each consumer's observers for one benchmark variant."""
    if variant in ("off", "otel_absent"):
        if variant == "otel_absent":
            if any(m.startswith("opentelemetry") for m in sys.modules):
                raise RuntimeError("opentelemetry was imported before the variant was set")
            sys.meta_path.insert(0, _NoOtel())
        yield list
        return
    if variant == "metrics":
        from prometheus_client import CollectorRegistry

        from aiooutbox.health import ConsumerHealth
        from aiooutbox.metrics import OutboxMetrics

        metrics = OutboxMetrics(CollectorRegistry())
        async with metrics.queue_gauges(pool):
            yield lambda: [metrics, ConsumerHealth()]
        return
    from aiooutbox.tracing import TracingObserver

    if variant == "otel_api":  # the API's default: a no-op provider, no SDK configured
        yield lambda: [TracingObserver()]
        return
    if variant not in ("tracing", "tracing_sampled"):  # the sampled one differs by its events
        raise ValueError(f"unknown observe variant {variant!r}")
    provider = sdk_provider()
    try:
        yield lambda: [TracingObserver(provider)]
    finally:
        provider.shutdown()


def sdk_provider() -> Any:
    """The SDK as deployed, exporting nowhere: the default sampler (ParentBased, so an
    event's sampled flag decides) and a `BatchSpanProcessor`, which every production
    exporter sits behind (a `SimpleSpanProcessor` exports each span synchronously on
    the event loop, a network round trip per span with a real exporter)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Discard(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Discard()))
    return provider
