"""The consumer's command-line options, shared by ``run`` and ``relay``: add them, and
build the `ConsumerOptions` they describe (checked once, errors naming the flag)."""

from __future__ import annotations

import argparse
import inspect

from .._engine.options import ConsumerOptions
from ..consumer import OutboxConsumer
from ..errors import InvalidArgument
from ..retry import RetryPolicy
from . import output
from .args import (
    DURATION,
    FRACTION,
    NON_NEGATIVE_INT,
    NUMBER,
    OPTIONAL_DURATION,
    POSITIVE_INT,
    TOPICS,
    env_default,
    env_flag,
)
from .errors import UsageError

__all__ = ["add_consumer_options", "build_options"]

_CONSUMER = {k: p.default for k, p in inspect.signature(OutboxConsumer).parameters.items()}
_RETRY = RetryPolicy()
_CLAIM_BYTES = _CONSUMER["max_claim_bytes"]


def add_consumer_options(parser: argparse.ArgumentParser, *, topics_help: str) -> None:
    """The "consumer" and "retry policy" groups (with env defaults)."""
    group = parser.add_argument_group("consumer")
    group.add_argument(
        "--concurrency",
        type=POSITIVE_INT,
        metavar="N",
        default=env_default("AIOOUTBOX_CONCURRENCY", POSITIVE_INT, str(_CONSUMER["concurrency"])),
        help=f"handlers running at once (env AIOOUTBOX_CONCURRENCY; default "
        f"{_CONSUMER['concurrency']})",
    )
    group.add_argument(
        "--batch-size",
        type=POSITIVE_INT,
        metavar="N",
        default=env_default("AIOOUTBOX_BATCH_SIZE", POSITIVE_INT, None),
        help="most events one claim takes (env AIOOUTBOX_BATCH_SIZE; default = concurrency)",
    )
    group.add_argument(
        "--prefetch",
        type=NON_NEGATIVE_INT,
        metavar="N",
        default=env_default("AIOOUTBOX_PREFETCH", NON_NEGATIVE_INT, None),
        help="most events claimed ahead of the running handlers, about 0.1 s of work at "
        "the recent rate (env AIOOUTBOX_PREFETCH; default 512 - concurrency, at least 0, "
        "or with batch handlers enough to hold four of the largest batch; 0 turns it off)",
    )
    group.add_argument(
        "--topics",
        type=TOPICS,
        default=env_default("AIOOUTBOX_TOPICS", TOPICS, None),
        help=f"comma-separated topics to consume (env AIOOUTBOX_TOPICS; {topics_help})",
    )
    for option, key, what in (
        ("--poll-interval", "poll_interval", "fallback poll when no notification comes"),
        ("--lease-timeout", "lease_timeout", "recover a silent worker's events after"),
        ("--shutdown-grace", "shutdown_grace", "on stop, let running handlers finish for"),
        (
            "--orphan-sweep-interval",
            "orphan_sweep_interval",
            "look this often for ordered keys left without a head, and move them on",
        ),
    ):
        env = "AIOOUTBOX_" + key.upper()
        group.add_argument(
            option,
            type=DURATION,
            default=env_default(env, DURATION, f"{_CONSUMER[key]:g}s"),
            metavar="DURATION",
            help=f"{what} (env {env}; default {_CONSUMER[key]:g}s)",
        )
    group.add_argument(
        "--handler-timeout",
        type=OPTIONAL_DURATION,
        default=env_default("AIOOUTBOX_HANDLER_TIMEOUT", OPTIONAL_DURATION, None),
        metavar="DURATION",
        help="cancel a handler running longer, as a failed attempt (env "
        "AIOOUTBOX_HANDLER_TIMEOUT; default none; a Router's timeout= wins)",
    )
    retention = _CONSUMER["retention"].total_seconds()
    group.add_argument(
        "--retention",
        type=OPTIONAL_DURATION,
        default=env_default("AIOOUTBOX_RETENTION", OPTIONAL_DURATION, f"{retention:g}s"),
        metavar="DURATION",
        help=f"purge done events finished longer ago; none keeps them (env "
        f"AIOOUTBOX_RETENTION; default {output.duration(retention)})",
    )
    group.add_argument(
        "--statement-timeout",
        type=DURATION,
        default=env_default("AIOOUTBOX_STATEMENT_TIMEOUT", DURATION, "10s"),
        metavar="DURATION",
        help="limit on every statement the consumer runs (env AIOOUTBOX_STATEMENT_TIMEOUT; "
        "default 10s)",
    )
    group.add_argument(
        "--max-claim-bytes",
        type=POSITIVE_INT,
        default=env_default("AIOOUTBOX_MAX_CLAIM_BYTES", POSITIVE_INT, str(_CLAIM_BYTES)),
        metavar="N",
        help="stop adding rows to a claim past this many stored payload bytes; the first "
        f"row is always taken (env AIOOUTBOX_MAX_CLAIM_BYTES; default {_CLAIM_BYTES})",
    )
    for option, key, what in (
        ("--listen-probe-interval", "listen_probe_interval", "self-notification probe"),
        ("--watchdog-interval", "watchdog_interval", "MVCC watchdog check"),
    ):
        env = "AIOOUTBOX_" + key.upper()
        group.add_argument(
            option,
            type=OPTIONAL_DURATION,
            default=env_default(env, OPTIONAL_DURATION, f"{_CONSUMER[key]:g}s"),
            metavar="DURATION",
            help=f"interval of the {what}; none turns it off (env {env}; default "
            f"{_CONSUMER[key]:g}s)",
        )
    group.add_argument(
        "--horizon-warning",
        type=DURATION,
        default=env_default("AIOOUTBOX_HORIZON_WARNING", DURATION, "300s"),
        metavar="DURATION",
        help="warn about a transaction pinning the xmin horizon longer than this (env "
        "AIOOUTBOX_HORIZON_WARNING; default 5m)",
    )
    group.add_argument(
        "--migrate",
        action="store_true",
        default=env_flag("AIOOUTBOX_MIGRATE"),
        help="apply schema migrations before starting (env AIOOUTBOX_MIGRATE=1)",
    )
    retry = parser.add_argument_group(
        "retry policy (after a failed attempt; a Router's retry= wins)",
        "the delay ceiling grows from --retry-base by --retry-factor per attempt up to\n"
        "--retry-max-delay; each delay is drawn from [ceiling * (1 - jitter), ceiling]",
    )
    for option, key, kind, what in (
        ("--retry-base", "base", DURATION, "first ceiling"),
        ("--retry-factor", "factor", NUMBER, "growth per attempt"),
        ("--retry-max-delay", "max_delay", DURATION, "largest delay"),
        ("--retry-jitter", "jitter", FRACTION, "0 = exact delays, 1 = full jitter"),
    ):
        env = "AIOOUTBOX_RETRY_" + key.upper()
        value = getattr(_RETRY, key)
        shown = output.duration(value) if kind is DURATION else f"{value:g}"
        retry.add_argument(
            option,
            dest="retry_" + key,
            type=kind,
            default=env_default(env, kind, shown),
            metavar="DURATION" if kind is DURATION else "X",
            help=f"{what} (env {env}; default {shown})",
        )


_FLAGS = {
    "concurrency": "--concurrency",
    "batch_size": "--batch-size",
    "prefetch": "--prefetch",
    "each of topics": "--topics",
    "poll_interval": "--poll-interval",
    "lease_timeout": "--lease-timeout",
    "shutdown_grace": "--shutdown-grace",
    "handler_timeout": "--handler-timeout",
    "retention": "--retention",
    "listen_dsn": "--listen-dsn",
    "statement_timeout": "--statement-timeout",
    "max_claim_bytes": "--max-claim-bytes",
    "listen_probe_interval": "--listen-probe-interval",
    "watchdog_interval": "--watchdog-interval",
    "horizon_warning": "--horizon-warning",
    "orphan_sweep_interval": "--orphan-sweep-interval",
    "RetryPolicy.base": "--retry-base",
    "RetryPolicy.factor": "--retry-factor",
    "RetryPolicy.max_delay": "--retry-max-delay",
    "RetryPolicy.jitter": "--retry-jitter",
}


def build_options(args: argparse.Namespace) -> ConsumerOptions:
    """The run command's settings, checked once by `ConsumerOptions.build`; a bad one
    is a `UsageError` naming its flag."""
    try:
        retry = RetryPolicy(
            base=args.retry_base,
            factor=args.retry_factor,
            max_delay=args.retry_max_delay,
            jitter=args.retry_jitter,
        )
        return ConsumerOptions.build(
            concurrency=args.concurrency,
            batch_size=args.batch_size,
            prefetch=args.prefetch,
            topics=args.topics,
            poll_interval=args.poll_interval,
            lease_timeout=args.lease_timeout,
            shutdown_grace=args.shutdown_grace,
            retry=retry,
            handler_timeout=args.handler_timeout,
            listen=args.listen,
            listen_dsn=args.listen_dsn,
            retention=args.retention,
            schema=args.schema,
            table=args.table,
            statement_timeout=args.statement_timeout,
            max_claim_bytes=args.max_claim_bytes,
            listen_probe_interval=args.listen_probe_interval,
            watchdog_interval=args.watchdog_interval,
            horizon_warning=args.horizon_warning,
            orphan_sweep_interval=args.orphan_sweep_interval,
        )
    except (InvalidArgument, TypeError) as exc:
        message = str(exc)
        for name, flag in _FLAGS.items():
            if message.startswith(name + " "):
                message = flag + message[len(name) :]
                break
        raise UsageError(message) from None
