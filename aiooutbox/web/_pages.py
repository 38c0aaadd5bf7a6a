"""The read-only pages (GET) and the live-update stream."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Match, Route

from . import _data, _events, _topic
from ._backlog import Backlog, read_backlog
from ._filters import PAGE, parse_filter
from ._input import BadInput, stored_text, whole_number
from ._render import dashboard_of, render

__all__ = ["answer_from", "backlog", "routes"]

HOURS = [f"{h}h ago" if h else "this hour" for h in range(23, -1, -1)]
HOUR_TICKS = [(0, "24h ago"), (6, "18h"), (12, "12h"), (18, "6h"), (23, "this hour")]


async def backlog(request: Request) -> tuple[Backlog, str]:
    """The exact backlog, shared by every page and browser, and the pulse it is current
    to: read again only once the pulse moved, and at most every 25 times what reading
    it took; never waited for once read (a page shows the last count while the next is
    made)."""
    d = dashboard_of(request)

    async def load() -> Any:
        async with d.connection() as conn:
            return await read_backlog(conn, d.w)

    counted, pulse = await d.counts.get(("backlog",), load, stale=True)
    result: Backlog = counted
    return result, pulse


def current_to(view: str, counted: str) -> str:
    """The pulse a page says it is current to: its view's, unless the backlog it shows
    was read at another pulse (then a value that matches none, so the page asks again
    an interval later, once both are read again)."""
    return view if view == counted else f"{view}|{counted}"


async def overview(request: Request) -> Response:
    d = dashboard_of(request)

    async def load() -> Any:
        async with d.connection() as conn:
            return await _data.overview(conn, d.w, d.past_hours)

    data, pulse = await d.cache.get(("overview",), load)
    counted, counted_at = await backlog(request)
    return await render(
        request,
        "overview.html",
        pulse=current_to(pulse, counted_at),
        o=_data.with_backlog(data, counted),
        hours=HOURS,
        hour_ticks=HOUR_TICKS,
    )


async def topic(request: Request) -> Response:
    d = dashboard_of(request)
    name = request.path_params["name"] or request.query_params.get("name", "")
    try:
        name = stored_text(name, "a topic")
    except BadInput:
        name = ""
    if not name or len(name) > 255:
        return await render(request, "missing.html", status_code=404, what="topic")

    async def load() -> Any:
        async with d.connection() as conn:
            return await _topic.load_topic(conn, d.w, name)

    page, pulse = await d.cache.get(("topic", name), load)
    counted, counted_at = await backlog(request)
    page = page.with_backlog(counted)
    if not page.known:
        return await render(request, "missing.html", status_code=404, what="topic", topic=name)
    return await render(
        request, "topic.html", pulse=current_to(pulse, counted_at), p=page, t=page.row
    )


async def events(request: Request) -> Response:
    d = dashboard_of(request)
    f = parse_filter(request.query_params, raw=request.scope.get("query_string", b""))
    if f.errors:
        return await render(request, "events.html", status_code=400, f=f, page=None)

    async def load() -> Any:
        async with d.connection() as conn:
            return await _events.event_page(conn, d.w, f)

    page, pulse = await d.cache.get(("events", f.query()), load)
    return await render(request, "events.html", pulse=pulse, f=f, page=page, size=PAGE)


async def event(request: Request) -> Response:
    d = dashboard_of(request)
    raw = request.path_params["event_id"]
    try:
        event_id = whole_number(raw, "an event id")
    except BadInput:
        return await render(request, "missing.html", status_code=404, what="event")
    async with d.connection() as conn:
        detail = await _events.load_event(conn, d.w, event_id)
    if detail is None:
        return await render(request, "missing.html", status_code=404, what=f"event {raw}")
    return await render(request, "event.html", e=detail)


async def dead(request: Request) -> Response:
    d = dashboard_of(request)
    f = parse_filter(
        request.query_params, status="dead", raw=request.scope.get("query_string", b"")
    )
    if f.errors:
        return await render(request, "dead.html", status_code=400, f=f, page=None)

    async def load() -> Any:
        async with d.connection() as conn:
            return await _events.event_page(conn, d.w, f)

    page, pulse = await d.cache.get(("dead", f.query()), load)
    return await render(request, "dead.html", pulse=pulse, f=f, page=page, size=PAGE)


async def keys(request: Request) -> Response:
    d = dashboard_of(request)

    async def load() -> Any:
        async with d.connection() as conn:
            return await _events.blocked_keys(conn, d.w)

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
    try:
        before = whole_number(raw, "before") if raw else None
    except BadInput as exc:
        return await render(request, "refused.html", status_code=400, reason=str(exc))
    async with d.connection() as conn:
        entries = await _events.audit_entries(conn, d.w, before)
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


async def answer_from(request: Request, back: str, status: int, **state: Any) -> Response:
    """The page at ``back`` (one of ours, see `_render.safe_back`), as the answer to this
    request, with ``state`` (a refused form's error and input) and ``status``: the
    operator stays where the form was, and sees why it was refused."""
    path, _, query = back.partition("?")
    root = request.scope.get("root_path", "")
    scope = dict(request.scope)
    scope.update(
        method="GET",
        path=root + unquote(path),
        raw_path=(root + path).encode("latin-1", "replace"),
        query_string=query.encode("latin-1", "replace"),
        headers=[h for h in request.scope["headers"] if h[0] != b"x-dashboard-partial"],
    )
    scope["state"] = {
        **request.scope.get("state", {}),
        "status_code": status,
        "answer_to_a_post": True,
        **state,
    }
    for route in request.app.router.routes:
        if not isinstance(route, Route) or "GET" not in (route.methods or ()):
            continue
        match, child = route.matches(scope)
        if match == Match.FULL:
            scope.update(child)
            response: Response = await route.endpoint(Request(scope, request.receive))
            return response
    reason = (state.get("form_error") or {}).get("message", "refused")
    return await render(request, "refused.html", status_code=status, reason=reason)


def routes() -> list[Route]:
    return [
        Route("/", overview, name="overview"),
        Route("/events", events, name="events"),
        Route("/events/{event_id}", event, name="event"),
        Route("/dead", dead, name="dead"),
        Route("/keys", keys, name="keys"),
        Route("/consumers", consumers, name="consumers"),
        Route("/audit", audit, name="audit"),
        Route("/topics/{name:path}", topic, name="topic"),
        Route("/live", live, name="live"),
        Route("/healthz", health, name="healthz"),
    ]
