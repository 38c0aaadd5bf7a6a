"""The operator commands of ``python -m aiooutbox``: one coroutine per command.

Each takes the parsed arguments and returns the exit status; results go to stdout,
notes to stderr, and errors are raised (`UsageError`, `CommandError`) for `cli.main`
to print. ``run`` is `run.cmd_run`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
from typing import Any

import anyio
import asyncpg

from .. import admin, embedded
from ..errors import InvalidArgument, OutboxError
from ..migrations import check_schema, migration_sql
from ..producer import enqueue
from . import output
from .connect import (
    apply_migrations,
    connect,
    database,
    ensure_embedded,
    open_pool,
    resolve_data_dir,
    resolve_dsn,
)
from .databases import Target, targets
from .errors import CommandError, UsageError


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
                ordering_key=args.ordering_key,
                group=args.group,
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
    found = targets(args)
    if len(found) > 1:
        return await _stats_of_many(args, found)
    args.dsn = found[0].dsn if found else None
    async with database(args) as conn:
        report = await admin.stats(conn, schema=args.schema, table=args.table)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(output.stats_view(report, hint=table_hint(args)))
    return 0


async def _stats_of_many(args: argparse.Namespace, found: list[Target]) -> int:
    """One row per database, read at once; one that cannot be read is reported in its
    row and on stderr, and the status is 1."""

    async def one(target: Target) -> admin.OutboxStats | str:
        try:
            conn = await connect(target.dsn, pgbouncer=args.pgbouncer)
        except CommandError as exc:
            return str(exc)
        try:
            await check_schema(conn, schema=args.schema, table=args.table)
            return await admin.stats(conn, schema=args.schema, table=args.table)
        except (OutboxError, asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            with anyio.CancelScope(shield=True):
                await conn.close(timeout=5)

    reports = list(zip(found, await asyncio.gather(*(one(t) for t in found)), strict=True))
    if args.json:
        print(
            json.dumps(
                {
                    t.name: (r.as_dict() if not isinstance(r, str) else {"error": r})
                    for t, r in reports
                },
                indent=2,
            )
        )
    else:
        print(output.databases_view([(t.name, r) for t, r in reports], hint=table_hint(args)))
    failed = [t.name for t, r in reports if isinstance(r, str)]
    for t, r in reports:
        if isinstance(r, str):
            print(f"{args.prog}: error: database {t.name}: {r}", file=sys.stderr)
    return 1 if failed else 0


def table_hint(args: argparse.Namespace) -> str:
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
        print(output.dead_table(events))
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
    detail = ", ".join(f"{output.safe(t)}: {n}" for t, n in sorted(requeued.items()))
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
        f"dead for less than {output.duration(args.older_than)}"
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
    print(f"deleted {deleted} {args.status} event(s) older than {output.duration(args.older_than)}")
    return 0


async def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import check_options, run_demo

    # before the embedded server starts or the pool connects: a usage error costs neither
    check_options(events=args.events, concurrency=args.concurrency)
    async with open_pool(await resolve_dsn(args), pgbouncer=args.pgbouncer) as pool:
        return await run_demo(
            pool,
            schema=args.schema,
            table=args.table,
            events=args.events,
            concurrency=args.concurrency,
            hint=table_hint(args),
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
