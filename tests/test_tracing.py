"""OpenTelemetry tracing (issue 15): the SDK's in-memory exporter, real PostgreSQL.

The provider is passed explicitly (the global one can be set only once per process);
the producer side reads whatever span is current, so it needs no provider at all.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from typing import Any

import asyncpg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import aiooutbox
from aiooutbox.cli.logsetup import JsonFormatter
from aiooutbox.observe import Observer
from aiooutbox.tracing import TracingObserver
from tests.clirunner import ROOT
from tests.helpers import running, truthy, wait_until


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def finished(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


async def stored_headers(pool: asyncpg.Pool, event_id: int | None) -> dict[str, str]:
    raw = await pool.fetchval("SELECT headers::text FROM outbox_events_all WHERE id = $1", event_id)
    headers: dict[str, str] = json.loads(raw)
    return headers


async def test_request_span_enqueue_and_handler_span_share_one_trace(
    pool: asyncpg.Pool, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    tracer = provider.get_tracer("app")
    seen_inside: list[trace.SpanContext] = []

    async def handler(event: aiooutbox.Event) -> None:
        seen_inside.append(trace.get_current_span().get_span_context())

    with tracer.start_as_current_span("POST /orders") as request:
        event_id = await aiooutbox.enqueue(pool, "orders.created", {"id": 1})
    headers = await stored_headers(pool, event_id)
    assert headers["traceparent"].split("-")[1] == format(
        request.get_span_context().trace_id, "032x"
    )

    consumer = aiooutbox.OutboxConsumer(
        pool, poll_interval=0.1, observers=[TracingObserver(provider)]
    )
    async with consumer, running(consumer, {"orders.created": handler}):
        await wait_until(truthy(lambda: finished(exporter, "process orders.created")))
    (span,) = finished(exporter, "process orders.created")
    (req,) = finished(exporter, "POST /orders")
    assert span.kind is SpanKind.CONSUMER
    assert span.context.trace_id == req.context.trace_id
    assert span.parent is not None and span.parent.span_id == req.context.span_id
    assert [link.context.span_id for link in span.links] == [req.context.span_id]
    assert seen_inside == [span.context]  # the handler runs inside its span
    attributes = dict(span.attributes or {})
    message_id = await pool.fetchval(
        "SELECT message_id::text FROM outbox_events_all WHERE id = $1", event_id
    )
    assert attributes == {
        "messaging.system": "aiooutbox",
        "messaging.destination.name": "orders.created",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.message.id": message_id,
        "aiooutbox.event.id": event_id,
        "aiooutbox.attempt": 1,
        "aiooutbox.outcome": "done",
    }
    assert span.status.status_code is StatusCode.UNSET


async def test_failures_record_the_exception_and_the_outcome(
    pool: asyncpg.Pool, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    async def broken(event: aiooutbox.Event) -> None:
        if event.attempts == 1:
            raise ValueError("bad input")
        raise aiooutbox.Dead("give up")

    await aiooutbox.enqueue(pool, "t", {})  # no span current: a new trace
    consumer = aiooutbox.OutboxConsumer(
        pool,
        poll_interval=0.1,
        retry=aiooutbox.RetryPolicy(base=0.01, max_delay=0.02),
        observers=[TracingObserver(provider)],
    )
    async with consumer, running(consumer, {"t": broken}):
        await wait_until(truthy(lambda: len(finished(exporter, "process t")) == 2))
    first, second = sorted(finished(exporter, "process t"), key=lambda s: s.start_time or 0)
    assert first.parent is None and not first.links
    assert first.attributes is not None and second.attributes is not None
    assert first.attributes["aiooutbox.outcome"] == "retry"
    assert first.attributes["error.type"] == "ValueError"
    assert first.status.status_code is StatusCode.ERROR
    assert [e.name for e in first.events] == ["exception"]
    assert first.events[0].attributes is not None
    assert first.events[0].attributes["exception.message"] == "bad input"
    assert second.attributes["aiooutbox.outcome"] == "dead"
    assert second.attributes["aiooutbox.attempt"] == 2
    assert second.attributes["error.type"] == "Dead"


async def test_injection_keeps_the_callers_headers(
    pool: asyncpg.Pool, provider: TracerProvider
) -> None:
    tracer = provider.get_tracer("app")
    custom = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with tracer.start_as_current_span("request") as span:
        mine = await aiooutbox.enqueue(pool, "t", {}, headers={"traceparent": custom, "k": "v"})
        merged = await aiooutbox.enqueue(pool, "t", {}, headers={"k": "v"})
        many = await aiooutbox.enqueue_many(
            pool, [aiooutbox.NewEvent("t", {}), aiooutbox.NewEvent("t", {}, headers={"a": "b"})]
        )
    outside = await aiooutbox.enqueue(pool, "t", {}, headers={"k": "v"})
    assert await stored_headers(pool, mine) == {"traceparent": custom, "k": "v"}
    trace_id = format(span.get_span_context().trace_id, "032x")
    got = await stored_headers(pool, merged)
    assert got["k"] == "v" and got["traceparent"].split("-")[1] == trace_id
    for event_id in many:
        assert (await stored_headers(pool, event_id))["traceparent"].split("-")[1] == trace_id
    assert (await stored_headers(pool, many[1]))["a"] == "b"
    assert await stored_headers(pool, outside) == {"k": "v"}
    # validation still comes first: a bad header is refused inside a span too
    with tracer.start_as_current_span("request"), pytest.raises(TypeError):
        await aiooutbox.enqueue(pool, "t", {}, headers=[("k", "v")])  # type: ignore[arg-type]


async def test_a_garbled_traceparent_starts_a_new_trace(
    pool: asyncpg.Pool, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    await aiooutbox.enqueue(pool, "t", {}, headers={"traceparent": "nonsense", "tracestate": 7})

    async def handler(event: aiooutbox.Event) -> None:
        pass

    consumer = aiooutbox.OutboxConsumer(
        pool, poll_interval=0.1, observers=[TracingObserver(provider)]
    )
    async with consumer, running(consumer, {"t": handler}):
        await wait_until(truthy(lambda: finished(exporter, "process t")))
    (span,) = finished(exporter, "process t")
    assert span.parent is None and not span.links
    assert consumer.stats.done == 1


# what a raw SQL producer may store (the table takes any JSON object as headers)
_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
_HOSTILE_HEADERS: list[tuple[dict[str, Any], bool]] = [  # headers, continues the trace
    ({"traceparent": "x" * 10_000_000}, False),
    ({"traceparent": " " * 1_000_000 + "00-"}, False),
    ({"traceparent": 7}, False),
    ({"traceparent": {"v": _PARENT}}, False),
    ({"traceparent": [_PARENT]}, False),
    ({"traceparent": None}, False),
    ({"traceparent": _PARENT + "\x01\x1b[31m\u2028"}, False),
    ({"traceparent": "\\xff\\xfe" + _PARENT}, False),
    ({"Traceparent": _PARENT, "TRACEPARENT": _PARENT, "traceparent": "junk"}, False),
    ({"traceparent": _PARENT, "tracestate": ",".join(f"k{i}=v" for i in range(1000))}, True),
    ({"traceparent": _PARENT, "tracestate": 5, "Tracestate": "a=b"}, True),
    ({"traceparent": _PARENT, "baggage": "k=" + "v" * 10_000_000}, True),
    ({"traceparent": _PARENT, "baggage": ["k=v"] * 1000, "x": "y" * 1_000_000}, True),
]


async def _insert_hostile(pool: asyncpg.Pool, topic: str) -> dict[int, bool]:
    ids = {}
    for headers, continues in _HOSTILE_HEADERS:
        event_id = await pool.fetchval(
            "INSERT INTO outbox_events (topic, payload, headers)"
            " VALUES ($1, '{}', $2::jsonb) RETURNING id",
            topic,
            json.dumps(headers),
        )
        ids[event_id] = continues
    return ids


def _no_huge_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    # a propagator logs what it refuses: never the 10 MB a producer stored
    sizes = [(r.name, len(r.getMessage())) for r in caplog.records]
    assert all(size < 20_000 for _, size in sizes), [s for s in sizes if s[1] >= 20_000]
    assert not [r for r in caplog.records if r.name.startswith("aiooutbox")], caplog.text[:2000]


async def test_hostile_trace_headers_stored_by_raw_sql_still_give_spans(
    pool: asyncpg.Pool,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ids = await _insert_hostile(pool, "t")

    async def handler(event: aiooutbox.Event) -> None:
        pass

    consumer = aiooutbox.OutboxConsumer(
        pool, poll_interval=0.1, observers=[TracingObserver(provider)]
    )
    async with consumer, running(consumer, {"t": handler}):
        await wait_until(truthy(lambda: len(finished(exporter, "process t")) == len(ids)))
    assert consumer.stats.done == len(ids)
    for span in finished(exporter, "process t"):
        continues = ids[span.attributes["aiooutbox.event.id"]]  # type: ignore[index]
        parent = span.parent
        if continues:
            assert parent is not None and parent.span_id == 0xB7AD6B7169203331
            assert [link.context for link in span.links] == [parent]
        else:
            assert parent is None and not span.links
    _no_huge_log_lines(caplog)


async def test_hostile_trace_headers_still_give_one_linked_span_per_batch(
    pool: asyncpg.Pool,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ids = await _insert_hostile(pool, "b")

    async def bulk(events: list[aiooutbox.Event]) -> None:
        pass

    consumer = aiooutbox.OutboxConsumer(
        pool, poll_interval=0.1, observers=[TracingObserver(provider)]
    )
    async with consumer, running(consumer, {"b": aiooutbox.Handler(bulk, batch=50)}):
        await wait_until(truthy(lambda: consumer.stats.done == len(ids)))
    (span,) = finished(exporter, "process b")  # one claim: one batch
    assert span.attributes is not None
    assert span.attributes["messaging.batch.message_count"] == len(ids)
    linked = sorted(int(str((link.attributes or {})["aiooutbox.event.id"])) for link in span.links)
    assert linked == sorted(i for i, continues in ids.items() if continues)
    _no_huge_log_lines(caplog)


def test_tracing_observer_refuses_what_is_not_a_tracer_provider() -> None:
    for bad in ("provider", 5, False, object()):
        with pytest.raises(TypeError, match="tracer_provider must be"):
            TracingObserver(bad)


def test_json_log_lines_carry_the_trace_ids(provider: TracerProvider) -> None:
    formatter = JsonFormatter()
    record = logging.LogRecord("aiooutbox.test", logging.INFO, "", 0, "hello", (), None)
    assert "trace_id" not in json.loads(formatter.format(record))
    with provider.get_tracer("app").start_as_current_span("work") as span:
        line = json.loads(formatter.format(record))
    context = span.get_span_context()
    assert line["trace_id"] == format(context.trace_id, "032x")
    assert line["span_id"] == format(context.span_id, "016x")
    assert line["message"] == "hello"


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_without_opentelemetry_nothing_is_imported_and_tracing_says_what_to_install() -> None:
    result = _python(
        """
        import sys

        class Blocker:
            # as if opentelemetry were not installed
            def find_spec(self, name, path=None, target=None):
                if name == "opentelemetry" or name.startswith("opentelemetry."):
                    raise ModuleNotFoundError(f"No module named {name!r}")
                return None

        sys.meta_path.insert(0, Blocker())
        import logging
        import aiooutbox
        from aiooutbox import producer
        from aiooutbox.cli.logsetup import JsonFormatter

        producer.prepare_one(
            "t", {}, dedupe_key=None, delay=None, available_at=None, max_attempts=None,
            headers={"k": "v"}, schema="public", table="outbox_events", encoder=None,
        )
        record = logging.LogRecord("x", logging.INFO, "", 0, "m", (), None)
        assert "trace_id" not in JsonFormatter().format(record)
        assert producer._trace_looked_up and producer._inject_trace is None
        from aiooutbox.tracing import TracingObserver
        try:
            TracingObserver()
        except ImportError as exc:
            print(exc)
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
        """
    )
    assert result.returncode == 0, result.stderr
    assert "pip install -e '.[otel]' in a clone of aiooutbox" in result.stdout
    assert result.stdout.strip().endswith("[]")


def test_importing_aiooutbox_imports_no_opentelemetry_or_prometheus() -> None:
    result = _python(
        """
        import sys
        import aiooutbox, aiooutbox.health, aiooutbox.tracing, aiooutbox.observe
        print(sorted(m for m in sys.modules if m.startswith(("opentelemetry", "prometheus"))))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


async def test_the_runner_traces_handlers_when_opentelemetry_is_installed(
    dsn: str, pool: asyncpg.Pool
) -> None:
    """`python -m aiooutbox run` adds the tracing observer by itself; a handlers module
    that configures the SDK gets spans (here printed by the console exporter)."""
    from tests.clirunner import Runner, clean_env

    await aiooutbox.enqueue(pool, "traced", {})
    async with Runner(
        "tests.tracing_handlers:handlers", "--dsn", dsn, "--log-format", "json",
        env=clean_env(),
    ) as runner:  # fmt: skip
        match = await runner.wait_for_line(
            r'"message": "handled traced event".*"trace_id": "(\w+)"'
        )
        assert len(match.group(1)) == 32
        runner.signal()
        assert await runner.wait() == 0


def test_without_an_sdk_handlers_run_without_a_span() -> None:
    event = aiooutbox.Event(
        1, "t", {}, None, {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    )
    for provider in (trace.NoOpTracerProvider(), trace.ProxyTracerProvider()):
        observer = TracingObserver(provider)
        token = observer.handler_started(event)
        assert token is None
        observer.handler_finished(event, token, "done", 0.001, None)
        assert not trace.get_current_span().get_span_context().is_valid


class Gated(Observer):
    """Counts its per-event hooks; wants them only while ``wanted``."""

    def __init__(self) -> None:
        self.wanted = False
        self.claims = self.started = self.finished = self.settled_events = 0

    def claimed(self, rows: int, seconds: float) -> None:
        self.claims += 1

    def wants_events(self) -> bool:
        return self.wanted

    def handler_started(self, event: aiooutbox.Event) -> Any:
        self.started += 1

    def handler_finished(
        self, event: aiooutbox.Event, token: Any, outcome: str, seconds: float, error: Any
    ) -> None:
        self.finished += 1

    def settled(self, topic: str, outcome: str) -> None:
        self.settled_events += 1


async def test_per_event_hooks_go_only_to_observers_that_want_them_asked_per_claim(
    pool: asyncpg.Pool,
) -> None:
    gated = Gated()
    consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.1, observers=[gated])

    async def handler(event: aiooutbox.Event) -> None:
        pass

    async with consumer, running(consumer, {"t": handler}):
        await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", {}) for _ in range(3)])
        await wait_until(truthy(lambda: consumer.stats.done == 3))
        assert gated.claims >= 1
        assert (gated.started, gated.finished, gated.settled_events) == (0, 0, 0)
        gated.wanted = True  # asked again after the next claim, before its rows run
        await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", {}) for _ in range(2)])
        await wait_until(truthy(lambda: consumer.stats.done == 5))
    assert (gated.started, gated.finished, gated.settled_events) == (2, 2, 2)


def test_an_sdk_configured_after_the_consumer_started_is_used_from_the_next_claim(
    dsn: str,
) -> None:
    """The global provider can be set once per process: a child process of its own."""
    result = _python(
        f"""
        import asyncio
        import asyncpg
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        import aiooutbox
        from aiooutbox.tracing import TracingObserver

        async def main():
            seen = []
            arrived = [asyncio.Event(), asyncio.Event()]

            async def handler(event):
                seen.append(trace.get_current_span().get_span_context().is_valid)
                arrived[len(seen) - 1].set()

            async with asyncpg.create_pool({dsn!r}, min_size=1, max_size=4) as pool:
                consumer = aiooutbox.OutboxConsumer(
                    pool, poll_interval=0.1, observers=[TracingObserver()]
                )
                async with consumer:
                    task = asyncio.ensure_future(consumer.run({{"late": handler}}))
                    await aiooutbox.enqueue(pool, "late", {{}})
                    await asyncio.wait_for(arrived[0].wait(), 30)
                    exporter = InMemorySpanExporter()
                    provider = TracerProvider()
                    provider.add_span_processor(SimpleSpanProcessor(exporter))
                    trace.set_tracer_provider(provider)
                    await aiooutbox.enqueue(pool, "late", {{}})
                    await asyncio.wait_for(arrived[1].wait(), 30)
                    consumer.stop()
                    await task
            print(seen, [s.name for s in exporter.get_finished_spans()])

        asyncio.run(main())
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[False, True] ['process late']", result.stdout


def test_the_stored_context_is_read_as_the_w3c_propagator_reads_it(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A lone traceparent takes a shortcut past the propagator; it must agree with it."""
    trace_id, span_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    cases = {
        "lone": {"traceparent": f"00-{trace_id}-{span_id}-01"},
        "unsampled": {"traceparent": f" 00-{trace_id}-{span_id}-00\t"},
        "with tracestate": {"traceparent": f"00-{trace_id}-{span_id}-01", "tracestate": "k=v"},
        "upper case": {"traceparent": f"00-{trace_id.upper()}-{span_id}-01"},
        "zero span id": {"traceparent": f"00-{trace_id}-{'0' * 16}-01"},
        "future version": {"traceparent": f"01-{trace_id}-{span_id}-01-later"},
    }
    observer = TracingObserver(provider)
    inside: dict[str, trace.SpanContext] = {}
    for name, headers in cases.items():
        event = aiooutbox.Event(1, name, {}, None, headers)
        token = observer.handler_started(event)
        inside[name] = trace.get_current_span().get_span_context()
        observer.handler_finished(event, token, "done", 0.0, None)
    # not sampled: the handler still runs in the trace, so its calls carry the decision on
    assert format(inside["unsampled"].trace_id, "032x") == trace_id
    assert not inside["unsampled"].trace_flags.sampled
    spans = {s.name.removeprefix("process "): s for s in exporter.get_finished_spans()}
    # "unsampled": the SDK's default sampler (ParentBased) drops it, so nothing exported
    assert set(spans) == {"lone", "with tracestate", "upper case", "zero span id", "future version"}
    for name in ("lone", "with tracestate", "future version"):
        parent = spans[name].parent
        assert parent is not None and parent.is_remote, name
        assert (format(parent.trace_id, "032x"), format(parent.span_id, "016x")) == (
            trace_id,
            span_id,
        )
        assert parent.trace_flags.sampled
        assert [link.context for link in spans[name].links] == [parent]
    parent = spans["with tracestate"].parent
    assert parent is not None and dict(parent.trace_state) == {"k": "v"}
    for name in ("upper case", "zero span id"):  # refused, as the propagator does
        assert spans[name].parent is None and not spans[name].links, name
