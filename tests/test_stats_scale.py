"""``stats`` beside a large history: exact counts where an index reaches the rows, the
``done`` rows estimated past the bound, and no statement scanning the whole table.

The table holds 60,000 ``done`` rows (past the 50,000 bound) and the planner is told it
holds ten million (``pg_class.reltuples``): the plans are those of a 10M-row table.
"""

from __future__ import annotations

import json
import re
from typing import Any

import asyncpg

import aiooutbox
from aiooutbox import admin
from aiooutbox._admin.counts import BOUND
from aiooutbox.cli.output import stats_view
from tests.helpers import insert_unchecked

FAKE_ROWS = 10_000_000
DONE = {"a": 40_000, "b": 20_000}
_SEQ_SCAN = re.compile(r"Seq Scan on outbox_events(\s|$)")


async def _history(conn: asyncpg.Connection) -> None:
    for topic, rows in DONE.items():
        await insert_unchecked(  # a history of finished rows, as a restore writes them
            conn,
            "INSERT INTO outbox_events (topic, payload, status, attempts, finished_at)"
            " SELECT $1, '{}', 'done', 1, now() - g * interval '1 second'"
            " FROM generate_series(1, $2) g",
            topic,
            rows,
        )
    ids = await aiooutbox.enqueue_many(conn, [aiooutbox.NewEvent("a", i) for i in range(6)])
    await conn.execute("UPDATE outbox_events SET status = 'retry' WHERE id = $1", ids[0])
    await conn.execute(
        "UPDATE outbox_events SET status = 'processing', locked_by = 'w1', locked_at = now(),"
        " lease_expires_at = now() + interval '1 hour' WHERE id = ANY ($1::bigint[])",
        ids[1:3],
    )
    await conn.execute(
        "UPDATE outbox_events SET status = 'dead', finished_at = now() WHERE id = $1", ids[3]
    )
    await aiooutbox.enqueue(conn, "b", {}, ordering_key="k")
    await aiooutbox.enqueue(conn, "b", {}, ordering_key="k")  # waits behind the first
    await conn.execute("ANALYZE outbox_events")


EXPECTED = {
    "a": {"pending": 2, "scheduled": 0, "retry": 1, "processing": 2, "waiting": 0, "dead": 1},
    "b": {"pending": 1, "scheduled": 0, "retry": 0, "processing": 0, "waiting": 1, "dead": 0},
}


async def test_stats_estimates_done_past_the_bound_and_scans_no_table(
    conn: asyncpg.Connection,
) -> None:
    await _history(conn)
    await conn.execute(
        "UPDATE pg_catalog.pg_class SET reltuples = $1 WHERE oid = 'outbox_events'::regclass",
        float(FAKE_ROWS),
    )
    ran: list[tuple[str, tuple[Any, ...]]] = []

    def record(query: Any) -> None:
        ran.append((query.query, tuple(query.args or ())))

    conn.add_query_logger(record)
    report = await admin.stats(conn)
    conn.remove_query_logger(record)
    assert report.done_estimated
    for topic, expected in EXPECTED.items():
        counts = next(t.counts for t in report.topics if t.topic == topic)
        assert {s: n for s, n in counts.items() if s != "done"} == expected, counts
    unfinished = sum(sum(e.values()) for e in EXPECTED.values())
    done = report.totals["done"]
    # the planner's ten million less the exact others, shared by topic (rounded)
    assert abs(done - (FAKE_ROWS - unfinished)) <= len(DONE), done
    shares = {t.topic: t.counts["done"] / done for t in report.topics}
    assert abs(shares["a"] - 2 / 3) < 0.01, shares  # the whole (small) table was sampled
    text = stats_view(report)
    assert f"≈{report.totals['done']}" in text and "≈: estimated" in text, text
    assert json.loads(json.dumps(report.as_dict()))["done_estimated"] is True

    # every statement stats ran, explained as the planner sees a 10M-row table; a full
    # count by topic and status (what stats ran before) is a sequential scan there
    full = await conn.fetch(
        "EXPLAIN SELECT topic, status, count(*) FROM outbox_events GROUP BY 1, 2"
    )
    assert _SEQ_SCAN.search("\n".join(r[0] for r in full)), full
    explained = 0
    for sql, args in ran:
        if sql.lstrip().upper().startswith("EXPLAIN") or "outbox_events" not in sql:
            continue
        plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + sql, *args))
        assert not _SEQ_SCAN.search(plan), f"{sql}\n{plan}"
        explained += 1
    assert explained >= 6, ran


async def test_stats_counts_done_exactly_below_the_bound(conn: asyncpg.Connection) -> None:
    await insert_unchecked(
        conn,
        "INSERT INTO outbox_events (topic, payload, status, attempts, finished_at)"
        " SELECT 't', '{}', 'done', 1, now() FROM generate_series(1, $1) g",
        BOUND - 1,
    )
    await aiooutbox.enqueue(conn, "t", {})
    report = await admin.stats(conn)
    assert not report.done_estimated
    assert report.totals == {
        "pending": 1,
        "scheduled": 0,
        "retry": 0,
        "processing": 0,
        "waiting": 0,
        "done": BOUND - 1,
        "dead": 0,
    }
    assert "≈" not in stats_view(report)
    await insert_unchecked(
        conn,
        "INSERT INTO outbox_events (topic, payload, status, attempts, finished_at)"
        " VALUES ('t', '{}', 'done', 1, now())",
    )
    assert (await admin.stats(conn)).done_estimated  # the bound reached
