"""Who may do what: permissions, HTTP Basic credentials, same-origin and CSRF checks.

Permissions are ``none``, ``read`` and ``write``. They come from, in order: a callable
the host application passes (request → permission, like Oban Web's resolver), else
HTTP Basic credentials (a users file or environment variables), else the bind: a
dashboard nobody configured credentials for may change things only over loopback
(``anonymous``). ``read_only`` caps everyone at ``read``.

Every mutation is a POST that must come from the dashboard's own origin (``Origin`` /
``Sec-Fetch-Site``) and carry the session's token, an HMAC of a random session cookie.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import inspect
import ipaddress
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..errors import InvalidArgument

__all__ = [
    "AllowedHosts",
    "BasicAuth",
    "Permission",
    "Resolver",
    "credentials_from_env",
    "is_loopback",
]

SESSION_COOKIE = "aiooutbox_dashboard_session"
_PROXY_HEADERS = (b"forwarded", b"x-forwarded-for", b"x-real-ip")


class Permission(enum.IntEnum):
    """What a request may do: nothing, look, or also act (retry, purge)."""

    NONE = 0
    READ = 1
    WRITE = 2

    @classmethod
    def parse(cls, value: object) -> Permission:
        if isinstance(value, Permission):
            return value
        if isinstance(value, str) and value.strip().upper() in cls.__members__:
            return cls[value.strip().upper()]
        raise InvalidArgument(f"invalid permission {value!r}: use none, read or write")

    @property
    def label(self) -> str:
        return self.name.lower()


Resolver = Callable[[Any], "Permission | str | Awaitable[Permission | str]"]


@dataclass(frozen=True)
class BasicAuth:
    """HTTP Basic users: name → (password, permission). Compared in constant time."""

    users: Mapping[str, tuple[str, Permission]]
    realm: str = "aiooutbox"

    def __post_init__(self) -> None:
        if not self.users:
            raise InvalidArgument("BasicAuth needs at least one user")
        for name, (password, permission) in self.users.items():
            if not name or ":" in name or not password:
                raise InvalidArgument(
                    f"invalid dashboard user {name!r}: a name without ':' and a password"
                )
            Permission.parse(permission)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> BasicAuth:
        """One user a line, ``name:permission:password`` (``#`` comments, blank lines)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidArgument(f"cannot read the dashboard users file {path}: {exc}") from None
        users: dict[str, tuple[str, Permission]] = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, _, rest = line.partition(":")
            permission, _, password = rest.partition(":")
            if not name or not password:
                raise InvalidArgument(f"{path}, line {number}: expected name:permission:password")
            try:
                users[name] = (password, Permission.parse(permission))
            except InvalidArgument as exc:
                raise InvalidArgument(f"{path}, line {number}: {exc}") from None
        return cls(users)

    def check(self, header: str | None) -> tuple[str, Permission] | None:
        """The user and permission of an ``Authorization`` header, or None."""
        import base64
        import binascii

        if not header or header[:6].lower() != "basic ":
            return None
        try:
            decoded = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        name, sep, password = decoded.partition(":")
        if not sep:
            return None
        found: tuple[str, Permission] | None = None
        for user, (expected, permission) in self.users.items():
            # compare against every user so timing says nothing about which names exist
            same_name = hmac.compare_digest(user.encode(), name.encode())
            same_password = hmac.compare_digest(expected.encode(), password.encode())
            if same_name and same_password:
                found = (user, permission)
        return found


def credentials_from_env(environ: Mapping[str, str] | None = None) -> BasicAuth | None:
    """``AIOOUTBOX_DASHBOARD_USERS_FILE``, or ``AIOOUTBOX_DASHBOARD_USER`` with
    ``AIOOUTBOX_DASHBOARD_PASSWORD`` (and ``AIOOUTBOX_DASHBOARD_PERMISSION``, default
    write); None when neither is set."""
    env = os.environ if environ is None else environ
    path = env.get("AIOOUTBOX_DASHBOARD_USERS_FILE")
    user = env.get("AIOOUTBOX_DASHBOARD_USER")
    if path:
        return BasicAuth.from_file(path)
    if user:
        password = env.get("AIOOUTBOX_DASHBOARD_PASSWORD")
        if not password:
            raise InvalidArgument(
                "AIOOUTBOX_DASHBOARD_USER is set without AIOOUTBOX_DASHBOARD_PASSWORD"
            )
        permission = Permission.parse(env.get("AIOOUTBOX_DASHBOARD_PERMISSION", "write"))
        return BasicAuth({user: (password, permission)})
    return None


def is_loopback(host: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``."""
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def proxied(scope: Mapping[str, Any]) -> bool:
    """Did a proxy forward this request (then its socket says nothing about the client)?"""
    return any(name in _PROXY_HEADERS for name, _ in scope.get("headers", ()))


async def resolve(resolver: Resolver, request: Any) -> Permission:
    result = resolver(request)
    if inspect.isawaitable(result):
        result = await result
    return Permission.parse(result)


# -- the Host a request names (DNS rebinding) ------------------------------------------
def host_of(value: str) -> str:
    """The host of a ``Host`` header (or an allowed-host entry): without its port and
    brackets, lower case, without a trailing dot."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6] or [v6]:port
        value = value[1 : value.find("]")] if "]" in value else value[1:]
    elif value.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class AllowedHosts:
    """Which ``Host`` a request may name, against DNS rebinding: a page of another site
    whose name was made to resolve to this address sends its own name as the Host, and
    the browser then treats the dashboard as that site's (its pages, tokens and forms).

    Allowed: ``localhost`` and its subdomains (``*.localhost`` resolves to loopback in
    browsers), loopback addresses, the address the connection reached (the bound
    address; a page on another name cannot send that, since its Host is its name), and
    the configured names: exact, ``.example.com`` for every subdomain of it, or ``*``
    for any (then the check is off, as Django's ``ALLOWED_HOSTS = ["*"]``)."""

    def __init__(self, names: object = None) -> None:
        if names is None:
            names = ()
        if isinstance(names, str) or not isinstance(names, (list, tuple, set, frozenset)):
            raise InvalidArgument(
                f"allowed_hosts must be a list of host names, not {type(names).__name__}"
            )
        exact: set[str] = set()
        suffixes: list[str] = []
        self.any = False
        for raw in names:
            if not isinstance(raw, str) or not raw.strip():
                raise InvalidArgument(f"invalid allowed host {raw!r}: give a host name")
            text = raw.strip().lower()
            if text == "*":
                self.any = True
                continue
            if any(c in text for c in "/@ \t?#") or text.startswith("http"):
                raise InvalidArgument(
                    f"invalid allowed host {raw!r}: a host name such as ops.example.com"
                    " (no scheme, path or port; .example.com for every subdomain)"
                )
            if text.startswith("."):
                suffixes.append(text.rstrip("."))
            else:
                exact.add(host_of(text))
        self.exact = frozenset(exact)
        self.suffixes = tuple(suffixes)

    def allows(self, header: str | None, server: tuple[Any, ...] | None) -> bool:
        """Whether a request may be answered: ``header`` is its Host (None: none was
        sent, as HTTP/1.0 allows; no browser does), ``server`` the ASGI scope's."""
        if self.any or header is None:
            return True
        host = host_of(header)
        if host == "localhost" or host.endswith(".localhost") or host in self.exact:
            return True
        if any(host.endswith(s) or host == s[1:] for s in self.suffixes):
            return True
        address = _ip(host)
        if address is not None and address.is_loopback:
            return True
        if server and isinstance(server[0], str):
            bound = host_of(server[0]) if not server[0].startswith("/") else ""
            if bound and (host == bound or (address is not None and address == _ip(bound))):
                return True
        return False


# -- same origin and the per-session token ---------------------------------------------
def same_origin(headers: Mapping[str, str]) -> bool:
    """Refuse what a browser says came from elsewhere; a client that sends neither
    header (curl, a script) is let through to the token check."""
    site = headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = headers.get("origin")
    if origin is None:
        return True
    if origin == "null":
        return False
    host = headers.get("host", "")
    return urlsplit(origin).netloc.lower() == host.lower()


class Tokens:
    """Per-session tokens: HMAC(secret, session cookie). The secret is random per
    process unless given (several processes behind one address need the same one)."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret or secrets.token_bytes(32)

    @staticmethod
    def new_session() -> str:
        return secrets.token_urlsafe(24)

    def token(self, session: str) -> str:
        raw = session.encode("utf-8", "surrogatepass")
        return hmac.new(self._secret, raw, hashlib.sha256).hexdigest()

    def valid(self, session: str | None, token: str | None) -> bool:
        if not session or not token:
            return False
        # as bytes: compare_digest refuses a str with a non-ASCII character (TypeError),
        # and a token a client sent may hold any
        sent = token.encode("utf-8", "surrogatepass")
        return hmac.compare_digest(self.token(session).encode(), sent)
