"""``relay`` over several databases: one consumer per database, all through one sink.

Every database gets its own pool and its own `OutboxConsumer` with the command's
options (``--concurrency`` is per database), so each is claimed at its own pace: a
database that is slow holds only its own handler slots, and one that goes down only
stops its own claims while its consumer reconnects, as a single relay's does. The
publishes of all of them share the sink (one broker connection, one ``--max-in-flight``
window, waited for in turn).

Nothing is published until every database has answered: each is connected to, migrated
with ``--migrate``, and its outbox schema checked first, concurrently; any failure is one
line naming the database, and the command exits with nothing relayed. A consumer that
stops on an error it cannot retry (a revoked grant, a dropped table) stops the relay, as
it does with one database: exit status 1, naming the database.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import asyncpg

from ..cli.args import redact
from ..cli.connect import apply_migrations, close_pool, make_pool
from ..cli.databases import Target
from ..cli.errors import CommandError
from ..cli.logsetup import DATABASE
from ..cli.run import Telemetry, _settings, _Signals
from ..consumer import OutboxConsumer
from ..errors import OutboxError, SchemaNotReady, SchemaTooNew
from ..handlers import Handler
from ..migrations import check_schema
from ._masked import masked

__all__ = ["relay_many"]

logger = logging.getLogger("aiooutbox.cli")


@dataclass
class _Member:
    target: Target
    pool: asyncpg.Pool
    consumer: OutboxConsumer | None = None

    @property
    def name(self) -> str:
        return self.target.name


class _Consumers:
    """What the signal handler stops: every database's consumer."""

    def __init__(self, members: Sequence[_Member]) -> None:
        self._members = members

    def stop(self) -> None:
        for m in self._members:
            if m.consumer is not None:
                token = DATABASE.set(m.name)  # what stop() logs names the database
                try:
                    m.consumer.stop()
                finally:
                    DATABASE.reset(token)


async def relay_many(
    args: argparse.Namespace,
    sink: Any,
    signals: _Signals,
    observed: Telemetry,
    handlers: dict[str, Handler],
    targets: Sequence[Target],
) -> int:
    """Relay every database of ``targets`` through ``sink`` until signalled."""
    members = await _connect_all(targets, pgbouncer=args.pgbouncer)
    try:
        await _prepare_all(members, args)
        async with contextlib.AsyncExitStack() as stack:
            for m in members:
                await stack.enter_async_context(
                    observed.queue_gauges(m.pool, args, database=m.name)
                )
                m.consumer = OutboxConsumer.from_options(
                    m.pool, args.consumer_options, observers=observed.for_database(m.name)
                )
            await sink.start()  # BrokerUnavailable: one line, exit 1
            try:
                for m in members:
                    assert m.consumer is not None
                    await stack.enter_async_context(_named(m.name, m.consumer))
                signals.consumer = _Consumers(members)
                logger.info(
                    "relaying %s from %d databases (%s) to %s %s as %r with concurrency %d "
                    "per database, batches of %d, claims of at most %d (%s)",
                    ", ".join(args.topics) if args.topics else "every topic",
                    len(members),
                    ", ".join(f"{m.name}: {redact(m.target.dsn)}" for m in members),
                    sink.name,
                    sink.describe(),
                    masked(sink.destination),
                    args.concurrency,
                    args.batch,
                    args.consumer_options.claim_size,
                    _settings(args),
                )
                status = await _run_all(members, handlers)
            finally:
                # every consumer has settled (run returned) before the sink closes; one
                # still entered on a failure stops in the stack's exit, its unfinished
                # publishes failing and retried later
                await sink.close()
    finally:
        for m in members:
            await close_pool(m.pool)
    for m in members:
        if m.consumer is not None:
            s = m.consumer.stats
            logger.info(
                "stopped %s: %d published, %d retried, %d dead, %d released",
                m.name,
                s.done,
                s.retried,
                s.dead,
                s.released,
            )
    return status


@contextlib.asynccontextmanager
async def _named(name: str, consumer: OutboxConsumer) -> Any:
    """Enter ``consumer`` (its schema check) with its errors naming the database."""
    try:
        await consumer.__aenter__()
    except (SchemaNotReady, SchemaTooNew) as exc:
        raise type(exc)(f"database {name}: {exc}") from None
    except (OutboxError, TimeoutError, OSError, asyncpg.PostgresError) as exc:
        raise CommandError(f"database {name}: {type(exc).__name__}: {exc}") from None
    try:
        yield consumer
    finally:
        await consumer.__aexit__(None, None, None)


async def _connect_all(targets: Sequence[Target], *, pgbouncer: bool) -> list[_Member]:
    """A pool per database, made at once; if any fails, none is kept and the error names
    every database that failed."""
    made = await asyncio.gather(
        *(make_pool(t.dsn, pgbouncer=pgbouncer) for t in targets), return_exceptions=True
    )
    failed = [(t, r) for t, r in zip(targets, made, strict=True) if isinstance(r, BaseException)]
    pools = [r for r in made if isinstance(r, asyncpg.Pool)]
    if failed:
        for pool in pools:
            await close_pool(pool)
        unexpected = [r for _, r in failed if not isinstance(r, CommandError)]
        if unexpected:
            raise unexpected[0]
        raise CommandError(
            "; ".join(f"database {t.name}: {r}" for t, r in failed)
            + f" ({len(failed)} of {len(targets)} unreachable; nothing was relayed)"
        )
    return [_Member(t, p) for t, p in zip(targets, pools, strict=True)]


async def _prepare_all(members: Sequence[_Member], args: argparse.Namespace) -> None:
    """``--migrate`` each database, then check each outbox schema, all at once; the
    first database that fails (in the order given) is the error."""
    limit = 3 * args.consumer_options.statement_timeout

    async def prepare(m: _Member) -> None:
        if args.migrate:
            try:
                applied = await apply_migrations(m.pool, args)
            except (OutboxError, asyncpg.PostgresError, OSError) as exc:
                raise CommandError(
                    f"database {m.name}: migrate failed: {type(exc).__name__}: {exc}"
                ) from None
            logger.info(
                "schema of %s %s", m.name, f"migrated to {applied}" if applied else "up to date"
            )
        try:
            with anyio.fail_after(limit):
                await check_schema(m.pool, schema=args.schema, table=args.table)
        except TimeoutError:
            raise CommandError(
                f"database {m.name}: the outbox schema check got no answer within {limit:g}s"
            ) from None
        except (SchemaNotReady, SchemaTooNew) as exc:
            raise type(exc)(f"database {m.name}: {exc}") from None
        except (asyncpg.PostgresError, OSError, asyncpg.InterfaceError) as exc:
            raise CommandError(f"database {m.name}: {type(exc).__name__}: {exc}") from None

    results = await asyncio.gather(*(prepare(m) for m in members), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


async def _run_all(members: Sequence[_Member], handlers: dict[str, Handler]) -> int:
    """Run every consumer until all have returned (after a signal); when one fails,
    stop the others and return 1."""

    async def run(m: _Member) -> None:
        DATABASE.set(m.name)  # this task's records, and its consumer's, name it
        assert m.consumer is not None
        await m.consumer.run(handlers)

    tasks = {asyncio.ensure_future(run(m)): m for m in members}
    status = 0
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = None if task.cancelled() else task.exception()
                if exc is None:
                    continue
                status = 1
                logger.error(
                    "relay of database %s failed: %s: %s",
                    tasks[task].name,
                    type(exc).__name__,
                    exc,
                    exc_info=exc,
                )
                _Consumers(members).stop()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return status
