"""``python -m aiooutbox``: run handlers, and operate an outbox from a shell.

Every command that talks to PostgreSQL takes ``--dsn`` (else ``$AIOOUTBOX_DSN``, else
``$DATABASE_URL``); with none configured it uses an embedded server kept in
``--data-dir`` (see `aiooutbox.embedded`). Results go to stdout, notes and errors to
stderr. Exit status: 0 success, 1 failure, 2 bad usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import asyncpg

from .. import embedded
from .._sql.db import permanent_message, permanent_reason
from .._values.text import describe_exception
from ..errors import OutboxError, SchemaNotReady
from . import logsetup
from .args import env_value, redact
from .commands import table_hint
from .errors import CommandError, UsageError
from .parser import build_parser

__all__ = ["build_parser", "main"]


# -- entry point --------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None, prog: str = "aiooutbox") -> int:
    """Run one command; return its exit status."""
    try:
        args = build_parser(prog).parse_args(argv)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    logsetup.configure(args.log_level, args.log_format)
    args.prog = prog
    args.started_embedded = None
    status = 1
    try:
        status = _call(args)
    finally:
        if status != 0 and args.started_embedded is not None:
            _stop_started_server(args)
    return status


def _stop_started_server(args: argparse.Namespace) -> None:
    """Never leave behind a server that a failed command started."""
    with contextlib.suppress(OutboxError, OSError):
        embedded.stop(args.started_embedded)
        print(
            f"{args.prog}: stopped the embedded PostgreSQL this command started "
            f"in {args.started_embedded}",
            file=sys.stderr,
        )


def _call(args: argparse.Namespace) -> int:
    prog = args.prog
    func: Callable[[argparse.Namespace], Coroutine[Any, Any, int]] = args.func
    try:
        return asyncio.run(func(args))
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except SchemaNotReady as exc:
        print(f"{prog}: error: {_migrate_hint(str(exc), args)}", file=sys.stderr)
        return 1
    except (CommandError, OutboxError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # stdout closed early, as by `| head`: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
        reason = permanent_reason(exc)
        if reason is not None and args.command == "migrate":
            reason = _MIGRATE_FIX.get(getattr(exc, "sqlstate", "")[:2], reason)
        if reason is not None:  # one line with the fix, not asyncpg's multi-line hint
            message = permanent_message(exc, f"{prog} {args.command}", reason)
        else:
            message = describe_exception(exc)
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


# what fixes a failed `migrate` (the general hints name the consumer's grants, or
# `migrate` itself)
_MIGRATE_FIX = {
    "42": "run migrate as the owner of the schema (a role with CREATE on it, and on the"
    " database if the schema does not exist yet), and check that no other object in the"
    " schema has the outbox's names (docs/deployment.md)",
}


def _dsn_flag(args: argparse.Namespace) -> str:
    """`` --dsn DSN`` (password redacted) for a DSN that `migrate` would not find by
    itself: one given on the command line (or in a file), not in the environment."""
    dsn = getattr(args, "dsn", None)
    if not isinstance(dsn, str) or not dsn:
        return ""
    if (env_value("AIOOUTBOX_DSN") or env_value("DATABASE_URL") or "").strip() == dsn:
        return ""
    return f" --dsn {shlex.quote(redact(dsn))}"


def _migrate_hint(message: str, args: argparse.Namespace) -> str:
    """The library's "run `python -m aiooutbox migrate`" with this command's database
    and outbox named, so that the command runs as shown."""
    hint = _dsn_flag(args) + table_hint(args)
    if getattr(args, "pgbouncer", False):
        hint += " --pgbouncer"
    if args.command == "run":
        hint += "` (or pass --migrate to run)"
    else:
        hint += "`"
    # a shell user needs the command, not the Python call the library also suggests
    message = message.replace(" or `await aiooutbox.migrate(pool)`", "")
    return message.replace("python -m aiooutbox migrate`", f"python -m aiooutbox migrate{hint}")
