"""Every statement a page runs reaches its rows through an index, the id window, or the
page sample: none reads the whole table. Checked with EXPLAIN beside 300,000 rows (the
table is then well past the sample's size, so the at-scale paths run), for every page
and the filters that have an index and those that do not, the live pulse every open
page shares, and the count a bulk action shows before it is confirmed."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import pytest

from aiooutbox.web import _data, _events, _topic
from aiooutbox.web._actions import count_to_confirm
from aiooutbox.web._backlog import read_backlog
from aiooutbox.web._filters import parse_filter
from aiooutbox.web._sql import web_queries
from benchmarks.dashboard_data import populate

pytestmark = pytest.mark.slow

W = web_queries()
# tables that grow without bound (the per-minute counts: with the topics, for 8 days):
# a sequential scan of any is a page that slows with age
# (the consumer registry and the idle adverts hold a row per running consumer)
BIG = ("outbox_events", "outbox_events_audit", "outbox_events_rollups")


class Recording:
    """A real connection that remembers every statement and its arguments."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self.statements: list[tuple[str, tuple[Any, ...]]] = []

    def transaction(self) -> Any:
        return self.conn.transaction()

    async def execute(self, sql: str, *args: Any) -> Any:
        return await self.conn.execute(sql, *args)

    async def fetch(self, sql: str, *args: Any) -> Any:
        self.statements.append((sql, args))
        return await self.conn.fetch(sql, *args)

    async def fetchrow(self, sql: str, *args: Any) -> Any:
        self.statements.append((sql, args))
        return await self.conn.fetchrow(sql, *args)

    async def fetchval(self, sql: str, *args: Any) -> Any:
        self.statements.append((sql, args))
        return await self.conn.fetchval(sql, *args)


def scans(plan: dict[str, Any]) -> list[tuple[str, str | None]]:
    found = [(plan["Node Type"], plan.get("Relation Name"))]
    for child in plan.get("Plans", []):
        found += scans(child)
    return found


PAGES: dict[str, Callable[[Any, int], Awaitable[Any]]] = {
    "overview": lambda c, _: _overview(c),
    "backlog": lambda c, _: read_backlog(c, W),
    "topic page": lambda c, _: _topic_page(c, "topic.07"),
    "topic page of a topic with blocked keys": lambda c, _: _topic_page(c, "topic.05"),
    "scheduled of a topic": lambda c, _: _events.event_page(
        c, W, parse_filter({"topic": "topic.07", "status": "scheduled"})
    ),
    "confirm a selection to cancel": lambda c, event_id: count_to_confirm(
        c, W, [1, 2, event_id], parse_filter({}), "events"
    ),
    "confirm cancelling the scheduled of a topic": lambda c, _: count_to_confirm(
        c, W, None, parse_filter({"topic": "topic.07", "status": "scheduled"}), "events"
    ),
    "audit entry": lambda c, _: c.fetchrow(W.audit_entry, 1),
    "cancel": lambda c, event_id: _cancel(c, event_id),
    "run now": lambda c, event_id: _run_now(c, event_id),
    "events": lambda c, _: _events.event_page(c, W, parse_filter({})),
    "events of a topic": lambda c, _: _events.event_page(c, W, parse_filter({"topic": "topic.07"})),
    "pending of a topic": lambda c, _: _events.event_page(
        c, W, parse_filter({"topic": "topic.07", "status": "pending"})
    ),
    "retry": lambda c, _: _events.event_page(c, W, parse_filter({"status": "retry"})),
    "done": lambda c, _: _events.event_page(c, W, parse_filter({"status": "done"})),
    "payload": lambda c, _: _events.event_page(c, W, parse_filter({"payload": '{"n": 5}'})),
    "headers": lambda c, _: _events.event_page(c, W, parse_filter({"headers": '{"a": 1}'})),
    "ordering key": lambda c, _: _events.event_page(c, W, parse_filter({"ordering_key": "key-5"})),
    "waiting of a key": lambda c, _: _events.event_page(
        c, W, parse_filter({"ordering_key": "key-5", "status": "waiting"})
    ),
    "dedupe key": lambda c, _: _events.event_page(c, W, parse_filter({"dedupe_key": "d-1"})),
    "id": lambda c, _: _events.event_page(c, W, parse_filter({"id": "17"})),
    "time range": lambda c, _: _events.event_page(
        c, W, parse_filter({"created_from": "2000-01-01T00:00", "created_to": "2100-01-01"})
    ),
    "dead": lambda c, _: _events.event_page(c, W, parse_filter({}, status="dead")),
    "dead of a topic, by error": lambda c, _: _events.event_page(
        c, W, parse_filter({"topic": "topic.03", "error": "boom"}, status="dead")
    ),
    "event": lambda c, event_id: _events.load_event(c, W, event_id),
    "ordering keys": lambda c, _: _events.blocked_keys(c, W),
    "audit": lambda c, _: _events.audit_entries(c, W, None),
    "consumers": lambda c, _: _data.consumers(c, W),
    "pulse": lambda c, _: c.fetchrow(W.pulse, W.outbox.schema, W.outbox.table),
    "confirm every dead": lambda c, _: count_to_confirm(
        c, W, None, parse_filter({}, status="dead")
    ),
    "confirm dead of a topic, by error": lambda c, _: count_to_confirm(
        c, W, None, parse_filter({"topic": "topic.03", "error": "boom"}, status="dead")
    ),
    "confirm dead by payload": lambda c, _: count_to_confirm(
        c, W, None, parse_filter({"payload": '{"n": 5}'}, status="dead")
    ),
    "confirm a selection": lambda c, event_id: count_to_confirm(
        c, W, [1, 2, event_id], parse_filter({}, status="dead")
    ),
}


async def _overview(conn: Any) -> Any:
    return _data.with_backlog(await _data.overview(conn, W), await read_backlog(conn, W))


async def _topic_page(conn: Any, topic: str) -> Any:
    return (await _topic.load_topic(conn, W, topic)).with_backlog(await read_backlog(conn, W))


async def _cancel(conn: Any, event_id: int) -> Any:
    from aiooutbox.web._actions import _cancel as cancel

    head = await conn.conn.fetchval(
        "SELECT min(id) FROM outbox_events WHERE ordering_key = 'key-5' AND status = 'pending'"
    )
    # rolled back: the test reads the plans of what it ran, and the table stays as it was
    try:
        async with conn.transaction():
            await cancel(conn, W, [1, head, event_id])
            raise _RolledBack
    except _RolledBack:
        pass


class _RolledBack(Exception):
    pass


async def _run_now(conn: Any, event_id: int) -> None:
    try:
        async with conn.transaction():
            await conn.fetch(W.run_now, [1, event_id])
            raise _RolledBack
    except _RolledBack:
        pass


# a statement each of these must run (so that the check above covers it)
READS = {
    "consumers": ("outbox_events_consumers", "outbox_events_idle", "lease_expires_at"),
    "pulse": ("max(id)", "_audit", "pg_stat_get_tuples_inserted"),
    "confirm every dead": ("SELECT count(*)",),
    "confirm a selection": ("= ANY",),
    "backlog": ("status = 'retry'", "status = 'dead'", "status IN ('pending', 'retry')"),
    "topic page": ("_rollups", "topic = $1"),
    "cancel": ("DELETE", "pg_advisory_xact_lock"),
}


@pytest.fixture(scope="module")
def big(shared_dsn: str) -> str:
    import asyncio

    asyncio.run(populate(shared_dsn, done=300_000, pending=30_000, log=lambda _: None))
    return shared_dsn


@pytest.mark.parametrize("page", sorted(PAGES))
async def test_no_page_reads_the_whole_table(big: str, page: str) -> None:
    conn = await asyncpg.connect(big)
    try:
        waiting = await conn.fetchval(
            "SELECT max(id) FROM outbox_events WHERE ordering_key = 'key-5' AND status = 'waiting'"
        )
        recording = Recording(conn)
        await PAGES[page](recording, waiting)
        assert recording.statements
        sampled = False
        for sql, args in recording.statements:
            if sql.startswith("EXPLAIN"):
                continue
            raw = await conn.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", *args)
            plan = json.loads(raw)[0]["Plan"]
            nodes = scans(plan)
            for table in BIG:
                assert ("Seq Scan", table) not in nodes, (page, sql, nodes)
            sampled |= ("Sample Scan", "outbox_events") in nodes
        assert sampled == (page == "overview"), page
        ran = " ".join(sql for sql, _ in recording.statements)
        for fragment in READS.get(page, ()):
            assert fragment in ran, (page, fragment, [sql for sql, _ in recording.statements])
    finally:
        await conn.close()


def _indexes(plan: dict[str, Any]) -> list[tuple[str, str | None]]:
    found = [(plan["Node Type"], plan.get("Index Name"))]
    for child in plan.get("Plans", []):
        found += _indexes(child)
    return found


async def test_the_backlog_is_counted_index_only(big: str) -> None:
    """Each exact backlog count reads one partial index and no table page (the index
    holds what it counts), so it stays cheap at a million rows and more."""
    conn = await asyncpg.connect(big)
    try:
        await conn.execute("VACUUM outbox_events")  # the visibility map of a fresh table
        for sql, index in (
            (W.claimable_counts, "outbox_events_topic_claimable_idx"),
            (W.retry_counts, "outbox_events_retry_idx"),
            (W.dead_counts, "outbox_events_dead_idx"),
        ):
            raw = await conn.fetchval(f"EXPLAIN (FORMAT JSON) {sql}")
            nodes = _indexes(json.loads(raw)[0]["Plan"])
            assert ("Index Only Scan", index) in nodes, (sql, nodes)
    finally:
        await conn.close()
