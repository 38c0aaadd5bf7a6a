"""Batch handlers under flow control (max_running counts events, across two consumers;
a rate counts events), traced (one span per batch, linked to each event's trace) and
measured (metrics count events, and the batch sizes)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import CollectorRegistry

import aiooutbox
from aiooutbox import Handler, admin
from aiooutbox.metrics import OutboxMetrics
from aiooutbox.tracing import TracingObserver
from tests.helpers import running, truthy, wait_until
from tests.test_flow import sampled


def consumer(pool: asyncpg.Pool, **options: Any) -> aiooutbox.OutboxConsumer:
    return aiooutbox.OutboxConsumer(
        pool, **{"concurrency": 16, "poll_interval": 0.2, "lease_timeout": 5.0, **options}
    )


async def done(pool: asyncpg.Pool, topic: str) -> int:
    n: int = await pool.fetchval(
        "SELECT count(*) FROM outbox_events_all WHERE topic = $1 AND status = 'done'", topic
    )
    return n


async def test_max_running_counts_every_event_of_a_batch_across_two_consumers(
    pool: asyncpg.Pool,
) -> None:
    await admin.limit_topic(pool, "narrow", max_running=5)
    await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("narrow", {}) for _ in range(60)])
    now = peak = 0
    sizes: list[int] = []

    async def bulk(events: list[aiooutbox.Event]) -> None:
        nonlocal now, peak
        sizes.append(len(events))
        now += len(events)
        peak = max(peak, now)
        await asyncio.sleep(0.05)
        now -= len(events)

    handlers = {"narrow": Handler(bulk, batch=20)}
    async with (
        sampled(pool, "narrow") as seen,
        running(consumer(pool, concurrency=32, prefetch=100), handlers),
        running(consumer(pool, concurrency=32, prefetch=100), handlers),
    ):
        await wait_until(lambda: _done(pool, "narrow", 60), timeout=60)
    assert sum(sizes) == 60
    assert peak <= 5, f"{peak} events of the topic in handlers at once"
    assert max(seen) <= 5, f"the database saw {max(seen)} claimed at once"
    assert max(sizes) > 1  # batches did form, within the limit


async def _done(pool: asyncpg.Pool, topic: str, n: int) -> bool:
    return await done(pool, topic) == n


async def test_a_rate_counts_events_not_calls(pool: asyncpg.Pool) -> None:
    await admin.limit_topic(pool, "rated", rate="20/s", burst=5)
    await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("rated", {}) for _ in range(25)])
    sizes: list[int] = []

    async def bulk(events: list[aiooutbox.Event]) -> None:
        sizes.append(len(events))

    started = time.monotonic()
    async with running(consumer(pool), {"rated": Handler(bulk, batch=100)}):
        await wait_until(lambda: _done(pool, "rated", 25), timeout=30)
    took = time.monotonic() - started
    # 5 at once (the burst), then 20 more at 20/s: about a second, not one call
    assert took >= 0.7, took
    assert sum(sizes) == 25 and max(sizes) <= 5


# -- tracing ------------------------------------------------------------------------------------


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


async def test_one_span_per_batch_linked_to_each_events_trace(
    pool: asyncpg.Pool, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    tracer = provider.get_tracer("app")
    requests = []
    for i in range(3):
        with tracer.start_as_current_span(f"POST /orders/{i}") as request:
            await aiooutbox.enqueue(pool, "orders.created", {"i": i})
        requests.append(request.get_span_context())
    await aiooutbox.enqueue(pool, "orders.created", {"untraced": True})
    inside: list[trace.SpanContext] = []

    async def publish(events: list[aiooutbox.Event]) -> dict[int, BaseException]:
        inside.append(trace.get_current_span().get_span_context())
        return {events[0].id: RuntimeError("one fails")} if events[0].attempts == 1 else {}

    observer = TracingObserver(provider)

    def spans() -> list[ReadableSpan]:
        return [s for s in exporter.get_finished_spans() if s.name == "process orders.created"]

    c = consumer(pool, observers=[observer], retry=aiooutbox.RetryPolicy(base=0.01, max_delay=0.02))
    async with c, running(c, {"orders.created": Handler(publish, batch=10)}):
        await wait_until(truthy(lambda: len(spans()) >= 2))
    first = min(spans(), key=lambda s: s.start_time or 0)
    assert first.kind is SpanKind.CONSUMER
    attributes = dict(first.attributes or {})
    assert attributes["messaging.batch.message_count"] == 4
    assert attributes["messaging.destination.name"] == "orders.created"
    assert attributes["aiooutbox.outcome"] == "mixed"
    assert (
        attributes["aiooutbox.outcomes.done"] == 3 and attributes["aiooutbox.outcomes.retry"] == 1
    )
    assert sorted(link.context.span_id for link in first.links) == sorted(
        r.span_id for r in requests
    )  # one link per traced event; the untraced one has none
    assert first.context.trace_id not in {r.trace_id for r in requests}  # no one parent
    assert inside[0] == first.context  # the handler runs inside the batch's span
    # the call returned: its per-event failures are counted, the span is not an error
    assert first.status.status_code is trace.StatusCode.UNSET


# -- metrics --------------------------------------------------------------------------------------


async def test_metrics_count_events_and_batch_sizes(pool: asyncpg.Pool) -> None:
    await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", {}) for _ in range(45)])
    registry = CollectorRegistry()
    metrics = OutboxMetrics(registry)
    calls = 0

    async def bulk(events: list[aiooutbox.Event]) -> dict[int, BaseException]:
        nonlocal calls
        calls += 1
        return {events[0].id: aiooutbox.Dead("no")} if calls == 1 else {}

    c = consumer(pool, observers=[metrics])
    async with c, running(c, {"t": Handler(bulk, batch=20)}):
        await wait_until(lambda: _finished(pool, 45))

    def value(name: str, **labels: str) -> float:
        found = registry.get_sample_value(name, labels)
        return 0.0 if found is None else found

    assert value("aiooutbox_events_total", topic="t", outcome="done") == 44
    assert value("aiooutbox_events_total", topic="t", outcome="dead") == 1
    assert value("aiooutbox_batch_size_count", topic="t") == calls
    assert value("aiooutbox_batch_size_sum", topic="t") == 45
    assert value("aiooutbox_handler_duration_seconds_count", topic="t") == calls


async def _finished(pool: asyncpg.Pool, n: int) -> bool:
    found = await pool.fetchval(
        "SELECT count(*) FROM outbox_events_all WHERE status IN ('done', 'dead')"
    )
    return bool(found == n)
