"""Handlers for the standalone runner: publish order events onward to an HTTP webhook.

    export AIOOUTBOX_DSN=postgresql://postgres@127.0.0.1:5432/test
    export WEBHOOK_URL=https://hooks.example.com/orders
    python -m aiooutbox run examples.worker:handlers

Each event is POSTed as JSON with an ``Idempotency-Key`` header (the receiver can see it
twice: delivery is at-least-once). A 2xx answer settles the event ``done``; a network
error, a timeout, 408, 425, 429 or 5xx retries it later through `aiooutbox.Retry`
(honouring ``Retry-After``), up to the event's ``max_attempts``; any other status sends it
to ``dead`` at once, since sending it again would not help. Needs ``aiohttp``.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import aiooutbox

logger = logging.getLogger("examples.worker")

RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
BACKOFF = aiooutbox.RetryPolicy(base=2.0, max_delay=600.0)
MAX_RETRY_AFTER = 3600.0


async def publish(event: aiooutbox.Event, url: str | None = None) -> None:
    """POST ``event`` to ``url`` (default: the ``WEBHOOK_URL`` environment variable)."""
    import aiohttp  # lazily: only workers that publish need it

    url = url or os.environ.get("WEBHOOK_URL")
    if not url:
        raise aiooutbox.Retry(60, "WEBHOOK_URL is not set")
    body: dict[str, Any] = {
        "id": event.id,
        "topic": event.topic,
        "payload": event.payload,
        "created_at": event.created_at.isoformat() if event.created_at else None,
    }
    headers = {"Idempotency-Key": event.dedupe_key or f"aiooutbox-{event.id}"}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
            session.post(url, json=body, headers=headers) as response,
        ):
            status = response.status
            retry_after = response.headers.get("Retry-After")
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise aiooutbox.Retry(
            BACKOFF.delay(event.attempts), f"webhook unreachable: {type(exc).__name__}: {exc}"
        ) from exc
    if 200 <= status < 300:
        logger.info("event %d published to the webhook", event.id)
        return
    if status in RETRYABLE_STATUS:
        raise aiooutbox.Retry(
            _retry_after(retry_after) or BACKOFF.delay(event.attempts),
            f"webhook answered HTTP {status}",
        )
    raise aiooutbox.Dead(f"webhook refused the event with HTTP {status}")


def _retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (the delay-seconds form only)."""
    try:
        seconds = float(value) if value else math.nan
    except ValueError:
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER) if math.isfinite(seconds) else None


handlers = aiooutbox.Router()
handlers.add("orders.created", publish, timeout=15)
handlers.add("orders.cancelled", publish, timeout=15)
