"""Behind a real PgBouncer in transaction mode (issue 17, item 1): migrate, producers and
the CLI runner, with LISTEN on a direct DSN or none at all; nothing lost, nothing warned.

The test starts its own PgBouncer (Debian's package; ``.ci/run`` installs it) on a free
port in front of the test server, and stops it at the end; without it, it is skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit, urlunsplit

import asyncpg
import pytest

import aiooutbox
from aiooutbox._sql.db import PermanentDatabaseError
from aiooutbox.migrations import migrations as _shipped
from tests.clirunner import Runner, clean_env, cli
from tests.helpers import status_counts, wait_until
from tests.programs import needs, program

pytestmark = needs("pgbouncer")

ALL_VERSIONS = [m.version for m in _shipped()]

HANDLERS = "tests.cli_handlers:handlers"
QUICK = (HANDLERS, "--topics", "quick")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _backend(dsn: str) -> tuple[str, int]:
    """Host (or unix socket directory) and port of the server a DSN points at."""
    parts = urlsplit(dsn)
    query = parse_qs(parts.query)
    host = query.get("host", [parts.hostname or "127.0.0.1"])[0]
    port = int(query.get("port", [parts.port or 5432])[0])
    return host, port


def _run_as(host: str) -> str | None:
    """PgBouncer refuses to run as root: as root, run it as the owner of the server's
    socket directory (so it may connect there), else as ``postgres``."""
    if os.geteuid() != 0:
        return None
    if host.startswith("/"):
        return pwd.getpwuid(os.stat(host).st_uid).pw_name
    return "postgres"


@pytest.fixture(scope="module")
def bouncer(pg_server: str) -> Iterator[int]:
    """Port of a private PgBouncer in transaction mode in front of the test server."""
    pgbouncer = program("pgbouncer")
    host, port = _backend(pg_server)
    listen = _free_port()
    user = urlsplit(pg_server).username or "postgres"
    workdir = Path(tempfile.mkdtemp(prefix="aiooutbox-pgbouncer-"))
    (workdir / "userlist.txt").write_text(f'"{user}" ""\n')
    (workdir / "pgbouncer.ini").write_text(
        f"""[databases]
* = host={host} port={port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen}
unix_socket_dir =
auth_type = trust
auth_file = {workdir / "userlist.txt"}
pool_mode = transaction
default_pool_size = 8
max_client_conn = 200
ignore_startup_parameters = extra_float_digits
logfile = {workdir / "pgbouncer.log"}
pidfile = {workdir / "pgbouncer.pid"}
"""
    )
    run_as = _run_as(host)
    command = [pgbouncer, *(["-u", run_as] if run_as else []), str(workdir / "pgbouncer.ini")]
    if run_as:
        entry = pwd.getpwnam(run_as)
        os.chown(workdir, entry.pw_uid, entry.pw_gid)
    output = workdir / "output.log"
    with output.open("wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", listen)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                log = workdir / "pgbouncer.log"
                raise RuntimeError(
                    f"pgbouncer did not start: {output.read_text()}\n"
                    f"{log.read_text() if log.exists() else ''}"
                )
            time.sleep(0.05)
        yield listen
    finally:
        proc.send_signal(signal.SIGINT)  # safe shutdown
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _through(dsn: str, port: int) -> str:
    """The same database and user, through PgBouncer."""
    parts = urlsplit(dsn)
    user = parts.username or "postgres"
    return urlunsplit(("postgresql", f"{user}@127.0.0.1:{port}", parts.path, "", ""))


@pytest.fixture
async def bounced(empty_dsn: str, bouncer: int) -> tuple[str, str]:
    """(direct DSN, DSN through PgBouncer) of a fresh database without the schema."""
    return empty_dsn, _through(empty_dsn, bouncer)


def _warnings(lines: list[str]) -> list[str]:
    return [line for line in lines if " WARNING " in line or " ERROR " in line]


async def _produce(dsn: str, producers: int, each: int, tag: str) -> None:
    """``producers`` tasks at once, each enqueueing ``each`` events one by one and then
    ``each`` in one batch, through a pool without a statement cache."""
    async with asyncpg.create_pool(dsn, min_size=2, max_size=8, statement_cache_size=0) as pool:

        async def one(n: int) -> None:
            for i in range(each):
                async with pool.acquire() as conn, conn.transaction():
                    await aiooutbox.enqueue(conn, "quick", {"p": n, "i": i, "tag": tag})
            await aiooutbox.enqueue_many(
                pool,
                [aiooutbox.NewEvent("quick", {"p": n, "b": i, "tag": tag}) for i in range(each)],
            )

        await asyncio.gather(*(one(n) for n in range(producers)))


@pytest.mark.timeout(240)
@pytest.mark.slow  # a PgBouncer of its own and four command-line processes
async def test_migrate_produce_and_run_through_pgbouncer(bounced: tuple[str, str]) -> None:
    direct, bouncer = bounced
    env = clean_env()

    first = await cli("migrate", "--dsn", bouncer, "--pgbouncer", env=env)
    assert first.rc == 0 and f"applied migration(s) {ALL_VERSIONS}" in first.out, first
    again = await cli("migrate", "--dsn", bouncer, env=clean_env(AIOOUTBOX_PGBOUNCER="1"))
    assert again.rc == 0 and "is up to date" in again.out, again

    refused = await cli("run", HANDLERS, "--dsn", bouncer, "--pgbouncer", env=env)
    assert refused.rc == 2 and "--listen-dsn" in refused.err and "--no-listen" in refused.err
    both = await cli("run", HANDLERS, "--no-listen", "--listen-dsn", direct, "--dsn", bouncer)
    assert both.rc == 2 and "not allowed with argument" in both.err, both.err

    conn = await asyncpg.connect(direct)
    try:
        # 8 producers through PgBouncer while the runner consumes through it, LISTEN direct
        await _produce(bouncer, producers=8, each=25, tag="before")
        args = ["--dsn", bouncer, "--pgbouncer", "--listen-dsn", direct, "--concurrency", "16"]
        async with Runner(*QUICK, *args, "--poll-interval", "120s", env=env) as r:
            line = await r.wait_for_line(r"consuming quick.*\((.*)\)")
            assert "LISTEN on postgresql://" in line[1] and "no statement cache" in line[1]
            await wait_until(lambda: _all_done(conn, 400), timeout=60)
            # the runner is idle now; with a 120 s poll only its direct LISTEN wakes it
            await _produce(bouncer, producers=8, each=5, tag="woken")
            enqueued = await cli("enqueue", "quick", "{}", "--dsn", bouncer, "--pgbouncer")
            assert enqueued.rc == 0, enqueued.err
            await wait_until(lambda: _all_done(conn, 481), timeout=60)
            r.signal(signal.SIGTERM)
            assert await r.wait() == 0, r.stderr
        assert _warnings(r.lines) == [], r.stderr

        # poll only, configured from the environment
        await _produce(bouncer, producers=8, each=10, tag="polled")
        poll_env = clean_env(
            AIOOUTBOX_DSN=bouncer, AIOOUTBOX_PGBOUNCER="1", AIOOUTBOX_NO_LISTEN="1"
        )
        async with Runner(*QUICK, "--poll-interval", "0.2", env=poll_env) as r:
            line = await r.wait_for_line(r"consuming quick.*\((.*)\)")
            assert "no LISTEN, poll every 0.2s" in line[1], line[0]
            await wait_until(lambda: _all_done(conn, 641), timeout=60)
            r.signal(signal.SIGTERM)
            assert await r.wait() == 0, r.stderr
        assert _warnings(r.lines) == [], r.stderr

        stats = await cli("stats", "--json", env=poll_env)
        assert stats.rc == 0, stats.err
        assert json.loads(stats.out)["totals"]["done"] == 641
        # nothing lost, nothing run twice
        assert await status_counts(conn) == {"done": 641}
        assert await conn.fetchval("SELECT max(attempts) FROM outbox_events_all") == 1
        tags = await conn.fetch(
            "SELECT payload->>'tag', count(*) FROM outbox_events_all GROUP BY 1 ORDER BY 1"
        )
        assert [tuple(t) for t in tags] == [
            ("before", 400),
            ("polled", 160),
            ("woken", 80),
            (None, 1),
        ]
    finally:
        await conn.close()


async def _all_done(conn: asyncpg.Connection, total: int) -> bool:
    return await status_counts(conn) == {"done": total}


@pytest.mark.timeout(180)
@pytest.mark.slow  # a PgBouncer of its own and command-line processes
async def test_run_through_pgbouncer_without_the_flag_stops_with_one_line(
    bounced: tuple[str, str],
) -> None:
    """Without ``--pgbouncer`` asyncpg's named prepared statements meet another server
    connection: the runner stops at once with one line naming the flag, instead of
    warning about failed claims for as long as it runs."""
    direct, bouncer = bounced
    migrated = await cli("migrate", "--dsn", direct)
    assert migrated.rc == 0, migrated.err
    # events to claim, and producers through PgBouncer beside the runner, as in production
    await _produce(bouncer, producers=4, each=10, tag="before")
    started = time.monotonic()
    async with Runner(*QUICK, "--dsn", bouncer, "--poll-interval", "0.2") as r:
        producing = asyncio.ensure_future(_produce(bouncer, producers=4, each=50, tag="during"))
        try:
            rc: int | None = await r.wait(timeout=60)
        except TimeoutError:
            rc = None  # still running after a minute (the context manager kills it)
        finally:
            await producing
    took = time.monotonic() - started
    context = f"rc={rc} after {took:.1f}s\n{r.stderr}"
    assert rc == 1, context
    # the last line says what to do (logged by the runner, or printed when the start-up
    # schema check already met the error)
    assert "pass --pgbouncer" in r.lines[-1] and "SQLSTATE 26000" in r.lines[-1], context
    # what it claimed before it stopped is given back, or (when that fails for the same
    # reason) left to its lease; either way it says so, in one line
    assert [x for x in _warnings(r.lines[:-1]) if "at shutdown" not in x] == [], context
    # every line is one log record or the error: no traceback, no 15-line hint
    assert all(re.match(r"\d{4}-\d\d-\d\d |(python -m )?aiooutbox: error: ", x) for x in r.lines), (
        context
    )
    assert "claim failed" not in r.stderr, context


@pytest.mark.timeout(120)
async def test_a_consumer_on_a_pool_with_a_statement_cache_behind_pgbouncer_stops(
    bounced: tuple[str, str],
) -> None:
    """The library's consumer, given a pool with asyncpg's statement cache behind
    PgBouncer, stops with `PermanentDatabaseError` naming ``statement_cache_size=0``."""
    direct, bouncer = bounced
    conn = await asyncpg.connect(direct)
    try:
        await aiooutbox.migrate(conn)
    finally:
        await conn.close()
    await _produce(bouncer, producers=4, each=10, tag="before")

    async def handle(event: aiooutbox.Event) -> None:
        pass

    async def consume(pool: asyncpg.Pool) -> None:
        consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.2)
        async with consumer:
            await asyncio.wait_for(consumer.run({"quick": handle}), 60)

    started = time.monotonic()
    async with asyncpg.create_pool(bouncer, min_size=2, max_size=8) as pool:
        producing = asyncio.ensure_future(_produce(bouncer, producers=4, each=50, tag="during"))
        try:
            with pytest.raises(PermanentDatabaseError) as stopped:
                await consume(pool)
        finally:
            await producing
    message = str(stopped.value)
    took = time.monotonic() - started
    assert "statement_cache_size=0" in message and "\n" not in message, (took, message)
