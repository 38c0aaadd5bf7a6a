"""The probe of the claim from low marks (`claim_v9`, migrations 0019 and 0020) reads a
few index pages for a topic with a big backlog, with and without groups.

Since 0018 the claimable index is ``(topic, coalesce(grp, ''), available_at, id)``: a
topic's rows are in ``(available_at, id)`` order only within a group, so a probe that
ordered the whole topic by position would sort its backlog (hundreds of buffers here).
The probe takes the first of the ungrouped range's first row and each named group's
(a skip scan, one descent per group), and since migration 0020 (`claim_v9`) probes at
most a given number of groups per call, so its cost does not grow with the number of
groups. Buffer counts, not timings.
"""

from __future__ import annotations

import json
import re

import asyncpg
import pytest

from aiooutbox._sql.plans import nested_plans
from aiooutbox._sql.statements import queries

Q = queries()
BACKLOG = 20_000
GROUPS = 8
# a descent of the index and a heap page: a few buffers per range the probe reads
PER_RANGE = 8

_BUFFERS = re.compile(r"Buffers: shared(?: hit=(\d+))?(?: read=(\d+))?")


def _buffers(plan: str) -> int:
    match = _BUFFERS.search(plan)
    if match is None:  # nothing read (a statement whose scans never ran)
        assert "actual" in plan, plan
        return 0
    return sum(int(n) for n in match.groups() if n)


async def _fill(conn: asyncpg.Connection, groups: int) -> None:
    # the big topic's backlog (grouped: GROUPS groups and ungrouped rows), and a small one
    grp = f"CASE WHEN g % {groups + 1} = 0 THEN NULL ELSE 'g' || (g % {groups + 1}) END"
    await conn.execute(
        "INSERT INTO outbox_events (topic, payload, grp)"
        f" SELECT 'big', '{{}}', {grp if groups else 'NULL'}"
        f" FROM generate_series(1, {BACKLOG}) AS g"
    )
    await conn.execute("INSERT INTO outbox_events (topic, payload) VALUES ('small', '{}')")
    await conn.execute("VACUUM ANALYZE outbox_events")


@pytest.mark.parametrize(("groups", "probed"), [(0, 512), (GROUPS, 512), (600, GROUPS)])
async def test_the_marks_probe_reads_a_few_buffers_per_group(
    conn: asyncpg.Connection, groups: int, probed: int
) -> None:
    await _fill(conn, groups)
    topics = ["big", "small"]
    none: list[None] = [None] * len(topics)
    claim = ("probe-plans", 30.0, topics, 10, 1 << 30, 0, 0)
    args: tuple[object, ...] = (*claim, none, none, [], 0.05, None, 32, none, none, [0, 0], probed)
    plans = await nested_plans(conn, Q, [("claim_marked", Q.claim_marked, args)], analyze=True)
    # the probe's statements, run once per topic: each reads from the topic's mark
    probes = [
        p for p in re.split(r"\n(?=Query Text:)", plans["claim_marked"]) if "(m_at, m_id)" in p
    ]
    assert len(probes) == 2 * len(topics), plans["claim_marked"]
    probe = "\n".join(probes)
    assert "Seq Scan" not in probe, probe
    # two topics: each one descent for its ungrouped range, one for its first group (none
    # for "small"), and per group of "big" probed one step of the skip scan, which finds
    # the group's first row (one group more is found, to know whether the sweep ended)
    seen = min(groups, probed + 1)
    bound = PER_RANGE * (2 + 2 + seen)
    read = sum(_buffers(p) for p in probes)
    print(f"{groups} groups, {probed} probed a call: the probe read {read} buffers")
    assert read <= bound, f"the probe touched {read} buffers:\n{probe}"
    if groups > probed:  # not every group probed: "big"'s mark stays, its sweep goes on
        (row,) = [r for r in await conn.fetch(Q.claim_marked, *args) if r["id"] is None]
        found = json.loads(row["payload"])
        assert found["us"][0] is None and found["after"][0] is not None, found
        assert found["after"][1] is None, found  # "small" has no groups: its sweep ended
        return

    # the idle probe from the marks: the same ranges
    sql = f"EXPLAIN (ANALYZE, BUFFERS) {Q.next_available_marked}"
    plan = "\n".join(r[0] for r in await conn.fetch(sql, topics, none, none, [1]))
    assert "Seq Scan" not in plan, plan
    # (every group, two descents each: one step of its skip scan, one first row)
    bound = PER_RANGE * (2 + 2 + 2 * groups)
    assert _buffers(plan) <= bound, f"the idle probe touched {_buffers(plan)} buffers:\n{plan}"
