"""Flow control from the overview: pause, resume and limit a topic.

One POST route, under the same checks as every mutation (`_actions._checked_form`:
``write`` permission, our own origin, the session's token). The change itself is
`aiooutbox.admin`'s (`pause_topic`, `resume_topic`, `limit_topic`), with the actor
``dashboard:<user>``, so it lands in the outbox's flow log; the dashboard's audit entry
commits in the same transaction. Bad values are refused before anything is written.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from .. import admin
from .._admin.flow import MAX_RUNNING
from .._values.limits import check_topic_name
from ..errors import InvalidArgument, OutboxError
from ._actions import Refused, _checked_form
from ._render import dashboard_of, render, url

__all__ = ["routes"]

FLOW_ACTIONS = ("pause", "resume", "limit")
_MAX_FIELD = 40  # characters of a limit field: "1000000" or "0.5/min" fit many times


def _max_running(raw: object) -> int | None:
    text = str(raw if raw is not None else "").strip()
    if not text or text.lower() == "none":
        return None
    if len(text) > _MAX_FIELD or not text.isdigit():
        raise Refused(
            400,
            f"max running must be a whole number from 1 to {MAX_RUNNING}, or empty for no limit",
        )
    value = int(text)
    if not 1 <= value <= MAX_RUNNING:
        raise Refused(
            400,
            f"max running must be from 1 to {MAX_RUNNING} (got {value}): to stop a topic,"
            " pause it; for no limit, leave it empty",
        )
    return value


def _rate(raw: object) -> str | None:
    text = str(raw if raw is not None else "").strip()
    if not text or text.lower() == "none":
        return None
    if len(text) > _MAX_FIELD:
        raise Refused(400, "rate: use N/s, N/min or N/h (e.g. 50/s), or empty for no limit")
    try:
        admin.parse_rate(text)
    except InvalidArgument as exc:
        raise Refused(400, str(exc)) from None
    return text


def _change(form: FormData) -> tuple[str, str, dict[str, Any]]:
    """(action, topic, limits) of a flow form, or `Refused`."""
    action = form.get("action")
    if action not in FLOW_ACTIONS:
        raise Refused(400, "unknown action")
    try:
        topic = check_topic_name(form.get("topic"))
    except (InvalidArgument, TypeError) as exc:
        raise Refused(400, str(exc)) from None
    limits: dict[str, Any] = {}
    if action == "limit":
        limits = {
            "max_running": _max_running(form.get("max_running")),
            "rate": _rate(form.get("rate")),
        }
    return str(action), topic, limits


async def flow(request: Request) -> Response:
    d = dashboard_of(request)
    try:
        action, topic, limits = _change(await _checked_form(request))
    except Refused as exc:
        return await render(request, "refused.html", status_code=exc.status, reason=exc.reason)
    q = d.w.outbox
    actor = f"dashboard:{request.state.actor}"[:200]
    names: dict[str, Any] = {"schema": q.schema, "table": q.table, "actor": actor}
    try:
        async with d.connection() as conn, conn.transaction():
            if action == "pause":
                control = await admin.pause_topic(conn, topic, **names)
            elif action == "resume":
                control = await admin.resume_topic(conn, topic, **names)
            else:
                control = await admin.limit_topic(conn, topic, **limits, **names)
            await conn.fetchval(
                d.w.audit_insert,
                request.state.actor,
                f"topic {action}",
                json.dumps({**control.as_dict(), "topic": topic}, ensure_ascii=False),
                1,
            )
    except OutboxError as exc:  # InvalidArgument included: nothing was written
        return await render(request, "refused.html", status_code=400, reason=str(exc))
    d.cache.clear()
    return RedirectResponse(url(request, "/") + "#topics", status_code=303)


def routes() -> list[Route]:
    return [Route("/topics/flow", flow, methods=["POST"], name="topic_flow")]
