"""The mutations: retry and purge dead events, one, a selection, or every one matching
a filter. Each is a POST from our own origin with the session's token, by a request
with ``write`` permission; each asks for confirmation first (a page with the count) and
is recorded in the audit table in the same transaction as the change itself. The
changes themselves are `aiooutbox.admin.requeue_dead` and `aiooutbox.admin.delete_dead`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from .. import admin
from ._auth import Permission, same_origin
from ._counts import Count, exact
from ._data import count_matching
from ._filters import EventFilter, parse_filter
from ._render import dashboard_of, render, url
from ._sql import WebQueries

__all__ = ["count_to_confirm", "routes"]

ACTIONS = ("retry", "purge")
MAX_SELECTED = 10_000
_AUDITED_IDS = 1000  # ids written into an audit entry (the count is always whole)


class Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


async def _checked_form(request: Request) -> FormData:
    """The form of a mutation request, or `Refused`: permission, origin, token."""
    d = dashboard_of(request)
    if request.state.permission < Permission.WRITE:
        why = (
            "this dashboard is read-only"
            if d.read_only
            else "you have read permission only (without credentials, changes are allowed"
            " only over a loopback connection)"
        )
        raise Refused(403, why)
    if not same_origin(request.headers):
        raise Refused(403, "cross-origin request refused")
    form = await request.form(max_files=0, max_fields=MAX_SELECTED + 50)
    token = form.get("csrf")
    if not isinstance(token, str) or not d.tokens.valid(request.state.session, token):
        raise Refused(403, "missing or stale form token: reload the page and try again")
    return form


def _selection(form: FormData) -> tuple[str, list[int] | None, EventFilter]:
    action = form.get("action")
    if action not in ACTIONS:
        raise Refused(400, "unknown action")
    ids: list[int] | None = None
    if form.get("mode") == "selection":
        raw = form.getlist("ids")
        if not raw:
            raise Refused(400, "no event selected")
        if len(raw) > MAX_SELECTED:
            raise Refused(400, f"select at most {MAX_SELECTED} events (or act on a filter)")
        try:
            ids = sorted({int(str(x)) for x in raw})
        except ValueError:
            raise Refused(400, "event ids are whole numbers") from None
        if any(i <= 0 or i >= 2**63 for i in ids):
            raise Refused(400, "event ids are positive")
    fields = {k: str(v) for k, v in form.items() if k not in ("ids", "csrf", "action", "mode")}
    f = parse_filter(fields, status="dead")
    if f.errors:
        raise Refused(400, "; ".join(f.errors))
    return str(action), ids, f


async def count_to_confirm(
    conn: Any, w: WebQueries, ids: list[int] | None, f: EventFilter
) -> tuple[int | None, list[int], Count]:
    """What the confirmation shows: the newest id (a filter acts on no row above it), the
    dead ones of a selection, and how many rows the action would touch (the plan tests
    check these statements at scale)."""
    max_id = await conn.fetchval(f"SELECT max(id) FROM {w.t}")
    if ids is not None:
        statuses = await admin.event_statuses(
            conn, ids, schema=w.outbox.schema, table=w.outbox.table
        )
        dead = [i for i in ids if statuses.get(i) == "dead"]
        return max_id, dead, exact(len(dead))
    return max_id, [], await count_matching(conn, w, replace(f, before=None, max_id=max_id))


async def confirm(request: Request) -> Response:
    """Show what an action would touch and ask; changes nothing."""
    d = dashboard_of(request)
    try:
        action, ids, f = _selection(await _checked_form(request))
    except Refused as exc:
        return await render(request, "refused.html", status_code=exc.status, reason=exc.reason)
    async with d.connection() as conn:
        max_id, dead, matching = await count_to_confirm(conn, d.w, ids, f)
    return await render(
        request,
        "confirm.html",
        action=action,
        ids=dead if ids is not None else None,
        f=f,
        max_id=max_id,
        matching=matching,
    )


async def act(request: Request) -> Response:
    d = dashboard_of(request)
    try:
        action, ids, f = _selection(await _checked_form(request))
    except Refused as exc:
        return await render(request, "refused.html", status_code=exc.status, reason=exc.reason)
    q = d.w.outbox
    target: dict[str, Any]
    async with d.connection() as conn, conn.transaction():
        if ids is None:
            if f.max_id is None:
                return await render(
                    request, "refused.html", status_code=400, reason="confirm the count first"
                )
            where, args = f.where(cursor=False)
            ids = [r[0] for r in await conn.fetch(d.w.event_ids(where), *args)]
            target = {"filter": f.params(include_cursor=False), "max_id": f.max_id}
        else:
            target = {"ids": ids[:_AUDITED_IDS]}
        if not ids:
            affected = 0
        elif action == "retry":
            affected = len(await admin.requeue_dead(conn, ids=ids, schema=q.schema, table=q.table))
        else:
            affected = len(await admin.delete_dead(conn, ids=ids, schema=q.schema, table=q.table))
        entry = await conn.fetchval(
            d.w.audit_insert,
            request.state.actor,
            f"dead {action}",
            json.dumps(target, ensure_ascii=False),
            affected,
        )
    d.cache.clear()
    return RedirectResponse(url(request, "/audit", f"highlight={entry}"), status_code=303)


def routes() -> list[Route]:
    return [
        Route("/dead/confirm", confirm, methods=["POST"], name="dead_confirm"),
        Route("/dead/act", act, methods=["POST"], name="dead_act"),
    ]
