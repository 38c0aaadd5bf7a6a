"""The operator commands on odd input and odd rows: one line and exit 2 for a mistake,
nothing written; any dead event listed; stored text never drives the terminal."""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg

from aiooutbox import admin
from tests.clirunner import Result, cli
from tests.test_admin_odd_rows import DEEP, HUGE_FRACTION, dead_rows

EVIL_TOPIC = "evil\x1b[2J\x1b[31m"
EVIL_ERROR = "boom\x1b]0;owned\x07 \u202etxt.exe"


def refused(result: Result, *fragments: str) -> None:
    """Exit 2, a short message on stderr (argparse adds where help is), no traceback."""
    context = f"rc={result.rc}\nstdout={result.out}\nstderr={result.err}"
    assert result.rc == 2, context
    assert 1 <= len(result.err_lines) <= 2 and "error:" in result.err_lines[0], context
    assert "Traceback" not in result.err and result.out == "", context
    for fragment in fragments:
        assert fragment in result.err_lines[0], context


def strict_json(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


async def test_dead_list_lists_an_undecodable_payload(dsn: str, conn: asyncpg.Connection) -> None:
    ids = await dead_rows(conn, '{"a": 1}', f'{{"x": {HUGE_FRACTION}}}', DEEP)
    text = await cli("dead", "list", "--dsn", dsn)
    assert (text.rc, text.err) == (0, ""), text.err
    assert [int(line.split()[0]) for line in text.out.splitlines()[1:]] == ids
    listed = await cli("dead", "list", "--json", "--dsn", dsn)
    assert (listed.rc, listed.err) == (0, ""), listed.err
    plain, fraction, deep = strict_json(listed.out)
    assert plain["payload"] == {"a": 1} and "payload_error" not in plain
    assert fraction["payload"] == f'{{"x": {HUGE_FRACTION}}}' and fraction["payload_error"]
    assert (deep["payload"], deep["payload_error"]) == (DEEP, "nested too deeply to decode")


async def test_deep_json_is_a_usage_error(dsn: str, conn: asyncpg.Connection) -> None:
    for depth in (3000, 5000):
        deep = "[" * depth + "]" * depth
        refused(await cli("enqueue", "t", deep, "--dsn", dsn), "nested too deeply")
        refused(
            await cli("enqueue", "t", "1", "--headers", f'{{"a": {deep}}}', "--dsn", dsn),
            "--headers",
            "nested too deeply",
        )
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_all") == 0


async def test_a_number_json_cannot_carry_is_refused_saying_why(
    dsn: str, conn: asyncpg.Connection
) -> None:
    refused(await cli("enqueue", "t", "1e400", "--dsn", dsn), "1e400 is beyond a float's range")
    refused(await cli("enqueue", "t", '{"a": -1e999}', "--dsn", dsn), "beyond a float's range")
    refused(await cli("enqueue", "t", "1", "--headers", '{"a": NaN}', "--dsn", dsn), "NaN")
    assert await conn.fetchval("SELECT count(*) FROM outbox_events_all") == 0
    large = await cli("enqueue", "t", '{"n": 1e300, "m": -1.5e-400}', "--dsn", dsn)
    assert large.rc == 0, large.err


async def test_a_burst_without_a_rate_is_refused(dsn: str, conn: asyncpg.Connection) -> None:
    db = ("--dsn", dsn)
    refused(await cli("topics", "limit", "t", "--rate", "none", "--burst", "5", *db), "--burst")
    assert (await cli("topics", "limit", "u", "--rate", "10/s", *db)).rc == 0
    for flags in (
        ["--rate", "none", "--burst", "5"],
        ["--group-rate", "none", "--group-burst", "5"],
    ):
        refused(await cli("topics", "limit", "u", *flags, *db), "needs a rate")
    [control] = await admin.topic_controls(conn)
    assert (control.topic, control.rate_text, control.burst) == ("u", "10/s", 1.0)
    assert len(await admin.flow_history(conn)) == 1


async def test_purge_takes_any_age(dsn: str, conn: asyncpg.Connection) -> None:
    await dead_rows(conn, "1")
    for command in (["purge"], ["purge", "--status", "dead"], ["dead", "purge", "--all"]):
        result = await cli(*command, "--older-than", "1000000w", "--dsn", dsn)
        assert (result.rc, result.err) == (0, ""), result.err
        assert result.out.startswith("deleted 0 ")
    assert await conn.fetchval("SELECT count(*) FROM outbox_events") == 1


async def test_text_output_escapes_stored_control_characters(
    dsn: str, conn: asyncpg.Connection
) -> None:
    [dead] = await dead_rows(conn, "1", topic=EVIL_TOPIC)
    await conn.execute("UPDATE outbox_events SET last_error = $1", EVIL_ERROR)
    await conn.execute("INSERT INTO outbox_events (topic, payload) VALUES ($1, '1')", EVIL_TOPIC)
    await admin.limit_topic(conn, EVIL_TOPIC, max_running=3, actor="mallory\x1b[2J")
    for command in (["stats"], ["topics"], ["dead", "list"], ["topics", "history"]):
        result = await cli(*command, "--dsn", dsn)
        assert (result.rc, result.err) == (0, ""), (command, result.err)
        shown = result.out
        assert not any(c in shown for c in "\x1b\x07\u202e"), (command, shown)
        assert "evil\\x1b[2J\\x1b[31m" in shown, (command, shown)
    dead_text = (await cli("dead", "list", "--dsn", dsn)).out
    assert "boom\\x1b]0;owned\\x07 \\u202etxt.exe" in dead_text
    show = await cli("topics", "show", EVIL_TOPIC, "--dsn", dsn)
    assert show.rc == 0 and "mallory\\x1b[2J" in show.out and "\x1b" not in show.out
    # --json stays exact
    [listed] = strict_json((await cli("dead", "list", "--json", "--dsn", dsn)).out)
    assert (listed["id"], listed["topic"], listed["last_error"]) == (dead, EVIL_TOPIC, EVIL_ERROR)
    report = strict_json((await cli("stats", "--json", "--dsn", dsn)).out)
    assert EVIL_TOPIC in report["topics"]
    retried = await cli("dead", "retry", "--all", "--dsn", dsn)
    assert retried.rc == 0 and "\x1b" not in retried.out and "evil\\x1b" in retried.out


async def test_bad_topics_ids_limits_and_dsns_are_usage_errors(
    dsn: str, conn: asyncpg.Connection
) -> None:
    [dead] = await dead_rows(conn, "1")
    db = ("--dsn", dsn)
    not_utf8 = "\udcff"  # the byte 0xff in argv, as Python decodes it
    for action in ("list", "retry", "purge"):
        refused(await cli("dead", action, "--topic", not_utf8, *db), "--topic", "Unicode")
        refused(await cli("dead", action, "--topic", "x" * 256, *db), "--topic")
    for action in ("retry", "purge"):
        refused(await cli("dead", action, "--id", str(dead), "99999999999999999999", *db), "--id")
    refused(await cli("dead", "list", "--limit", "999999", *db), "--limit", "100000")
    refused(await cli("topics", "history", "--limit", "999999", *db), "--limit", "100000")
    assert (await cli("dead", "list", "--limit", "100000", *db)).rc == 0
    assert (await cli("topics", "history", "--limit", "100000", *db)).rc == 0
    refused(await cli("stats", "--dsn", dsn + "?application_name=" + not_utf8), "invalid DSN")
    assert await admin.event_statuses(conn, [dead]) == {dead: "dead"}  # nothing written
    retried = await cli("dead", "retry", "--id", str(dead), str(2**63 - 1), *db)
    assert retried.rc == 1 and f"{2**63 - 1} (no such event)" in retried.err


async def test_a_failed_migrate_says_who_should_run_it(empty_dsn: str) -> None:
    """A role that may not create the outbox's objects: the one line says to run migrate
    as the schema's owner, not to grant the consumer's privileges (which would not do)."""
    from urllib.parse import urlsplit, urlunsplit

    role = f"aiooutbox_nobody_{uuid.uuid4().hex[:8]}"
    admin_conn = await asyncpg.connect(empty_dsn)
    try:
        await admin_conn.execute(f"CREATE ROLE {role} LOGIN")
        await admin_conn.execute("CREATE SCHEMA app")
        await admin_conn.execute(f"GRANT USAGE ON SCHEMA app TO {role}")
        parts = urlsplit(empty_dsn)
        host = parts.netloc.rpartition("@")[2]
        as_role = urlunsplit(parts._replace(netloc=f"{role}@{host}"))
        result = await cli("migrate", "--schema", "app", "--dsn", as_role)
        assert result.rc == 1, result
        assert len(result.err_lines) == 1, result.err
        assert "run migrate as the owner of the schema" in result.err, result.err
        assert "consumer's role" not in result.err
        assert not await admin_conn.fetchval(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'app'"
        )
    finally:
        await admin_conn.execute(f"DROP OWNED BY {role}")
        await admin_conn.execute(f"DROP ROLE {role}")
        await admin_conn.close()
