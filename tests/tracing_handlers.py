"""Handlers for the runner's tracing test: the module configures the OpenTelemetry SDK,
as an application would, and logs from inside the handler's span."""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

import aiooutbox

trace.set_tracer_provider(TracerProvider())
logger = logging.getLogger("tests.tracing_handlers")


async def traced(event: aiooutbox.Event) -> None:
    logger.warning("handled traced event")


handlers = {"traced": traced}
