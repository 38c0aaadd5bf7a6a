"""Rendering: one helper that fills a template with what every page needs.

Jinja2 escapes every value (autoescape on for every template), so stored text lands in
HTML text and quoted attributes as text. URLs are built here from our own paths and
``urlencode``d query strings only: nothing stored ever starts an ``href``.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from markupsafe import Markup, escape
from starlette.requests import Request
from starlette.responses import HTMLResponse

from ._audit import describe, message
from ._auth import Permission
from ._charts import bars, minute_chart
from ._counts import Count
from ._data import age, when
from ._times import Stored
from ._topic import topic_path

if TYPE_CHECKING:
    from ._dashboard import Dashboard

__all__ = ["dashboard_of", "here", "render", "safe_back", "url"]

NAV = (
    ("/", "Overview"),
    ("/events", "Events"),
    ("/dead", "Dead"),
    ("/keys", "Ordering keys"),
    ("/consumers", "Consumers & relays"),
    ("/audit", "Audit"),
)
# where a form may send the browser back to: one of our pages, with its query
_BACK = re.compile(r"/(|events(/\d{1,19})?|dead|keys|consumers|audit|topics/[^?#\s]*)(\?[^#\s]*)?")


def dashboard_of(request: Request) -> Dashboard:
    dashboard: Dashboard = request.app.state.dashboard
    return dashboard


def can_write(request: Request) -> bool:
    return bool(request.state.permission >= Permission.WRITE)


def url(request: Request, path: str, query: str = "") -> str:
    root = request.scope.get("root_path", "")
    return f"{root}{path}" + (f"?{query}" if query else "")


def here(request: Request) -> str:
    """This page's path and query, relative to the dashboard's root, without the
    message of an earlier action: what a form sends back to return here."""
    root = request.scope.get("root_path", "")
    raw = request.scope.get("raw_path")
    if isinstance(raw, bytes):  # as the browser sent it: a topic's "/" or "?" stays encoded
        path = raw.decode("latin-1")
        path = path[len(quote(root)) :] if path.startswith(quote(root)) else path
    else:
        path = quote(request.url.path[len(root) :])
    query = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "done"])
    return (path or "/") + (f"?{query}" if query else "")


def safe_back(value: object, fallback: str = "/") -> str:
    """A form's ``back``, if it is one of our pages (never another site: it must be a
    path of ours, not ``//host`` or a scheme), else ``fallback``."""
    if isinstance(value, str) and len(value) <= 4000 and _BACK.fullmatch(value):
        return value
    return fallback


def count(value: Count | int | None) -> str:
    if value is None:
        return "\N{EN DASH}"
    if isinstance(value, Count):
        return value.text
    return f"{value:,}"


def rel(value: Stored) -> Markup:
    """A time relative to now ("3m ago", "in 2h 10m"), the absolute time on hover; the
    page's script keeps it current. One no datetime holds is shown as stored."""
    if value is None:
        return Markup("\N{EN DASH}")
    if isinstance(value, str):
        return escape(value)
    try:
        at = value.timestamp()
    except (OverflowError, ValueError, OSError):
        return escape(when(value))
    ago = time.time() - at
    text = f"{age(ago)} ago" if ago >= 0 else age(ago)
    return Markup('<time datetime="{}" data-at="{:.3f}" title="{}">{}</time>').format(
        value.isoformat(), at, when(value), text
    )


async def render(
    request: Request, template: str, status_code: int = 200, **context: Any
) -> HTMLResponse:
    dashboard = dashboard_of(request)
    partial = request.headers.get("x-dashboard-partial") == "1"
    pulse = context.pop("pulse", None)
    if pulse is None:
        pulse = await dashboard.hub.read_pulse()
    state = request.state
    # a refused form is answered with the page it was on, its input and the reason
    status_code = getattr(state, "status_code", None) or status_code
    context.setdefault("form_error", getattr(state, "form_error", None))
    context.setdefault("answer_to_a_post", getattr(state, "answer_to_a_post", False))
    flash = None
    done = request.query_params.get("done", "")
    if done.isascii() and done.isdigit() and len(done) < 19:
        async with dashboard.connection() as conn:
            entry = await conn.fetchrow(dashboard.w.audit_entry, int(done))
        if entry is not None:
            flash = message(dict(entry.items()))
    page = dashboard.templates.get_template(template)
    html = page.render(
        request=request,
        partial=partial,
        pulse=pulse,
        refresh_ms=int(dashboard.hub.interval * 1000),
        title=dashboard.title,
        nav=NAV,
        path=request.url.path[len(request.scope.get("root_path", "")) :] or "/",
        here=here(request),
        flash=flash,
        permission=request.state.permission.label,
        read_only=dashboard.read_only,
        can_write=can_write(request),
        csrf=dashboard.tokens.token(request.state.session),
        actor=request.state.actor,
        url=lambda path, query="": url(request, path, query),
        topic_url=lambda topic: url(request, topic_path(topic)),
        count=count,
        qs=lambda **params: urlencode({k: v for k, v in params.items() if v is not None}),
        age=age,
        when=when,
        rel=rel,
        now=time.time(),
        bars=bars,
        minute_chart=minute_chart,
        describe=describe,
        trace_link=lambda trace_id: (
            dashboard.trace_url.replace("{trace_id}", quote(trace_id, safe=""))
            if dashboard.trace_url and trace_id
            else None
        ),
        **context,
    )
    # what the data is current to: a page whose pulse moved on asks again later; and
    # the server's clock, by which the page ticks its ages on
    return HTMLResponse(
        html,
        status_code=status_code,
        headers={"X-Dashboard-Pulse": pulse, "X-Dashboard-Now": f"{time.time():.3f}"},
    )
