"""`ConsumerOptions`: every consumer setting, validated once, frozen.

The consumer, the CLI runner and the web integrations all build one of these, so a
setting is checked in one place and means the same thing everywhere.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from datetime import timedelta

from .._sql.statements import DEFAULT_SCHEMA, DEFAULT_TABLE, Queries, queries
from .._values.callables import is_async_callable
from .._values.codec import Decoder, decode_json
from .._values.limits import (
    MAX_WORKER_ID,
    check_count,
    check_seconds,
    check_topic_name,
    optional_seconds,
)
from ..errors import InvalidArgument
from ..retry import RetryPolicy

__all__ = ["DEFAULT_MAX_CLAIM_BYTES", "DEFAULT_ORPHAN_SWEEP", "ConsumerOptions"]

# A claim stops adding rows once the stored payloads it holds reach this many bytes
# (after TOAST compression; the first row is always taken); why: docs/benchmarks.md, 8.
DEFAULT_MAX_CLAIM_BYTES = 16 * 1024 * 1024
# With the default `prefetch`, a consumer under load claims ahead until it holds up to
# this many rows: a claim and a settlement cost the same round trips for 64 rows as for
# 512, and at concurrency 64 they were half the client CPU of a drain (docs/benchmarks.md,
# "Prefetch"; 256 left a third more CPU per event, 1024 gained nothing over 512).
PREFETCH_TO = 512
# Every consumer looks this often for ordered keys left without a head (waiting events
# that nothing will promote: an operator deleted the head in SQL, a promotion deferred
# by a producer's lock outlived the consumer that was to retry it) and promotes them.
DEFAULT_ORPHAN_SWEEP = 30.0
# the most events of one ordered key a claim takes behind its head (and never more than
# the claim asks for): one key's drain is a claim, a run and a settlement per run, so
# longer runs pay those fewer times (20k events of one key: 7-9k/s with 256, 9-11k/s
# with 1,024 at want 512; docs/benchmarks.md, "Migration 0008")
MAX_RUN = 1024
# the run rows a claim may take in all, per head asked for: an event a run leaves costs a
# promotion more (an UPDATE); four took a 50k drain's 10k keys whole (docs/internals.md)
RUN_ROWS_PER_HEAD = 4


def run_length(want: int, heads: int) -> int:
    """The most events of one key a claim of ``want`` takes behind its head, when the
    last claim had ``heads``: no more than twice a fair share of the runs' budget.

    The claim reads up to this many waiting events of each head's key, and takes the
    first of every key, then the second, ... until the budget is spent: over 1,000 keys
    with 100 events each, reading up to 1,024 a key read every waiting event each time
    to take 8 of each (a third of the claim's time). Twice the share leaves room for
    the keys with more when others have few; over one key the share is the budget."""
    share = RUN_ROWS_PER_HEAD * want // max(1, heads)
    return min(want, MAX_RUN, max(2 * share, 2 * RUN_ROWS_PER_HEAD))


def _default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, slots=True)
class ConsumerOptions:
    """Validated consumer settings; see `OutboxConsumer` for what each one does."""

    concurrency: int = 64
    batch_size: int | None = None
    prefetch: int | None = None
    topics: frozenset[str] | None = None
    poll_interval: float = 5.0
    lease_timeout: float = 30.0
    shutdown_grace: float = 10.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    handler_timeout: float | None = None
    worker_id: str = field(default_factory=_default_worker_id)
    schema: str = DEFAULT_SCHEMA
    table: str = DEFAULT_TABLE
    listen: bool = True
    listen_dsn: str | None = None
    retention: float | None = 7 * 86400.0
    statement_timeout: float = 10.0
    decoder: Decoder = decode_json
    max_claim_bytes: int = DEFAULT_MAX_CLAIM_BYTES
    # production safety nets (docs/deployment.md)
    listen_probe_interval: float | None = 5.0
    watchdog_interval: float | None = 60.0
    horizon_warning: float = 300.0
    dead_tuples_warning: int = 1_000_000
    orphan_sweep_interval: float = DEFAULT_ORPHAN_SWEEP

    @classmethod
    def build(
        cls,
        *,
        concurrency: object = 64,
        batch_size: object = None,
        prefetch: object = None,
        topics: object = None,
        poll_interval: object = 5.0,
        lease_timeout: object = 30.0,
        shutdown_grace: object = 10.0,
        retry: object = None,
        handler_timeout: object = None,
        worker_id: object = None,
        schema: object = DEFAULT_SCHEMA,
        table: object = DEFAULT_TABLE,
        listen: object = True,
        listen_dsn: object = None,
        retention: object = timedelta(days=7),
        statement_timeout: object = 10.0,
        decoder: object = None,
        max_claim_bytes: object = DEFAULT_MAX_CLAIM_BYTES,
        listen_probe_interval: object = 5.0,
        watchdog_interval: object = 60.0,
        horizon_warning: object = 300.0,
        dead_tuples_warning: object = 1_000_000,
        orphan_sweep_interval: object = DEFAULT_ORPHAN_SWEEP,
    ) -> ConsumerOptions:
        """Check every value (raising `TypeError`/`InvalidArgument`) and freeze them."""
        q = queries(schema, table)  # validated inside
        slots = check_count("concurrency", concurrency, 1, 100_000)
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be an aiooutbox.RetryPolicy, not {retry!r}")
        if not isinstance(listen, bool):
            raise TypeError(f"listen must be True or False, not {listen!r}")
        if decoder is not None and (not callable(decoder) or is_async_callable(decoder)):
            raise TypeError(
                f"decoder must be a plain (not async) callable taking the JSON text, "
                f"not {decoder!r}"
            )
        return cls(
            concurrency=slots,
            batch_size=None
            if batch_size is None
            else check_count("batch_size", batch_size, 1, slots),
            prefetch=None if prefetch is None else check_count("prefetch", prefetch, 0, 100_000),
            topics=_topics(topics),
            poll_interval=check_seconds("poll_interval", poll_interval, minimum=0.01),
            lease_timeout=check_seconds("lease_timeout", lease_timeout, minimum=1.0),
            shutdown_grace=check_seconds("shutdown_grace", shutdown_grace),
            retry=retry or RetryPolicy(),
            handler_timeout=optional_seconds("handler_timeout", handler_timeout, minimum=0.001),
            worker_id=_default_worker_id() if worker_id is None else _worker_id(worker_id),
            schema=q.schema,
            table=q.table,
            listen=listen,
            listen_dsn=_listen_dsn(listen_dsn),
            retention=optional_seconds("retention", retention, minimum=1.0),
            statement_timeout=check_seconds("statement_timeout", statement_timeout, minimum=0.1),
            decoder=decoder or decode_json,
            max_claim_bytes=check_count("max_claim_bytes", max_claim_bytes, 1, 1 << 40),
            listen_probe_interval=optional_seconds(
                "listen_probe_interval", listen_probe_interval, minimum=0.1
            ),
            watchdog_interval=optional_seconds("watchdog_interval", watchdog_interval, minimum=1.0),
            horizon_warning=check_seconds("horizon_warning", horizon_warning, minimum=1.0),
            dead_tuples_warning=check_count("dead_tuples_warning", dead_tuples_warning, 1, 1 << 62),
            orphan_sweep_interval=check_seconds(
                "orphan_sweep_interval", orphan_sweep_interval, minimum=0.1
            ),
        )

    @property
    def queries(self) -> Queries:
        return queries(self.schema, self.table)

    @property
    def claim_size(self) -> int:
        """The most rows one claim takes while traffic is sparse."""
        return self.concurrency if self.batch_size is None else self.batch_size

    @property
    def ahead(self) -> int:
        """The most rows claimed beyond the running handlers (see `prefetch`)."""
        if self.prefetch is not None:
            return self.prefetch
        return max(0, PREFETCH_TO - self.concurrency)

    def for_batches(self, largest: int) -> ConsumerOptions:
        """These options for a consumer whose largest batch handler takes ``largest``
        events a call. Its slots free a batch at a time: when ``concurrency`` holds only
        a batch or two, a claim waits for a batch to end and takes about one, and the
        claim's connection idles while the batches run. Unless ``prefetch`` was given,
        claim ahead until four batches are held (a 100k drain with a handler of 500 at
        concurrency 1,000: 1.17x; at 2,048 with 256, where eight batches run, more
        rows ahead gained nothing: docs/benchmarks-history.md). A batch larger than
        ``concurrency`` is capped at it (docs/batches.md), and so counted here."""
        if self.prefetch is not None:
            return self
        largest = min(largest, self.concurrency)
        return replace(self, prefetch=max(self.ahead, 4 * largest - self.concurrency))

    def max_unwritten(self, claim_rows: int) -> int:
        """Outcomes not yet written past which the consumer stops claiming: four claims'
        worth, a claim being ``concurrency + ahead`` rows or a recent claim's rows, if more
        (ordered heads bring their runs). Four times `concurrency` paused the claims after
        every claim once a consumer at the defaults held 512 rows (a 50k drain at the
        defaults: 24.9k/s against 30.0k/s with this bound); a bound that left runs out
        paused a 50k drain over 10k keys after each claim (0.38 s of its 1.6 s)."""
        return 4 * max(self.concurrency + self.ahead, claim_rows)

    @property
    def dense_claim_size(self) -> int:
        """The most rows one claim takes while claiming ahead (an explicit
        ``batch_size`` still caps it)."""
        return self.claim_size if self.batch_size is not None else self.concurrency + self.ahead


def _topics(topics: object) -> frozenset[str] | None:
    if topics is None:
        return None
    if isinstance(topics, (str, bytes)) or not isinstance(topics, Collection):
        raise TypeError(
            "topics must be a collection of topic names (a list, set or tuple), "
            f"not {type(topics).__name__} {topics!r:.80}"
        )
    if not topics:
        raise InvalidArgument("topics is empty: pass None to consume every handled topic")
    wanted = frozenset(check_topic_name(t, "each of topics") for t in topics)
    if "*" in wanted:  # handlers.ALL_TOPICS: it would claim only events of topic "*"
        raise InvalidArgument(
            "each of topics names a topic to claim, and '*' is none: leave topics unset "
            "(None) to claim every topic, as a '*' handler then does"
        )
    return wanted


def _worker_id(worker_id: object) -> str:
    if not isinstance(worker_id, str):
        raise TypeError(f"worker_id must be a str, not {type(worker_id).__name__}")
    try:
        worker_id.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument("worker_id is not valid Unicode text") from None
    if not worker_id.strip() or len(worker_id) > MAX_WORKER_ID or "\x00" in worker_id:
        raise InvalidArgument(
            f"worker_id must be a non-empty string of 1-{MAX_WORKER_ID} characters without NUL"
        )
    return worker_id


def _listen_dsn(dsn: object) -> str | None:
    if dsn is None:
        return None
    if not isinstance(dsn, str):
        raise TypeError(f"listen_dsn must be a str or None, not {type(dsn).__name__}")
    if not dsn.strip():
        raise InvalidArgument("listen_dsn is empty: pass None to listen through the pool")
    return dsn
