"""``python -m aiooutbox run``: load the handlers, connect, consume until signalled."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import importlib
import inspect
import logging
import os
import signal
import socket
import sys
import traceback
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

import asyncpg

from .. import admin
from .._engine.options import ConsumerOptions
from .._observability.databases_health import DatabasesHealth
from .._values.text import describe_exception, exception_message
from ..consumer import OutboxConsumer
from ..errors import OutboxError
from ..handlers import Handler, resolve_handlers
from ..health import ConsumerHealth, HealthStatus
from ..observe import Observer
from . import output
from .args import redact
from .connect import apply_migrations, open_pool, resolve_dsn
from .consumer_flags import build_options
from .errors import CommandError, UsageError
from .options import check_listen_options, check_metrics_options

__all__ = ["Stoppable", "Telemetry", "cmd_run", "load_handlers", "telemetry"]

logger = logging.getLogger("aiooutbox.cli")


#: this package's files: a check of ours that refused the user's value is not where the
#: user's mistake is (a bad ``aiooutbox.Handler(...)`` in their module)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _where(exc: BaseException) -> str:
    """Where it went wrong: the offending line of a syntax error, else the last frame
    outside the import machinery and, if there is one, outside this package."""
    if isinstance(exc, SyntaxError) and exc.filename:
        text = (exc.text or "").strip()
        return f" at {exc.filename}:{exc.lineno}" + (f": {text}" if text else "")
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")
    ]
    # nor generated code (a dataclass's ``__init__`` is "<string>")
    theirs = [f for f in frames if not f.filename.startswith((_PACKAGE, "<"))]
    frames = theirs or frames
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _import_failed(module_name: str, exc: BaseException, detail: str) -> UsageError:
    logger.debug("importing %r failed", module_name, exc_info=exc)  # --log-level debug
    return UsageError(f"importing {module_name!r} failed: {detail}{_where(exc)}")


def _file_spec(module_name: str) -> str | None:
    """``myjobs/handlers.py`` as the module name it means, ``myjobs.handlers``."""
    if not (module_name.endswith(".py") or "/" in module_name or "\\" in module_name):
        return None
    path = module_name.removesuffix(".py").replace("\\", "/").strip("/")
    return ".".join(part for part in path.split("/") if part and part != ".")


async def load_handlers(spec: str) -> dict[str, Handler]:
    """Import ``module.path:attribute`` and validate it as handlers; raise `UsageError`."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"expected MODULE:HANDLERS such as myapp.jobs:handlers, got {spec!r}")
    dotted = _file_spec(module_name)
    if dotted is not None:
        raise UsageError(
            f"{module_name!r} is a file path; name the module instead: {dotted}:{attribute}"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # the console script does not add it, python -m does
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise UsageError(
                f"cannot import {module_name!r}: no module named {missing!r} "
                "(run from the directory that holds it, or set PYTHONPATH)"
            ) from None
        raise _import_failed(module_name, exc, exception_message(exc)) from None
    except SyntaxError as exc:
        raise _import_failed(module_name, exc, f"{type(exc).__name__}: {exc.msg}") from None
    except Exception as exc:
        raise _import_failed(module_name, exc, describe_exception(exc)) from None
    for name in attribute.split("."):
        try:
            target = getattr(target, name)
        except AttributeError:
            raise UsageError(f"module {module_name!r} has no attribute {attribute!r}") from None
    if not isinstance(target, Mapping) and callable(target):
        try:
            target = target()
            if inspect.isawaitable(target):
                target = await target
        except Exception as exc:
            logger.debug("calling %s() failed", spec, exc_info=exc)
            raise CommandError(
                f"calling {spec}() failed: {describe_exception(exc)}{_where(exc)}"
            ) from None
    if not isinstance(target, Mapping):
        raise UsageError(
            f"{spec} is of type {type(target).__name__}; expected a mapping of topic to async "
            "handler, an aiooutbox.Router, or a zero-argument function returning one"
        )
    try:
        return resolve_handlers(target)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{spec}: {exception_message(exc)}") from None


class Stoppable(Protocol):
    """What a signal stops: a consumer, or several (`relay` over many databases)."""

    def stop(self) -> None: ...


class _Signals:
    """SIGTERM/SIGINT: the first stops gracefully, the second fast, the third exits now.

    Before the consumer exists, a signal cancels start-up instead.
    """

    def __init__(self) -> None:
        self.received = 0
        self.consumer: Stoppable | None = None
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()

    def __enter__(self) -> _Signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._loop.add_signal_handler(sig, self._received, sig)
            except (NotImplementedError, RuntimeError):  # Windows
                signal.signal(sig, lambda s, _f: self._loop.call_soon_threadsafe(self._received, s))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                self._loop.remove_signal_handler(sig)

    def _received(self, sig: int) -> None:
        self.received += 1
        name = signal.Signals(sig).name
        if self.consumer is None:
            logger.info("%s received during start-up: stopping", name)
            if self._task is not None:
                self._task.cancel()
        elif self.received == 1:
            logger.info(
                "%s received: finishing running handlers, then exiting (again to stop now)", name
            )
            self.consumer.stop()
        elif self.received == 2:
            logger.warning("%s received again: cancelling running handlers, releasing events", name)
            self.consumer.stop()
        else:
            logger.error("%s received a third time: exiting now; leases will expire", name)
            os._exit(130)


# the command-line flag of each setting `ConsumerOptions.build` and `RetryPolicy` check
async def cmd_run(args: argparse.Namespace) -> int:
    handlers = await load_handlers(args.handlers)
    if args.topics:
        unknown = sorted(set(args.topics) - handlers.keys())
        if unknown:
            raise UsageError(
                f"--topics {','.join(unknown)}: no handler in {args.handlers} "
                f"(it handles {', '.join(sorted(handlers))})"
            )
    options = build_options(args)
    args.retry = options.retry
    check_listen_options(args)
    check_metrics_options(args)
    with _Signals() as signals:
        try:
            return await _serve(args, options, handlers, signals)
        except asyncio.CancelledError:
            if not signals.received:
                raise
            return 0


class Telemetry:
    """What a long-running command observes itself with: the observers to give its
    consumer, and (with ``--metrics-port``) the metrics behind ``/metrics``."""

    def __init__(self, metrics: Any = None) -> None:
        self.metrics = metrics  # aiooutbox.metrics.OutboxMetrics, or None
        self.health = ConsumerHealth()
        self.observers: list[Observer] = [self.health]
        if metrics is not None:
            self.observers.append(metrics)
        self._tracing: list[Observer] = []
        from ..tracing import TracingObserver

        try:
            # spans go wherever the SDK the handlers module configured sends them; with
            # the API alone (or no SDK configured) handlers run without one, at no cost
            self._tracing.append(TracingObserver())
        except ImportError:
            logger.debug("opentelemetry-api is not installed: handlers are not traced")
        self.observers += self._tracing
        self.databases: DatabasesHealth | None = None  # once several are served

    def for_database(self, name: str) -> list[Observer]:
        """The observers for the consumer of the database called ``name``, when one
        process serves several: its own health, metrics labelled ``database=name``."""
        if self.databases is None:
            self.databases = DatabasesHealth()
        observers: list[Observer] = [self.databases.add(name)]
        if self.metrics is not None:
            observers.append(self.metrics.database(name))
        return observers + self._tracing

    async def check(self) -> HealthStatus:
        """``/healthz``: the consumer's health, or that of every database served."""
        if self.databases is not None:
            return await self.databases.check()
        return await self.health.check()

    @contextlib.asynccontextmanager
    async def queue_gauges(
        self, pool: asyncpg.Pool, args: argparse.Namespace, database: str | None = None
    ) -> AsyncIterator[None]:
        """Refresh the table-level gauges while the block runs (with metrics only);
        ``database``: their label, when one process serves several."""
        if self.metrics is None or self.metrics.tracks_queue(database):
            yield  # none, or the handlers module's own OutboxMetrics refreshes them
            return
        async with self.metrics.queue_gauges(
            pool, schema=args.schema, table=args.table, database=database
        ):
            yield


@contextlib.asynccontextmanager
async def telemetry(args: argparse.Namespace) -> AsyncIterator[Telemetry]:
    """Serve ``/metrics`` and ``/healthz`` on ``--metrics-port`` while the block runs.

    Binds before anything connects, so a port in use fails the command at once
    (`CommandError`, exit 1); an unknown host is a `UsageError` (exit 2). Without
    ``--metrics-port`` it serves nothing and imports no prometheus_client.
    """
    if args.metrics_port is None:
        yield Telemetry()
        return
    from ..metrics import MetricsServer, OutboxMetrics

    # the global registry: process_* and python_* come along. A handlers module that made
    # its own OutboxMetrics there (docs/observability.md) has its instance reused.
    metrics = OutboxMetrics.registered()
    ours = metrics is None
    if metrics is None:
        try:
            metrics = OutboxMetrics()
        except ValueError as exc:
            raise UsageError(
                f"--metrics-port: prometheus_client's global registry already holds metrics"
                f" named like aiooutbox's, not registered by an OutboxMetrics"
                f" ({exception_message(exc)}); register yours on a registry of your own"
            ) from None
    found = Telemetry(metrics)
    host = args.metrics_host or "127.0.0.1"
    where = f"--metrics-port {args.metrics_port}"
    server = MetricsServer(metrics.registry, found, host=host, port=args.metrics_port)
    try:
        try:
            await server.__aenter__()
        except BaseException:
            if ours:
                metrics.unregister()
            raise
    except socket.gaierror as exc:
        raise UsageError(f"--metrics-host {host}: unknown host ({exc.strerror})") from None
    except OSError as exc:
        reason = (
            "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
        )
        raise CommandError(
            f"{where}: cannot listen on {host}:{args.metrics_port}: {reason}"
        ) from None
    try:
        yield found
    finally:
        await server.__aexit__(None, None, None)
        if ours:
            metrics.unregister()


async def _serve(
    args: argparse.Namespace,
    options: ConsumerOptions,
    handlers: dict[str, Handler],
    signals: _Signals,
) -> int:
    async with telemetry(args) as observed:
        return await _consume(args, options, handlers, signals, observed)


async def _consume(
    args: argparse.Namespace,
    options: ConsumerOptions,
    handlers: dict[str, Handler],
    signals: _Signals,
    observed: Telemetry,
) -> int:
    dsn = await resolve_dsn(args, log=True)
    async with (
        open_pool(dsn, pgbouncer=args.pgbouncer) as pool,
        contextlib.AsyncExitStack() as stack,
    ):
        if args.migrate:
            applied = await apply_migrations(pool, args)
            logger.info("schema %s", f"migrated to {applied}" if applied else "up to date")
        await stack.enter_async_context(observed.queue_gauges(pool, args))
        topics = sorted(args.topics or handlers)
        consumer = OutboxConsumer.from_options(pool, options, observers=observed.observers)
        async with consumer:
            signals.consumer = consumer
            logger.info(
                "consuming %s from %s with concurrency %d (%s)",
                ", ".join(topics),
                redact(dsn),
                args.concurrency,
                _settings(args),
            )
            await _warn_unconsumed(pool, args, topics)
            try:
                await consumer.run(handlers)
            except (Exception, SystemExit, KeyboardInterrupt) as exc:
                # our own errors say what to fix in one line; the traceback is for debugging
                logger.error(
                    "consumer failed: %s",
                    describe_exception(exc),
                    exc_info=None if isinstance(exc, OutboxError) else exc,
                )
                logger.debug("consumer failed", exc_info=exc)
                return 1
    s = consumer.stats
    logger.info(
        "stopped: %d done, %d retried, %d dead, %d released", s.done, s.retried, s.dead, s.released
    )
    return 0


def _settings(args: argparse.Namespace) -> str:
    """The options a reader of the start-up line may need to know were in force."""
    wake = (
        f"LISTEN on {redact(args.listen_dsn)}"
        if args.listen_dsn
        else "LISTEN"
        if args.listen
        else "no LISTEN"
    )
    parts = [
        f"{wake}, poll every {output.duration(args.poll_interval)}",
        f"handler timeout {output.duration(args.handler_timeout)}"
        if args.handler_timeout is not None
        else "no handler timeout",
        f"retry {output.duration(args.retry.base)} x{args.retry.factor:g} up to "
        f"{output.duration(args.retry.max_delay)}, jitter {args.retry.jitter:g}",
        f"retention {output.duration(args.retention)}"
        if args.retention is not None
        else "done events kept forever",
    ]
    if args.pgbouncer:
        parts.append("PgBouncer: no statement cache")
    return "; ".join(parts)


async def _warn_unconsumed(pool: Any, args: argparse.Namespace, topics: list[str]) -> None:
    """Say so when events wait in topics that neither this runner nor any other consumer
    in sight handles: they would otherwise sit there silently."""
    try:
        found = await asyncio.wait_for(
            admin.unconsumed_topics(
                pool, handled=topics, waited=0, schema=args.schema, table=args.table
            ),
            10,
        )
    except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        logger.debug("could not look for unconsumed topics: %s", describe_exception(exc))
        return
    if found:
        # stored text: a raw SQL producer's topic may hold newlines or terminal escapes
        listed = ", ".join(
            f"{output.safe(u.topic)} ({u.waiting} waiting, oldest {output.age(u.lag)})"
            for u in found
        )
        logger.warning(
            "events wait in topic(s) this runner has no handler for, and no other consumer "
            "is seen handling: %s; they stay pending until a consumer handles them",
            listed,
            extra={"unconsumed": [u.topic for u in found]},
        )
