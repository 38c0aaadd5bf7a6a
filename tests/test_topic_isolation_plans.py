"""Issue 16: a large pending backlog of a topic nobody consumes costs the other topics'
hot statements nothing.

Each statement runs with ``EXPLAIN (ANALYZE, BUFFERS)`` (through auto_explain for the
statements inside the claim and settle functions) beside 50,000 pending rows of a
topic the consumer does not handle, all older than the rows it does handle. A scan
that walked the backlog and filtered it by topic touched about 550 buffers here (1,088
at 100,000 rows); the handled topics' rows take 5-10. Buffer counts, not timings: they
do not move with the machine's load.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

import asyncpg
import pytest

from aiooutbox._sql.plans import nested_plans
from aiooutbox._sql.statements import queries
from tests.helpers import table_scans

Q = queries()
BACKLOG = 50_000
HANDLED = 50  # pending rows of each handled topic
# the buffers a statement that reads the claimable index may touch: fifteen times what
# it needs, a quarter of what walking the backlog costs
BOUND = 150

_BUFFERS = re.compile(r"Buffers: shared(?: hit=(\d+))?(?: read=(\d+))?")


def buffers(plan: str) -> int:
    """Shared buffers (hit + read) of the plan's top node: its first Buffers line."""
    match = _BUFFERS.search(plan)
    assert match, plan
    return sum(int(n) for n in match.groups() if n)


def statements(plans: str) -> list[str]:
    """auto_explain's plans of one function call, one per statement it ran."""
    return [p for p in re.split(r"\n(?=Query Text:)", plans) if p.strip()]


@pytest.fixture
async def backlog(conn: asyncpg.Connection) -> asyncpg.Connection:
    await conn.execute(
        "INSERT INTO outbox_events (topic, payload, available_at)"
        " SELECT 'unconsumed', '{}', now() - interval '1 hour' - g * interval '1 ms'"
        f" FROM generate_series(1, {BACKLOG}) AS g"
    )
    for topic in ("a", "c"):
        await conn.execute(
            "INSERT INTO outbox_events (topic, payload)"
            f" SELECT '{topic}', '{{}}' FROM generate_series(1, {HANDLED})"
        )
    await conn.execute("VACUUM ANALYZE outbox_events")
    return conn


def check_index_reads(name: str, plans: str, expected_rows: int) -> None:
    """The statements that read the claimable index stay within `BOUND` buffers and
    read exactly the handled topics' rows; the others go by id (primary key)."""
    scanned = 0
    for plan in statements(plans):
        assert "Seq Scan" not in plan, plan
        # (PostgreSQL 18 prints rows as averages with two decimals: rows=50.00)
        scans = re.findall(
            r"Scan using outbox_events_topic_claimable_idx .*rows=([\d.]+) loops=(\d+)\)", plan
        )
        if scans:
            assert buffers(plan) <= BOUND, f"{name} touched {buffers(plan)} buffers:\n{plan}"
            removed = re.findall(r"Rows Removed by \w+: ([\d.]+)", plan)
            assert not [n for n in removed if float(n)], plan
            scanned += round(sum(float(rows) * int(loops) for rows, loops in scans))
        else:  # locking or updating the rows picked, by id: never near the backlog
            assert "outbox_events_pkey" in plan, plan
    # none of the backlog's entries was visited, not even to be filtered out
    assert scanned == expected_rows, plans


@pytest.mark.parametrize("topics", [["a"], ["a", "c"]])
async def test_claims_and_settles_do_not_visit_an_unconsumed_topics_backlog(
    backlog: asyncpg.Connection, topics: list[str]
) -> None:
    ids = [
        r["id"]
        for r in await backlog.fetch(
            "SELECT id FROM outbox_events WHERE topic = ANY ($1::text[]) ORDER BY id", topics
        )
    ]
    worker, epoch = "isolation-plans", datetime(1970, 1, 1, tzinfo=UTC)
    claim = (worker, 30.0, topics, 100, 1 << 40, 100, 100)
    none: list[None] = [None] * len(topics)
    # each claim alone (in its own rolled-back transaction), then settling what it took
    for name, sql, args in (
        ("claim", Q.claim, claim),
        ("claim_after", Q.claim_after, (*claim, epoch, 0)),
        # from low marks (migration 0019): a first claim, from the start
        (
            "claim_marked",
            Q.claim_marked,
            (*claim, none, none, [], 0.05, None, 32, none, none, [0] * len(none), 512),
        ),
    ):
        plans = await nested_plans(
            backlog,
            Q,
            [
                (name, sql, args),
                ("settle_done", Q.settle_done, (ids[::2], worker, 1)),
                (
                    "settle_failed",
                    Q.settle_failed,
                    (
                        ids[1::2],
                        [5.0] * len(ids[1::2]),
                        ["e"] * len(ids[1::2]),
                        ["retry"] * len(ids[1::2]),
                        worker,
                        1,
                    ),
                ),
            ],
            analyze=True,
        )
        check_index_reads(name, plans[name], len(ids))
        for settle, settled in (("settle_done", ids[::2]), ("settle_failed", ids[1::2])):
            check_index_reads(settle, plans[settle], 0)
            # and they did settle the rows the claim took (done: moved to the ring, 0022)
            updated = re.findall(
                r"(?:Update|Delete) on outbox_events .*rows=([\d.]+) loops=1\)", plans[settle]
            )
            assert round(sum(float(n) for n in updated)) == len(settled), plans[settle]


async def test_idle_probe_does_not_visit_an_unconsumed_topics_backlog(
    backlog: asyncpg.Connection,
) -> None:
    async with backlog.transaction():
        await backlog.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        for sql, args in (
            (Q.idle_probe, (["a", "c"],)),
            (Q.idle_probe_marked, (["a", "c"], [None, None], [None, None], [1])),
        ):
            stmt = await backlog.prepare("EXPLAIN (ANALYZE, BUFFERS) " + sql)
            plan = "\n".join(r[0] for r in await stmt.fetch(*args))
            assert "topic_claimable_idx" in plan and not table_scans(plan), plan
            assert buffers(plan) <= BOUND, f"the probe touched {buffers(plan)} buffers:\n{plan}"
