"""Per-group limits from a topic's page: the topic's default for every group, one group's
override, and removing an override.

One POST route, under the same checks as every mutation (`_actions.checked_form`:
``write`` permission, our own origin, the session's token), as flow control's form
(`_flow`). The change is `aiooutbox.admin.limit_groups`', with the actor
``dashboard:<user>``, so it lands in the outbox's flow log; the dashboard's audit entry
commits in the same transaction. Bad values are refused, beside their field, before
anything is written.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import asyncpg
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from .. import admin
from .._admin.flow import KEEP, MAX_RATE
from .._admin.groups import check_group
from .._values.limits import check_topic_name
from ..errors import InvalidArgument, OutboxError
from ._actions import Refused, checked_form
from ._flow import FieldRefused, _plain, max_running_field, operator_names, rate_field
from ._pages import answer_from
from ._render import dashboard_of, render, safe_back, url

__all__ = ["routes"]

# "default": the topic's limits of every group; "override": one group's; "remove": drop
# one group's override (it takes the default again)
GROUP_ACTIONS = ("default", "override", "remove")
FIELDS = ("group", "group_max_running", "group_rate", "group_burst")
_MAX_FIELD = 40  # characters of a number or rate field
_KEPT = 600  # characters of a refused field shown again (a group name fits: 512 bytes)
_NUMBER = re.compile(r"[0-9]{1,16}(\.[0-9]{1,6})?")


def _text(form: FormData, name: str) -> str:
    value = form.get(name)
    return value.strip() if isinstance(value, str) else ""


def _max_running(text: str) -> int | None:
    return max_running_field(text, "group_max_running", ";")


def _rate(text: str) -> str | None:
    return rate_field(
        text, "group_rate", "10/s", drop=": to stop a topic, pause it (its Pause button)"
    )


def _burst(text: str) -> float | None:
    if not text or text.lower() == "none":
        return None
    why = (
        f"burst must be a number of events from 1 to {MAX_RATE:.0f}, or empty for the"
        " default (a tenth of a second's worth)"
    )
    if len(text) > _MAX_FIELD or not _NUMBER.fullmatch(text):
        raise FieldRefused("group_burst", why)
    value = float(text)
    if not (math.isfinite(value) and 1 <= value <= MAX_RATE):
        raise FieldRefused("group_burst", why)
    return value


def _group(form: FormData) -> str:
    raw = form.get("group")
    if not isinstance(raw, str) or not raw:
        raise FieldRefused("group", "name the group (as its events carry it)")
    try:
        return check_group(raw)
    except InvalidArgument as exc:
        raise FieldRefused("group", str(exc)) from None


def _change(form: FormData) -> tuple[str, str | None, dict[str, Any]]:
    """(topic, group, limits) of a group-limit form, or `Refused`."""
    action = form.get("action")
    if action not in GROUP_ACTIONS:
        raise Refused(400, "unknown action")
    try:
        topic = check_topic_name(form.get("topic"))
    except (InvalidArgument, TypeError) as exc:
        raise Refused(400, str(exc)) from None
    group = None if action == "default" else _group(form)
    if action == "remove":
        return topic, group, {"max_running": None, "rate": None}
    rate = _rate(_text(form, "group_rate"))
    limits: dict[str, Any] = {
        "max_running": _max_running(_text(form, "group_max_running")),
        "rate": rate,
    }
    burst = _burst(_text(form, "group_burst"))
    if burst is not None:
        if rate is None:
            raise FieldRefused("group_burst", "a burst needs a rate: give a rate too")
        limits["burst"] = burst
    return topic, group, limits


async def limit(request: Request) -> Response:
    d = dashboard_of(request)
    form = None
    try:
        form = await checked_form(request)
        topic, group, limits = _change(form)
    except Refused as exc:
        return await _refused(request, form, exc.status, exc.reason, getattr(exc, "field", ""))
    back = safe_back(form.get("back"))
    names = operator_names(request)
    try:
        async with d.connection() as conn, conn.transaction():
            result = await admin.limit_groups(
                conn, topic, group=group, burst=limits.pop("burst", KEEP), **limits, **names
            )
            target = {**result.as_dict(), "topic": topic, "group": group}
            entry = await conn.fetchval(
                d.w.audit_insert,
                request.state.actor,
                "group limit",
                json.dumps(target, ensure_ascii=False),
                1,
            )
    except OutboxError as exc:  # InvalidArgument included: nothing was written
        return await _refused(request, form, 400, _plain(str(exc)), "group_rate")
    except asyncpg.InsufficientPrivilegeError as exc:
        reason = (
            f"this dashboard's database role may not change group limits ({exc}): see the"
            " operator's grants in the dashboard's documentation"
        )
        return await render(request, "refused.html", status_code=403, reason=reason)
    d.changed()
    path, _, query = back.partition("?")
    query = "&".join(p for p in query.split("&") if p and not p.startswith("done="))
    done = (query + "&" if query else "") + f"done={entry}"
    return RedirectResponse(url(request, path, done) + "#group-limits", status_code=303)


def _kept(value: object) -> str:
    """What was typed, to show again: cut short, as text HTML can carry (no NUL, no lone
    surrogate)."""
    text = value[:_KEPT] if isinstance(value, str) else ""
    return text.replace("\x00", "\N{REPLACEMENT CHARACTER}").encode("utf-8", "replace").decode()


async def _refused(
    request: Request, form: FormData | None, status: int, reason: str, field: str
) -> Response:
    """A refused change, answered with the page the form was on: the reason beside the
    field, and what was typed still in the fields."""
    back = safe_back(form.get("back") if form is not None else None, "")
    if status != 400 or not back or form is None:
        return await render(request, "refused.html", status_code=status, reason=reason)
    kind = "group-default" if form.get("action") == "default" else "group-override"
    error = {
        "form": kind,
        "topic": _kept(form.get("topic")),
        "field": field or "group",
        "message": reason,
        "values": {k: _kept(form.get(k)) for k in FIELDS},
    }
    return await answer_from(request, back, 400, form_error=error)


def routes() -> list[Route]:
    return [Route("/topics/groups", limit, methods=["POST"], name="group_limits")]
