"""``python -m aiooutbox topics``: the operator's side of flow control, as users run it."""

from __future__ import annotations

import json

import asyncpg
import pytest

import aiooutbox
from aiooutbox import admin
from tests.clirunner import cli


async def test_topics_pause_limit_resume_list_and_history(
    dsn: str, conn: asyncpg.Connection
) -> None:
    await aiooutbox.enqueue_many(conn, [aiooutbox.NewEvent("pay", {"n": i}) for i in range(3)])
    db = ("--dsn", dsn)
    result = await cli("topics", "pause", "pay", "--actor", "alice", *db)
    assert (result.rc, result.out.strip(), result.err) == (0, "paused pay", "")
    result = await cli("topics", "limit", "pay", "--max-running", "5", "--rate", "10/min", *db)
    assert (
        result.rc == 0 and result.out.strip() == "pay: paused, max running 5, rate 10/min (burst 1)"
    )
    result = await cli("topics", *db)
    assert result.rc == 0
    header, row = result.out.splitlines()[:2]
    assert header.split()[:3] == ["TOPIC", "STATE", "QUEUED"]
    assert row.split()[:3] == ["pay", "paused", "3"] and "10/min" in row
    listed = json.loads((await cli("topics", "--json", *db)).out)
    assert listed["topics"][0] | {"lag_seconds": None, "updated_at": None} == {
        "topic": "pay", "queued": 3, "due": 3, "waiting": 0, "running": 0, "lag_seconds": None,
        "paused": True, "max_running": 5, "rate": "10/min", "burst": 1.0, "updated_at": None,
        "updated_by": listed["topics"][0]["updated_by"],
    }  # fmt: skip
    result = await cli("topics", "resume", "pay", *db)
    assert result.rc == 0 and result.out.strip() == "resumed pay"
    result = await cli("topics", "resume", "pay", *db)
    assert result.rc == 0 and result.out.strip() == "pay was already resumed"
    shown = json.loads((await cli("topics", "show", "pay", "--json", *db)).out)
    assert shown["paused"] is False and [c["action"] for c in shown["changes"]] == [
        "resume", "limit", "pause"
    ]  # fmt: skip
    history = (await cli("topics", "history", *db)).out
    assert "alice" in history and "pause" in history
    result = await cli("topics", "pause", "--all", *db)
    assert result.rc == 0 and (await admin.topics(conn))[0].paused
    result = await cli("topics", "resume", "pay", *db)
    assert "every topic is paused" in result.err
    result = await cli("topics", "resume", "--all", *db)
    assert result.rc == 0 and not (await admin.topics(conn))[0].paused
    stats = await cli("stats", *db)
    assert "limited: pay: max running 5, rate 10/min (burst 1)" in stats.out


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["limit", "t", "--max-running", "0"], "max_running must be at least 1"),
        (["limit", "t", "--max-running", "-2"], "max_running must be at least 1"),
        (["limit", "t", "--max-running", "many"], "--max-running must be a whole number"),
        (["limit", "t", "--rate", "0/s"], "lets nothing through"),
        (["limit", "t", "--rate", "1e12/s"], "above the highest limit, 1000000/s"),
        (["limit", "t", "--rate", "fast"], "invalid rate 'fast'"),
        (["limit", "t", "--burst", "5"], "has no rate limit"),
        (["limit", "t"], "say which limit to change"),
        (["pause", "x" * 300], "the limit is 255"),
        (["pause"], "one of the arguments topic --all is required"),
    ],
)
async def test_bad_input_is_one_line_and_writes_nothing(
    dsn: str, conn: asyncpg.Connection, args: list[str], error: str
) -> None:
    result = await cli("topics", *args, "--dsn", dsn)
    assert result.rc == 2, result
    assert error in result.err_lines[0] and len(result.err_lines) <= 2, result.err
    assert await admin.topic_controls(conn) == [] and await admin.flow_history(conn) == []


async def test_unknown_topics(dsn: str, conn: asyncpg.Connection) -> None:
    result = await cli("topics", "show", "nothing.here", "--dsn", dsn)
    assert result.rc == 1
    assert result.err_lines == [
        "python -m aiooutbox: error: no topic 'nothing.here': it has no unfinished events"
        " and no controls"
    ]
    # a topic with no events yet may be paused: the pause waits for its events
    result = await cli("topics", "pause", "later", "--dsn", dsn)
    assert result.rc == 0 and "later has no events waiting" in result.err
    await aiooutbox.enqueue(conn, "later", {})
    listed = {t.topic: t for t in await admin.topics(conn)}
    assert listed["later"].paused and listed["later"].queued == 1
