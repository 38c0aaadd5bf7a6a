"""An exception that cannot describe itself must not stop a consumer or lose its trace.

A real pattern: exception classes that build their message lazily from attributes that
were never set, so ``str(exc)`` (and sometimes ``repr(exc)``) raises. Every place that
turns a handler's exception into text (the stored ``last_error``, the log line, the
tracing span, a relay's error) falls back to the class name and ``repr``, or the class
name alone, and keeps the traceback.
"""

from __future__ import annotations

import logging
from collections import Counter

import asyncpg
import pytest

import aiooutbox
from aiooutbox._values.text import describe_exception
from aiooutbox.relay import BrokerUnavailable, Message, Sink
from tests.clirunner import Runner, clean_env, cli
from tests.helpers import running, status_counts, truthy, wait_until

FAST_RETRY = aiooutbox.RetryPolicy(base=0.05, factor=2.0, max_delay=0.1)


class LazyMessage(Exception):
    """Formats its message from an attribute the raiser forgot to set."""

    def __str__(self) -> str:
        return f"order {self.order_id} refused"  # type: ignore[attr-defined]


class Unprintable(Exception):
    """Neither str() nor repr() works."""

    def __str__(self) -> str:
        raise ValueError("no str")

    def __repr__(self) -> str:
        raise ValueError("no repr")


def raise_in_depth(exc: BaseException) -> None:
    def deep_frame_marker() -> None:
        raise exc

    deep_frame_marker()


def test_describe_exception_falls_back() -> None:
    assert describe_exception(RuntimeError("boom")) == "RuntimeError: boom"
    assert describe_exception(RuntimeError()) == "RuntimeError"
    lazy = describe_exception(LazyMessage("x"))
    assert lazy.startswith("LazyMessage") and "LazyMessage('x')" in lazy, lazy
    assert describe_exception(Unprintable()).startswith("Unprintable"), describe_exception(
        Unprintable()
    )


@pytest.mark.parametrize("cls", [LazyMessage, Unprintable])
async def test_an_unprintable_handler_error_settles_and_the_consumer_runs_on(
    pool: asyncpg.Pool, cls: type[Exception], caplog: pytest.LogCaptureFixture
) -> None:
    bad = await aiooutbox.enqueue(pool, "t", {"bad": True}, max_attempts=2)
    good = await aiooutbox.enqueue_many(
        pool, [aiooutbox.NewEvent("t", {"n": i}) for i in range(20)]
    )
    assert bad is not None and None not in good
    runs: Counter[int | None] = Counter()

    async def handle(event: aiooutbox.Event) -> None:
        runs[event.id] += 1
        if event.payload.get("bad"):
            raise_in_depth(cls("x"))

    consumer = aiooutbox.OutboxConsumer(pool, concurrency=8, lease_timeout=5, retry=FAST_RETRY)
    caplog.set_level(logging.INFO, logger="aiooutbox")
    async with running(consumer, {"t": handle}) as task:

        async def settled() -> bool:
            if task.done():
                task.result()  # the consumer died: show why
            return await status_counts(pool) == {"done": 20, "dead": 1}

        await wait_until(settled, timeout=30)
    assert all(runs[i] == 1 for i in good), runs
    assert runs[bad] == 2
    error = await pool.fetchval("SELECT last_error FROM outbox_events_all WHERE id = $1", bad)
    assert error.startswith(cls.__qualname__), error
    assert "deep_frame_marker" in error, error  # the traceback is kept
    failures = [r.getMessage() for r in caplog.records if f"event {bad} " in r.getMessage()]
    assert len(failures) == 2 and all(cls.__name__ in m for m in failures), failures


async def test_the_tracing_span_records_an_unprintable_error_and_ends(pool: asyncpg.Pool) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from aiooutbox.tracing import TracingObserver

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def handle(event: aiooutbox.Event) -> None:
        raise_in_depth(LazyMessage("x"))

    await aiooutbox.enqueue(pool, "t", {}, max_attempts=1)
    consumer = aiooutbox.OutboxConsumer(
        pool, poll_interval=0.1, retry=FAST_RETRY, observers=[TracingObserver(provider)]
    )
    async with consumer, running(consumer, {"t": handle}):
        await wait_until(lambda: status_counts_are(pool, {"dead": 1}), timeout=20)
        await wait_until(truthy(lambda: exporter.get_finished_spans()), timeout=10)
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes is not None and span.attributes["aiooutbox.outcome"] == "dead"
    (recorded,) = span.events
    assert recorded.name == "exception" and recorded.attributes is not None
    assert str(recorded.attributes["exception.message"]).startswith("LazyMessage('x')")
    assert "deep_frame_marker" in str(recorded.attributes["exception.stacktrace"])


async def status_counts_are(
    pool: asyncpg.Pool | asyncpg.Connection, expected: dict[str, int]
) -> bool:
    return await status_counts(pool) == expected


# -- the runner ----------------------------------------------------------------------------

MODULE = "tests.cli_unprintable_handlers"


async def test_the_runner_reports_unprintable_errors_in_one_line(dsn: str) -> None:
    d = ["--dsn", dsn]
    at_import = await cli("run", f"{MODULE}:handlers", *d, env=clean_env(UNPRINTABLE_AT_IMPORT="1"))
    in_factory = await cli("run", f"{MODULE}:factory", *d)
    for result, rc, fragment in (
        (at_import, 2, "LazyMessage('at import')"),
        (in_factory, 1, "LazyMessage('in the factory')"),
    ):
        context = f"rc={result.rc}\nstderr={result.err}"
        assert result.rc == rc and len(result.err_lines) == 1, context
        assert "Traceback" not in result.err and fragment in result.err, context


async def test_the_runner_handles_them_and_a_fatal_one_exits_1(
    dsn: str, conn: asyncpg.Connection
) -> None:
    ids = await aiooutbox.enqueue_many(
        conn,
        [aiooutbox.NewEvent("lazy", {}, max_attempts=1)]
        + [aiooutbox.NewEvent("fine", {"n": i}) for i in range(5)],
    )
    async with Runner(f"{MODULE}:handlers", *["--dsn", dsn, "--poll-interval", "0.2"]) as runner:
        await wait_until(lambda: status_counts_are(conn, {"dead": 1, "done": 5}), timeout=30)
        runner.signal()
        assert await runner.wait() == 0, runner.stderr
    assert f"event {ids[0]} (lazy) attempt 1/1 failed: LazyMessage: " in runner.stderr
    assert "Logging error" not in runner.stderr, runner.stderr

    await aiooutbox.enqueue(conn, "fatal", {})
    async with Runner(f"{MODULE}:fatal_handlers", "--dsn", dsn) as runner:
        assert await runner.wait() == 1, runner.stderr
    assert "handler raised LazyExit(1); stopping the consumer" in runner.stderr, runner.stderr
    assert "consumer failed: LazyExit: LazyExit(1) <str() failed" in runner.stderr, runner.stderr
    assert "Logging error" not in runner.stderr, runner.stderr
    assert await status_counts(conn) == {"dead": 1, "done": 5, "retry": 1}


# -- relay sinks ---------------------------------------------------------------------------


class LazyOSError(OSError):
    """A client library's connection error that formats itself from a missing field."""

    def __str__(self) -> str:
        return f"lost {self.peer}"  # type: ignore[attr-defined]


class FlakySink(Sink):
    """A sink whose client raises errors that cannot describe themselves."""

    name = "flaky"

    def __init__(self, *, fail_open: bool = False) -> None:
        super().__init__(reconnect_wait=5)
        self.fail_open = fail_open
        self.sent: list[int] = []
        self.outages = 1

    async def _open(self) -> None:
        if self.fail_open:
            raise LazyMessage("no handshake")

    async def _close(self) -> None:
        return None

    async def _send(self, message: Message) -> None:
        if message.event.payload.get("bad"):
            raise LazyMessage("refused")
        if self.outages:
            self.outages -= 1
            raise LazyOSError("down")
        self.sent.append(message.event.id)


async def test_a_relay_sink_survives_unprintable_client_errors(
    pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(BrokerUnavailable) as refused:
        await FlakySink(fail_open=True).start()
    assert str(refused.value) == (
        "flaky at flaky: LazyMessage: LazyMessage('no handshake') <str() failed: AttributeError>"
    )

    bad = await aiooutbox.enqueue(pool, "t", {"bad": True}, max_attempts=1)
    good = await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", {"n": i}) for i in range(5)])
    caplog.set_level(logging.INFO, logger="aiooutbox")
    sink = FlakySink()
    async with sink:
        consumer = aiooutbox.OutboxConsumer(pool, concurrency=1, retry=FAST_RETRY)
        async with running(consumer, {"*": sink}) as task:

            async def settled() -> bool:
                if task.done():
                    task.result()
                return await status_counts(pool) == {"done": 5, "dead": 1}

            await wait_until(settled, timeout=30)
    assert sorted(sink.sent) == sorted(i for i in good if i is not None)
    error = await pool.fetchval("SELECT last_error FROM outbox_events_all WHERE id = $1", bad)
    assert error.startswith("LazyMessage: LazyMessage('refused')"), error
    messages = [r.getMessage() for r in caplog.records]
    assert any("flaky unavailable (LazyOSError: LazyOSError('down')" in m for m in messages), (
        messages
    )
