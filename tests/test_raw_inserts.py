"""A plain SQL INSERT is a producer too: it may set only what a producer owns.

Every column of the table, set by a raw INSERT (or COPY), one at a time: the columns a
producer owns are accepted and the event is handled; the ones a consumer owns are
refused before anything is written, with a check violation that names them (migration
0013). Before, a row inserted `processing` was never handled, recovered or made dead
(and blocked its key for ever), `waiting` ones were handled by nobody, and `attempts`
near INT_MAX failed every claim of the topic.
"""

from __future__ import annotations

import json

import asyncpg
import pytest

import aiooutbox
from tests.helpers import all_in, running, status_counts, wait_until

# column, value (SQL), what the error must name
REFUSED = [
    ("status", "'retry'", "status 'retry'"),
    ("status", "'processing'", "status 'processing'"),
    ("status", "'waiting'", "status 'waiting'"),
    ("status", "'done'", "status 'done'"),
    ("status", "'dead'", "status 'dead'"),
    ("attempts", "1", "attempts 1"),
    ("attempts", "2147483647", "attempts 2147483647"),
    ("locked_by", "'worker-1'", "locked_by"),
    ("locked_at", "now()", "locked_at"),
    ("lease_expires_at", "now() + interval '1 minute'", "lease_expires_at"),
    ("finished_at", "now()", "finished_at"),
    ("last_error", "'boom'", "last_error"),
    ("blocks_key", "true", "blocks_key"),
    ("holds_key", "true", "holds_key"),
    ("flow_counted", "true", "flow_counted"),
    ("flow_counted", "false", "flow_counted"),
    ("failures", "'[]'", "failures"),
    ("headers", "'[1, 2]'", "headers [1, 2] (must be a JSON object)"),
    ("headers", "'null'", "headers null"),
]

# column, value (SQL): a producer's own, or a consumer's column left at its default
ACCEPTED = [
    ("status", "'pending'"),
    ("status", "DEFAULT"),
    ("attempts", "0"),
    ("max_attempts", "3"),
    ("dedupe_key", "'raw-1'"),
    ("headers", "'{\"h\": 1}'"),
    ("available_at", "now() - interval '1 hour'"),
    ("available_at", "'-infinity'"),
    ("available_at", "'4000-01-01 BC'"),
    # ('infinity', never due, is accepted too and waits: tests/test_defects.py)
    ("created_at", "'2001-02-03 04:05:06+00'"),
    ("updated_at", "now()"),
    ("message_id", "gen_random_uuid()"),
    ("message_id", "NULL"),
    ("ordering_key", "'raw-key'"),
    ("grp", "'tenant-1'"),
    ("grp", "NULL"),
    ("locked_by", "NULL"),
    ("locked_at", "NULL"),
    ("lease_expires_at", "NULL"),
    ("finished_at", "NULL"),
    ("last_error", "NULL"),
    ("blocks_key", "false"),
    ("holds_key", "false"),
    ("flow_counted", "NULL"),
    ("failures", "NULL"),
]

# set by every insert; `id` is GENERATED ALWAYS (only OVERRIDING SYSTEM VALUE sets it)
ALWAYS = {"id", "topic", "payload"}


async def test_every_column_of_the_table_is_classified(pool: asyncpg.Pool) -> None:
    """A column added by a later migration must be sorted here: refused or accepted."""
    columns = await pool.fetch(
        "SELECT column_name FROM information_schema.columns"
        " WHERE table_schema = 'public' AND table_name = 'outbox_events'"
    )
    classified = ALWAYS | {c for c, _, _ in REFUSED} | {c for c, _ in ACCEPTED}
    assert {r[0] for r in columns} == classified


@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
@pytest.mark.parametrize(("column", "value", "named"), REFUSED, ids=[r[1] for r in REFUSED])
async def test_a_raw_insert_of_a_consumers_column_is_refused_before_anything_is_written(
    pool: asyncpg.Pool, column: str, value: str, named: str, ordered: bool
) -> None:
    if ordered:
        await aiooutbox.enqueue(pool, "t", {}, ordering_key="k")  # the key has a head
    before = await status_counts(pool)
    key = ", ordering_key" if ordered else ""
    keyed = ", 'k'" if ordered else ""
    with pytest.raises(asyncpg.CheckViolationError) as caught:
        await pool.execute(
            f"INSERT INTO outbox_events (topic, payload, {column}{key})"
            f" VALUES ('t', '{{}}', {value}{keyed})"
        )
    message = caught.value.message  # one line; the hint apart
    assert message.startswith("outbox_events: a new event cannot set ") and named in message
    assert "\n" not in message, message
    assert caught.value.table_name == "outbox_events"
    assert caught.value.hint and "leave the other columns to their defaults" in caught.value.hint
    assert await status_counts(pool) == before


async def test_the_error_names_every_column_at_once_and_one_bad_row_refuses_the_statement(
    pool: asyncpg.Pool,
) -> None:
    with pytest.raises(asyncpg.CheckViolationError) as caught:
        await pool.execute(
            "INSERT INTO outbox_events (topic, payload, status, attempts, locked_by)"
            " VALUES ('t', '{}', 'pending', 0, NULL), ('t', '{}', 'done', 2, 'w')"
        )
    assert caught.value.message == (
        "outbox_events: a new event cannot set status 'done' (a new event is pending);"
        " attempts 2 (0: consumers count them);"
        " locked_by, locked_at, lease_expires_at (a consumer's lease)"
    )
    assert await pool.fetchval("SELECT count(*) FROM outbox_events_all") == 0


async def test_copy_is_checked_like_insert(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        with pytest.raises(asyncpg.CheckViolationError, match="status 'processing'"):
            await conn.copy_records_to_table(
                "outbox_events",
                records=[("t", "{}", "processing")],
                columns=["topic", "payload", "status"],
            )
        await conn.copy_records_to_table(
            "outbox_events", records=[("t", json.dumps({"n": 1}))], columns=["topic", "payload"]
        )
    assert await status_counts(pool) == {"pending": 1}


async def test_every_column_a_producer_owns_is_accepted_and_handled(pool: asyncpg.Pool) -> None:
    for n, (column, value) in enumerate(ACCEPTED):
        await pool.execute(
            f"INSERT INTO outbox_events (topic, payload, {column})"
            f" VALUES ('t', jsonb_build_object('n', {n}::int), {value})"
        )
    seen: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        seen.append(event.payload["n"])

    async with running(aiooutbox.OutboxConsumer(pool, poll_interval=0.1), {"t": handle}):
        await wait_until(all_in(pool, "done", len(ACCEPTED)), timeout=20)
    assert sorted(seen) == list(range(len(ACCEPTED)))


async def test_a_raw_insert_cannot_strand_a_key(pool: asyncpg.Pool) -> None:
    """The issue's case: a row inserted `processing` with an ordering key had no lease,
    so nothing ever handled, recovered or killed it, and every later event of its key
    waited behind it for ever."""
    with pytest.raises(asyncpg.CheckViolationError, match="status 'processing'"):
        await pool.execute(
            "INSERT INTO outbox_events (topic, payload, status, ordering_key)"
            " VALUES ('t', '{\"seq\": 0}', 'processing', 'k')"
        )
    for seq in range(1, 4):
        await pool.execute(
            "INSERT INTO outbox_events (topic, payload, ordering_key) VALUES ('t', $1, 'k')",
            json.dumps({"seq": seq}),
        )
    seen: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        seen.append(event.payload["seq"])

    async with running(aiooutbox.OutboxConsumer(pool, poll_interval=0.1), {"t": handle}):
        await wait_until(all_in(pool, "done", 3), timeout=20)
    assert seen == [1, 2, 3]
