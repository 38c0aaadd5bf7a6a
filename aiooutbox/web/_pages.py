"""The read-only pages (GET) and the live-update stream."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from . import _data
from ._filters import PAGE, parse_filter
from ._render import dashboard_of, render

__all__ = ["routes"]

HOURS = [f"{h}h ago" if h else "this hour" for h in range(23, -1, -1)]


async def overview(request: Request) -> Response:
    d = dashboard_of(request)

    async def load() -> Any:
        async with d.connection() as conn:
            return await _data.overview(conn, d.w)

    data, pulse = await d.cache.get(("overview",), load)
    return await render(request, "overview.html", pulse=pulse, o=data, hours=HOURS)


async def events(request: Request) -> Response:
    d = dashboard_of(request)
    f = parse_filter(request.query_params)
    if f.errors:
        return await render(request, "events.html", status_code=400, f=f, page=None)

    async def load() -> Any:
        async with d.connection() as conn:
            return await _data.event_page(conn, d.w, f)

    page, pulse = await d.cache.get(("events", f.query()), load)
    return await render(request, "events.html", pulse=pulse, f=f, page=page, size=PAGE)


async def event(request: Request) -> Response:
    d = dashboard_of(request)
    raw = request.path_params["event_id"]
    if not raw.isdigit() or len(raw) > 19:
        return await render(request, "missing.html", status_code=404, what="event")
    async with d.connection() as conn:
        detail = await _data.load_event(conn, d.w, int(raw))
    if detail is None:
        return await render(request, "missing.html", status_code=404, what=f"event {raw}")
    return await render(request, "event.html", e=detail)


async def dead(request: Request) -> Response:
    d = dashboard_of(request)
    f = parse_filter(request.query_params, status="dead")
    if f.errors:
        return await render(request, "dead.html", status_code=400, f=f, page=None)

    async def load() -> Any:
        async with d.connection() as conn:
            return await _data.event_page(conn, d.w, f)

    page, pulse = await d.cache.get(("dead", f.query()), load)
    return await render(request, "dead.html", pulse=pulse, f=f, page=page, size=PAGE)


async def keys(request: Request) -> Response:
    d = dashboard_of(request)

    async def load() -> Any:
        async with d.connection() as conn:
            return await _data.blocked_keys(conn, d.w)

    heads, pulse = await d.cache.get(("keys",), load)
    return await render(request, "keys.html", pulse=pulse, heads=heads)


async def consumers(request: Request) -> Response:
    d = dashboard_of(request)

    async def load() -> Any:
        async with d.connection() as conn:
            return await _data.consumers(conn, d.w)

    data, pulse = await d.cache.get(("consumers",), load)
    return await render(request, "consumers.html", pulse=pulse, o=data)


async def audit(request: Request) -> Response:
    d = dashboard_of(request)
    raw = request.query_params.get("before", "")
    before = int(raw) if raw.isdigit() and len(raw) < 19 else None
    async with d.connection() as conn:
        entries = await _data.audit_entries(conn, d.w, before)
    return await render(request, "audit.html", entries=entries)


async def live(request: Request) -> Response:
    d = dashboard_of(request)
    return StreamingResponse(
        d.hub.subscribe(),
        media_type="text/event-stream",
        headers={"X-Accel-Buffering": "no"},
    )


async def health(request: Request) -> Response:
    return PlainTextResponse("ok\n")


def routes() -> list[Route]:
    return [
        Route("/", overview, name="overview"),
        Route("/events", events, name="events"),
        Route("/events/{event_id}", event, name="event"),
        Route("/dead", dead, name="dead"),
        Route("/keys", keys, name="keys"),
        Route("/consumers", consumers, name="consumers"),
        Route("/audit", audit, name="audit"),
        Route("/live", live, name="live"),
        Route("/healthz", health, name="healthz"),
    ]
