"""Upgrading a live outbox: schema 15 (the last release's) with a backlog, producers
inserting and that release's consumer handling events while `migrate` runs to head.

Migrations 0017 and 0018 build their indexes with CREATE INDEX CONCURRENTLY, in steps
outside a transaction: no producer waits for a lock while an index is being built (a
watcher samples pg_stat_progress_create_index and the producers' wait events every few
milliseconds). An interrupted build (its backend cancelled) leaves an invalid index and
an unrecorded migration, which the next `migrate` completes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import textwrap
from pathlib import Path

import asyncpg
import pytest

import aiooutbox
from aiooutbox._sql.db import PermanentDatabaseError
from aiooutbox.migrations import latest_version, migration_sql, migrations
from benchmarks.live_upgrade import BACKLOG_TOPIC, TOPIC, load_backlog, migrate_to, upgrade
from tests.helpers import extract_release, wait_until

# the last release (schema 15): before attempt history, groups and low marks
RELEASE_15 = "900cf10"
BACKLOG = 300_000
AFTER_15 = [m.version for m in migrations() if m.version > 15]
HEAD = [m.version for m in migrations() if m.version > 17]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def release_15(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The last release's package (and its schema files), extracted from git."""
    return extract_release(tmp_path_factory.mktemp("release15"), RELEASE_15, "aiooutbox", "schema")


OLD_CONSUMER = textwrap.dedent(
    """
    import asyncio, sys
    import asyncpg
    import aiooutbox

    async def main() -> None:
        dsn, topic = sys.argv[1], sys.argv[2]
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)

        async def handle(event):
            await pool.execute("INSERT INTO handled_by (id) VALUES ($1)", event.id)

        consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.2)
        async with consumer:
            print("started", flush=True)
            task = asyncio.ensure_future(consumer.run({topic: handle}))
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            consumer.stop()
            await task
        await pool.close()

    asyncio.run(main())
    """
)


async def _start_old(release: Path, dsn: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        OLD_CONSUMER,
        dsn,
        TOPIC,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(release)},
        cwd=str(release),
    )
    assert proc.stdout is not None and proc.stderr is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    if line.strip() != b"started":
        err = await proc.stderr.read()
        raise AssertionError(f"the last release's consumer did not start: {err.decode()}")
    return proc


async def _stop_old(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdin is not None and proc.stderr is not None
    proc.stdin.write(b"\n")
    await proc.stdin.drain()
    err = await asyncio.wait_for(proc.stderr.read(), 60)
    assert await asyncio.wait_for(proc.wait(), 60) == 0, err.decode()
    return err.decode()


async def _with_backlog(dsn: str, version: int = 17) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await migrate_to(conn, version)
        await load_backlog(conn, BACKLOG)
        await conn.execute("CREATE TABLE handled_by (id bigint PRIMARY KEY)")
    finally:
        await conn.close()


async def _shape(dsn: str) -> dict[str, object]:
    """The outbox table's columns, constraints and indexes, as the catalogs show them."""
    conn = await asyncpg.connect(dsn)
    try:
        columns = await conn.fetch(
            "SELECT attname, format_type(atttypid, atttypmod), attnotnull,"
            " pg_get_expr(d.adbin, d.adrelid) AS dflt, collname FROM pg_attribute a"
            " LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum"
            " LEFT JOIN pg_collation c ON c.oid = a.attcollation AND a.attcollation <> 100"
            " WHERE attrelid = 'outbox_events'::regclass AND attnum > 0 AND NOT attisdropped"
            " ORDER BY attnum"
        )
        constraints = await conn.fetch(
            "SELECT conname, pg_get_constraintdef(oid), convalidated FROM pg_constraint"
            " WHERE conrelid = 'outbox_events'::regclass ORDER BY conname"
        )
        indexes = await conn.fetch(
            "SELECT c.relname, pg_get_indexdef(i.indexrelid), i.indisvalid FROM pg_index i"
            " JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE i.indrelid = 'outbox_events'::regclass ORDER BY c.relname"
        )
    finally:
        await conn.close()
    return {
        "columns": [tuple(r) for r in columns],
        "constraints": [tuple(r) for r in constraints],
        "indexes": [tuple(r) for r in indexes],
    }


async def test_migrate_a_live_outbox_from_the_last_release_blocks_no_producer(
    empty_dsn: str, dsn: str, release_15: Path
) -> None:
    await _with_backlog(empty_dsn, 15)
    old = await _start_old(release_15, empty_dsn)
    try:
        # two migrates at once, as two deploys starting together: one applies, one waits
        result = await upgrade(empty_dsn, producers=4, migrate_dsns=2)
    finally:
        err = await _stop_old_when_done(old, empty_dsn)
    print(
        f"\nlive upgrade from 15 with {BACKLOG:,} pending rows: migrate took"
        f" {result['migrate_s']} s; longest insert {result['longest_stall_ms']} ms"
        f" (p99 {result['p99_insert_ms']} ms) over {result['inserts']} inserts;"
        f" {result['building_samples']} samples while the index was being built"
        f" ({', '.join(result['phases'])}), {result['blocked_while_building']} with a"
        f" producer waiting for a lock; {result['blocked_samples']} of"
        f" {result['samples']} in all"
    )
    assert result["building_samples"] > 0, "the watcher never saw the build"
    shown = {k: v for k, v in result.items() if k != "ids"}
    assert result["blocked_while_building"] == 0, shown
    assert any("validation" in p for p in result["phases"]), shown  # a concurrent build's
    # each migration applied once, by one of the two (they may share the work)
    assert sorted(v for applied in result["applied"] for v in applied) == AFTER_15
    assert result["longest_stall_ms"] < 10_000, shown  # generous: a stall of the build's length
    # nothing lost: every event the producers committed was handled by the old consumer
    conn = await asyncpg.connect(empty_dsn)
    try:
        await wait_until(lambda: _handled(conn, len(result["ids"])), timeout=60)
        handled = {r[0] for r in await conn.fetch("SELECT id FROM handled_by")}
        assert handled == set(result["ids"])
        backlog = await conn.fetchval(
            "SELECT count(*) FROM outbox_events WHERE topic = $1 AND status = 'pending'",
            BACKLOG_TOPIC,
        )
        assert backlog == BACKLOG
    finally:
        await conn.close()
    assert "Traceback" not in err, err
    # the schema is the one a fresh migrate builds: the new index valid, under its name
    assert await _shape(empty_dsn) == await _shape(dsn)


async def _handled(conn: asyncpg.Connection, n: int) -> bool:
    return bool(await conn.fetchval("SELECT count(*) FROM handled_by") >= n)


async def _stop_old_when_done(proc: asyncio.subprocess.Process, dsn: str) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        await wait_until(lambda: _no_pending(conn), timeout=60)
    finally:
        await conn.close()
    return await _stop_old(proc)


async def _no_pending(conn: asyncpg.Connection) -> bool:
    left = await conn.fetchval(
        "SELECT count(*) FROM outbox_events WHERE topic = $1 AND status <> 'done'", TOPIC
    )
    return bool(left == 0)


async def _index_state(conn: asyncpg.Connection, name: str) -> bool | None:
    state: bool | None = await conn.fetchval(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)", name
    )
    return state


async def test_an_interrupted_concurrent_build_is_completed_by_the_next_migrate(
    empty_dsn: str, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    await _with_backlog(empty_dsn)
    conn = await asyncpg.connect(empty_dsn)
    watcher = await asyncpg.connect(empty_dsn)
    try:
        migrating = asyncio.create_task(aiooutbox.migrate(conn))
        # cancel the build's backend once it reads the table
        pid = None
        for _ in range(3000):
            row = await watcher.fetchrow(
                "SELECT pid, phase FROM pg_stat_progress_create_index"
                " WHERE command = 'CREATE INDEX CONCURRENTLY' AND phase LIKE 'building index%'"
            )
            if row is not None:
                pid = row["pid"]
                break
            await asyncio.sleep(0.002)
        assert pid is not None, "the concurrent build was never seen"
        assert await watcher.fetchval("SELECT pg_cancel_backend($1)", pid)
        with pytest.raises(asyncpg.QueryCanceledError):
            await migrating
        print(f"\ncancelled the build in backend {pid}")

        # what it left: the column, an invalid index, 0018 not recorded, no lock held
        assert await _index_state(watcher, "outbox_events_topic_grp_claimable_idx") is False
        assert await _index_state(watcher, "outbox_events_topic_claimable_idx") is True
        assert await watcher.fetchval(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = 'outbox_events'::regclass"
            " AND attname = 'grp'"
        )
        versions = {
            r[0] for r in await watcher.fetch("SELECT version FROM outbox_events_migrations")
        }
        compat = {
            r[0] for r in await watcher.fetch("SELECT version FROM outbox_events_migrations_compat")
        }
        assert max(versions | compat) == 17
        held = await watcher.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND database"
            " = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        assert held == 0  # the build lock went with the failed call
        # producers of schema 17 still insert meanwhile (the invalid index takes their rows)
        await watcher.execute("INSERT INTO outbox_events (topic, payload) VALUES ('t', '{}')")
        with pytest.raises(aiooutbox.SchemaNotReady):
            await aiooutbox.check_schema(watcher)

        # the next migrate drops the invalid index, builds it again and records 0018, 0019
        with caplog.at_level(logging.INFO, logger="aiooutbox.migrations"):
            assert await aiooutbox.migrate(conn) == HEAD
        assert "left invalid by an interrupted build" in caplog.text
        assert await _index_state(watcher, "outbox_events_topic_grp_claimable_idx") is None
        await aiooutbox.check_schema(watcher)
        assert await aiooutbox.migrate(conn) == []
    finally:
        await conn.close()
        await watcher.close()
    assert await _shape(empty_dsn) == await _shape(dsn)


async def test_a_migrate_in_one_transaction_waits_for_a_concurrent_build(empty_dsn: str) -> None:
    """A `migrate --pgbouncer` (the build in its transaction) started while another
    `migrate` builds concurrently neither queues for the outbox table's lock (which would
    block every writer behind it until the build ends) nor waits holding a snapshot the
    build would wait for: it tries the build lock until the build is done."""
    await _with_backlog(empty_dsn)
    first, second, watcher = [await asyncpg.connect(empty_dsn) for _ in range(3)]
    try:
        building = asyncio.create_task(aiooutbox.migrate(first))
        for _ in range(3000):
            if await watcher.fetchval(
                "SELECT count(*) FROM pg_stat_progress_create_index"
                " WHERE command = 'CREATE INDEX CONCURRENTLY'"
            ):
                break
            await asyncio.sleep(0.002)
        else:
            raise AssertionError("the concurrent build was never seen")
        pid = await second.fetchval("SELECT pg_backend_pid()")
        in_one = asyncio.create_task(aiooutbox.migrate(second, concurrently=False))
        queued = 0
        while not building.done():
            queued += await watcher.fetchval(
                "SELECT count(*) FROM pg_locks"
                " WHERE pid = $1 AND NOT granted AND locktype = 'relation'",
                pid,
            )
            await asyncio.sleep(0.005)
        applied = [await building, await in_one]
    finally:
        for conn in (first, second, watcher):
            await conn.close()
    assert queued == 0  # samples that found the second migrate waiting for a table's lock
    assert sorted(v for a in applied for v in a) == HEAD, applied
    conn = await asyncpg.connect(empty_dsn)
    try:
        assert await _index_state(conn, "outbox_events_topic_claimable_idx") is True
    finally:
        await conn.close()


async def test_a_long_transaction_does_not_hold_producers_behind_migrate(
    empty_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A transaction that read the outbox stays open for 12 s (a pg_dump, say) while
    `migrate` runs: 0018's ALTER TABLE waits for it, but only 2 s at a time (its
    lock_timeout), so producers queued behind it go on between the tries instead of
    waiting the 12 s; the migration completes once the transaction ends."""
    conn = await asyncpg.connect(empty_dsn)
    holder = await asyncpg.connect(empty_dsn)
    try:
        await migrate_to(conn, 17)
        await load_backlog(conn, 1_000)
        await holder.execute("BEGIN; SELECT count(*) FROM outbox_events")
        holder_pid = await holder.fetchval("SELECT pg_backend_pid()")

        async def end_holder() -> None:
            await asyncio.sleep(12)
            await holder.execute("COMMIT")

        ending = asyncio.create_task(end_holder())
        with caplog.at_level(logging.WARNING, logger="aiooutbox.migrations"):
            result = await upgrade(empty_dsn, producers=2, before=0.5, after=0.5)
        await ending
    finally:
        await conn.close()
        await holder.close()
    print(
        f"\nmigrate behind a 12 s transaction: {result['migrate_s']} s; longest insert"
        f" {result['longest_stall_ms']} ms over {result['inserts']} inserts"
    )
    assert result["longest_stall_ms"] < 8_000, result["longest_stall_ms"]  # not the 12 s
    assert result["applied"] == [HEAD]
    assert result["migrate_s"] > 10  # it did wait for the transaction
    assert f"backend {holder_pid}" in caplog.text and "trying again" in caplog.text


async def test_a_migration_chosen_to_end_a_deadlock_is_tried_again(
    empty_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """0018's last step locks the outbox (DROP INDEX), then the flow control table
    (ALTER TABLE); a consumer of the previous release locks them the other way round
    (its topic's control row, then the outbox rows it claims). Such a session holds the
    control table while the migration waits for it, then asks for the outbox: the
    server ends the deadlock by rolling back the migration's transaction (it waited
    first), and `migrate` tries that step again instead of failing the deploy."""
    conn = await asyncpg.connect(empty_dsn)
    holder = await asyncpg.connect(empty_dsn)
    watcher = await asyncpg.connect(empty_dsn)
    try:
        await migrate_to(conn, 17)
        flow = await conn.fetchval("SELECT 'outbox_events_flow'::regclass::oid")
        # the holder never runs the deadlock check itself: the migration, waiting
        # first, finds the cycle a second into its wait (deadlock_timeout)
        await holder.execute("SET deadlock_timeout = '60s'")
        await holder.execute("BEGIN; LOCK TABLE outbox_events_flow IN ROW SHARE MODE")
        migrate_pid = await conn.fetchval("SELECT pg_backend_pid()")
        with caplog.at_level(logging.WARNING, logger="aiooutbox.migrations"):
            migrating = asyncio.create_task(aiooutbox.migrate(conn))
            await wait_until(
                lambda: watcher.fetchval(
                    "SELECT count(*) > 0 FROM pg_locks WHERE pid = $1 AND relation = $2"
                    " AND NOT granted",
                    migrate_pid,
                    flow,
                ),
                timeout=60,
                interval=0.005,
            )
            # the other order: the server's deadlock check rolls the migration back
            await holder.execute("LOCK TABLE outbox_events IN ROW SHARE MODE")
            await holder.execute("COMMIT")
            applied = await asyncio.wait_for(migrating, 60)
    finally:
        for c in (conn, holder, watcher):
            await c.close()
    assert applied == HEAD
    assert "chosen to end a deadlock" in caplog.text and "trying again" in caplog.text


async def test_a_build_waits_for_a_session_outside_a_transaction(empty_dsn: str) -> None:
    conn = await asyncpg.connect(empty_dsn)
    try:
        await migrate_to(conn, 17)
        async with conn.transaction():
            with pytest.raises(PermanentDatabaseError, match="inside a transaction"):
                await aiooutbox.migrate(conn)
        # inside the migration's transaction when asked (as behind PgBouncer)
        assert await aiooutbox.migrate(conn, concurrently=False) == HEAD
        assert await _index_state(conn, "outbox_events_topic_claimable_idx") is True
    finally:
        await conn.close()


@pytest.mark.skipif(shutil.which("psql") is None, reason="psql is not installed")
async def test_migration_sql_concurrently_runs_in_psql(empty_dsn: str, dsn: str) -> None:
    """``migration_sql(concurrently=True)``: the build outside a transaction, as psql runs
    a file statement by statement; the same schema as `migrate` builds."""
    sql = migration_sql(concurrently=True)
    assert "CREATE INDEX CONCURRENTLY IF NOT EXISTS" in sql
    assert "INDEX CONCURRENTLY" not in migration_sql()
    done = await asyncio.create_subprocess_exec(
        "psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", empty_dsn, "-f", "-",
        stdin=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await done.communicate(sql.encode())
    assert done.returncode == 0, err.decode()
    conn = await asyncpg.connect(empty_dsn)
    try:
        await aiooutbox.check_schema(conn)
        assert await aiooutbox.migrate(conn) == []
        assert latest_version() == max(HEAD)
    finally:
        await conn.close()
    assert await _shape(empty_dsn) == await _shape(dsn)
