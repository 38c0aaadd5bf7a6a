"""`Dashboard`: the state every route shares (database, queries, templates, live hub,
auth), apart from the app and its routes so that the routes can name it."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

import asyncpg
from jinja2 import Environment, PackageLoader, select_autoescape

from ..errors import InvalidArgument
from ._auth import (
    AllowedHosts,
    BasicAuth,
    Permission,
    Resolver,
    Tokens,
    is_loopback,
    proxied,
    resolve,
)
from ._data import PastHours
from ._live import Cache, LiveHub
from ._sql import web_queries

__all__ = ["POOL_OPTIONS", "Dashboard", "unavailable"]

logger = logging.getLogger("aiooutbox.web")

STATEMENT_TIMEOUT = 10.0  # seconds the server lets a statement of ours run
# the client's own bounds, for a network that stops passing data (the server's timeout
# then never arrives): a statement a little after the server's, a connection's start,
# a pool connection when all are busy
COMMAND_TIMEOUT = STATEMENT_TIMEOUT + 2
CONNECT_TIMEOUT = 5.0
ACQUIRE_TIMEOUT = COMMAND_TIMEOUT + CONNECT_TIMEOUT
# the pool the dashboard opens (create_app(dsn=...) and the command): no floor of
# connections, which asyncpg would restore in the background while the database is
# away, logging a traceback a try; a request opens what it needs
POOL_OPTIONS: dict[str, Any] = {
    "min_size": 0,
    "max_size": 4,
    "timeout": CONNECT_TIMEOUT,
    "command_timeout": COMMAND_TIMEOUT,
    "server_settings": {
        "application_name": "aiooutbox dashboard",
        "statement_timeout": f"{STATEMENT_TIMEOUT:.0f}s",
        "jit": "off",
    },
}

# what a request meets when the database cannot be reached or does not answer, rather
# than a fault of the request or of ours
_UNAVAILABLE = (
    OSError,  # refused, reset, unreachable
    TimeoutError,  # no answer within the timeouts above
    asyncpg.ConnectionDoesNotExistError,  # closed under us (a terminated backend)
    asyncpg.PostgresConnectionError,  # class 08
    asyncpg.OperatorInterventionError,  # class 57: shutdown, terminated, statement_timeout
    asyncpg.InsufficientResourcesError,  # class 53: too many connections
    asyncpg.InvalidCatalogNameError,  # the database is gone
    asyncpg.InvalidAuthorizationSpecificationError,  # class 28: the role may not log in
)
_SECRET = re.compile(r"(://[^:/@\s]*:)[^@\s]*@|(password\s*=\s*)\S+", re.IGNORECASE)


def unavailable(exc: BaseException) -> str | None:
    """Why the database is unavailable, when ``exc`` says it is (one line, no
    password), else None."""
    refused = isinstance(exc, asyncpg.ObjectNotInPrerequisiteStateError) and (
        "not currently accepting connections" in str(exc)  # ALLOW_CONNECTIONS false
    )
    if not refused and not isinstance(exc, _UNAVAILABLE):
        return None
    if isinstance(exc, TimeoutError) and not str(exc):
        text = f"no answer within {COMMAND_TIMEOUT:g} s"
    else:
        text = str(exc).strip() or type(exc).__name__
    text = _SECRET.sub(lambda m: (m[1] or m[2]) + "***" + ("@" if m[1] else ""), text)
    return " ".join(text.split())[:300]


class Dashboard:
    """Everything the routes share: the database, queries, templates, live hub, auth."""

    def __init__(
        self,
        *,
        dsn: str | None,
        pool: asyncpg.Pool | None,
        schema: str,
        table: str,
        read_only: bool,
        auth: BasicAuth | Resolver | None,
        anonymous: Permission | str | None,
        trace_url: str | None,
        refresh: float,
        secret: bytes | None,
        title: str,
        allowed_hosts: object = None,
    ) -> None:
        if (dsn is None) == (pool is None):
            raise InvalidArgument("create_app needs exactly one of dsn=... or pool=...")
        if not isinstance(refresh, (int, float)) or not 0.25 <= refresh <= 3600:
            raise InvalidArgument(f"refresh must be 0.25-3600 seconds, got {refresh!r}")
        if trace_url is not None and (
            not trace_url.startswith(("https://", "http://")) or "{trace_id}" not in trace_url
        ):
            raise InvalidArgument(
                "trace_url must be an http(s) URL containing {trace_id}, e.g. "
                "https://tempo.example.com/trace/{trace_id}"
            )
        self.allowed_hosts = AllowedHosts(allowed_hosts)
        self.w = web_queries(schema, table)
        self.dsn = dsn
        self._pool = pool
        self._own_pool = pool is None
        self.read_only = read_only
        self.auth = auth
        self.anonymous = None if anonymous is None else Permission.parse(anonymous)
        self.trace_url = trace_url
        self.title = title
        self.tokens = Tokens(secret)
        self.hub = LiveHub(self.connection, self.w, float(refresh))
        self.cache = Cache(float(refresh), self.hub.read_pulse)  # each view's data
        self.counts = Cache(float(refresh), self.hub.read_pulse)  # the exact backlog
        self.past_hours = PastHours()  # the day's per-minute counts, hour by hour
        self.templates = Environment(
            loader=PackageLoader("aiooutbox.web", "templates"),
            autoescape=select_autoescape(default=True, default_for_string=True),
            trim_blocks=True,
            lstrip_blocks=True,
        )

    async def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            assert self.dsn is not None
            self._pool = await asyncpg.create_pool(self.dsn, **POOL_OPTIONS)
        return self._pool

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        pool = await self.pool()
        async with pool.acquire(timeout=ACQUIRE_TIMEOUT) as conn:
            yield conn

    def end_streams(self) -> None:
        """End the open live streams (and refuse new ones): call it as the server serving
        the app starts to stop, since a server waits for open responses to end."""
        self.hub.end_streams()

    def changed(self) -> None:
        """An action changed the outbox: every page reads it again."""
        self.cache.clear()
        self.counts.clear()

    async def aclose(self) -> None:
        """Stop the live updates; close the pool if the dashboard opened it."""
        await self.hub.close()
        await self.counts.close()
        await self.cache.close()
        pool, self._pool = self._pool, None
        if pool is not None and self._own_pool:
            await pool.close()

    async def permission(self, scope: dict[str, Any]) -> tuple[Permission, str, bool]:
        """(permission, actor, ask for credentials) of a request."""
        from starlette.requests import Request

        client = scope.get("client") or ("?", 0)
        if isinstance(self.auth, BasicAuth):
            headers = dict(scope.get("headers", ()))
            raw = headers.get(b"authorization")
            found = self.auth.check(raw.decode("latin-1") if raw else None)
            if found is None:
                return Permission.NONE, "", True
            user, permission = found
            actor = user
        elif self.auth is not None:
            permission = await resolve(self.auth, Request(scope))
            named = scope.get("state", {}).get("dashboard_actor")  # set by the resolver
            actor = str(named or f"app user at {client[0]}")
        else:
            permission = self.anonymous if self.anonymous is not None else self._by_socket(scope)
            actor = f"anonymous at {client[0]}"
        if self.read_only:
            permission = min(permission, Permission.READ)
        return permission, actor, False

    @staticmethod
    def _by_socket(scope: Mapping[str, Any]) -> Permission:
        server = scope.get("server") or ("", 0)
        if is_loopback(server[0]) and not proxied(scope):
            return Permission.WRITE
        return Permission.READ
