"""``python -m aiooutbox demo``: the whole event lifecycle on sample events, in seconds.

It works on a table of its own (``aiooutbox_demo`` unless told otherwise), emptied first,
so it never touches real events.
"""

from __future__ import annotations

import asyncio
import collections
import random
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg

from .. import admin
from .._engine.options import ConsumerOptions
from .._sql.admin import admin_queries
from ..consumer import OutboxConsumer
from ..errors import Dead, InvalidArgument, Retry
from ..events import Event, NewEvent
from ..handlers import Router
from ..migrations import migrate
from ..producer import enqueue_many
from ..retry import RetryPolicy
from . import output
from .errors import UsageError

__all__ = ["check_options", "router", "run_demo", "sample_events"]

# short delays, so that retries and dead letters happen within the demo's seconds
DEMO_RETRY = RetryPolicy(base=0.05, max_delay=0.5)
TIME_LIMIT = 50.0
#: more would not finish within TIME_LIMIT, and would take seconds and memory to build
MAX_EVENTS = 100_000
# every demo event carries the header, so the demo never empties a table it did not fill
_DEMO: dict[str, Any] = {"max_attempts": 4, "headers": {"demo": True}}

router = Router()


async def _io() -> None:
    await asyncio.sleep(random.uniform(0.005, 0.03))  # a simulated network call


@router.handler("orders.created")
async def confirm_order(event: Event) -> None:
    await _io()


@router.handler("emails.send")
async def send_email(event: Event) -> None:
    await _io()
    if event.attempts <= event.payload.get("busy_for", 0):
        raise ConnectionError("SMTP server busy (simulated)")


@router.handler("webhooks.deliver")
async def deliver_webhook(event: Event) -> None:
    await _io()
    url = event.payload["url"]
    simulate = event.payload.get("simulate")
    if simulate == "timeout":
        raise TimeoutError(f"POST {url} timed out (simulated)")
    if simulate == "gone":
        raise Dead(f"POST {url}: 410 Gone, the endpoint was removed (simulated)")
    if simulate == "rate_limited" and event.attempts == 1:
        raise Retry(delay=0.3, reason=f"POST {url}: 429 Too Many Requests (simulated)")


def sample_events(total: int) -> list[NewEvent]:
    """Half orders, 30% emails (a third busy once or twice), 20% webhooks (some fatal)."""
    events = []
    for n in range(total):
        slot = n % 20
        if slot < 10:
            events.append(NewEvent("orders.created", {"order_id": n}, **_DEMO))
        elif slot < 16:
            busy = 2 if n % 7 == 0 else 1 if slot in (10, 15) else 0
            payload = {"to": f"customer{n}@example.com", "busy_for": busy}
            events.append(NewEvent("emails.send", payload, **_DEMO))
        else:
            simulate = {16: "timeout", 17: "gone", 18: "rate_limited"}.get(slot, "ok")
            if simulate in ("timeout", "gone") and n % 3:
                simulate = "ok"
            payload = {"url": f"https://hooks.example.com/{n % 7}", "simulate": simulate}
            events.append(NewEvent("webhooks.deliver", payload, **_DEMO))
    return events


def check_options(*, events: int, concurrency: int) -> None:
    """Refuse what the demo cannot do before it writes anything (`UsageError`)."""
    if not 1 <= events <= MAX_EVENTS:
        raise UsageError(
            f"--events {events}: at most {MAX_EVENTS} sample events (the demo stops"
            f" after {TIME_LIMIT:g}s)"
        )
    try:
        ConsumerOptions.build(concurrency=concurrency)
    except InvalidArgument as exc:
        raise UsageError(f"--concurrency {concurrency}: {exc}") from None


async def run_demo(
    pool: asyncpg.Pool,
    *,
    schema: str,
    table: str,
    events: int,
    concurrency: int,
    hint: str,
    embedded_dir: Path | None = None,
) -> int:
    check_options(events=events, concurrency=concurrency)
    q = admin_queries(schema, table)
    await migrate(pool, schema=schema, table=table)
    foreign = await pool.fetchval(q.not_demo_events)
    if foreign:
        raise InvalidArgument(
            f"{schema}.{table} holds {foreign} event(s) the demo did not write, and the demo"
            " empties its table first: pick another --table"
        )
    await pool.execute(q.reset_demo)
    started = time.monotonic()
    batch = sample_events(events)
    for chunk in range(0, events, 5000):
        await enqueue_many(pool, batch[chunk : chunk + 5000], schema=schema, table=table)
    print(
        f"enqueued {events} sample events into {schema}.{table} "
        f"in {time.monotonic() - started:.2f}s; consuming with concurrency {concurrency}\n",
        flush=True,
    )

    consumer = OutboxConsumer(
        pool,
        concurrency=concurrency,
        poll_interval=0.5,
        retry=DEMO_RETRY,
        schema=schema,
        table=table,
    )
    async with consumer:
        started = time.monotonic()
        runner = asyncio.ensure_future(consumer.run(router))
        try:
            await _progress(consumer, runner, events, started)
        finally:
            consumer.stop()
            await runner
    elapsed = time.monotonic() - started

    rows = await pool.fetch(q.attempts_by_topic)
    done = sum(r[2] for r in rows)
    dead = sum(r[3] for r in rows)
    attempts = sum(r[4] for r in rows)
    print(
        f"\n{done + dead} of {events} events finished in {elapsed:.1f}s "
        f"({(done + dead) / elapsed:.0f} events/s): {done} done, {dead} dead, "
        f"{attempts - events} retries\n"
    )
    print(
        output.table(
            ["TOPIC", "EVENTS", "DONE", "DEAD", "ATTEMPTS"],
            [[r[0], r[1], r[2], r[3], r[4]] for r in rows],
        )
    )
    print(f"\n$ python -m aiooutbox stats{hint}\n")
    print(output.stats_view(await admin.stats(pool, schema=schema, table=table), hint=hint))
    sample = await admin.dead_list(pool, limit=5, schema=schema, table=table)
    if sample:
        print(f"\n$ python -m aiooutbox dead list --limit 5{hint}\n")
        print(output.dead_table(sample))
    steps = [
        (f"python -m aiooutbox dead retry --all{hint}", "requeue the dead events"),
        # --migrate: the demo made only its own table, not the default outbox
        ("python -m aiooutbox run myapp.jobs:handlers --migrate", "run your own handlers"),
    ]
    if embedded_dir is not None:
        steps.append(("python -m aiooutbox embedded stop", "stop the embedded PostgreSQL"))
    width = max(len(command) for command, _ in steps)
    print("\nnext:")
    for command, what in steps:
        print(f"  $ {command:<{width}}  # {what}")
    if embedded_dir is not None:
        print(
            f"\nThe embedded PostgreSQL in {embedded_dir} keeps running for these commands"
            " and your application; its DSN:\n"
            "  $ export AIOOUTBOX_DSN=$(python -m aiooutbox embedded start)"
        )
    return 0 if done + dead == events else 1


async def _progress(
    consumer: OutboxConsumer, runner: asyncio.Future[None], total: int, started: float
) -> None:
    """Show a live progress line on stderr until every event is done or dead."""
    tty = sys.stderr.isatty()
    window: collections.deque[tuple[float, int]] = collections.deque(maxlen=10)
    printed = time.monotonic()
    while not runner.done():
        now = time.monotonic()
        s = consumer.stats
        finished = s.done + s.dead
        window.append((now, finished))
        span = now - window[0][0]
        rate = (finished - window[0][1]) / span if span > 0 else 0.0
        line = (
            f"done {s.done:>6}   retried {s.retried:>5}   dead {s.dead:>4}   "
            f"in flight {s.in_flight:>4}   {rate:>6.0f} events/s   {now - started:5.1f}s"
        )
        if tty:
            sys.stderr.write("\r" + line + "\x1b[K")
        elif now - printed >= 1.0 or finished >= total:
            sys.stderr.write(line + "\n")
            printed = now
        sys.stderr.flush()
        if finished >= total or now - started > TIME_LIMIT:
            break
        await asyncio.wait([runner], timeout=0.1)
    if tty:
        sys.stderr.write("\n")
