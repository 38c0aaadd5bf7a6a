"""A paused or limited topic's backlog costs the other topics' claims nothing, and the
claims of a held topic do not walk its backlog either.

As in ``test_topic_isolation_plans.py``: the statements inside the claim functions run
under ``EXPLAIN (ANALYZE, BUFFERS)`` (auto_explain) beside 50,000 pending rows of the
held topic, all older than the rows of the topics that run. Buffer counts, not
timings.
"""

from __future__ import annotations

import re

import asyncpg
import pytest

from aiooutbox import admin
from aiooutbox._sql.flow import flow_queries
from aiooutbox._sql.plans import nested_plans
from aiooutbox._sql.statements import queries
from tests.test_topic_isolation_plans import BACKLOG, BOUND, HANDLED, buffers, check_index_reads
from tests.test_topic_isolation_plans import statements as split

Q = queries()
FQ = flow_queries()
WORKER = "flow-plans"


@pytest.fixture
async def backlog(conn: asyncpg.Connection) -> asyncpg.Connection:
    await conn.execute(
        "INSERT INTO outbox_events (topic, payload, available_at)"
        " SELECT 'held', '{}', now() - interval '1 hour' - g * interval '1 ms'"
        f" FROM generate_series(1, {BACKLOG}) AS g"
    )
    for topic in ("a", "c"):
        await conn.execute(
            "INSERT INTO outbox_events (topic, payload)"
            f" SELECT '{topic}', '{{}}' FROM generate_series(1, {HANDLED})"
        )
    await conn.execute("VACUUM ANALYZE outbox_events")
    return conn


@pytest.mark.parametrize("control", ["paused", "max_running", "rate"])
async def test_the_open_claim_leaves_a_held_topics_backlog_alone(
    backlog: asyncpg.Connection, control: str
) -> None:
    if control == "paused":
        await admin.pause_topic(backlog, "held")
    elif control == "max_running":
        await admin.limit_topic(backlog, "held", max_running=2)
    else:
        await admin.limit_topic(backlog, "held", rate="1/h")
    plans: dict[str, str] = {}
    for name, topics in (("listed", ["held", "a", "c"]), ("every", None)):
        # each in its own rolled-back transaction
        claim = (WORKER, 30.0, topics, 500, 1 << 40, 100, 100)
        plans |= await nested_plans(backlog, Q, [(name, Q.claim, claim)], analyze=True)
    # the held topic's rows are never visited, not even to be filtered out
    check_index_reads("listed", plans["listed"], 2 * HANDLED)
    for plan in split(plans["every"]):
        assert "Seq Scan" not in plan, plan
        if "topic_claimable_idx" in plan:  # the skip scan over the topics, the scan of each
            assert buffers(plan) <= BOUND, f"touched {buffers(plan)} buffers:\n{plan}"
            assert "'held'" not in plan, plan
        else:  # locking and updating the rows picked, by id
            assert "outbox_events_pkey" in plan, plan
    claimed = re.findall(r"Update on outbox_events .*rows=([\d.]+) loops=1\)", plans["every"])
    assert round(sum(float(n) for n in claimed)) == 2 * HANDLED, plans["every"]


@pytest.mark.parametrize("control", ["max_running", "rate"])
async def test_a_limited_claim_at_its_limit_does_not_walk_the_backlog(
    backlog: asyncpg.Connection, control: str
) -> None:
    if control == "max_running":
        await admin.limit_topic(backlog, "held", max_running=3)
    else:
        # a token a minute: the claim below still finds none on a loaded machine (at
        # 10/s one came back when 0.1 s passed before it)
        await admin.limit_topic(backlog, "held", rate="1/min", burst=3)
    taken = await backlog.fetch(FQ.claim_limited, WORKER, 30.0, ["held"], [10], 1 << 40, [])
    assert [r["held"] for r in taken] == [None] * 3 + [
        "running" if control == "max_running" else "rate"
    ]
    none: list[int] = []  # no rows claimed before
    again = [("held", FQ.claim_limited, (WORKER, 30.0, ["held"], [10], 1 << 40, none))]
    plans = await nested_plans(backlog, Q, again, analyze=True)
    if control == "rate":
        # out of tokens: the claim reads nothing of the outbox table at all (the count
        # of a max_running topic's claimed rows is in its plan, never run)
        scans = re.findall(r"Scan using \w+ on outbox_events .*", plans["held"])
        assert scans and all("never executed" in s for s in scans), plans["held"]
        return
    for plan in split(plans["held"]):
        assert "Seq Scan" not in plan, plan
        assert buffers(plan) <= BOUND, f"touched {buffers(plan)} buffers:\n{plan}"
        assert "topic_claimable_idx" not in plan, plan  # nothing was claimed: no scan
    # the count goes through the index of the limited topic's claimed rows alone
    assert "flow_running_idx" in plans["held"], plans["held"]


async def test_a_limited_claim_below_its_limit_reads_only_what_it_takes(
    backlog: asyncpg.Connection,
) -> None:
    await admin.limit_topic(backlog, "held", max_running=100)
    plans = await nested_plans(
        backlog,
        Q,
        [("held", FQ.claim_limited, (WORKER, 30.0, ["held"], [40], 1 << 40, []))],
        analyze=True,
    )
    scans = re.findall(
        r"Scan using outbox_events_topic_claimable_idx .*rows=([\d.]+) loops=(\d+)\)",
        plans["held"],
    )
    assert round(sum(float(r) * int(n) for r, n in scans)) == 40, plans["held"]
    for plan in split(plans["held"]):
        if "topic_claimable_idx" in plan or "flow_running_idx" in plan:
            assert buffers(plan) <= BOUND, f"touched {buffers(plan)} buffers:\n{plan}"
        else:  # updating the rows it took, by id
            assert "outbox_events_pkey" in plan, plan


async def test_the_open_topics_of_a_consumer_of_every_topic_are_found_on_the_index(
    backlog: asyncpg.Connection,
) -> None:
    """What a consumer of every topic claims while topics are held: the topics with
    events but the held ones, by a skip scan that descends into each topic once (the
    held topic's 50,000 events are not read)."""
    await admin.pause_topic(backlog, "held")
    assert sorted(await backlog.fetchval(FQ.open_topics)) == ["a", "c"]
    await admin.limit_topic(backlog, "a", max_running=5)
    assert await backlog.fetchval(FQ.open_topics) == ["c"]
    plan = "\n".join(
        r[0] for r in await backlog.fetch(f"EXPLAIN (ANALYZE, BUFFERS) {FQ.open_topics}")
    )
    assert "Seq Scan on outbox_events " not in plan, plan
    assert "topic_claimable_idx" in plan, plan
    assert buffers(plan) <= BOUND, f"touched {buffers(plan)} buffers:\n{plan}"
