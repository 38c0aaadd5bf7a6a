"""The option groups the commands share, the parser class, and how a command is added.

``--dsn``/``--schema``/``--table``/``--data-dir``, ``--listen-dsn``/``--no-listen``,
``--metrics-port``/``--metrics-host`` and the logging flags are written once here, with
the checks of combinations argparse cannot express (`check_listen_options`,
`check_metrics_options`).
"""

from __future__ import annotations

import argparse
import inspect
import re
import textwrap
from pathlib import Path
from typing import Any, NoReturn

from .. import embedded
from .._values.extras import install_hint
from . import logsetup
from .args import (
    DSN,
    HOST,
    LEVEL,
    LOG_FORMAT,
    PORT,
    SCHEMA,
    TABLE,
    env_default,
    env_flag,
    env_value,
)
from .databases import TARGET
from .errors import UsageError


def _data_dir(text: str) -> Path:
    """``--data-dir``: refused at once when it is empty (the current directory) or an
    existing directory holding no cluster, before a server is started in it."""
    refused = embedded.refusal(text)
    if refused is not None:
        raise argparse.ArgumentTypeError(refused)
    return Path(text)


DATA_DIR = _data_dir


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
    parser: argparse.ArgumentParser,
    *,
    table: str | None = None,
    dsn: bool = True,
    many: bool = False,
) -> None:
    """``many``: ``--dsn`` repeatable as ``[NAME=]DSN`` and ``--dsn-file``, read into
    a list of `databases.Target` by `databases.targets` (the environment too)."""
    group = parser.add_argument_group("database")
    if dsn and many:
        group.add_argument(
            "--dsn",
            type=TARGET,
            action="append",
            metavar="[NAME=]DSN",
            help="PostgreSQL DSN, postgresql://user:password@host:port/database; repeat it "
            "for several databases, each optionally named (NAME=DSN; default host:port/"
            "dbname) (env AIOOUTBOX_DSN, then DATABASE_URL; without one: the embedded server)",
        )
        group.add_argument(
            "--dsn-file",
            type=Path,
            metavar="FILE",
            help="databases to serve, one [NAME=]DSN per line, # comments "
            "(env AIOOUTBOX_DSN_FILE; adds to --dsn)",
        )
    elif dsn:
        env = "AIOOUTBOX_DSN" if env_value("AIOOUTBOX_DSN") else "DATABASE_URL"
        group.add_argument(
            "--dsn",
            type=DSN,
            default=env_default(env, DSN, None),
            help="PostgreSQL DSN, postgresql://user:password@host:port/database "
            "(env AIOOUTBOX_DSN, then DATABASE_URL; without one: the embedded server)",
        )
    if dsn:
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
        type=DATA_DIR,
        # without it, `connect.resolve_data_dir` reads and checks $AIOOUTBOX_DATA_DIR when
        # the embedded server is needed (a command given --dsn never uses it)
        default=None,
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
    validates the pair and ``run.telemetry`` serves them.
    """
    group = parser.add_argument_group("metrics and health")
    group.add_argument(
        "--metrics-port",
        type=PORT,
        metavar="PORT",
        default=env_default("AIOOUTBOX_METRICS_PORT", PORT, None),
        help="serve Prometheus /metrics and /healthz on this port (0: any free port; "
        f"needs the prometheus extra: {install_hint('prometheus')}; "
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
            f"--metrics-port needs prometheus_client: {install_hint('prometheus')}"
        ) from None


def add_logging_options(parser: argparse.ArgumentParser, level: str) -> None:
    group = parser.add_argument_group("logging")
    group.add_argument(
        "--log-level",
        metavar="{" + ",".join(logsetup.LEVELS) + "}",
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
