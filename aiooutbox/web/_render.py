"""Rendering: one helper that fills a template with what every page needs.

Jinja2 escapes every value (autoescape on for every template), so stored text lands in
HTML text and quoted attributes as text. URLs are built here from our own paths and
``urlencode``d query strings only: nothing stored ever starts an ``href``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from starlette.requests import Request
from starlette.responses import HTMLResponse

from ._auth import Permission
from ._charts import bars
from ._counts import Count
from ._data import age, when

if TYPE_CHECKING:
    from ._dashboard import Dashboard

__all__ = ["dashboard_of", "render", "url"]

NAV = (
    ("/", "Overview"),
    ("/events", "Events"),
    ("/dead", "Dead"),
    ("/keys", "Ordering keys"),
    ("/consumers", "Consumers & relays"),
    ("/audit", "Audit"),
)


def dashboard_of(request: Request) -> Dashboard:
    dashboard: Dashboard = request.app.state.dashboard
    return dashboard


def can_write(request: Request) -> bool:
    return bool(request.state.permission >= Permission.WRITE)


def url(request: Request, path: str, query: str = "") -> str:
    root = request.scope.get("root_path", "")
    return f"{root}{path}" + (f"?{query}" if query else "")


def count(value: Count | int | None) -> str:
    if value is None:
        return "\N{EN DASH}"
    if isinstance(value, Count):
        return value.text
    return f"{value:,}"


async def render(
    request: Request, template: str, status_code: int = 200, **context: Any
) -> HTMLResponse:
    dashboard = dashboard_of(request)
    partial = request.headers.get("x-dashboard-partial") == "1"
    pulse = context.pop("pulse", None)
    if pulse is None:
        pulse = await dashboard.hub.read_pulse()
    page = dashboard.templates.get_template(template)
    html = page.render(
        request=request,
        partial=partial,
        pulse=pulse,
        refresh_ms=int(dashboard.hub.interval * 1000),
        title=dashboard.title,
        nav=NAV,
        path=request.url.path[len(request.scope.get("root_path", "")) :] or "/",
        permission=request.state.permission.label,
        read_only=dashboard.read_only,
        can_write=can_write(request),
        csrf=dashboard.tokens.token(request.state.session),
        actor=request.state.actor,
        url=lambda path, query="": url(request, path, query),
        count=count,
        qs=lambda **params: urlencode({k: v for k, v in params.items() if v is not None}),
        age=age,
        when=when,
        bars=bars,
        trace_link=lambda trace_id: (
            dashboard.trace_url.replace("{trace_id}", quote(trace_id, safe=""))
            if dashboard.trace_url and trace_id
            else None
        ),
        **context,
    )
    # what the data is current to: a page whose pulse moved on asks again later
    return HTMLResponse(html, status_code=status_code, headers={"X-Dashboard-Pulse": pulse})
