"""A rolling upgrade from the previous release (``ab0edab``, schema 2) to this one.

The previous release is taken from git into a temporary directory and run in
subprocesses beside this release: a consumer of each handles events through the
upgrade, and an old consumer (re)started after ``migrate`` still starts, because every
migration since declares itself compatible with schema 2.
"""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from pathlib import Path

import asyncpg
import pytest

import aiooutbox
from aiooutbox._sql.statements import queries
from aiooutbox.migrations import migrations
from tests.helpers import extract_release, running, wait_until

PREVIOUS = "ab0edab"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's package, extracted from git."""
    return extract_release(tmp_path_factory.mktemp("previous"), PREVIOUS, "aiooutbox")


OLD_CONSUMER = textwrap.dedent(
    """
    import asyncio, sys
    import asyncpg
    import aiooutbox

    async def main() -> None:
        dsn, name = sys.argv[1], sys.argv[2]
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)

        async def handle(event):
            await pool.execute(
                "INSERT INTO handled_by (id, consumer) VALUES ($1, $2)", event.id, name
            )

        consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.2)
        async with consumer:
            print("started", flush=True)
            task = asyncio.ensure_future(consumer.run({"t": handle}))
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            consumer.stop()
            await task
        await pool.close()

    asyncio.run(main())
    """
)


async def _start_old(previous: Path, dsn: str, name: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": str(previous)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        OLD_CONSUMER,
        dsn,
        name,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=str(previous),
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    if line.strip() != b"started":
        assert proc.stderr is not None
        err = await proc.stderr.read()
        raise AssertionError(f"the previous release's consumer did not start: {err.decode()}")
    return proc


async def _stop_old(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdin is not None
    proc.stdin.write(b"\n")
    await proc.stdin.drain()
    assert await asyncio.wait_for(proc.wait(), 60) == 0


async def test_old_and_new_consumers_run_side_by_side_through_an_upgrade(
    empty_dsn: str, previous_release: Path
) -> None:
    conn = await asyncpg.connect(empty_dsn)
    try:
        # the database as the previous release left it: its own migrations (1 and 2)
        q = queries()
        await conn.execute(q.create_versions_table)
        for m in migrations()[:2]:
            await conn.execute(q.render(m.template))
            await conn.execute(q.record_version, m.version, m.name)
        await conn.execute("CREATE TABLE handled_by (id bigint PRIMARY KEY, consumer text)")
        old = await _start_old(previous_release, empty_dsn, "old-1")
        await conn.execute("INSERT INTO outbox_events (topic, payload) VALUES ('t', '{}')")
        await wait_until(lambda: _count(conn, "old-1", 1), timeout=30)

        # upgrade the schema while the old consumer runs
        assert await aiooutbox.migrate(conn) == [m.version for m in migrations()[2:]]

        async with asyncpg.create_pool(empty_dsn, min_size=1, max_size=4) as pool:

            async def handle(event: aiooutbox.Event) -> None:
                await pool.execute("INSERT INTO handled_by VALUES ($1, 'new')", event.id)

            async with running(aiooutbox.OutboxConsumer(pool, poll_interval=0.2), {"t": handle}):
                # an old consumer restarted after the upgrade still starts
                await _stop_old(old)
                old = await _start_old(previous_release, empty_dsn, "old-2")
                ids = await aiooutbox.enqueue_many(
                    pool, [aiooutbox.NewEvent("t", {"n": i}) for i in range(200)]
                )
                await wait_until(lambda: _all_done(conn, len(ids) + 1), timeout=60)
            await _stop_old(old)
        by = {
            r["consumer"]: r["n"]
            for r in await conn.fetch(
                "SELECT consumer, count(*) AS n FROM handled_by GROUP BY consumer"
            )
        }
        assert sum(by.values()) == 201, by  # every event handled exactly once
        assert by.get("old-1") == 1 and set(by) <= {"old-1", "old-2", "new"}, by
    finally:
        await conn.close()


async def _count(conn: asyncpg.Connection, consumer: str, n: int) -> bool:
    got = await conn.fetchval("SELECT count(*) FROM handled_by WHERE consumer = $1", consumer)
    return bool(got == n)


async def _all_done(conn: asyncpg.Connection, n: int) -> bool:
    # before the upgrade finished events stay in the table; after it (0022) they are
    # in the ring, or in the table for an old consumer's own settlement function
    source = "outbox_events"
    if await conn.fetchval("SELECT to_regclass('outbox_events_all') IS NOT NULL"):
        source = "outbox_events_all"
    done = await conn.fetchval(f"SELECT count(*) FROM {source} WHERE status = 'done'")
    return bool(done == n)


async def test_a_newer_schema_that_declares_compatibility_is_accepted(empty_dsn: str) -> None:
    conn = await asyncpg.connect(empty_dsn)
    try:
        await aiooutbox.migrate(conn)
        latest = migrations()[-1].version
        # a future migration compatible with this release: accepted
        await conn.execute(
            "INSERT INTO outbox_events_migrations_compat (version, name, compatible_with)"
            " VALUES ($1, 'future_additive', $2)",
            latest + 1,
            latest,
        )
        await conn.execute(
            "INSERT INTO outbox_events_migrations (version, name) VALUES ($1, 'future_additive')",
            latest + 1,
        )
        await aiooutbox.check_schema(conn)
        assert await aiooutbox.migrate(conn) == []
        # one that needs a newer release: refused, with the fix
        await conn.execute(
            "INSERT INTO outbox_events_migrations_compat (version, name, compatible_with)"
            " VALUES ($1, 'future_breaking', $1)",
            latest + 2,
        )
        with pytest.raises(aiooutbox.SchemaTooNew, match="upgrade aiooutbox"):
            await aiooutbox.check_schema(conn)
    finally:
        await conn.close()
