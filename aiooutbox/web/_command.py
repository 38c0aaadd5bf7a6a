"""``python -m aiooutbox dashboard``: the parser entry and the command.

Imports nothing from the ``web`` extra until the command runs, so the command line
works (and says what to install) without it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys
from typing import Any

__all__ = ["add_dashboard_command", "cmd_dashboard"]

logger = logging.getLogger("aiooutbox.web")

DEFAULT_PORT = 8040


def add_dashboard_command(commands: Any, prog: str) -> None:
    from .._values.extras import install_hint
    from ..cli.args import DURATION, HOST, PORT, env_default, env_flag, env_value
    from ..cli.options import add_command, add_database_options, add_logging_options

    cmd = add_command(
        commands,
        "dashboard",
        "serve the operator dashboard (web UI) for an outbox",
        f"""
        {prog} dashboard --dsn postgresql://app@db/app
        {prog} dashboard --host 0.0.0.0 --port 8040 --users-file /etc/aiooutbox/users
        AIOOUTBOX_DASHBOARD_USER=ops AIOOUTBOX_DASHBOARD_PASSWORD=... {prog} dashboard \\
            --host 0.0.0.0
        {prog} dashboard --read-only --trace-url 'https://tempo.example.com/trace/{{trace_id}}'
        """,
        f"""
        Needs the web extra:
          {install_hint("web")}

        Permissions are read and write. With credentials (--users-file, lines of
        name:permission:password; or AIOOUTBOX_DASHBOARD_USER and
        AIOOUTBOX_DASHBOARD_PASSWORD, with AIOOUTBOX_DASHBOARD_PERMISSION read or write,
        default write) every request must log in with HTTP Basic. Without them: read
        and write on a loopback bind, read-only on any other. --read-only makes everyone
        read-only.
        """,
    )
    cmd.set_defaults(func=cmd_dashboard)
    cmd.add_argument(
        "--host",
        type=HOST,
        default=env_default("AIOOUTBOX_DASHBOARD_HOST", HOST, "127.0.0.1"),
        help="address to serve on (env AIOOUTBOX_DASHBOARD_HOST; default 127.0.0.1)",
    )
    cmd.add_argument(
        "--port",
        type=PORT,
        default=env_default("AIOOUTBOX_DASHBOARD_PORT", PORT, str(DEFAULT_PORT)),
        help=f"port (0: any free one; env AIOOUTBOX_DASHBOARD_PORT; default {DEFAULT_PORT})",
    )
    cmd.add_argument(
        "--read-only",
        action="store_true",
        default=env_flag("AIOOUTBOX_DASHBOARD_READ_ONLY"),
        help="no actions for anyone (env AIOOUTBOX_DASHBOARD_READ_ONLY=1)",
    )
    cmd.add_argument(
        "--users-file",
        metavar="PATH",
        default=env_value("AIOOUTBOX_DASHBOARD_USERS_FILE"),
        help="HTTP Basic users, one name:permission:password a line "
        "(env AIOOUTBOX_DASHBOARD_USERS_FILE)",
    )
    cmd.add_argument(
        "--trace-url",
        metavar="URL",
        default=env_value("AIOOUTBOX_DASHBOARD_TRACE_URL"),
        help="link an event's trace id: a URL containing {trace_id} "
        "(env AIOOUTBOX_DASHBOARD_TRACE_URL)",
    )
    cmd.add_argument(
        "--refresh",
        type=DURATION,
        metavar="DURATION",
        default=env_default("AIOOUTBOX_DASHBOARD_REFRESH", DURATION, "2s"),
        help="live update interval: one cheap query each, shared by every open page "
        "(env AIOOUTBOX_DASHBOARD_REFRESH; default 2s)",
    )
    cmd.add_argument(
        "--allowed-host",
        dest="allowed_hosts",
        action="append",
        metavar="NAME",
        default=_split(env_value("AIOOUTBOX_DASHBOARD_ALLOWED_HOSTS")),
        help="a host name browsers may reach it by, besides localhost and its address "
        "(repeat for several; .example.com: every subdomain; env "
        "AIOOUTBOX_DASHBOARD_ALLOWED_HOSTS, comma-separated); any other Host is refused",
    )
    add_database_options(cmd)
    add_logging_options(cmd, "info")


def _split(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def _access(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """(auth, anonymous permission, what the startup line says about access)."""
    from ..cli.errors import UsageError
    from ..errors import InvalidArgument
    from ._auth import BasicAuth, Permission, credentials_from_env, is_loopback

    try:
        auth = BasicAuth.from_file(args.users_file) if args.users_file else credentials_from_env()
    except InvalidArgument as exc:
        raise UsageError(str(exc)) from None
    if auth is not None:
        writers = sum(p == Permission.WRITE for _, p in auth.users.values())
        said = f"HTTP Basic login required ({len(auth.users)} user(s), {writers} with write)"
        return auth, None, said + ("; read-only (--read-only)" if args.read_only else "")
    if args.read_only:
        return None, Permission.READ, "read-only for everyone (--read-only)"
    if is_loopback(args.host):
        return None, Permission.WRITE, "read and write without login (loopback bind)"
    return (
        None,
        Permission.READ,
        f"READ-ONLY: bound to {args.host}, not loopback, and no credentials are set "
        "(set --users-file or AIOOUTBOX_DASHBOARD_USER/PASSWORD to allow actions)",
    )


def _hosts(args: argparse.Namespace) -> list[str]:
    """The allowed names: those given, and the bound name when it is one (an address
    needs no entry: a request that reached it may name it)."""
    import ipaddress

    hosts = list(args.allowed_hosts or ())
    try:
        ipaddress.ip_address(args.host)
    except ValueError:
        hosts.append(args.host)
    return hosts


def _server(config: Any, end_streams: Any) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server that ends the dashboard's live streams as it starts to stop:
        it waits for open responses before the app's shutdown, and a stream ends only
        when told (else it waits out its graceful timeout and cancels them, with errors
        logged)."""

        async def shutdown(self, sockets: Any = None) -> None:
            end_streams()
            await super().shutdown(sockets)

    return Server(config)


def _bind(host: str, port: int) -> socket.socket:
    from ..cli.errors import CommandError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CommandError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def cmd_dashboard(args: argparse.Namespace) -> int:
    import asyncpg

    from ..cli.args import redact
    from ..cli.connect import resolve_dsn
    from ..cli.errors import CommandError, UsageError
    from ..errors import InvalidArgument
    from ..migrations import check_schema
    from ._deps import MissingExtra, require

    try:
        require(server=True)
    except MissingExtra as exc:
        raise CommandError(str(exc)) from None
    import uvicorn

    from ._app import create_app
    from ._dashboard import POOL_OPTIONS

    auth, anonymous, access = _access(args)
    dsn = await resolve_dsn(args, log=True)
    try:
        pool = await asyncpg.create_pool(dsn, **POOL_OPTIONS)
    except Exception as exc:
        raise CommandError(f"cannot connect to {redact(dsn)}: {exc}") from None
    try:
        await check_schema(pool, schema=args.schema, table=args.table)
        try:
            app = create_app(
                pool=pool,
                schema=args.schema,
                table=args.table,
                read_only=args.read_only,
                auth=auth,
                anonymous=anonymous,
                trace_url=args.trace_url,
                refresh=args.refresh,
                allowed_hosts=_hosts(args),
            )
        except InvalidArgument as exc:
            raise UsageError(str(exc)) from None
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=3,
        )
        server = _server(config, app.state.dashboard.end_streams)
        sock = _bind(args.host, args.port)  # here, for a one-line error when taken
        port = sock.getsockname()[1]
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():  # uvicorn has no started event
            await asyncio.wait({task}, timeout=0.05)
        if task.done():
            with contextlib.suppress(SystemExit):
                await task
            raise CommandError(f"could not serve on {args.host}:{port}")
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(
            f"dashboard for {args.schema}.{args.table} on http://{host}:{port}/ ({access})",
            file=sys.stderr,
            flush=True,
        )
        await task
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(pool.close(), 10)
    return 0
