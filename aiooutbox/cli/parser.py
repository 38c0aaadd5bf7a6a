"""The parser of ``python -m aiooutbox``: every command, its options, examples and notes.

Each command's ``func`` is its coroutine in `cli.commands` (``run`` in `cli.run`,
``relay`` in `relay._runner`); `cli.main` parses and calls it.
"""

from __future__ import annotations

import argparse

from .. import __version__, admin
from .args import DURATION, EVENT_ID, JSON, JSON_OBJECT, LIST_LIMIT, POSITIVE_INT, TOPIC, choices
from .commands import (
    cmd_dead_list,
    cmd_dead_purge,
    cmd_dead_retry,
    cmd_demo,
    cmd_embedded_start,
    cmd_embedded_status,
    cmd_embedded_stop,
    cmd_enqueue,
    cmd_migrate,
    cmd_purge,
    cmd_stats,
)
from .consumer_flags import add_consumer_options
from .options import (
    Formatter,
    Parser,
    add_command,
    add_database_options,
    add_listen_options,
    add_logging_options,
    add_metrics_options,
)
from .run import cmd_run
from .topics import add_topics_command

__all__ = ["build_parser"]


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

    from ..relay._runner import add_relay_command  # the relay's extras load only when used

    add_relay_command(commands, prog)

    from ..web._command import add_dashboard_command  # the web extra loads only when run

    add_dashboard_command(commands, prog)

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
        {prog} enqueue orders.paid '{{"order_id": 42}}' --ordering-key order-42
        {prog} enqueue invoices.send '{{"invoice": 7}}' --group tenant-42
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
    enq.add_argument(
        "--ordering-key",
        metavar="KEY",
        help="events with the same key are handled one at a time, in order",
    )
    enq.add_argument(
        "--group",
        metavar="NAME",
        help="claims serve groups (tenants, say) in turn, so no group's backlog starves another",
    )
    add_database_options(enq)
    add_logging_options(enq, "warning")

    sta = add_command(
        commands,
        "stats",
        "show events by topic and status, lag, events in flight by worker, dead count",
        f"""
        {prog} stats
        {prog} stats --json | jq .lag_seconds
        {prog} stats --dsn-file tenants.txt     # one row per database, with its lag
        """,
    )
    sta.set_defaults(func=cmd_stats)
    sta.add_argument("--json", action="store_true", help="print JSON for scripts")
    add_database_options(sta, many=True)
    add_logging_options(sta, "warning")

    add_topics_command(commands, prog)

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
    dlist.add_argument("--topic", type=TOPIC, help="only this topic")
    dlist.add_argument(
        "--limit",
        type=LIST_LIMIT,
        metavar="N",
        default=50,
        help=f"at most this many (default 50, at most {admin.MAX_LIST})",
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
            type=EVENT_ID,
            nargs="+",
            action="extend",
            help="event ids",
        )
        which.add_argument("--topic", type=TOPIC, help="every dead event of this topic")
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
