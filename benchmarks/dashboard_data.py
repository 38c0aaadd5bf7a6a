"""A dashboard-sized outbox: 10M rows (1M pending over 50 topics, 9M done) and a few of
every other state, written with ``INSERT … SELECT generate_series`` in 250k-row statements.

``python -m benchmarks.dashboard_data --dsn postgresql://postgres@127.0.0.1/postgres``
(re)creates ``<prefix>aiooutbox_dashboard`` with it; `populate` does the same for the
dashboard scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

import asyncpg

import aiooutbox

from .harness.databases import recreate_database

TOPICS = 50
CHUNK = 250_000
# the rows `populate` writes beside the done and pending ones: 2,000 dead, 1,000 retry,
# 200 processing, 500 ordered keys of 11, and (`add_history`) 1,000 scheduled
EXTRA_ROWS = 2_000 + 1_000 + 200 + 500 * 11 + 1_000

Log = Callable[[str], None]


def _insert(status: str, start: int, count: int, *, age: str, finished: bool) -> str:
    # topic.00 .. topic.49; created over `age` before now, oldest first
    return f"""
    INSERT INTO outbox_events
        (topic, payload, headers, status, attempts, created_at, available_at,
         updated_at, finished_at)
    SELECT 'topic.' || lpad((g % {TOPICS})::text, 2, '0'),
           jsonb_build_object('n', g, 'customer', 'c-' || (g % 997), 'amount', g % 1000),
           jsonb_build_object('traceparent',
               '00-' || lpad(to_hex(g), 32, '0') || '-' || lpad(to_hex(g), 16, '0') || '-01'),
           '{status}', {1 if finished else 0},
           now() - interval '{age}' * (1 - (g - {start})::float8 / {count}),
           now() - interval '{age}' * (1 - (g - {start})::float8 / {count}),
           now(),
           {
        "now() - interval '"
        + age
        + "' * (1 - (g - "
        + str(start)
        + ")::float8 / "
        + str(count)
        + ") + interval '1 second'"
        if finished
        else "NULL"
    }
    FROM generate_series({start}, {start + count - 1}) AS g
    """


async def populate(dsn: str, *, done: int, pending: int, log: Log = print) -> None:
    """Fill an empty, migrated outbox at ``dsn``; ends with VACUUM ANALYZE."""
    conn = await asyncpg.connect(dsn, command_timeout=None)
    try:
        await conn.execute("SET synchronous_commit = off")
        # rows in every state, as a restore writes them: past the insert check (0013)
        # that refuses a producer's rows in states only consumers reach
        check = await conn.fetchval(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'outbox_events'::regclass"
            " AND tgname = 'outbox_events_insert_check'"
        )
        if check is not None:
            await conn.execute(f"ALTER TABLE outbox_events DISABLE TRIGGER {check}")
        started = time.monotonic()
        for status, total, age, finished in (
            ("done", done, "7 days", True),
            ("pending", pending, "1 hour", False),
        ):
            for start in range(0, total, CHUNK):
                count = min(CHUNK, total - start)
                for attempt in range(5):  # a shared server's lock table can be full
                    try:
                        await conn.execute(
                            _insert(status, start, count, age=age, finished=finished)
                        )
                        break
                    except asyncpg.OutOfMemoryError as exc:
                        log(f"  retrying after {exc}")
                        await asyncio.sleep(2 + attempt)
                else:
                    raise RuntimeError("the server kept running out of shared memory")
                log(f"  {status}: {start + count:,}/{total:,} ({time.monotonic() - started:.0f}s)")
        # a few of every other state: failing, dead, held by workers, ordered keys
        await conn.execute(
            "INSERT INTO outbox_events (topic, payload, status, attempts, last_error,"
            " finished_at, created_at)"
            " SELECT 'topic.' || lpad((g % 50)::text, 2, '0'), jsonb_build_object('n', g),"
            " 'dead', 5, 'ValueError: boom ' || g, now() - g * interval '1 minute',"
            " now() - g * interval '1 minute' FROM generate_series(1, 2000) g"
        )
        await conn.execute(
            "INSERT INTO outbox_events (topic, payload, status, attempts, last_error,"
            " available_at) SELECT 'topic.' || lpad((g % 50)::text, 2, '0'),"
            " jsonb_build_object('n', g), 'retry', 2, 'TimeoutError',"
            " now() + g * interval '1 second' FROM generate_series(1, 1000) g"
        )
        await conn.execute(
            "INSERT INTO outbox_events (topic, payload, status, attempts, locked_by,"
            " locked_at, lease_expires_at) SELECT 'topic.' || lpad((g % 50)::text, 2, '0'),"
            " jsonb_build_object('n', g), 'processing', 1, 'host:' || (g % 4) || ':worker',"
            " now(), now() + interval '1 hour' FROM generate_series(1, 200) g"
        )
        # 500 ordered keys of 11 events each: a head and ten waiting behind it
        await conn.execute(
            "INSERT INTO outbox_events (topic, payload, ordering_key)"
            " SELECT 'topic.' || lpad((k % 50)::text, 2, '0'), jsonb_build_object('k', k, 'i', i),"
            " 'key-' || k FROM generate_series(1, 500) k, generate_series(1, 11) i ORDER BY i, k"
        )
        await add_history(conn)
        if check is not None:
            await conn.execute(f"ALTER TABLE outbox_events ENABLE TRIGGER {check}")
        log(f"  extras written ({time.monotonic() - started:.0f}s); VACUUM ANALYZE")
        await conn.execute("VACUUM ANALYZE outbox_events")
        log(f"  populated in {time.monotonic() - started:.0f}s")
    finally:
        await conn.close()


async def add_history(conn: asyncpg.Connection) -> None:
    """What the dashboard's second pass reads (migration 0017): the dead events' attempt
    histories, 1,000 scheduled events, and eight days of per-minute counts of every
    topic (the consumers' rollups: 576,000 rows). Once per database."""
    if await conn.fetchval("SELECT EXISTS (SELECT 1 FROM outbox_events_rollups)"):
        return
    await conn.execute(
        "UPDATE outbox_events SET failures = (SELECT jsonb_agg(jsonb_build_object("
        " 'attempt', a, 'at', extract(epoch FROM now()) - 60 * (6 - a), 'worker',"
        " 'host:' || (id % 4) || ':worker', 'seconds', 0.25 * a, 'error',"
        " 'ValueError: boom ' || id || ' (attempt ' || a || ')', 'outcome',"
        " CASE WHEN a = 5 THEN 'dead' ELSE 'retry' END)) FROM generate_series(1, 5) a)"
        " WHERE status = 'dead'"
    )
    await conn.execute(
        "INSERT INTO outbox_events (topic, payload, available_at)"
        f" SELECT 'topic.' || lpad((g % {TOPICS})::text, 2, '0'), jsonb_build_object('s', g),"
        " now() + g * interval '1 minute' FROM generate_series(1, 1000) g"
    )
    await conn.execute(
        "INSERT INTO outbox_events_rollups (minute, topic, done, retried, dead, claimed,"
        " lag_sum, lag_max)"
        " SELECT date_trunc('minute', now()) - m * interval '1 minute',"
        f" 'topic.' || lpad(t::text, 2, '0'), 20 + (m + t) % 7, (m + t) % 3, (m % 97 = 0)::int,"
        " 20, 4.0, 0.2 + (m % 11) / 10.0"
        f" FROM generate_series(0, 8 * 1440 - 1) m, generate_series(0, {TOPICS - 1}) t"
    )


async def create(admin_dsn: str, name: str, *, done: int, pending: int, log: Log = print) -> str:
    dsn = await recreate_database(admin_dsn, name)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        await aiooutbox.migrate(pool)
    finally:
        await pool.close()
    await populate(dsn, done=done, pending=pending, log=log)
    return dsn


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dashboard_data")
    parser.add_argument("--dsn", required=True, help="admin DSN (CREATE DATABASE)")
    parser.add_argument("--prefix", default="bench_")
    parser.add_argument("--done", type=int, default=9_000_000)
    parser.add_argument("--pending", type=int, default=1_000_000)
    args = parser.parse_args()
    name = f"{args.prefix}aiooutbox_dashboard"
    print(asyncio.run(create(args.dsn, name, done=args.done, pending=args.pending)))


if __name__ == "__main__":
    main()
