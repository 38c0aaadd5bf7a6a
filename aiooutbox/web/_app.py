"""The dashboard as an ASGI application: `create_app` and the request guard.

The guard runs before every route: it decides the request's permission (`_auth`),
answers 401/403 itself, gives each browser a session cookie (the CSRF token is an HMAC
of it), and adds the security headers to every response: a Content-Security-Policy
that allows only our own script and style files, no framing, no referrer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from http.cookies import SimpleCookie
from typing import Any

import asyncpg
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from .._sql.statements import DEFAULT_SCHEMA, DEFAULT_TABLE
from ..errors import InvalidArgument
from . import _actions, _flow, _groups, _pages
from ._auth import (
    SESSION_COOKIE,
    BasicAuth,
    Permission,
    Resolver,
)
from ._dashboard import Dashboard, unavailable

__all__ = ["CSP", "Dashboard", "create_app"]

logger = logging.getLogger("aiooutbox.web")

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
    " connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]
_RETRY = (b"retry-after", b"5")


async def _plain(send: Any, status: int, body: str, *extra: tuple[bytes, bytes]) -> None:
    headers = [*_HEADERS, (b"content-type", b"text/plain; charset=utf-8"), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body.encode()})


class Guard:
    """ASGI middleware: the Host, permission, session cookie, security headers; and
    an answer with those headers even when a route fails."""

    def __init__(self, app: Any, dashboard: Dashboard) -> None:
        self.app = app
        self.dashboard = dashboard

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw_host = dict(scope.get("headers", ())).get(b"host")
        host = None if raw_host is None else raw_host.decode("latin-1")
        if not self.dashboard.allowed_hosts.allows(host, scope.get("server")):
            await _plain(
                send,
                400,
                f"this dashboard does not answer to the host {(host or '')[:100]!r}: open it by"
                " its address or localhost, or allow the name (--allowed-host NAME,"
                " create_app(allowed_hosts=[...]))\n",
            )
            return
        started = False

        async def watch(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._guarded(scope, receive, watch)
        except Exception as exc:
            if started:
                raise
            # never Starlette's bare 500 (it carries none of our headers)
            if isinstance(exc, asyncpg.InsufficientPrivilegeError):  # a grant is missing
                logger.warning("dashboard request refused by the database: %s", exc)
                await _plain(
                    send,
                    503,
                    f"this dashboard's database role lacks a privilege ({exc}): grant it"
                    " what docs/guarantees.md lists for the viewer role\n",
                )
                return
            if isinstance(exc, asyncpg.DataError):  # a value the database refused
                logger.info("dashboard request refused by the database: %s", exc)
                await _plain(send, 400, f"the database refused a value of this request: {exc}\n")
                return
            if isinstance(exc, InvalidArgument):  # a value the library refused
                logger.info("dashboard request refused: %s", exc)
                await _plain(send, 400, f"refused: {exc}\n")
                return
            reason = unavailable(exc)
            if reason is not None:  # one line: it is the database's state, not a fault here
                logger.warning(
                    "dashboard answered %s %s with 503: database unavailable: %s",
                    scope.get("method"),
                    scope["path"],
                    reason,
                )
                await _plain(send, 503, f"database unavailable: {reason}\n", _RETRY)
                return
            logger.exception("dashboard request failed: %s %s", scope.get("method"), scope["path"])
            await _plain(send, 500, "internal error: see the dashboard's log\n")

    async def _guarded(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        permission, actor, challenge = await self.dashboard.permission(scope)
        if challenge:
            realm = getattr(self.dashboard.auth, "realm", "aiooutbox")
            challenge_header = (b"www-authenticate", f'Basic realm="{realm}"'.encode())
            await _plain(send, 401, "authentication required\n", challenge_header)
            return
        if permission == Permission.NONE:
            await _plain(send, 403, "forbidden\n")
            return
        cookie = SimpleCookie()
        raw = dict(scope.get("headers", ())).get(b"cookie")
        if raw:
            with contextlib.suppress(Exception):
                cookie.load(raw.decode("latin-1"))
        session = cookie[SESSION_COOKIE].value if SESSION_COOKIE in cookie else None
        fresh = session is None
        if session is None:
            session = self.dashboard.tokens.new_session()
        state = scope.setdefault("state", {})
        state.update(permission=permission, actor=actor, session=session)
        path = (scope.get("root_path") or "") + "/"
        secure = "; Secure" if scope.get("scheme") == "https" else ""
        set_cookie = (
            f"{SESSION_COOKIE}={session}; Path={path}; HttpOnly; SameSite=Strict{secure}"
        ).encode()

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    h for h in message.get("headers", []) if h[0].lower() != b"cache-control"
                ]
                headers += _HEADERS
                if fresh:
                    headers.append((b"set-cookie", set_cookie))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def create_app(
    dsn: str | None = None,
    *,
    pool: asyncpg.Pool | None = None,
    schema: str = DEFAULT_SCHEMA,
    table: str = DEFAULT_TABLE,
    read_only: bool = False,
    auth: BasicAuth | Resolver | None = None,
    anonymous: Permission | str | None = None,
    trace_url: str | None = None,
    refresh: float = 2.0,
    secret: bytes | None = None,
    title: str = "aiooutbox",
    allowed_hosts: list[str] | tuple[str, ...] | None = None,
) -> Starlette:
    """The dashboard as an ASGI app (Starlette) to serve or mount.

    Pass ``pool`` (yours; the dashboard never closes it) or ``dsn`` (the dashboard opens
    a small pool of its own; ``await app.state.dashboard.aclose()`` closes it when
    mounted, since a mounted app's lifespan does not run). ``auth`` is a `BasicAuth`
    or a callable ``request -> "none" | "read" | "write"`` (sync or async). Without
    ``auth``, a request gets ``anonymous`` when given, else ``write`` when it arrived
    on a loopback socket with no proxy header and ``read`` otherwise. ``read_only``
    caps every request at ``read``. ``trace_url`` (containing ``{trace_id}``) links an
    event's trace. ``refresh`` is the live update interval in seconds.
    ``allowed_hosts``: the names besides localhost and the address it is reached at
    that a request's ``Host`` may carry (``ops.example.com``, ``.example.com`` for its
    subdomains, ``*`` for any); any other is refused with 400 (DNS rebinding).
    """
    dashboard = Dashboard(
        dsn=dsn,
        pool=pool,
        schema=schema,
        table=table,
        read_only=read_only,
        auth=auth,
        anonymous=anonymous,
        trace_url=trace_url,
        refresh=refresh,
        secret=secret,
        title=title,
        allowed_hosts=allowed_hosts,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await dashboard.aclose()

    routes = [
        *_pages.routes(),
        *_actions.routes(),
        *_flow.routes(),
        *_groups.routes(),
        Mount("/static", app=StaticFiles(packages=[("aiooutbox.web", "static")]), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.dashboard = dashboard
    app.add_middleware(Guard, dashboard=dashboard)
    return app
