"""Building blocks of the command line: errors, argument types, option groups, connections.

Argument types also convert defaults taken from the environment, so a bad
``$AIOOUTBOX_...`` value is reported like a bad flag, naming the variable.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import logging
import os
import re
import socket
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit, urlunsplit

import anyio
import asyncpg

from . import _logging, admin, embedded
from ._sql import _MAX_TABLE, validate_identifier
from .errors import InvalidArgument
from .migrations import check_schema, migrate

logger = logging.getLogger("aiooutbox.cli")

CONNECT_TIMEOUT = 5.0


class UsageError(Exception):
    """Bad input from the command line: exit status 2."""


class CommandError(Exception):
    """The command could not do its job: exit status 1."""


# -- argument types (also applied to defaults taken from the environment) -------------
def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name) or default


def env_default(name: str, convert: Callable[[str], Any], fallback: str | None) -> Any:
    """``$name`` converted (a bad value is a usage error naming it), else ``fallback``."""
    value = _env(name)
    if value is None:
        return fallback  # argparse converts a string default itself
    try:
        return convert(value)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        raise UsageError(f"${name}: {exc}") from None


def env_flag(name: str) -> bool:
    value = (_env(name) or "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise UsageError(f"${name} must be 1/0, true/false, yes/no or on/off, not {value!r}")


def _argument_type(func: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return func(text)
        except (ValueError, TypeError) as exc:  # InvalidArgument is a ValueError
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name
    return convert


def _positive_int(text: str) -> int:
    if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < 1:
        raise InvalidArgument(f"expected a positive integer, got {text!r}")
    return int(text)


def _choice(*options: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text.lower() not in options:
            raise InvalidArgument(f"expected one of {', '.join(options)}, got {text!r}")
        return text.lower()

    return check


def _topic_list(text: str) -> list[str]:
    topics = [t.strip() for t in text.split(",") if t.strip()]
    if not topics:
        raise InvalidArgument("expected comma-separated topic names")
    return topics


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"invalid JSON {_clip(text)!r}: {exc}") from None


def _json_object(text: str) -> dict[str, Any]:
    value = _json_value(text)
    if not isinstance(value, dict):
        raise InvalidArgument(f'expected a JSON object like \'{{"key": "value"}}\', got {text!r}')
    return value


def _dsn(text: str) -> str:
    """A PostgreSQL URL, checked before anything connects: a typo is a usage error."""
    dsn = text.strip()
    scheme, sep, _ = dsn.partition("://")
    if not sep or scheme not in ("postgresql", "postgres"):
        raise InvalidArgument(
            f"invalid DSN {_clip(redact(dsn))!r}: expected "
            "postgresql://user:password@host:port/database"
        )
    try:
        # several hosts (host1:port1,host2:port2, for failover): check every port
        for host in urlsplit(dsn).netloc.rpartition("@")[2].split(","):
            urlsplit(f"postgresql://{host}").port  # noqa: B018 - raises on a malformed port
    except ValueError as exc:
        raise InvalidArgument(f"invalid DSN {_clip(redact(dsn))!r}: {exc}") from None
    return dsn


def _clip(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InvalidArgument(f"expected a number such as 2 or 1.5, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise InvalidArgument(f"expected a finite number >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _number(text)
    if value > 1:
        raise InvalidArgument(f"expected a number from 0 to 1, got {text!r}")
    return value


def _optional_duration(text: str) -> float | None:
    if text.strip().lower() in ("none", "off", "never"):
        return None
    return admin.parse_duration(text)


def _port(text: str) -> int:
    if not re.fullmatch(r"\s*\d+\s*", text) or not 0 <= int(text) <= 65535:
        raise InvalidArgument(f"expected a TCP port between 0 and 65535, got {_clip(text)!r}")
    return int(text)


def _host(text: str) -> str:
    host = text.strip().removeprefix("[").removesuffix("]")
    if not host or any(c.isspace() or c in "/?#@" for c in host):
        raise InvalidArgument(f"expected a host name or IP address, got {_clip(text)!r}")
    return host


POSITIVE_INT = _argument_type(_positive_int, "positive_int")
PORT = _argument_type(_port, "port")
HOST = _argument_type(_host, "host")
DURATION = _argument_type(admin.parse_duration, "duration")
OPTIONAL_DURATION = _argument_type(_optional_duration, "duration")
NUMBER = _argument_type(_number, "number")
FRACTION = _argument_type(_fraction, "fraction")
TOPICS = _argument_type(_topic_list, "topics")
DSN = _argument_type(_dsn, "dsn")
JSON = _argument_type(_json_value, "json")
JSON_OBJECT = _argument_type(_json_object, "json_object")
SCHEMA = _argument_type(lambda s: validate_identifier("schema", s), "schema")
TABLE = _argument_type(lambda s: validate_identifier("table", s, _MAX_TABLE), "table")


def choices(*options: str) -> Callable[[str], str]:
    """An argument type accepting one of ``options``, in any case."""
    return _argument_type(_choice(*options), "choice")


LEVEL = choices(*_logging.LEVELS)
LOG_FORMAT = choices("text", "json")


# -- parser building -------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """Short errors; ``--delay -5s`` reaches the argument's type instead of being taken
    for an unknown option (no option here starts with ``-`` and a digit)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d[\d.a-z]*$")

    def error(self, message: str) -> NoReturn:
        """Two lines instead of the usage wall: what is wrong, and where help is."""
        self.exit(2, f"{self.prog}: error: {message}\n(see `{self.prog} --help`)\n")


class Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=100)


def add_database_options(
    parser: argparse.ArgumentParser, *, table: str | None = None, dsn: bool = True
) -> None:
    group = parser.add_argument_group("database")
    if dsn:
        env = "AIOOUTBOX_DSN" if _env("AIOOUTBOX_DSN") else "DATABASE_URL"
        group.add_argument(
            "--dsn",
            type=DSN,
            default=env_default(env, DSN, None),
            help="PostgreSQL DSN, postgresql://user:password@host:port/database "
            "(env AIOOUTBOX_DSN, then DATABASE_URL; without one: the embedded server)",
        )
        group.add_argument(
            "--pgbouncer",
            action="store_true",
            default=env_flag("AIOOUTBOX_PGBOUNCER"),
            help="the DSN goes through PgBouncer in transaction mode: no prepared-statement "
            "cache (env AIOOUTBOX_PGBOUNCER=1)",
        )
        group.add_argument(
            "--schema",
            type=SCHEMA,
            default=env_default("AIOOUTBOX_SCHEMA", SCHEMA, "public"),
            help="schema of the outbox table (env AIOOUTBOX_SCHEMA; default public)",
        )
        if table is None:
            group.add_argument(
                "--table",
                type=TABLE,
                default=env_default("AIOOUTBOX_TABLE", TABLE, "outbox_events"),
                help="outbox table (env AIOOUTBOX_TABLE; default outbox_events)",
            )
        else:
            group.add_argument("--table", type=TABLE, default=table, help=f"default {table}")
    group.add_argument(
        "--data-dir",
        type=Path,
        default=_env("AIOOUTBOX_DATA_DIR"),
        help="data directory of the embedded server (env AIOOUTBOX_DATA_DIR; default "
        f"{embedded.DEFAULT_DATA_DIR.as_posix()} in the project root: the nearest directory "
        "upward holding .aiooutbox, pyproject.toml, setup.py, setup.cfg or .git)",
    )


def add_listen_options(parser: argparse.ArgumentParser) -> None:
    """``--listen-dsn`` / ``--no-listen``: how a long-running command hears of new events.

    LISTEN needs a session of its own, which PgBouncer in transaction mode cannot give:
    behind it, listen on a direct DSN or poll only.
    """
    group = parser.add_argument_group("wake-ups")
    which = group.add_mutually_exclusive_group()
    which.add_argument(
        "--listen-dsn",
        type=DSN,
        metavar="DSN",
        default=env_default("AIOOUTBOX_LISTEN_DSN", DSN, None),
        help="LISTEN on this DSN, straight to PostgreSQL, instead of one like --dsn "
        "(env AIOOUTBOX_LISTEN_DSN)",
    )
    which.add_argument(
        "--no-listen",
        dest="listen",
        action="store_false",
        default=not env_flag("AIOOUTBOX_NO_LISTEN"),
        help="no LISTEN: find new events by polling every --poll-interval "
        "(env AIOOUTBOX_NO_LISTEN=1)",
    )


def check_listen_options(args: argparse.Namespace) -> None:
    """Refuse a combination that would silently lose wake-ups; call before connecting."""
    if args.listen_dsn is not None and not args.listen:
        raise UsageError("--listen-dsn and --no-listen (or their env variables) contradict")
    if args.pgbouncer and args.listen and args.listen_dsn is None:
        raise UsageError(
            "--pgbouncer: LISTEN does not work through PgBouncer in transaction mode "
            "(notifications go to whichever client has the server connection); pass "
            "--listen-dsn with a DSN straight to PostgreSQL, or --no-listen to poll"
        )


def add_metrics_options(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port`` / ``--metrics-host``: serve ``/metrics`` and ``/healthz``.

    Shared by the long-running commands (``run``, ``relay``); `check_metrics_options`
    validates the pair and ``_runner.telemetry`` serves them.
    """
    group = parser.add_argument_group("metrics and health")
    group.add_argument(
        "--metrics-port",
        type=PORT,
        metavar="PORT",
        default=env_default("AIOOUTBOX_METRICS_PORT", PORT, None),
        help="serve Prometheus /metrics and /healthz on this port (0: any free port; "
        'needs the prometheus extra: pip install "aiooutbox[prometheus]"; '
        "env AIOOUTBOX_METRICS_PORT; default: no server)",
    )
    group.add_argument(
        "--metrics-host",
        type=HOST,
        metavar="HOST",
        default=env_default("AIOOUTBOX_METRICS_HOST", HOST, None),
        help="address to serve them on; 0.0.0.0 (or ::) for every interface "
        "(env AIOOUTBOX_METRICS_HOST; default 127.0.0.1)",
    )


def check_metrics_options(args: argparse.Namespace) -> None:
    """Refuse ``--metrics-host`` without a port, and a missing prometheus_client."""
    if args.metrics_port is None:
        if args.metrics_host is not None:
            raise UsageError("--metrics-host needs --metrics-port (or $AIOOUTBOX_METRICS_PORT)")
        return
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise UsageError(
            '--metrics-port needs prometheus_client: pip install "aiooutbox[prometheus]"'
        ) from None


def add_logging_options(parser: argparse.ArgumentParser, level: str) -> None:
    group = parser.add_argument_group("logging")
    group.add_argument(
        "--log-level",
        metavar="{" + ",".join(_logging.LEVELS) + "}",
        type=LEVEL,
        default=env_default("AIOOUTBOX_LOG_LEVEL", LEVEL, level),
        help=f"(env AIOOUTBOX_LOG_LEVEL; default {level})",
    )
    group.add_argument(
        "--log-format",
        metavar="{text,json}",
        type=LOG_FORMAT,
        default=env_default("AIOOUTBOX_LOG_FORMAT", LOG_FORMAT, "text"),
        help="text, or one JSON object per line (env AIOOUTBOX_LOG_FORMAT; default text)",
    )


def add_command(
    commands: Any, name: str, summary: str, examples: str, notes: str = ""
) -> argparse.ArgumentParser:
    description = summary[0].upper() + summary[1:] + "."
    parser: argparse.ArgumentParser = commands.add_parser(
        name,
        help=summary,
        description=description + ("\n\n" + inspect.cleandoc(notes) if notes else ""),
        epilog="examples:\n" + textwrap.indent(inspect.cleandoc(examples), "  "),
        formatter_class=Formatter,
    )
    return parser


# -- connecting ---------------------------------------------------------------------------
def redact(dsn: str) -> str:
    """``dsn`` with any password replaced by ``***``."""
    dsn = re.sub(r"(password=)[^&\s]*", r"\1***", dsn)
    try:
        parts = urlsplit(dsn)
        password = parts.password
    except ValueError:
        return dsn
    if not password:
        return dsn
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=user.split(":", 1)[0] + ":***@" + host))


def _reason(exc: BaseException) -> str:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return f"no answer within {CONNECT_TIMEOUT:g}s"
    if isinstance(exc, ConnectionRefusedError):
        return f"{exc} (is PostgreSQL running there?)"
    if isinstance(exc, socket.gaierror):
        return f"{exc} (is the host name spelled right?)"
    return str(exc) or type(exc).__name__


def resolve_data_dir(args: argparse.Namespace) -> Path:
    """``--data-dir`` as given, else the project's (`embedded.default_data_dir`)."""
    if args.data_dir is None:
        args.data_dir = embedded.default_data_dir()
    path: Path = args.data_dir
    return path


async def ensure_embedded(args: argparse.Namespace) -> str:
    """Start or reuse the embedded server; say loudly when this creates a new one.

    A server this command started is recorded in ``args.started_embedded``, so that
    `main` stops it again when the command fails.
    """
    data_dir = resolve_data_dir(args)
    fresh = not embedded.initialised(data_dir)
    running = embedded.status(data_dir) is not None if not fresh else False
    dsn = await embedded.ensure(data_dir)
    if not running:
        args.started_embedded = data_dir
    if fresh:
        print(
            f"{args.prog}: created a new embedded PostgreSQL in {data_dir.resolve()} "
            "(none there yet; commands run anywhere in this project share it, "
            "--data-dir or $AIOOUTBOX_DATA_DIR picks another)",
            file=sys.stderr,
        )
    return dsn


async def resolve_dsn(args: argparse.Namespace, *, log: bool = False) -> str:
    """``--dsn`` (or its environment variables), else the embedded server's DSN, announced."""
    if args.dsn:
        dsn: str = args.dsn
        return dsn
    dsn = await ensure_embedded(args)
    note = f"using the embedded PostgreSQL in {args.data_dir}: {dsn}"
    if log:  # a runner: say it once, with how to stop the server
        logger.info("%s (it keeps running; `%s embedded stop` stops it)", note, args.prog)
    else:
        print(f"{args.prog}: {note}", file=sys.stderr)
    return dsn


def _cache(pgbouncer: bool) -> dict[str, Any]:
    # asyncpg names and caches prepared statements per connection; behind PgBouncer in
    # transaction mode the next statement may run on another server connection, where
    # that name does not exist. Without the cache it uses unnamed statements.
    return {"statement_cache_size": 0} if pgbouncer else {}


async def connect(dsn: str, *, pgbouncer: bool = False) -> Any:
    """One connection, or a one-line `CommandError` within `CONNECT_TIMEOUT` seconds."""
    try:
        return await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT, **_cache(pgbouncer))
    except Exception as exc:
        raise CommandError(f"cannot connect to {redact(dsn)}: {_reason(exc)}") from None


@contextlib.asynccontextmanager
async def database(args: argparse.Namespace, *, check: bool = True) -> AsyncIterator[Any]:
    """A connection to the configured database, its outbox schema checked."""
    conn = await connect(await resolve_dsn(args), pgbouncer=args.pgbouncer)
    try:
        if check:
            await check_schema(conn, schema=args.schema, table=args.table)
        yield conn
    finally:
        with anyio.CancelScope(shield=True):
            await conn.close(timeout=5)


async def apply_migrations(
    db: asyncpg.Connection | asyncpg.Pool, args: argparse.Namespace
) -> list[int]:
    """`migrate`; safe behind PgBouncer in transaction mode as it is (each step is one
    transaction holding its own transaction-level advisory lock)."""
    return await migrate(db, schema=args.schema, table=args.table)


@contextlib.asynccontextmanager
async def open_pool(dsn: str, *, pgbouncer: bool = False) -> AsyncIterator[asyncpg.Pool]:
    """A small pool, closed on exit.

    A consumer claims, settles and maintains on up to four connections at once; its
    LISTEN connection is its own.
    """
    try:
        pool = await asyncpg.create_pool(
            dsn, min_size=1, max_size=5, timeout=CONNECT_TIMEOUT, **_cache(pgbouncer)
        )
    except Exception as exc:
        raise CommandError(f"cannot connect to {redact(dsn)}: {_reason(exc)}") from None
    try:
        yield pool
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(10) as scope:
            await pool.close()
        if scope.cancelled_caught:
            pool.terminate()
