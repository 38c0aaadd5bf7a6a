"""A consumer whose event loop is blocked past its lease, beside a consumer process.

The blocked consumer's lease lapses, the other consumer recovers the key and runs it;
when the loop unblocks, the first consumer must not start anything more of what it had
claimed: only the handler that was running while the loop was blocked may repeat (as
docs/guarantees.md says). Every handler run is recorded (start and end) in ``runs`` and
checked with SQL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

import aiooutbox
from tests.faults.ordered_proc import RUNS_DDL
from tests.helpers import all_in, wait_until

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# two runs of one key that overlap in time, leaving out the run that was going on while
# the loop was blocked (the one repeat the guarantees allow)
OVERLAPS = """
SELECT count(*) FROM runs a JOIN runs b ON a.okey = b.okey AND a.run < b.run
WHERE a.run <> $1 AND b.run <> $1 AND a.started < b.ended AND b.started < a.ended
"""
# a run that started after a run of a later event of its key had started
BACKWARDS = """
SELECT count(*) FROM runs a JOIN runs b ON a.okey = b.okey
WHERE a.run <> $1 AND b.run <> $1 AND a.seq < b.seq AND a.started > b.started
"""


@pytest.fixture
async def runs(pool: asyncpg.Pool) -> asyncpg.Pool:
    await pool.execute(RUNS_DDL)
    return pool


@pytest.fixture
async def other_process(dsn: str) -> AsyncIterator[Any]:
    """Start a consumer process on demand (``await start()``); stopped on exit."""
    procs: list[asyncio.subprocess.Process] = []

    async def start(**config: Any) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.faults.ordered_proc",
            json.dumps({"dsn": dsn, **config}),
            stdout=asyncio.subprocess.PIPE,
            cwd=ROOT,
        )
        procs.append(proc)
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 60)).strip() == b"READY"

    try:
        yield start
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            await asyncio.wait_for(proc.wait(), 60)


async def test_a_consumer_whose_loop_was_blocked_past_its_lease_starts_nothing_more(
    runs: asyncpg.Pool, other_process: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The defect: a loop blocked 6 s with a 2 s lease; the other consumer re-claimed the
    key and ran e1..e10, and the first one then ran e2..e5 anyway, overlapping and after
    e10. Here the blocked handler returns without awaiting anything, so the next run
    member is looked at before the heartbeat (overdue) has had a chance to run."""
    lease, blocked_for, total = 2.0, 6.0, 10
    ids = await aiooutbox.enqueue_many(
        runs, [aiooutbox.NewEvent("t", {"seq": n}, ordering_key="k") for n in range(total)]
    )
    first = ids[0]
    mine: list[tuple[int, int, int, float, float]] = []  # event, seq, attempt, start, end
    blocking = asyncio.Event()
    go = asyncio.Event()

    async def handle(event: aiooutbox.Event) -> None:
        started = time.time()  # the server's clock_timestamp() is this machine's clock
        if event.id == first and not blocking.is_set():
            blocking.set()
            await go.wait()  # the other process is up: now block the whole loop
            time.sleep(blocked_for)  # the point of the test
        else:
            await asyncio.sleep(0.05)
        mine.append((event.id, event.payload["seq"], event.attempts, started, time.time()))

    consumer = aiooutbox.OutboxConsumer(
        runs, concurrency=16, lease_timeout=lease, poll_interval=0.5, worker_id="blocked"
    )
    caplog.set_level(logging.WARNING, logger="aiooutbox")
    async with consumer:
        task = asyncio.ensure_future(consumer.run({"t": handle}))
        try:
            await asyncio.wait_for(blocking.wait(), 30)
            # it claimed the head with the run behind it; the other consumer starts now
            # and can only get the key by recovering the lapsed lease
            held = await runs.fetchval(
                "SELECT count(*) FROM outbox_events_all WHERE status = 'processing'"
                " AND locked_by = 'blocked'"
            )
            assert held == total, held
            await other_process(
                worker_id="other", concurrency=4, lease_timeout=3, fail_rate=0,
                handler_seconds=0.4,
            )  # fmt: skip
            go.set()
            await asyncio.sleep(0)  # the handler blocks the loop here for `blocked_for`
            await wait_until(all_in(runs, "done", total), timeout=60, interval=0.1)
            await asyncio.sleep(1.0)  # anything the blocked consumer would still start
        finally:
            consumer.stop()
            await asyncio.wait_for(task, 30)

    await runs.execute(
        "INSERT INTO runs (event_id, okey, seq, worker, attempt, started, ended, outcome)"
        " SELECT m.e, 'k', m.s, 'blocked', m.a, to_timestamp(m.t0), to_timestamp(m.t1), 'ok'"
        " FROM unnest($1::bigint[], $2::int[], $3::int[], $4::float8[], $5::float8[])"
        "  AS m(e, s, a, t0, t1)",
        *(list(column) for column in zip(*mine, strict=True)),
    )
    frozen = await runs.fetchval(
        "SELECT min(run) FROM runs WHERE worker = 'blocked' AND event_id = $1", first
    )
    table = await runs.fetch(
        "SELECT worker, seq, attempt, started, ended FROM runs ORDER BY started"
    )
    shown = "\n".join(
        f"  {r['worker']:8} e{r['seq'] + 1:<3} attempt {r['attempt']} "
        f"{r['started']:%H:%M:%S.%f} .. {r['ended']:%H:%M:%S.%f}"
        for r in table
    )
    print(f"\n[blocked loop] handler runs:\n{shown}")
    # the lease really lapsed and the other consumer took the key over (it ran e1 again)
    assert [r["seq"] for r in table if r["worker"] == "other"][:1] == [0], shown
    assert await runs.fetchval(OVERLAPS, frozen) == 0, shown
    assert await runs.fetchval(BACKWARDS, frozen) == 0, shown
    assert any("not started, its lease lapsed" in r.getMessage() for r in caplog.records)


async def test_a_lone_consumer_resumes_a_key_in_order_after_its_loop_was_blocked(
    runs: asyncpg.Pool,
) -> None:
    """No other consumer: what the blocked one gave up (or its own recovery took back)
    is claimed again, and the key runs on in order; nothing is left waiting."""
    lease, total = 1.0, 8
    ids = await aiooutbox.enqueue_many(
        runs, [aiooutbox.NewEvent("t", {"seq": n}, ordering_key="k") for n in range(total)]
    )
    blocked = ids[1]  # the second event of the run blocks, so the head is done first
    starts: list[tuple[int, int]] = []  # (seq, attempt) in start order
    overlapping: list[tuple[int, int]] = []  # runs that started while another ran
    running = 0

    async def handle(event: aiooutbox.Event) -> None:
        nonlocal running
        starts.append((event.payload["seq"], event.attempts))
        if running:
            overlapping.append(starts[-1])
        running += 1
        try:
            if event.id == blocked and len(starts) == 2:
                time.sleep(3 * lease)  # the loop is blocked: no heartbeat, no recovery
            else:
                await asyncio.sleep(0.01)
        finally:
            running -= 1

    consumer = aiooutbox.OutboxConsumer(
        runs, concurrency=16, lease_timeout=lease, poll_interval=0.2
    )
    async with consumer:
        task = asyncio.ensure_future(consumer.run({"t": handle}))
        try:
            await wait_until(all_in(runs, "done", total), timeout=30, interval=0.05)
            await asyncio.sleep(0.5)  # anything still to start from the old claim
        finally:
            consumer.stop()
            await asyncio.wait_for(task, 30)
    print(f"\n[lone blocked consumer] starts (seq, attempt): {starts}")
    assert starts[1] == (1, 1)  # the run that was going on while the loop was blocked
    assert not overlapping, starts
    # after it, the key is delivered again from its earliest unsettled event, in order:
    # e2 (the blocked handler's own event) again unless its outcome was written before
    # anything took the row back (nothing else claims it here: both are allowed), then
    # e3, ...; never anything of the old claim
    after = [seq for seq, _ in starts[:1] + starts[2:]]
    assert after == sorted(after), starts
    assert set(after) | {1} == set(range(total)), starts
    assert await runs.fetchval("SELECT count(*) FROM outbox_events_all WHERE status <> 'done'") == 0


async def test_a_batch_whose_every_lease_lapsed_before_it_started_is_left_to_recovery(
    runs: asyncpg.Pool,
) -> None:
    """A batch handler's call blocks the loop past the lease while a second batch of
    the same claim waits for its turn: every row of the second has lapsed when it would
    start. It is left to lease recovery (nothing started, the consumer runs on), and
    every event ends done."""
    lease, total = 1.0, 10
    await aiooutbox.enqueue_many(runs, [aiooutbox.NewEvent("t", {"n": n}) for n in range(total)])
    calls: list[list[int]] = []

    async def handle(events: list[aiooutbox.Event]) -> None:
        calls.append([e.payload["n"] for e in events])
        if len(calls) == 1:
            time.sleep(3 * lease)  # the loop is blocked: no heartbeat, no recovery

    consumer = aiooutbox.OutboxConsumer(
        runs, concurrency=10, lease_timeout=lease, poll_interval=0.2
    )
    async with consumer:
        task = asyncio.ensure_future(consumer.run({"t": aiooutbox.Handler(handle, batch=5)}))
        try:
            await wait_until(all_in(runs, "done", total), timeout=30, interval=0.05)
            assert not task.done(), task.exception()  # the consumer runs on
        finally:
            consumer.stop()
            await asyncio.wait_for(task, 30)
    print(f"\n[lapsed batch] calls: {calls}")
    assert {n for call in calls for n in call} == set(range(total)), calls
