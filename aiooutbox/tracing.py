"""OpenTelemetry tracing: the producer's trace continues into the handler.

Needs only ``opentelemetry-api`` (the ``otel`` extra); the application brings and
configures the SDK. Nothing here is imported unless asked for, and ``opentelemetry`` is
imported only by code that needs it (once, cached), so without it nothing costs.

- Producer side: `enqueue`/`enqueue_many` (and `aiooutbox.sync`) call `inject` while
  validating headers: when a span is current, the global propagator's fields (W3C
  ``traceparent``/``tracestate``, plus baggage if configured) are added to the event's
  headers. Headers the caller set win: if it set ``traceparent`` or ``tracestate``
  itself, no trace field is added at all (that context is a custom creation context).
- Consumer side: `TracingObserver` runs each handler inside a span of kind CONSUMER,
  named ``process <topic>`` per the OpenTelemetry messaging conventions (v1.26+:
  ``{operation name} {destination}``). Its parent is the event's creation context (the
  ``traceparent`` header), so the handler continues the request's trace, and it also
  links to it, as the conventions ask of "process" spans. An event without the header
  starts a new trace under whatever span is current. A batch handler's call is one span
  (``process <topic>``, ``messaging.batch.message_count``) under the current span, with
  a link to each event's creation context.
"""

from __future__ import annotations

import importlib.metadata
import re
import traceback
from collections.abc import Mapping
from typing import Any

from ._values.extras import install_hint
from ._values.text import exception_message
from .events import Event
from .observe import Observer

__all__ = ["TracingObserver", "inject"]

_TRACE_FIELDS = ("traceparent", "tracestate")
_W3C_FIELDS = frozenset(("traceparent", "tracestate", "baggage"))
# a version-00 traceparent exactly as the W3C propagator accepts it (lower-case hex)
_TRACEPARENT = re.compile(r"[ \t]*00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})[ \t]*").fullmatch
# the longest header value given to the propagator: the W3C ones refuse longer ones
# (traceparent 512, tracestate and baggage 8192 bytes), and some log what they refuse
_MAX_FIELD = 8192
_api: Any = None  # the imported opentelemetry modules, or False when not importable


def _otel() -> Any:
    """The ``opentelemetry`` API modules, imported once; ``False`` if not installed."""
    global _api
    if _api is None:
        try:
            from opentelemetry import context, propagate, trace
        except ImportError:
            _api = False
        else:
            _api = (context, propagate, trace)
    return _api


def inject(headers: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``headers`` plus the current trace context, or ``headers`` itself when no span is
    current, OpenTelemetry is missing, or the caller set a trace field."""
    api = _otel()
    if not api:
        return headers
    _, propagate, trace = api
    if not trace.get_current_span().get_span_context().is_valid:
        return headers
    if headers and any(name in headers for name in _TRACE_FIELDS):
        return headers
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return headers
    if headers:
        carrier.update(headers)  # the caller's values win
    return carrier


def current_ids() -> tuple[str, str] | None:
    """The current span's (trace_id, span_id) in hex, for log lines; None if none."""
    api = _otel()
    if not api:
        return None
    ctx = api[2].get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


class TracingObserver(Observer):
    """A CONSUMER span per handler run; pass it in ``OutboxConsumer(observers=[...])``.

    Attributes: ``messaging.system`` = ``aiooutbox``, ``messaging.destination.name`` =
    the topic, ``messaging.operation.type``/``.name`` = ``process``,
    ``messaging.message.id``, ``aiooutbox.event.id``, ``aiooutbox.attempt`` and, at the
    end, ``aiooutbox.outcome`` (done, retry, dead, released). A failed run records the
    exception, sets ``error.type`` and the span status to ERROR; a release (the
    consumer stopped first) does neither.
    ``tracer_provider=None`` uses the global provider, looked up once per claim while
    none is configured, so an SDK configured after the consumer was built is used from
    the next claim on. While there is none (the API's proxy or no-op provider) the
    consumer does not call this observer per event at all: handlers run without a span,
    at no cost, and the incoming context is not passed through.
    """

    def __init__(self, tracer_provider: Any = None) -> None:
        api = _otel()
        if not api:
            raise ImportError(f"TracingObserver needs opentelemetry-api: {install_hint('otel')}")
        if tracer_provider is not None and not callable(
            getattr(tracer_provider, "get_tracer", None)
        ):
            raise TypeError(
                "tracer_provider must be an OpenTelemetry TracerProvider or None,"
                f" not {type(tracer_provider).__name__}"
            )
        self._context, self._propagate, self._trace = api
        self._provider = tracer_provider
        self._tracer: Any = None
        self._kind = api[2].SpanKind.CONSUMER
        self._names: dict[str, str] = {}
        self._textmap: Any = None
        self._w3c = False  # the global propagator reads only W3C fields
        self.wants_events()

    def wants_events(self) -> bool:
        """True once a real tracer provider is in force (asked once per claim).

        A real provider never changes once set (the API allows setting it once), so its
        tracer is kept. The global propagator is checked here too, not per event.
        """
        propagate, trace = self._propagate, self._trace
        if self._tracer is None:
            provider = self._provider or trace.get_tracer_provider()
            if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
                return False
            self._tracer = provider.get_tracer("aiooutbox", _installed_version())
        textmap = propagate.get_global_textmap()
        if textmap is not self._textmap:
            self._textmap = textmap
            try:
                self._w3c = set(textmap.fields) <= _W3C_FIELDS
            except Exception:  # a propagator without fields: always ask it
                self._w3c = False
        return True

    def _creation(self, headers: Mapping[str, Any]) -> Any:
        """The creation context's SpanContext stored in ``headers``, or None.

        A lone ``traceparent`` under the W3C propagators (the default) is parsed here:
        ``propagate.extract`` costs ~4 us per event, a third of a no-op event's CPU.
        Anything else (``tracestate``, baggage, another propagator) goes through the
        global propagator, as the producer's side did.
        """
        trace = self._trace
        value = headers.get("traceparent")
        match = (
            _TRACEPARENT(value)
            if self._w3c
            and isinstance(value, str)
            and "tracestate" not in headers
            and "baggage" not in headers
            else None
        )
        if match is not None:
            trace_id, span_id, flags = match.groups()
            creation = trace.SpanContext(
                int(trace_id, 16),
                int(span_id, 16),
                is_remote=True,
                trace_flags=trace.TraceFlags(int(flags, 16)),
            )
        else:  # garbled or another version too: the propagator has the last word
            # only strings the propagator could accept: a raw SQL producer may store
            # anything, and a 10 MB baggage header would be logged whole, per event
            carrier = {
                k: v for k, v in headers.items() if isinstance(v, str) and len(v) <= _MAX_FIELD
            }
            parent = self._propagate.extract(carrier)
            creation = trace.get_current_span(parent).get_span_context()
        return creation if creation.is_valid else None

    def handler_started(self, event: Event) -> Any:
        tracer = self._tracer
        if tracer is None:
            # no SDK (the consumer does not call us then, but a caller might)
            return None
        context, trace = self._context, self._trace
        headers = event.headers
        parent = links = None
        if headers and "traceparent" in headers:
            creation = self._creation(headers)
            if creation is not None:
                # an empty context, as the propagator's extract returns
                remote = trace.NonRecordingSpan(creation)
                parent = trace.set_span_in_context(remote, context.Context())
                links = [trace.Link(creation)]
        topic = event.topic
        name = self._names.get(topic)
        if name is None:
            name = f"process {topic}"
            if len(self._names) < 1000:  # a catch-all handler may see any topic
                self._names[topic] = name
        attributes: dict[str, Any] = {
            "messaging.system": "aiooutbox",
            "messaging.destination.name": topic,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "aiooutbox.event.id": event.id,
            "aiooutbox.attempt": event.attempts,
        }
        if event.message_id is not None:
            attributes["messaging.message.id"] = str(event.message_id)
        # start_span and an explicit end, not start_as_current_span: its context
        # manager machinery costs more, and the end comes from another hook anyway
        span = tracer.start_span(
            name, context=parent, kind=self._kind, attributes=attributes, links=links
        )
        return span, context.attach(trace.set_span_in_context(span))

    def handler_finished(
        self, event: Event, token: Any, outcome: str, seconds: float, error: BaseException | None
    ) -> None:
        if token is None:
            return
        span, attached = token
        try:
            self._context.detach(attached)
        finally:
            try:
                span.set_attribute("aiooutbox.outcome", outcome)
                if error is not None and outcome != "released":
                    _record_exception(span, error)
                    span.set_attribute("error.type", type(error).__qualname__)
                    status = self._trace.Status(self._trace.StatusCode.ERROR, type(error).__name__)
                    span.set_status(status)
            finally:
                span.end()

    def batch_started(self, events: list[Event]) -> Any:
        """One span for a batch handler's call: under the current span (a batch has no
        one parent), linked to each event's creation context (the conventions' batch
        "process" span); the handler runs inside it."""
        tracer = self._tracer
        if tracer is None or not events:
            return None
        context, trace = self._context, self._trace
        links = []
        for event in events:
            headers = event.headers
            if headers and "traceparent" in headers:
                creation = self._creation(headers)
                if creation is not None:
                    link = {
                        "messaging.message.id": str(event.message_id),
                        "aiooutbox.event.id": event.id,
                    }
                    links.append(trace.Link(creation, link))
        topic = events[0].topic
        attributes: dict[str, Any] = {
            "messaging.system": "aiooutbox",
            "messaging.destination.name": topic,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.batch.message_count": len(events),
        }
        span = tracer.start_span(
            f"process {topic}", kind=self._kind, attributes=attributes, links=links
        )
        return span, context.attach(trace.set_span_in_context(span))

    def batch_finished(
        self,
        events: list[Event],
        token: Any,
        outcomes: Mapping[str, int],
        seconds: float,
        error: BaseException | None,
    ) -> None:
        if token is None:
            return
        span, attached = token
        try:
            self._context.detach(attached)
        finally:
            try:
                kinds = [k for k, n in outcomes.items() if n]
                span.set_attribute("aiooutbox.outcome", kinds[0] if len(kinds) == 1 else "mixed")
                for kind in kinds:
                    span.set_attribute(f"aiooutbox.outcomes.{kind}", outcomes[kind])
                if error is not None and kinds != ["released"]:
                    _record_exception(span, error)
                    span.set_attribute("error.type", type(error).__qualname__)
                    status = self._trace.Status(self._trace.StatusCode.ERROR, type(error).__name__)
                    span.set_status(status)
            finally:
                span.end()


def _record_exception(span: Any, error: BaseException) -> None:
    """``span.record_exception(error)``, also for an exception whose ``__str__`` raises
    (the SDK calls ``str()`` on it): then the event is added with the message that
    `exception_message` gives (the class name and ``repr``)."""
    try:
        span.record_exception(error)
    except Exception:
        cls = type(error)
        module, name = cls.__module__, cls.__qualname__
        if module and module != "builtins":
            name = f"{module}.{name}"
        try:
            stacktrace = "".join(traceback.format_exception(error))
        except Exception:
            stacktrace = "".join(traceback.format_tb(error.__traceback__))
        attributes = {
            "exception.type": name,
            "exception.message": exception_message(error),
            "exception.stacktrace": stacktrace,
            "exception.escaped": "False",
        }
        span.add_event("exception", attributes)


def _installed_version() -> str | None:
    """This distribution's version, for the tracer's instrumentation scope (None when
    the package runs from a checkout that was never installed)."""
    try:
        return importlib.metadata.version("aiooutbox")
    except importlib.metadata.PackageNotFoundError:
        return None
