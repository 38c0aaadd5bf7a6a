"""`aiooutbox.admin` on rows and values at the edges: payloads no decoder reads, ages
past a timestamp's range, ids past 64 bits, a burst without a rate."""

from __future__ import annotations

import json
import math
from datetime import timedelta

import asyncpg
import pytest

import aiooutbox
from aiooutbox import admin
from aiooutbox.cli.output import dead_table, safe

# a number jsonb keeps exactly and Python's float cannot hold (a fraction: no int either)
HUGE_FRACTION = "1" + "0" * 400 + ".5"
DEEP = "[" * 3000 + "]" * 3000  # past every JSON decoder's nesting limit


async def dead_rows(conn: asyncpg.Connection, *payloads: str, topic: str = "odd") -> list[int]:
    """Rows of these stored payloads (JSON text, as a raw SQL producer writes it), dead."""
    ids: list[int] = [
        await conn.fetchval(
            "INSERT INTO outbox_events (topic, payload) VALUES ($1, $2::jsonb) RETURNING id",
            topic,
            payload,
        )
        for payload in payloads
    ]
    await conn.execute(
        "UPDATE outbox_events SET status = 'dead', attempts = 1, last_error = 'boom',"
        " finished_at = now() WHERE id = ANY($1)",
        ids,
    )
    return ids


async def test_dead_list_lists_every_dead_event_whatever_its_payload(
    conn: asyncpg.Connection,
) -> None:
    huge_int = f'{{"n": {10**400}}}'
    ids = await dead_rows(conn, huge_int, '{"a": 1}', f'{{"x": {HUGE_FRACTION}}}', DEEP)
    events = await admin.dead_list(conn)
    assert [e.id for e in events] == ids
    huge, plain, fraction, deep = events
    assert (huge.payload, huge.payload_error) == ({"n": 10**400}, None)  # exact
    assert (plain.payload, plain.payload_error) == ({"a": 1}, None)
    assert "payload_error" not in plain.as_dict()
    # the stored text stands in for what cannot be decoded, with why
    assert fraction.payload == f'{{"x": {HUGE_FRACTION}}}'
    assert fraction.payload_error is not None and "beyond a float's range" in fraction.payload_error
    assert deep.payload == DEEP and deep.payload_error == "nested too deeply to decode"
    for event in events:  # every record stays valid JSON
        text = json.dumps(event.as_dict(), allow_nan=False)
        assert json.loads(text)["id"] == event.id
    assert dead_table(events).count("\n") == 4


async def test_purge_takes_any_age(conn: asyncpg.Connection) -> None:
    await dead_rows(conn, "1", "2")
    await conn.execute("INSERT INTO outbox_events (topic, payload) VALUES ('t', '{}')")
    await conn.execute(
        "UPDATE outbox_events SET status = 'done', finished_at = now() - interval '400 years'"
        " WHERE topic = 't'"
    )
    for age in (timedelta.max, 1e12, 1e300, 10**300):
        assert await admin.purge(conn, older_than=age) == 0
        assert await admin.purge(conn, status="dead", older_than=age) == 0
        assert await admin.dead_purge(conn, everything=True, older_than=age) == 0
    assert await conn.fetchval("SELECT count(*) FROM outbox_events") == 3
    # the clamp keeps the answer exact: what finished longer ago still goes
    assert await admin.purge(conn, older_than=timedelta(days=300 * 366)) == 1
    await conn.execute("UPDATE outbox_events SET finished_at = '-infinity'")
    assert await admin.dead_purge(conn, everything=True, older_than=timedelta.max) == 2
    for wrong in (math.inf, -1.0):
        with pytest.raises(aiooutbox.InvalidArgument):
            await admin.purge(conn, older_than=wrong)


async def test_ids_and_topics_are_checked_before_the_database(conn: asyncpg.Connection) -> None:
    [dead] = await dead_rows(conn, "1")
    for ids in ([2**63], [-(2**63) - 1], [dead, 10**20]):
        with pytest.raises(aiooutbox.InvalidArgument, match="64-bit"):
            await admin.dead_retry(conn, ids=ids)
        with pytest.raises(aiooutbox.InvalidArgument, match="64-bit"):
            await admin.dead_purge(conn, ids=ids)
    for topic in ("\udcff", "", "x" * 256):
        with pytest.raises(aiooutbox.InvalidArgument):
            await admin.dead_list(conn, topic=topic)
        with pytest.raises(aiooutbox.InvalidArgument):
            await admin.dead_retry(conn, topic=topic)
        with pytest.raises(aiooutbox.InvalidArgument):
            await admin.dead_purge(conn, topic=topic)
    assert await admin.event_statuses(conn, [dead]) == {dead: "dead"}
    assert await admin.dead_retry(conn, ids=[dead, 2**63 - 1]) == {"odd": 1}


async def test_a_burst_without_a_rate_is_refused(conn: asyncpg.Connection) -> None:
    with pytest.raises(aiooutbox.InvalidArgument, match="a burst needs a rate"):
        await admin.limit_topic(conn, "t", rate=None, burst=5)
    await admin.limit_topic(conn, "u", rate="10/s")
    with pytest.raises(aiooutbox.InvalidArgument, match="a burst needs a rate"):
        await admin.limit_topic(conn, "u", rate=None, burst=5)
    with pytest.raises(aiooutbox.InvalidArgument, match="no rate limit"):
        await admin.limit_topic(conn, "t", burst=5)
    [control] = await admin.topic_controls(conn)  # nothing else written
    assert (control.topic, control.rate_text, control.burst) == ("u", "10/s", 1.0)
    assert [c.action for c in await admin.flow_history(conn)] == ["limit"]
    now = await admin.limit_topic(conn, "u", rate=None, burst=None)
    assert (now.rate, now.burst) == (None, None)


def test_safe_escapes_what_a_terminal_would_act_on() -> None:
    assert safe("evil\x1b[2J\x1b[31m") == "evil\\x1b[2J\\x1b[31m"
    assert safe("a\u202eb\u2066c\x9bd\x7f\ne\tf") == "a\\u202eb\\u2066c\\x9bd\\x7f\\x0ae\\x09f"
    assert safe("one\ntwo\x07", lines=True) == "one\ntwo\\x07"
    assert safe("plain ünïcode ✓ 日本") == "plain ünïcode ✓ 日本"
