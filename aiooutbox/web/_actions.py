"""The mutations on events: retry and purge dead events; run now and cancel waiting
ones (pending, scheduled or retrying). One event, a selection, or every one matching a
filter. Each is a POST from our own origin with the session's token, by a request with
``write`` permission; each asks for confirmation first (a page with the count) and is
recorded in the audit table in the same transaction as the change itself. Then the
browser goes back where it acted, with a message saying what was done; a refused form
is answered with that page and the reason beside the buttons.

Dead events change through `aiooutbox.admin.requeue_dead` and `delete_dead`. Waiting
ones through the statements of `_sql` (``run_now``, ``cancel``): a cancelled event that
heads its ordering key is deleted under the key's lock and the key's next event
promoted (``<table>_promote``), so the key moves on in order.
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
from ._events import count_matching
from ._filters import EventFilter, parse_filter
from ._input import BadInput, strict_utf8, whole_number
from ._pages import answer_from
from ._render import dashboard_of, render, safe_back, url
from ._sql import WebQueries

__all__ = ["Refused", "checked_form", "count_to_confirm", "routes"]

# the actions of each kind of event, and the status a filter of that kind may name
KINDS = {"dead": ("retry", "purge"), "events": ("run", "cancel")}
WAITING = ("pending", "scheduled", "retry")
MAX_SELECTED = 10_000  # ids in one selection; waiting events acted on per filter action
_AUDITED_IDS = 1000  # ids written into an audit entry (the count is always whole)


class Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


async def checked_form(request: Request) -> FormData:
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
    if request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
        try:  # before parsing: the parser turns bytes that are not UTF-8 into U+FFFD
            strict_utf8(await request.body(), "the form")
        except BadInput as exc:
            raise Refused(400, str(exc)) from None
    form = await request.form(max_files=0, max_fields=MAX_SELECTED + 50)
    token = form.get("csrf")
    if not isinstance(token, str) or not d.tokens.valid(request.state.session, token):
        raise Refused(403, "missing or stale form token: reload the page and try again")
    return form


_checked_form = checked_form  # (the name flow control's form used)


def _selection(form: FormData, kind: str) -> tuple[str, list[int] | None, EventFilter]:
    action = form.get("action")
    if action not in KINDS[kind]:
        raise Refused(400, "unknown action")
    ids: list[int] | None = None
    if form.get("mode") == "selection":
        raw = form.getlist("ids")
        if not raw:
            raise Refused(400, "no event selected: tick the events to act on first")
        if len(raw) > MAX_SELECTED:
            raise Refused(400, f"select at most {MAX_SELECTED:,} events (or act on a filter)")
        try:
            ids = sorted({whole_number(str(x), "an event id") for x in raw})
        except BadInput as exc:
            raise Refused(400, str(exc)) from None
    skip = ("ids", "csrf", "action", "mode", "back")
    fields = {k: str(v) for k, v in form.items() if k not in skip}
    if kind == "dead":
        f = parse_filter(fields, status="dead")
    else:
        f = parse_filter(fields)
        if ids is None and f.status not in WAITING:
            raise Refused(400, "filter by a status of pending, scheduled or retry first")
    if f.errors:
        raise Refused(400, "; ".join(f.errors))
    return str(action), ids, f


async def count_to_confirm(
    conn: Any, w: WebQueries, ids: list[int] | None, f: EventFilter, kind: str = "dead"
) -> tuple[int | None, list[int], Count, int]:
    """What the confirmation shows: the newest id (a filter acts on no row above it), the
    selected events the action applies to, how many rows it would touch, and how many of
    them head an ordering key (the plan tests check these statements at scale)."""
    max_id = await conn.fetchval(f"SELECT max(id) FROM {w.t}")
    if ids is not None:
        if kind == "dead":
            statuses = await admin.event_statuses(
                conn, ids, schema=w.outbox.schema, table=w.outbox.table
            )
            dead = [i for i in ids if statuses.get(i) == "dead"]
            return max_id, dead, exact(len(dead)), 0
        rows = await conn.fetch(w.waiting_states, ids)
        heads = sum(1 for r in rows if r[2] is not None)
        return max_id, [r[0] for r in rows], exact(len(rows)), heads
    matching = await count_matching(conn, w, replace(f, before=None, max_id=max_id))
    return max_id, [], matching, 0


async def _refused(request: Request, exc: Refused, form: FormData | None) -> Response:
    back = safe_back(form.get("back") if form is not None else None, "")
    if exc.status == 400 and back:
        # the page the form was on, the reason beside its buttons
        error = {"form": "actions", "message": exc.reason}
        return await answer_from(request, back, 400, form_error=error)
    return await render(request, "refused.html", status_code=exc.status, reason=exc.reason)


async def confirm(request: Request) -> Response:
    """Show what an action would touch and ask; changes nothing."""
    d = dashboard_of(request)
    kind = "dead" if request.url.path.endswith("/dead/confirm") else "events"
    form = None
    try:
        form = await checked_form(request)
        action, ids, f = _selection(form, kind)
    except Refused as exc:
        return await _refused(request, exc, form)
    async with d.connection() as conn:
        max_id, chosen, matching, heads = await count_to_confirm(conn, d.w, ids, f, kind)
    return await render(
        request,
        "confirm.html",
        kind=kind,
        action=action,
        ids=chosen if ids is not None else None,
        f=f,
        max_id=max_id,
        matching=matching,
        heads=heads,
        back=safe_back(form.get("back")),
        limit=MAX_SELECTED,
    )


async def act(request: Request) -> Response:
    d = dashboard_of(request)
    kind = "dead" if request.url.path.endswith("/dead/act") else "events"
    form = None
    try:
        form = await checked_form(request)
        action, ids, f = _selection(form, kind)
    except Refused as exc:
        return await _refused(request, exc, form)
    back = safe_back(form.get("back"), "/dead" if kind == "dead" else "/events")
    q = d.w.outbox
    target: dict[str, Any]
    async with d.connection() as conn, conn.transaction():
        if ids is None:
            if f.max_id is None:
                return await render(
                    request, "refused.html", status_code=400, reason="confirm the count first"
                )
            where, args = f.where(cursor=False)
            sql = d.w.event_ids(where)
            if kind == "events":
                sql += f" LIMIT {MAX_SELECTED}"
            ids = [r[0] for r in await conn.fetch(sql, *args)]
            target = {"filter": f.params(include_cursor=False), "max_id": f.max_id}
        else:
            target = {"ids": ids[:_AUDITED_IDS]}
        if not ids:
            affected = 0
        elif action == "retry":
            affected = len(await admin.requeue_dead(conn, ids=ids, schema=q.schema, table=q.table))
        elif action == "purge":
            affected = len(await admin.delete_dead(conn, ids=ids, schema=q.schema, table=q.table))
        elif action == "run":
            ran = await conn.fetch(d.w.run_now, ids)
            if ran:
                await conn.execute(q.notify, q.channel, sorted({r[1] for r in ran}))
            affected = len(ran)
        else:
            affected, target["keys_moved_on"] = await _cancel(conn, d.w, ids)
        entry = await conn.fetchval(
            d.w.audit_insert,
            request.state.actor,
            f"{kind} {action}",
            json.dumps(target, ensure_ascii=False),
            affected,
        )
    d.changed()
    path, _, query = back.partition("?")
    query = "&".join(p for p in query.split("&") if p and not p.startswith("done="))
    return RedirectResponse(
        url(request, path, (query + "&" if query else "") + f"done={entry}"), 303
    )


async def _cancel(conn: Any, w: WebQueries, ids: list[int]) -> tuple[int, int]:
    """Delete the waiting ones of ``ids``; the keys whose head went move on to their
    next event, in order. Returns (deleted, keys moved on)."""
    keys = [r[0] for r in await conn.fetch(w.keys_of, ids)]
    if keys:
        # each key's producers' lock, waited for in key order (as `delete_dead` does):
        # the promotion below then cannot be skipped for a lock held elsewhere
        await conn.fetchval(w.lock_keys, keys)
    deleted = await conn.fetch(w.cancel, ids)
    heads = sorted({r[2] for r in deleted if r[2] is not None})
    moved = 0
    if heads:
        moved = int((await conn.fetchrow(w.outbox.promote, heads))["promoted"] or 0)
    return len(deleted), moved


def routes() -> list[Route]:
    return [
        Route("/dead/confirm", confirm, methods=["POST"], name="dead_confirm"),
        Route("/dead/act", act, methods=["POST"], name="dead_act"),
        Route("/events/confirm", confirm, methods=["POST"], name="events_confirm"),
        Route("/events/act", act, methods=["POST"], name="events_act"),
    ]
