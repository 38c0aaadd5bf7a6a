"""The consumer's command-line options, shared by ``run`` and ``relay``: add and check."""

from __future__ import annotations

import argparse
import inspect

from . import _output
from ._cliutil import (
    DURATION,
    FRACTION,
    NUMBER,
    OPTIONAL_DURATION,
    POSITIVE_INT,
    TOPICS,
    UsageError,
    env_default,
    env_flag,
)
from .consumer import OutboxConsumer
from .errors import InvalidArgument
from .retry import RetryPolicy

__all__ = ["add_consumer_options", "check_consumer_options"]

_CONSUMER = {k: p.default for k, p in inspect.signature(OutboxConsumer).parameters.items()}
_RETRY = RetryPolicy()


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
        "--topics",
        type=TOPICS,
        default=env_default("AIOOUTBOX_TOPICS", TOPICS, None),
        help=f"comma-separated topics to consume (env AIOOUTBOX_TOPICS; {topics_help})",
    )
    for option, key, what in (
        ("--poll-interval", "poll_interval", "fallback poll when no notification comes"),
        ("--lease-timeout", "lease_timeout", "recover a silent worker's events after"),
        ("--shutdown-grace", "shutdown_grace", "on stop, let running handlers finish for"),
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
        f"AIOOUTBOX_RETENTION; default {_output.duration(retention)})",
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
        shown = _output.duration(value) if kind is DURATION else f"{value:g}"
        retry.add_argument(
            option,
            dest="retry_" + key,
            type=kind,
            default=env_default(env, kind, shown),
            metavar="DURATION" if kind is DURATION else "X",
            help=f"{what} (env {env}; default {shown})",
        )


def check_consumer_options(args: argparse.Namespace) -> None:
    """Refuse out-of-range values; set ``args.retry`` to the `RetryPolicy` they describe."""
    if args.batch_size and args.batch_size > args.concurrency:
        raise UsageError(f"--batch-size {args.batch_size} exceeds --concurrency")
    if args.lease_timeout < 1:
        raise UsageError("--lease-timeout must be at least 1s")
    if args.poll_interval < 0.01:
        raise UsageError("--poll-interval must be at least 10ms")
    if args.handler_timeout is not None and args.handler_timeout < 0.001:
        raise UsageError("--handler-timeout must be at least 1ms (or none)")
    if args.retention is not None and args.retention < 1:
        raise UsageError("--retention must be at least 1s (or none, to keep done events)")
    if args.retry_factor < 1:
        raise UsageError(f"--retry-factor must be at least 1, got {args.retry_factor:g}")
    try:
        args.retry = RetryPolicy(
            base=args.retry_base,
            factor=args.retry_factor,
            max_delay=args.retry_max_delay,
            jitter=args.retry_jitter,
        )
    except InvalidArgument as exc:
        raise UsageError(str(exc)) from None
