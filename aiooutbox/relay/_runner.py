"""``python -m aiooutbox relay --to URL``: publish the outbox to a broker until signalled."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
from typing import Any

from .._values.limits import MAX_WORKER_ID
from .._values.text import describe_exception, exception_message
from ..cli.args import DURATION, POSITIVE_INT, env_default, env_value, redact
from ..cli.connect import apply_migrations, open_pool, resolve_dsn
from ..cli.consumer_flags import add_consumer_options, build_options
from ..cli.databases import Target, targets
from ..cli.errors import CommandError, UsageError
from ..cli.options import (
    add_command,
    add_database_options,
    add_listen_options,
    add_logging_options,
    add_metrics_options,
    check_listen_options,
    check_metrics_options,
)
from ..cli.run import Telemetry, _settings, _Signals, telemetry
from ..consumer import OutboxConsumer
from ..errors import InvalidArgument, OutboxError
from ..handlers import ALL_TOPICS, Handler
from ._masked import masked

__all__ = [
    "RELAY_BATCH",
    "RELAY_CONCURRENCY",
    "add_relay_command",
    "cmd_relay",
    "relay_claim_size",
    "relay_handler",
]

logger = logging.getLogger("aiooutbox.cli")

#: the relay's defaults: the most events one publish call takes (``--batch``), and the
#: consumer's concurrency (``--concurrency``: events held at once, several batches; 2048
#: drained 10-25% faster than 1024 into Kafka, Redis and JetStream, unordered and over
#: 1,000 keys, three alternated rounds each). A claim takes at most one batch
#: (``--batch-size`` defaults to ``--batch``, `relay_claim_size`).
RELAY_BATCH = 256
RELAY_CONCURRENCY = 2048


def relay_claim_size(batch: int, concurrency: int) -> int:
    """The relay's default ``batch_size``: a claim takes one publish call's worth of
    events (an ordered key's head brings its run), published while the next claim runs.
    Claims of ``concurrency`` left the broker idle during each claim and the database
    idle during each wave of publishes: over 1,000 keys claims of a batch drained
    1.08-1.17x faster into Kafka, 1.15-1.18x into Redis (docs/benchmarks-history.md,
    "The relay claims a batch at a time"). A consumer that waits on nothing outside the
    database drains faster with larger claims, so this is the relay's default only."""
    return min(batch, concurrency)


def relay_handler(sink: Any, batch: int = RELAY_BATCH) -> Handler:
    """What a relay's consumer runs under each topic: the sink's batch handler, up to
    ``batch`` events a call (`Sink.handler`)."""
    handler: Handler = sink.handler(batch)
    return handler


def add_relay_command(commands: Any, prog: str) -> None:
    """Register ``relay`` on the ``python -m aiooutbox`` command parser."""
    relay = add_command(
        commands,
        "relay",
        "publish the outbox's events to a broker or webhook until SIGTERM or SIGINT",
        f"""
        {prog} relay --to nats://127.0.0.1:4222 --dsn postgresql://app@db/app
        {prog} relay --to nats://n1:4222,nats://n2:4222 --dsn a=postgresql://db1/app --dsn b=postgresql://db2/app
        {prog} relay --to kafka://k1:9092,k2:9092 --dsn-file tenants.txt --no-idempotence
        {prog} relay --to amqp://guest:guest@127.0.0.1:5672/ --exchange events
        {prog} relay --to kafka://127.0.0.1:9092 --destination 'outbox.{{topic}}'
        {prog} relay --to redis://127.0.0.1:6379/0 --topics orders.created,orders.paid
        AIOOUTBOX_WEBHOOK_SECRET=whsec_... {prog} relay --to 'https://hooks.example.com/{{topic}}'
        """,
        """
        The URL scheme picks the sink: nats://host:port[,host:port] (JetStream; the
        streams must exist), amqp(s):// (publisher confirms; without --exchange, the
        default exchange routes to the queue named by the destination),
        kafka://host:port[,host:port], redis(s)://host:port/db (streams) or http(s)://
        (Standard Webhooks signing with $AIOOUTBOX_WEBHOOK_SECRET). Without --topics it
        relays every topic of the outbox. A row is done only once the broker confirmed
        it. An unreachable broker at start exits 1; lost later, publishes wait up to
        --reconnect-wait for it (no attempt spent), then fail and are retried with the
        retry policy. An event the broker refuses for good (a name it cannot take, over
        its size limit, no stream or queue for it) is dead at once with the broker's
        reason. With several databases (--dsn repeated, --dsn-file) each has its
        own consumer and --concurrency, all publishing through one sink; every database
        must answer at start (else exit 1, nothing relayed), and one lost later stops
        only its own events until it is back. Signals and exit status as for run.
        """,
    )
    relay.set_defaults(func=cmd_relay)
    group = relay.add_argument_group("relay")
    group.add_argument(
        "--to",
        metavar="URL",
        default=env_default("AIOOUTBOX_RELAY_TO", str, None),
        help="where to publish (env AIOOUTBOX_RELAY_TO)",
    )
    group.add_argument(
        "--destination",
        metavar="TEMPLATE",
        default=env_default("AIOOUTBOX_RELAY_DESTINATION", str, "{topic}"),
        help="subject, routing key, Kafka topic or stream of each event; {topic} and "
        "{ordering_key} are replaced (env AIOOUTBOX_RELAY_DESTINATION; default {topic})",
    )
    group.add_argument(
        "--exchange",
        metavar="NAME",
        default=env_default("AIOOUTBOX_RELAY_EXCHANGE", str, None),
        help="amqp:// only: the exchange to publish to, which must exist (env "
        "AIOOUTBOX_RELAY_EXCHANGE; default: the default exchange)",
    )
    group.add_argument(
        "--reconnect-wait",
        type=DURATION,
        metavar="DURATION",
        default=env_default("AIOOUTBOX_RELAY_RECONNECT_WAIT", DURATION, "60s"),
        help="while the broker is down, hold each event this long before failing the "
        "attempt (env AIOOUTBOX_RELAY_RECONNECT_WAIT; default 60s)",
    )
    group.add_argument(
        "--batch",
        type=POSITIVE_INT,
        metavar="N",
        default=env_default("AIOOUTBOX_RELAY_BATCH", POSITIVE_INT, str(RELAY_BATCH)),
        help="the most events one publish call takes: the sink publishes them with the "
        "client's pipelined calls and settles each on its own (env AIOOUTBOX_RELAY_BATCH; "
        f"default {RELAY_BATCH}; keep --concurrency at least twice this)",
    )
    group.add_argument(
        "--max-in-flight",
        type=POSITIVE_INT,
        metavar="N",
        default=env_default("AIOOUTBOX_RELAY_MAX_IN_FLIGHT", POSITIVE_INT, None),
        help="publishes awaiting the broker's confirm at once; with --concurrency above "
        "it, claimed events wait for a slot and the window stays full while the relay "
        "claims (env AIOOUTBOX_RELAY_MAX_IN_FLIGHT; default: --concurrency)",
    )
    group.add_argument(
        "--format",
        metavar="FORMAT",
        default=env_default("AIOOUTBOX_RELAY_FORMAT", str, "outbox"),
        help="outbox (the default), cloudevents (CloudEvents 1.0 in each broker's binary "
        "content mode; structured on Redis) or cloudevents-structured (the whole "
        "CloudEvent as JSON in the body) (env AIOOUTBOX_RELAY_FORMAT)",
    )
    group.add_argument(
        "--cloudevents-source",
        metavar="URI-REFERENCE",
        default=env_default("AIOOUTBOX_CLOUDEVENTS_SOURCE", str, None),
        help="the CloudEvents source attribute (env AIOOUTBOX_CLOUDEVENTS_SOURCE; default "
        "/aiooutbox/DATABASE/SCHEMA.TABLE)",
    )
    group.add_argument(
        "--no-idempotence",
        dest="idempotence",
        action="store_false",
        help="kafka:// only: no idempotent producer (for brokers without it, e.g. Tansu)",
    )
    group.add_argument(
        "--no-read-back",
        dest="read_back",
        action="store_false",
        help="kafka:// and redis:// only: publish a repeated event again without first "
        "looking for it in the broker (a relay crash then leaves duplicates)",
    )
    group.add_argument(
        "--clock-skew",
        type=DURATION,
        metavar="DURATION",
        default=env_default("AIOOUTBOX_RELAY_CLOCK_SKEW", DURATION, None),
        help="kafka:// and redis:// only: how far the broker's timestamps may run behind "
        "the database's clock; a repeated event is looked up from its creation less "
        "this (env AIOOUTBOX_RELAY_CLOCK_SKEW; default 60s)",
    )
    add_consumer_options(relay, topics_help="default: every topic in the outbox")
    _relay_defaults(relay)
    add_listen_options(relay)
    add_metrics_options(relay)
    add_database_options(relay, many=True)
    add_logging_options(relay, "info")


def _relay_defaults(relay: argparse.ArgumentParser) -> None:
    """The relay's own defaults: ``--concurrency`` several batches in flight, and
    ``--batch-size`` one batch a claim (set in `cmd_relay`, which knows ``--batch``)."""
    for action in relay._actions:
        if action.dest == "batch_size":
            action.help = (
                "most events one claim takes (env AIOOUTBOX_BATCH_SIZE; the relay's "
                "default: --batch, so one batch is published while the next is claimed)"
            )
    if env_value("AIOOUTBOX_CONCURRENCY") is not None:
        return  # the environment's, as for run
    for action in relay._actions:
        if action.dest == "concurrency":
            action.default = str(RELAY_CONCURRENCY)
            action.help = (
                "events held at once, in publish calls or waiting for one (env "
                f"AIOOUTBOX_CONCURRENCY; default {RELAY_CONCURRENCY}: eight batches of "
                f"{RELAY_BATCH})"
            )


def _sink(args: argparse.Namespace, found: list[Target]) -> Any:
    import os

    from ._url import sink_for_url

    if not args.to:
        raise UsageError("relay needs --to URL (or $AIOOUTBOX_RELAY_TO)")
    scheme = args.to.partition("://")[0].lower()
    options: dict[str, Any] = {}
    if scheme in ("http", "https"):
        secret = os.environ.get("AIOOUTBOX_WEBHOOK_SECRET")
        if not secret:
            raise UsageError("a webhook relay needs $AIOOUTBOX_WEBHOOK_SECRET (whsec_...)")
        options["secret"] = secret
    else:
        options["reconnect_wait"] = args.reconnect_wait
    if args.max_in_flight is not None:
        options["max_in_flight"] = args.max_in_flight
    sources = _cloudevents_options(args, found, options)
    if not args.idempotence:
        if scheme != "kafka":
            raise UsageError("--no-idempotence applies only to kafka:// URLs")
        options["enable_idempotence"] = False
    if not args.read_back or args.clock_skew is not None:
        if scheme not in ("kafka", "redis", "rediss"):
            flag = "--no-read-back" if not args.read_back else "--clock-skew"
            raise UsageError(f"{flag} applies only to kafka:// and redis:// URLs")
        options["read_back"] = args.read_back
        if args.clock_skew is not None:
            options["clock_skew"] = args.clock_skew
    try:
        sink = sink_for_url(
            args.to, destination=args.destination, exchange=args.exchange, **options
        )
        if sources:
            sink._cloudevents.sources = sources  # each database its own default source
        return sink
    except (InvalidArgument, TypeError) as exc:
        raise UsageError(f"--to/--destination: {exception_message(exc)}") from None
    except ImportError as exc:
        raise CommandError(exception_message(exc).split(" (")[0]) from None


def _cloudevents_options(
    args: argparse.Namespace, found: list[Target], options: dict[str, Any]
) -> dict[str, str]:
    """Put ``--format`` and the CloudEvents source into ``options``; with several
    databases and no ``--cloudevents-source``, return each database's own source."""
    from ..cli.databases import _dbname
    from ..embedded import DATABASE
    from ._cloudevents import check_format, check_source, default_source

    try:
        fmt = check_format(args.format)
    except InvalidArgument as exc:
        raise UsageError(f"--format: {exception_message(exc)}") from None
    if args.cloudevents_source is not None:
        if fmt == "outbox":
            raise UsageError("--cloudevents-source applies only with --format cloudevents")
        try:
            check_source(args.cloudevents_source)
        except InvalidArgument as exc:
            raise UsageError(f"--cloudevents-source: {exception_message(exc)}") from None
    if fmt == "outbox":
        return {}
    options["format"] = fmt
    if args.cloudevents_source is not None:
        options["cloudevents_source"] = args.cloudevents_source
        return {}
    names = [_dbname(t.dsn) for t in found] if len(found) <= 1 else [t.name for t in found]
    sources = {
        t.name: default_source(n, args.schema, args.table)
        for t, n in zip(found, names, strict=True)
    }
    options["cloudevents_source"] = default_source(
        names[0] if names else DATABASE, args.schema, args.table
    )
    return sources if len(found) > 1 else {}


async def cmd_relay(args: argparse.Namespace) -> int:
    found = targets(args)  # every DSN checked, duplicates refused, before anything
    sink = _sink(args, found)
    if args.batch_size is None:  # neither --batch-size nor $AIOOUTBOX_BATCH_SIZE
        args.batch_size = relay_claim_size(args.batch, args.concurrency)
    args.consumer_options = build_options(args)  # checked once, errors name the flag
    args.retry = args.consumer_options.retry
    check_listen_options(args)
    check_metrics_options(args)
    if len(found) > 1 and args.listen_dsn is not None:
        raise UsageError(
            "--listen-dsn names one database's server; with several databases each "
            "consumer listens on its own --dsn (or pass --no-listen to poll)"
        )
    args.dsn = found[0].dsn if len(found) == 1 else None
    with _Signals() as signals:
        try:
            return await _serve(args, sink, signals, found)
        except asyncio.CancelledError:
            if not signals.received:
                raise
            return 0


async def _serve(
    args: argparse.Namespace, sink: Any, signals: _Signals, found: list[Target]
) -> int:
    async with telemetry(args) as observed:  # --metrics-port: /metrics and /healthz
        if len(found) > 1:
            from ._fleet import relay_many

            return await relay_many(args, sink, signals, observed, _handlers(args, sink), found)
        return await _relay(args, sink, signals, observed)


def _handlers(args: argparse.Namespace, sink: Any) -> dict[str, Handler]:
    """The sink's batch handler under each ``--topics`` topic, else every topic."""
    handler = relay_handler(sink, args.batch)
    topics = args.topics or None
    return dict.fromkeys(topics, handler) if topics else {ALL_TOPICS: handler}


async def _relay(
    args: argparse.Namespace, sink: Any, signals: _Signals, observed: Telemetry
) -> int:
    dsn = await resolve_dsn(args, log=True)
    async with (
        open_pool(dsn, pgbouncer=args.pgbouncer) as pool,
        contextlib.AsyncExitStack() as stack,
    ):
        if args.migrate:
            applied = await apply_migrations(pool, args)
            logger.info("schema %s", f"migrated to {applied}" if applied else "up to date")
        await stack.enter_async_context(observed.queue_gauges(pool, args))
        topics = args.topics or None
        handlers = _handlers(args, sink)
        # the worker id names the relay and its destination: the dashboard (and anyone
        # reading locked_by or the idle table) can tell relays apart
        options = dataclasses.replace(
            args.consumer_options, worker_id=relay_worker_id(sink, args.consumer_options)
        )
        consumer = OutboxConsumer.from_options(pool, options, observers=observed.observers)
        await sink.start()  # BrokerUnavailable: one line, exit 1
        try:
            async with consumer:
                signals.consumer = consumer
                logger.info(
                    "relaying %s from %s to %s %s as %r with concurrency %d, batches of %d,"
                    " claims of at most %d (%s)",
                    ", ".join(topics) if topics else "every topic",
                    redact(dsn),
                    sink.name,
                    sink.describe(),
                    masked(sink.destination),
                    args.concurrency,
                    args.batch,
                    options.claim_size,
                    _settings(args),
                )
                try:
                    await consumer.run(handlers)
                except (Exception, SystemExit, KeyboardInterrupt) as exc:
                    # our own errors say what to fix in one line; the traceback is for debugging
                    logger.error(
                        "relay failed: %s",
                        describe_exception(exc),
                        exc_info=None if isinstance(exc, OutboxError) else exc,
                    )
                    logger.debug("relay failed", exc_info=exc)
                    return 1
        finally:
            await sink.close()
    s = consumer.stats
    logger.info(
        "stopped: %d published, %d retried, %d dead, %d released, %d found already published",
        s.done,
        s.retried,
        s.dead,
        s.released,
        sink.found_published,
    )
    if sink._lookup is not None and sink._lookup.lookups:
        logger.info("read back: %s", sink._lookup.summary())
    return 0


def relay_worker_id(sink: Any, options: Any) -> str:
    """``relay SINK:DESTINATION @HOST:PID:RANDOM``, the destination cut to fit."""
    base: str = options.worker_id
    room = MAX_WORKER_ID - len(base) - len(sink.name) - 9
    # masked: a webhook's destination is its URL, and locked_by is stored and shown
    destination = " ".join(masked(str(sink.destination)).split())[: max(room, 0)] or "?"
    return f"relay {sink.name}:{destination} @{base}"
