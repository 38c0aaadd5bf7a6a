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
from ._actions import Refused, checked_form
from ._input import BadInput, whole_number
from ._pages import answer_from
from ._render import dashboard_of, render, safe_back, url

__all__ = ["routes"]

FLOW_ACTIONS = ("pause", "resume", "limit")
_MAX_FIELD = 40  # characters of a limit field: "1000000" or "0.5/min" fit many times


class FieldRefused(Refused):
    """A limit refused, with the field it is about."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(400, reason)
        self.field = field


def _max_running(raw: object) -> int | None:
    return max_running_field(raw, "max_running", ": to stop a topic, pause it;")


def max_running_field(raw: object, field: str, stop_hint: str) -> int | None:
    """A max-running field's value (None: no limit), or `FieldRefused` for ``field``;
    ``stop_hint`` follows the value refused when it is 0 or out of range."""
    text = str(raw if raw is not None else "").strip()
    if not text or text.lower() == "none":
        return None
    try:
        value = whole_number(text, "max running", low=0)
    except BadInput:
        raise FieldRefused(
            field,
            f"max running must be a whole number from 1 to {MAX_RUNNING}, or empty for no limit",
        ) from None
    if not 1 <= value <= MAX_RUNNING:
        raise FieldRefused(
            field,
            f"max running must be from 1 to {MAX_RUNNING} (got {value}){stop_hint} for no"
            " limit, leave it empty",
        )
    return value


def _rate(raw: object) -> str | None:
    return rate_field(raw, "rate", "50/s")


def rate_field(raw: object, field: str, example: str, drop: str = "") -> str | None:
    """A rate field's text as written (None: no limit), or `FieldRefused` for ``field``;
    ``drop`` is left out of the library's reason (a hint that does not apply there)."""
    text = str(raw if raw is not None else "").strip()
    if not text or text.lower() == "none":
        return None
    if len(text) > _MAX_FIELD:
        raise FieldRefused(
            field, f"rate: use N/s, N/min or N/h (e.g. {example}), or empty for no limit"
        )
    try:
        admin.parse_rate(text)
    except InvalidArgument as exc:
        reason = _plain(str(exc))
        raise FieldRefused(field, reason.replace(drop, "") if drop else reason) from None
    return text


def _plain(reason: str) -> str:
    """flow control's CLI wording, for a form: "or none" is "or empty" here."""
    return (
        reason.replace(", or none", ", or empty for no limit")
        .replace("(topics pause TOPIC)", "(its Pause button)")
        .replace("to remove the limit, use none", "to remove the limit, leave it empty")
    )


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


def operator_names(request: Request) -> dict[str, Any]:
    """The outbox an operator's action changes, and who acted (for the audit log)."""
    q = dashboard_of(request).w.outbox
    return {"schema": q.schema, "table": q.table, "actor": f"dashboard:{request.state.actor}"[:200]}


async def flow(request: Request) -> Response:
    d = dashboard_of(request)
    form = None
    try:
        form = await checked_form(request)
        action, topic, limits = _change(form)
    except Refused as exc:
        return await _refused(request, form, exc.status, exc.reason, getattr(exc, "field", ""))
    back = safe_back(form.get("back"))
    names = operator_names(request)
    try:
        async with d.connection() as conn, conn.transaction():
            if action == "pause":
                control = await admin.pause_topic(conn, topic, **names)
            elif action == "resume":
                control = await admin.resume_topic(conn, topic, **names)
            else:
                control = await admin.limit_topic(conn, topic, **limits, **names)
            entry = await conn.fetchval(
                d.w.audit_insert,
                request.state.actor,
                f"topic {action}",
                json.dumps({**control.as_dict(), "topic": topic}, ensure_ascii=False),
                1,
            )
    except OutboxError as exc:  # InvalidArgument included: nothing was written
        return await _refused(request, form, 400, _plain(str(exc)), "rate")
    d.changed()
    path, _, query = back.partition("?")
    query = "&".join(p for p in query.split("&") if p and not p.startswith("done="))
    done = (query + "&" if query else "") + f"done={entry}"
    return RedirectResponse(url(request, path, done) + "#topics", status_code=303)


async def _refused(
    request: Request, form: FormData | None, status: int, reason: str, field: str
) -> Response:
    """A refused change, answered with the page the form was on: the reason beside the
    field, and what was typed still in the fields."""
    back = safe_back(form.get("back") if form is not None else None, "")
    if status != 400 or not back or form is None:
        return await render(request, "refused.html", status_code=status, reason=reason)
    error = {
        "form": "limits" if form.get("action") == "limit" else "flow",
        "topic": str(form.get("topic") or ""),
        "field": field,
        "message": reason,
        "values": {k: str(form.get(k) or "")[:200] for k in ("max_running", "rate")},
    }
    return await answer_from(request, back, 400, form_error=error)


def routes() -> list[Route]:
    return [Route("/topics/flow", flow, methods=["POST"], name="topic_flow")]
