"""``python -m aiooutbox``: run handlers, and operate an outbox from a shell.

Every command that talks to PostgreSQL takes ``--dsn`` (else ``$AIOOUTBOX_DSN``, else
``$DATABASE_URL``); with none configured it uses an embedded server kept in
``--data-dir`` (see `aiooutbox.embedded`). Results go to stdout, notes and errors to
stderr. Exit status: 0 success, 1 failure, 2 bad usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import anyio
import asyncpg

from . import _logging, _output, admin, embedded
from ._cliconsumer import add_consumer_options
from ._cliutil import (
    DURATION,
    JSON,
    JSON_OBJECT,
    POSITIVE_INT,
    CommandError,
    Formatter,
    Parser,
    UsageError,
    add_command,
    add_database_options,
    add_listen_options,
    add_logging_options,
    add_metrics_options,
    apply_migrations,
    choices,
    database,
    ensure_embedded,
    open_pool,
    resolve_data_dir,
    resolve_dsn,
)
from ._runner import cmd_run
from ._version import __version__
from .consumer import OutboxConsumer
from .errors import InvalidArgument, OutboxError, SchemaNotReady
from .migrations import migration_sql
from .producer import enqueue
from .retry import RetryPolicy

__all__ = ["build_parser", "main"]

_CONSUMER = {k: p.default for k, p in inspect.signature(OutboxConsumer).parameters.items()}
_RETRY = RetryPolicy()


# -- the parser -------------------------------------------------------------------------
def build_parser(prog: str = "aiooutbox") -> argparse.ArgumentParser:
    parser = Parser(
        prog=prog,
        description="A transactional outbox and work queue on one PostgreSQL table: "
        "run handlers, and operate the queue.",
        epilog=f"First time? Try: {prog} demo\nHelp on a command: {prog} COMMAND --help",
        formatter_class=Formatter,
    )
    parser.add_argument("--version", action="version", version=f"aiooutbox {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = add_command(
        commands,
        "run",
        "run handlers for the outbox's events until SIGTERM or SIGINT",
        f"""
        {prog} run myapp.jobs:handlers --dsn postgresql://app@db/app
        {prog} run myapp.jobs:router --concurrency 16 --topics orders.created,emails.send
        AIOOUTBOX_DSN=postgresql://app@db/app {prog} run myapp.jobs:make_handlers --migrate
        {prog} run myapp.jobs:handlers --handler-timeout 30s --retry-base 5s --retention none
        {prog} run myapp.jobs:handlers --dsn postgresql://app@pgbouncer:6432/app --pgbouncer \\
            --listen-dsn postgresql://app@db:5432/app
        """,
        """
        MODULE:HANDLERS names a mapping of topic to async handler, an aiooutbox.Router,
        or a zero-argument (async) function returning one. The first SIGTERM/SIGINT stops
        claiming and lets running handlers finish (up to --shutdown-grace); a second
        one cancels them and releases their events at once. Exit status 0 after a stop,
        non-zero after any fatal error. A DURATION is 500ms, 30s, 15m, 12h, 7d, 1w or
        1h30m; a bare number is seconds. Behind PgBouncer in transaction mode, pass
        --pgbouncer and --listen-dsn (direct to PostgreSQL) or --no-listen.
        """,
    )
    run.set_defaults(func=cmd_run)
    run.add_argument("handlers", metavar="MODULE:HANDLERS", help="e.g. myapp.jobs:handlers")
    add_consumer_options(run, topics_help="default: all handled")
    add_listen_options(run)
    add_metrics_options(run)
    add_database_options(run)
    add_logging_options(run, "info")

    from .relay._runner import add_relay_command  # the relay's extras load only when used

    add_relay_command(commands, prog)

    mig = add_command(
        commands,
        "migrate",
        "create or upgrade the outbox schema (idempotent)",
        f"""
        {prog} migrate --dsn postgresql://app@db/app
        {prog} migrate --sql > outbox.sql        # for your own migration tool or psql
        """,
    )
    mig.set_defaults(func=cmd_migrate)
    mig.add_argument("--sql", action="store_true", help="print the SQL instead of applying it")
    add_database_options(mig)
    add_logging_options(mig, "warning")

    enq = add_command(
        commands,
        "enqueue",
        "add one event and print its id",
        f"""
        {prog} enqueue orders.created '{{"order_id": 42}}'
        {prog} enqueue emails.send '{{"to": "a@example.com"}}' --dedupe-key welcome-a --delay 10m
        """,
    )
    enq.set_defaults(func=cmd_enqueue)
    enq.add_argument("topic", help="topic of the event")
    enq.add_argument("payload", metavar="PAYLOAD_JSON", type=JSON, help="payload, as JSON")
    enq.add_argument("--dedupe-key", help="do nothing if an event with this key exists")
    enq.add_argument(
        "--delay",
        type=DURATION,
        metavar="DURATION",
        help="make it available later, e.g. 30s, 15m, or 90 (a bare number is seconds)",
    )
    enq.add_argument("--max-attempts", type=POSITIVE_INT, metavar="N", help="default 5")
    enq.add_argument("--headers", type=JSON_OBJECT, help="a JSON object of headers")
    add_database_options(enq)
    add_logging_options(enq, "warning")

    sta = add_command(
        commands,
        "stats",
        "show events by topic and status, lag, events in flight by worker, dead count",
        f"""
        {prog} stats
        {prog} stats --json | jq .lag_seconds
        """,
    )
    sta.set_defaults(func=cmd_stats)
    sta.add_argument("--json", action="store_true", help="print JSON for scripts")
    add_database_options(sta)
    add_logging_options(sta, "warning")

    dead = add_command(
        commands,
        "dead",
        "list, retry or purge dead events",
        f"""
        {prog} dead list --topic emails.send
        {prog} dead retry --id 17 42
        {prog} dead retry --topic emails.send
        {prog} dead purge --all --older-than 30d
        """,
    )
    actions = dead.add_subparsers(dest="action", metavar="ACTION", required=True)
    dlist = add_command(
        actions,
        "list",
        "list dead events with their last error",
        f"""
        {prog} dead list
        {prog} dead list --topic emails.send --limit 10 --json
        """,
    )
    dlist.set_defaults(func=cmd_dead_list)
    dlist.add_argument("--topic", help="only this topic")
    dlist.add_argument(
        "--limit", type=POSITIVE_INT, metavar="N", default=50, help="at most this many (50)"
    )
    dlist.add_argument("--json", action="store_true", help="print JSON, with full errors")
    add_database_options(dlist)
    add_logging_options(dlist, "warning")
    for name, func, summary, example in (
        ("retry", cmd_dead_retry, "send dead events back to pending, waking consumers", ""),
        ("purge", cmd_dead_purge, "delete dead events for good", " --older-than 30d"),
    ):
        action = add_command(
            actions,
            name,
            summary,
            f"""
            {prog} dead {name} --id 17 42
            {prog} dead {name} --topic emails.send
            {prog} dead {name} --all{example}
            """,
        )
        action.set_defaults(func=func)
        which = action.add_mutually_exclusive_group(required=True)
        which.add_argument(
            "--id",
            dest="ids",
            metavar="ID",
            type=POSITIVE_INT,
            nargs="+",
            action="extend",
            help="event ids",
        )
        which.add_argument("--topic", help="every dead event of this topic")
        which.add_argument("--all", action="store_true", help="every dead event")
        if name == "purge":
            action.add_argument(
                "--older-than",
                type=DURATION,
                metavar="DURATION",
                help="only those dead for longer, e.g. 30d",
            )
        add_database_options(action)
        add_logging_options(action, "warning")

    pur = add_command(
        commands,
        "purge",
        "delete finished events older than a given age",
        f"""
        {prog} purge --older-than 7d
        {prog} purge --status dead --older-than 30d
        """,
    )
    pur.set_defaults(func=cmd_purge)
    pur.add_argument(
        "--status",
        metavar="{done,dead}",
        type=choices(*admin.PURGEABLE),
        default="done",
        help="done (default) or dead",
    )
    pur.add_argument(
        "--older-than",
        type=DURATION,
        metavar="DURATION",
        required=True,
        help="finished longer ago, e.g. 7d, 12h",
    )
    add_database_options(pur)
    add_logging_options(pur, "warning")

    demo = add_command(
        commands,
        "demo",
        "a tour of the whole event lifecycle on sample events, in a few seconds",
        f"""
        {prog} demo
        {prog} demo --events 10000
        {prog} demo --dsn postgresql://me@localhost/scratch   # uses its own table
        """,
        """
        Migrates a table of its own (aiooutbox_demo, emptied first), enqueues sample
        events (some fail a few times, some end dead), runs a consumer with a live
        progress line, then prints a summary and the stats view.
        """,
    )
    demo.set_defaults(func=cmd_demo)
    demo.add_argument("--events", type=POSITIVE_INT, metavar="N", default=3000, help="default 3000")
    demo.add_argument(
        "--concurrency", type=POSITIVE_INT, metavar="N", default=32, help="default 32"
    )
    add_database_options(demo, table="aiooutbox_demo")
    add_logging_options(demo, "error")

    emb = add_command(
        commands,
        "embedded",
        "start, show or stop the embedded PostgreSQL used when no DSN is configured",
        f"""
        {prog} embedded start        # prints its DSN, for your application
        {prog} embedded status
        {prog} embedded stop
        """,
    )
    verbs = emb.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, summary, func in (
        ("start", "start it (or find it running) and print its DSN", cmd_embedded_start),
        ("status", "print its DSN if it is running; exit 1 if not", cmd_embedded_status),
        ("stop", "stop it; clients still connected are disconnected", cmd_embedded_stop),
    ):
        verb = add_command(verbs, name, summary, f"{prog} embedded {name} --data-dir ./pgdata")
        verb.set_defaults(func=func)
        add_database_options(verb, dsn=False)
        add_logging_options(verb, "warning")
    return parser


# -- entry point --------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None, prog: str = "aiooutbox") -> int:
    """Run one command; return its exit status."""
    try:
        args = build_parser(prog).parse_args(argv)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    _logging.configure(args.log_level, args.log_format)
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
        print(f"{prog}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def _migrate_hint(message: str, args: argparse.Namespace) -> str:
    """The library's "run `python -m aiooutbox migrate`" with this command's outbox named."""
    hint = _table_hint(args)
    if getattr(args, "pgbouncer", False):
        hint += " --pgbouncer"
    if args.command == "run":
        hint += "` (or pass --migrate to run)"
    else:
        hint += "`"
    # a shell user needs the command, not the Python call the library also suggests
    message = message.replace(" or `await aiooutbox.migrate(pool)`", "")
    return message.replace("python -m aiooutbox migrate`", f"python -m aiooutbox migrate{hint}")


# -- operator commands ----------------------------------------------------------------------
async def cmd_migrate(args: argparse.Namespace) -> int:
    if args.sql:
        print(migration_sql(schema=args.schema, table=args.table), end="")
        return 0
    async with database(args, check=False) as conn:
        applied = await apply_migrations(conn, args)
    where = f"{args.schema}.{args.table}"
    print(f"applied migration(s) {applied} to {where}" if applied else f"{where} is up to date")
    return 0


async def cmd_enqueue(args: argparse.Namespace) -> int:
    async with database(args) as conn:
        try:
            event_id = await enqueue(
                conn,
                args.topic,
                args.payload,
                dedupe_key=args.dedupe_key,
                delay=args.delay,
                max_attempts=args.max_attempts,
                headers=args.headers,
                schema=args.schema,
                table=args.table,
            )
        except (InvalidArgument, TypeError) as exc:
            raise UsageError(str(exc)) from None
    if event_id is None:
        print(
            f"{args.prog}: an event with dedupe key {args.dedupe_key!r} exists; nothing added",
            file=sys.stderr,
        )
    else:
        print(event_id)
    return 0


async def cmd_stats(args: argparse.Namespace) -> int:
    async with database(args) as conn:
        report = await admin.stats(conn, schema=args.schema, table=args.table)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(_output.stats_view(report, hint=_table_hint(args)))
    return 0


def _table_hint(args: argparse.Namespace) -> str:
    hint = "" if args.schema == "public" else f" --schema {args.schema}"
    return hint + ("" if args.table == "outbox_events" else f" --table {args.table}")


async def cmd_dead_list(args: argparse.Namespace) -> int:
    async with database(args) as conn:
        events = await admin.dead_list(
            conn, topic=args.topic, limit=args.limit, schema=args.schema, table=args.table
        )
    if args.json:
        print(json.dumps([e.as_dict() for e in events], indent=2, ensure_ascii=False))
    else:
        print(_output.dead_table(events))
    return 0


async def cmd_dead_retry(args: argparse.Namespace) -> int:
    async with database(args) as conn:
        rows = await admin.requeue_dead(
            conn,
            ids=args.ids,
            topic=args.topic,
            everything=args.all,
            schema=args.schema,
            table=args.table,
        )
        missed = await _missed(conn, args, {r[0] for r in rows})
    requeued = collections.Counter(topic for _, topic in rows)
    detail = ", ".join(f"{topic}: {n}" for topic, n in sorted(requeued.items()))
    print(f"requeued {len(rows)} dead event(s)" + (f" ({detail})" if detail else ""))
    return _report_missed(args, "requeued", missed)


async def cmd_dead_purge(args: argparse.Namespace) -> int:
    async with database(args) as conn:
        deleted = await admin.delete_dead(
            conn,
            ids=args.ids,
            topic=args.topic,
            everything=args.all,
            older_than=args.older_than,
            schema=args.schema,
            table=args.table,
        )
        missed = await _missed(conn, args, set(deleted))
    print(f"deleted {len(deleted)} dead event(s)")
    return _report_missed(args, "deleted", missed)


async def _missed(conn: Any, args: argparse.Namespace, acted_on: set[int]) -> dict[int, str]:
    """Each ``--id`` that was not acted on, with why: absent, its status, or too young."""
    if not args.ids:
        return {}
    rest = sorted(set(args.ids) - acted_on)
    if not rest:
        return {}
    found = await admin.event_statuses(conn, rest, schema=args.schema, table=args.table)
    young = (
        f"dead for less than {_output.duration(args.older_than)}"
        if getattr(args, "older_than", None) is not None
        else "dead"
    )
    return {
        i: "no such event" if i not in found else young if found[i] == "dead" else found[i]
        for i in rest
    }


def _report_missed(args: argparse.Namespace, verb: str, missed: dict[int, str]) -> int:
    if not missed:
        return 0
    listed = ", ".join(f"{i} ({why})" for i, why in missed.items())
    print(f"{args.prog}: not {verb}: {listed}", file=sys.stderr)
    return 1


async def cmd_purge(args: argparse.Namespace) -> int:
    async with database(args) as conn:
        deleted = await admin.purge(
            conn,
            status=args.status,
            older_than=args.older_than,
            schema=args.schema,
            table=args.table,
        )
    print(
        f"deleted {deleted} {args.status} event(s) older than {_output.duration(args.older_than)}"
    )
    return 0


async def cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    async with open_pool(await resolve_dsn(args), pgbouncer=args.pgbouncer) as pool:
        return await run_demo(
            pool,
            schema=args.schema,
            table=args.table,
            events=args.events,
            concurrency=args.concurrency,
            hint=_table_hint(args),
            embedded_dir=None if args.dsn else args.data_dir,
        )


async def cmd_embedded_start(args: argparse.Namespace) -> int:
    dsn = await ensure_embedded(args)
    print(dsn)
    print(
        f"{args.prog}: the embedded PostgreSQL runs in {args.data_dir}; "
        f"`{args.prog} embedded stop` stops it",
        file=sys.stderr,
    )
    return 0


async def cmd_embedded_status(args: argparse.Namespace) -> int:
    dsn = embedded.status(resolve_data_dir(args))
    if dsn is None:
        print(f"{args.prog}: no embedded PostgreSQL runs in {args.data_dir}", file=sys.stderr)
        return 1
    print(dsn)
    return 0


async def cmd_embedded_stop(args: argparse.Namespace) -> int:
    stopped = await anyio.to_thread.run_sync(embedded.stop, resolve_data_dir(args))
    if stopped:
        print(f"stopped the embedded PostgreSQL in {args.data_dir}")
    else:
        print(f"no embedded PostgreSQL was running in {args.data_dir}")
    return 0
