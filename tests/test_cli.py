"""`python -m aiooutbox` driven as a subprocess against the test database."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys

import asyncpg

import aiooutbox
from aiooutbox._sql.statements import queries
from aiooutbox.migrations import migrations as _shipped
from tests.clirunner import Result, Runner, clean_env, cli
from tests.conftest import with_database
from tests.helpers import backdate, status_counts, wait_until

ALL_VERSIONS = [m.version for m in _shipped()]

HANDLERS = "tests.cli_handlers"


def _one_clean_error(result: Result, rc: int, *fragments: str) -> None:
    """A short message on stderr, the expected exit status, no traceback, no output."""
    context = f"rc={result.rc}\nstdout={result.out}\nstderr={result.err}"
    assert result.rc == rc, context
    assert 1 <= len(result.err_lines) <= 2, context
    assert "Traceback" not in result.err, context
    assert result.out == "", context
    for fragment in fragments:
        assert fragment in result.err, context


async def test_help_on_every_command() -> None:
    script = (
        "import contextlib, io\n"
        "from aiooutbox.cli import build_parser\n"
        "commands = ['run', 'migrate', 'enqueue', 'stats', 'dead list', 'dead retry',\n"
        "            'dead purge', 'purge', 'demo', 'embedded start', 'embedded status',\n"
        "            'embedded stop']\n"
        "for command in [''] + commands:\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "        build_parser().parse_args(command.split() + ['--help'])\n"
        "    text = out.getvalue()\n"
        "    assert text.startswith('usage: aiooutbox'), (command, text)\n"
        "    assert command == '' or 'examples:' in text, (command, text)\n"
        "print('ok', len(commands))\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE, env=clean_env()
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    assert out.decode().strip() == "ok 12"


async def test_migrate_an_empty_database(empty_dsn: str) -> None:
    sql = await cli("migrate", "--sql", "--table", "jobs")
    assert sql.rc == 0
    assert 'CREATE TABLE "public"."jobs"' in sql.out

    before = await cli("stats", "--dsn", empty_dsn)
    _one_clean_error(before, 1, "migrate")

    first = await cli("migrate", "--dsn", empty_dsn)
    assert first.rc == 0, first.err
    assert f"applied migration(s) {ALL_VERSIONS}" in first.out
    again = await cli("migrate", "--dsn", empty_dsn)
    assert (again.rc, again.out.strip()) == (0, "public.outbox_events is up to date")
    conn = await asyncpg.connect(empty_dsn)
    try:
        await aiooutbox.check_schema(conn)
    finally:
        await conn.close()


async def test_enqueue_then_stats(dsn: str, conn: asyncpg.Connection) -> None:
    first = await cli("enqueue", "orders.created", '{"order_id": 42}', "--dsn", dsn)
    assert first.rc == 0, first.err
    event_id = int(first.out)
    keyed = ["enqueue", "emails.send", '"hi"', "--dedupe-key", "k1", "--dsn", dsn]
    options = ["--delay", "1h", "--max-attempts", "2", "--headers", '{"trace": "t1"}']
    assert (await cli(*keyed, *options)).rc == 0
    duplicate = await cli(*keyed)
    assert (duplicate.rc, duplicate.out) == (0, "")
    assert "dedupe key 'k1'" in duplicate.err

    row = await conn.fetchrow("SELECT * FROM outbox_events_all WHERE id = $1", event_id)
    assert (row["topic"], json.loads(row["payload"])) == ("orders.created", {"order_id": 42})
    delayed = await conn.fetchrow("SELECT * FROM outbox_events_all WHERE dedupe_key = 'k1'")
    assert delayed["max_attempts"] == 2
    assert json.loads(delayed["headers"]) == {"trace": "t1"}
    assert await conn.fetchval(
        "SELECT available_at > now() + interval '59 minutes' FROM outbox_events_all"
        " WHERE dedupe_key = 'k1'"
    )
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_all") == 2

    await backdate(
        conn,
        "UPDATE outbox_events SET available_at = now() - interval '90 seconds'"
        " WHERE topic = 'orders.created'",
    )
    report = await cli("stats", "--json", "--dsn", dsn)
    assert report.rc == 0, report.err
    data = json.loads(report.out)
    # the delayed event is scheduled (not due yet), the other pending (due)
    assert (data["totals"]["pending"], data["totals"]["scheduled"]) == (1, 1)
    assert data["topics"]["emails.send"]["lag_seconds"] is None
    assert 89 < data["topics"]["orders.created"]["lag_seconds"] < 120
    assert 89 < data["lag_seconds"] < 120
    assert (data["dead"], data["in_flight"]) == (0, [])

    text = await cli("stats", "--dsn", dsn)
    assert text.rc == 0
    assert "orders.created" in text.out
    assert "lag: oldest claimable event waited 1m" in text.out


async def test_bad_input_gets_a_short_message_and_writes_nothing(
    dsn: str, empty_dsn: str, conn: asyncpg.Connection
) -> None:
    d = ["--dsn", dsn]
    cases: list[tuple[list[str], dict[str, str], int, tuple[str, ...]]] = [
        (["frobnicate"], {}, 2, ("invalid choice: 'frobnicate'",)),
        (["stats", "--verbose", *d], {}, 2, ("unrecognized arguments: --verbose",)),
        (["dead"], {}, 2, ("required: ACTION",)),
        (["run", "tests.no_such_module:handlers", *d], {}, 2, ("no module named",)),
        (["run", f"{HANDLERS}:nothing", *d], {}, 2, ("has no attribute 'nothing'",)),
        (["run", HANDLERS, *d], {}, 2, ("MODULE:HANDLERS",)),
        (["run", f"{HANDLERS}:not_handlers", *d], {}, 2, ("of type int", "Router")),
        (["run", f"{HANDLERS}:sync_handlers", *d], {}, 2, ("must be an async function",)),
        (["run", f"{HANDLERS}:empty", *d], {}, 2, ("empty",)),
        (["run", f"{HANDLERS}:bad_factory", *d], {}, 1, ("LookupError: no configuration",)),
        (["run", "tests.cli_broken_handlers:handlers", *d], {}, 2, ("ZeroDivisionError",)),
        (
            ["run", "tests.cli_bad_batch_handlers:handlers", *d],
            {},
            2,
            ("batch must be between 1 and 100000, got 0", "cli_bad_batch_handlers.py:11)"),
        ),
        (["run", f"{HANDLERS}:handlers", "--topics", "nope", *d], {}, 2, ("--topics nope",)),
        (["run", f"{HANDLERS}:handlers", *d], {"AIOOUTBOX_CONCURRENCY": "many"}, 2, ("$AIOO",)),
        (["run", f"{HANDLERS}:handlers", "--prefetch", "-1", *d], {}, 2, ("0 or more",)),
        (["run", f"{HANDLERS}:handlers", *d], {"AIOOUTBOX_PREFETCH": "lots"}, 2, ("$AIOO",)),
        (["enqueue", "t", "{oops", *d], {}, 2, ("invalid JSON",)),
        (["enqueue", "t", "{}", "--headers", "[1]", *d], {}, 2, ("JSON object",)),
        (["enqueue", "t", "{}", "--delay", "soon", *d], {}, 2, ("invalid duration",)),
        (["enqueue", "t" * 300, "{}", *d], {}, 2, ("limit is 255",)),
        (["stats", "--schema", "Robert'); DROP", *d], {}, 2, ("invalid schema name",)),
        (["stats", "--table", "x" * 41, *d], {}, 2, ("invalid table name",)),
        (["stats"], {"AIOOUTBOX_TABLE": "1x"}, 2, ("$AIOOUTBOX_TABLE",)),
        (["dead", "retry", *d], {}, 2, ("one of the arguments --id --topic --all",)),
        (["purge", "--status", "pending", "--older-than", "1d", *d], {}, 2, ("done, dead",)),
        (["stats", "--dsn", "postgresql://postgres:s3cret@127.0.0.1:1/x"], {}, 1, (":***@",)),
        (["stats", "--dsn", "postgresq://postgres@127.0.0.1/x"], {}, 2, ("invalid DSN",)),
        (["stats", "--dsn", with_database(dsn, "no_such_db")], {}, 1, ("does not exist",)),
        (["stats", "--dsn", "postgresql://u@no-such-host.invalid/x"], {}, 1, ("cannot connect",)),
        (["enqueue", "t", "{}", "--dsn", empty_dsn], {}, 1, ("aiooutbox migrate --dsn",)),
        (["run", f"{HANDLERS}:handlers", "--dsn", empty_dsn], {}, 1, ("migrate",)),
    ]
    room = asyncio.Semaphore(4)

    async def attempt(args: list[str], env: dict[str, str]) -> Result:
        async with room:
            return await cli(*args, env=clean_env(**env), timeout=60)

    results = await asyncio.gather(*(attempt(args, env) for args, env, _, _ in cases))
    for (args, _, rc, fragments), result in zip(cases, results, strict=True):
        if args[0] == "run" and rc == 1 and "migrate" in fragments:
            # a runner logs; its last stderr line is the error
            assert result.rc == 1 and "Traceback" not in result.err, result.err
            assert "migrate" in result.err_lines[-1]
            continue
        _one_clean_error(result, rc, *fragments)
    assert "s3cret" not in "".join(r.err for r in results)
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_all") == 0


async def _processing(db: asyncpg.Connection) -> list[int]:
    rows = await db.fetch(
        "SELECT id FROM outbox_events_all WHERE status = 'processing' ORDER BY id"
    )
    return [r[0] for r in rows]


async def test_sigterm_drains_in_flight_events_and_exits_0(
    dsn: str, conn: asyncpg.Connection
) -> None:
    await aiooutbox.enqueue_many(conn, [aiooutbox.NewEvent("slow", {"n": n}) for n in range(40)])
    async with Runner(
        f"{HANDLERS}:handlers", "--dsn", dsn, "--concurrency", "4", "--poll-interval", "0.2"
    ) as runner:
        await runner.wait_for_line("slow handler started")
        await wait_until(lambda: _has_processing(conn), timeout=30)
        runner.signal(signal.SIGTERM)
        assert await runner.wait() == 0, runner.stderr
    assert "SIGTERM received" in runner.stderr
    started = {int(m) for m in re.findall(r"slow handler started event (\d+)", runner.stderr)}
    rows = await conn.fetch("SELECT id, status::text, last_error FROM outbox_events_all")
    status = {r["id"]: r["status"] for r in rows}
    assert {status[i] for i in started} == {"done"}, runner.stderr  # drained, not released
    assert "processing" not in status.values()
    # a row claimed but not yet started when the signal came is released, never lost
    assert all(r["last_error"].startswith("released") for r in rows if r["status"] == "retry")
    assert sum(s == "pending" for s in status.values()) >= 20  # it stopped claiming


async def _has_processing(db: asyncpg.Connection) -> bool:
    return bool(await _processing(db))


async def test_second_signal_releases_running_events(dsn: str, conn: asyncpg.Connection) -> None:
    await aiooutbox.enqueue_many(conn, [aiooutbox.NewEvent("sleepy", {}) for _ in range(3)])
    args = ["--dsn", dsn, "--shutdown-grace", "60s", "--poll-interval", "0.2"]
    async with Runner(f"{HANDLERS}:handlers", *args) as runner:

        async def claimed() -> bool:
            return len(await _processing(conn)) == 3

        await wait_until(claimed, timeout=30)
        runner.signal(signal.SIGTERM)
        await runner.wait_for_line("SIGTERM received: finishing running handlers")
        runner.signal(signal.SIGINT)
        assert await runner.wait(timeout=20) == 0, runner.stderr
    assert "received again: cancelling running handlers" in runner.stderr
    rows = await conn.fetch("SELECT status::text, attempts, last_error FROM outbox_events_all")
    assert [r[0] for r in rows] == ["retry"] * 3
    assert all(r[1] == 1 and "released" in r[2] for r in rows)


async def test_run_migrates_with_a_factory_and_logs_json(empty_dsn: str) -> None:
    env = clean_env(AIOOUTBOX_DSN=empty_dsn, AIOOUTBOX_MIGRATE="1", AIOOUTBOX_LOG_FORMAT="json")
    async with Runner(
        f"{HANDLERS}:make_handlers_async", "--poll-interval", "0.2", env=env
    ) as runner:
        await runner.wait_for_line("consuming failing, quick")
        conn = await asyncpg.connect(empty_dsn)
        try:
            await aiooutbox.enqueue(conn, "quick", {})
            await aiooutbox.enqueue(conn, "failing", {}, max_attempts=2)

            async def finished() -> bool:
                return await status_counts(conn) == {"done": 1, "dead": 1}

            await wait_until(finished, timeout=30)
        finally:
            await conn.close()
        runner.signal(signal.SIGINT)
        assert await runner.wait() == 0, runner.stderr
    records = [json.loads(line) for line in runner.lines]
    assert {"time", "level", "logger", "message"} <= set(records[0])
    assert any(r.get("topic") == "failing" for r in records)  # extras are fields
    assert records[-1]["message"] == "stopped: 1 done, 1 retried, 1 dead, 0 released"


async def test_a_fatal_handler_error_exits_non_zero(dsn: str, conn: asyncpg.Connection) -> None:
    await aiooutbox.enqueue(conn, "fatal", {})
    async with Runner(f"{HANDLERS}:fatal_handlers", "--dsn", dsn) as runner:
        assert await runner.wait() == 1, runner.stderr
    assert "consumer failed: SystemExit" in runner.stderr
    assert await _processing(conn) == []


async def _dead(conn: asyncpg.Connection, topic: str, n: int, **values: str) -> list[int]:
    ids = await aiooutbox.enqueue_many(
        conn, [aiooutbox.NewEvent(topic, {"n": i}) for i in range(n)]
    )
    await conn.execute(
        "UPDATE outbox_events SET status = 'dead', attempts = 5, finished_at = now(),"
        " last_error = 'RuntimeError: boom\nTraceback ...' WHERE id = ANY($1)",
        ids,
    )
    return [i for i in ids if i is not None]


async def test_dead_list_retry_and_purge(dsn: str, conn: asyncpg.Connection) -> None:
    mails = await _dead(conn, "emails.send", 3)
    hooks = await _dead(conn, "webhooks.deliver", 2)
    d = ["--dsn", dsn]

    listed = await cli("dead", "list", *d)
    assert listed.rc == 0 and "RuntimeError: boom" in listed.out
    assert "Traceback" not in listed.out  # first line of the error only
    one = await cli("dead", "list", "--topic", "webhooks.deliver", "--limit", "1", "--json", *d)
    assert [e["id"] for e in json.loads(one.out)] == hooks[:1]
    assert json.loads(one.out)[0]["payload"] == {"n": 0}
    stats = json.loads((await cli("stats", "--json", *d)).out)
    assert stats["dead"] == 5

    woken: asyncio.Queue[str] = asyncio.Queue()
    channel = queries().channel
    await conn.add_listener(channel, lambda *args: woken.put_nowait(args[3]))
    retried = await cli("dead", "retry", "--id", str(mails[0]), str(hooks[0]), *d)
    assert retried.rc == 0 and "requeued 2 dead event(s)" in retried.out, retried.err
    assert {await asyncio.wait_for(woken.get(), 5) for _ in range(2)} == {
        "emails.send",
        "webhooks.deliver",
    }
    row = await conn.fetchrow(
        "SELECT status::text, attempts FROM outbox_events_all WHERE id = $1", mails[0]
    )
    assert tuple(row) == ("pending", 0)

    by_topic = await cli("dead", "retry", "--topic", "emails.send", *d)
    assert "requeued 2 dead event(s) (emails.send: 2)" in by_topic.out
    kept = await cli("dead", "purge", "--all", "--older-than", "1h", *d)
    assert kept.out.strip() == "deleted 0 dead event(s)"
    purged = await cli("dead", "purge", "--topic", "webhooks.deliver", *d)
    assert purged.out.strip() == "deleted 1 dead event(s)"
    assert await status_counts(conn) == {"pending": 4}


async def test_purge_finished_events(dsn: str, conn: asyncpg.Connection) -> None:
    ids = await aiooutbox.enqueue_many(conn, [aiooutbox.NewEvent("t", {}) for _ in range(5)])
    await conn.execute(
        "UPDATE outbox_events SET status = 'done', finished_at = now() - interval '8 days'"
        " WHERE id = ANY($1)",
        ids[:3],
    )
    await conn.execute(
        "UPDATE outbox_events SET status = 'done', finished_at = now() WHERE id = $1", ids[3]
    )
    result = await cli("purge", "--status", "done", "--older-than", "7d", "--dsn", dsn)
    assert (result.rc, result.out.strip()) == (0, "deleted 3 done event(s) older than 7d")
    assert await status_counts(conn) == {"done": 1, "pending": 1}


async def test_demo_on_a_given_database(dsn: str, conn: asyncpg.Connection) -> None:
    await aiooutbox.enqueue(conn, "orders.created", {"real": True})
    refused = await cli("demo", "--table", "outbox_events", "--dsn", dsn)
    _one_clean_error(refused, 1, "1 event(s) the demo did not write", "another --table")

    result = await cli("demo", "--events", "400", "--dsn", dsn, timeout=50)
    assert result.rc == 0, result.err
    assert "400 of 400 events finished" in result.out
    assert "webhooks.deliver" in result.out and "dead list --limit 5" in result.out
    assert "events/s" in result.err  # the progress line
    # its own table; the real outbox is untouched
    assert await conn.fetchval("SELECT count(*) FROM aiooutbox_demo_all") == 400
    assert await status_counts(conn) == {"pending": 1}
