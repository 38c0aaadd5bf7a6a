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
  starts a new trace under whatever span is current.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from .events import Event
from .observe import Observer

__all__ = ["TracingObserver", "inject"]

_TRACE_FIELDS = ("traceparent", "tracestate")
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
    ``tracer_provider=None`` uses the global provider, read at each span so an SDK
    configured after the consumer was built is still used (within a second); while none
    is configured (the API's proxy or no-op provider) handlers run without a span, at
    no cost, and the incoming context is not passed through.
    """

    def __init__(self, tracer_provider: Any = None) -> None:
        api = _otel()
        if not api:
            raise ImportError(
                'TracingObserver needs opentelemetry-api: pip install "aiooutbox[otel]"'
            )
        self._provider = tracer_provider
        self._tracer: Any = None
        self._recheck_at = -math.inf
        self._kind = api[2].SpanKind.CONSUMER

    def _get_tracer(self) -> Any:
        """The tracer of the provider in force, or None while no SDK is configured.

        A real provider never changes once set (the API allows setting it once), so its
        tracer is kept; while there is none, the global provider is looked up again at
        most once a second (the lookup alone costs ~3 us, per event that adds up).
        """
        tracer = self._tracer
        if tracer is not None:
            return tracer
        now = time.monotonic()
        if now < self._recheck_at:
            return None
        self._recheck_at = now + 1.0
        trace = _otel()[2]
        provider = self._provider or trace.get_tracer_provider()
        if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
            return None
        from ._version import __version__

        self._tracer = provider.get_tracer("aiooutbox", __version__)
        return self._tracer

    def handler_started(self, event: Event) -> Any:
        tracer = self._get_tracer()
        if tracer is None:
            # the API alone: every span would be a no-op, so skip the work (measured:
            # extracting the context and starting a non-recording span cost ~15 us per
            # event, a third of a no-op drain's per-event CPU)
            return None
        context, propagate, trace = _otel()
        headers = event.headers
        parent = None
        links = None
        if headers and "traceparent" in headers:
            carrier = {k: v for k, v in headers.items() if isinstance(v, str)}
            parent = propagate.extract(carrier)
            creation = trace.get_current_span(parent).get_span_context()
            if creation.is_valid:
                links = [trace.Link(creation)]
            else:
                parent = None
        attributes: dict[str, Any] = {
            "messaging.system": "aiooutbox",
            "messaging.destination.name": event.topic,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "aiooutbox.event.id": event.id,
            "aiooutbox.attempt": event.attempts,
        }
        if event.message_id is not None:
            attributes["messaging.message.id"] = str(event.message_id)
        span = tracer.start_span(
            f"process {event.topic}",
            context=parent,
            kind=self._kind,
            attributes=attributes,
            links=links,
        )
        token = context.attach(trace.set_span_in_context(span))
        return span, token

    def handler_finished(
        self, event: Event, token: Any, outcome: str, seconds: float, error: BaseException | None
    ) -> None:
        if token is None:
            return
        context, _, trace = _otel()
        span, attached = token
        try:
            context.detach(attached)
        finally:
            span.set_attribute("aiooutbox.outcome", outcome)
            if error is not None and outcome != "released":
                span.record_exception(error)
                span.set_attribute("error.type", type(error).__qualname__)
                span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}"))
            span.end()
