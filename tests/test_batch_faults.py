"""A consumer process SIGKILLed in the middle of its batches: nothing is lost, only what
it held runs again (once more at most), and every key's events keep their order."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import pytest

import aiooutbox
from aiooutbox._engine.options import RUN_ROWS_PER_HEAD, ConsumerOptions
from tests.faults.batch_proc import RUNS_DDL
from tests.faults.procs import ConsumerProcess, all_finished, wait_until

pytestmark = pytest.mark.slow

#: the consumers' options (prefetch 0: nothing claimed ahead of the handlers)
OPTIONS = ConsumerOptions.build(concurrency=40, prefetch=0)
#: a claim's rows: as many as there are free handlers, and runs behind its ordered heads
CLAIM = OPTIONS.concurrency * (1 + RUN_ROWS_PER_HEAD)
#: bounded work (docs/guarantees.md): the handlers' rows, the outcomes not yet written up
#: to the bound past which claiming pauses, and the claim under way when it is reached
HELD = OPTIONS.concurrency + OPTIONS.max_unwritten(CLAIM) + CLAIM


@pytest.fixture
async def db(dsn: str) -> asyncpg.Connection:
    conn = await asyncpg.connect(dsn)
    await conn.execute(RUNS_DDL)
    try:
        yield conn
    finally:
        await conn.close()


async def test_sigkill_mid_batch_loses_nothing_and_keeps_order(
    dsn: str, db: asyncpg.Connection
) -> None:
    lease, total, keys = 2.0, 2 * HELD, 20
    # prefetch 0 (`OPTIONS`): nothing claimed ahead, whose bound (~0.1 s of work at the
    # recent rate) would move with the machine
    base = {"dsn": dsn, "concurrency": OPTIONS.concurrency, "batch": 20, "sleep": 0.05,
            "lease_timeout": lease, "prefetch": OPTIONS.prefetch}  # fmt: skip
    victim = ConsumerProcess({**base, "worker_id": "victim"}, module="tests.faults.batch_proc")
    survivor = ConsumerProcess({**base, "worker_id": "survivor"}, module="tests.faults.batch_proc")
    try:
        await asyncio.gather(victim.ready(), survivor.ready())
        events = []
        for i in range(total):  # half unordered, half over 20 keys, numbered per key
            key = f"k{i // 2 % keys}" if i % 2 else None
            events.append(aiooutbox.NewEvent("t", {"seq": i // 2 // keys}, ordering_key=key))
        await aiooutbox.enqueue_many(db, events)

        async def victim_busy() -> bool:
            n = await db.fetchval("SELECT count(*) FROM runs WHERE worker = 'victim'")
            return bool(n >= 100)

        await wait_until(victim_busy, 30, "the victim to run 100 events")
        victim.kill()
        killed_at = time.monotonic()
        held = {
            r[0]
            for r in await db.fetch(
                "SELECT id FROM outbox_events WHERE status = 'processing' AND locked_by = 'victim'"
            )
        }
        await wait_until(lambda: all_finished(db, total), 60, "every event to finish")
        recovery = time.monotonic() - killed_at
        await survivor.stop()
    finally:
        victim.close()
        survivor.close()

    statuses = await db.fetch("SELECT status::text, count(*) FROM outbox_events_all GROUP BY 1")
    assert {r[0]: r[1] for r in statuses} == {"done": total}  # nothing lost
    never = await db.fetchval(
        "SELECT count(*) FROM outbox_events_all e WHERE NOT EXISTS"
        " (SELECT 1 FROM runs r WHERE r.event_id = e.id)"
    )
    assert never == 0
    twice = {
        r[0]: r[1]
        for r in await db.fetch(
            "SELECT event_id, count(*) FROM runs GROUP BY 1 HAVING count(*) > 1"
        )
    }
    # only what the victim held can run again, and once more at most
    assert set(twice) <= held, set(twice) - held
    assert max(twice.values(), default=2) == 2
    assert len(held) <= HELD, f"the victim held {len(held)} rows (bound {HELD})"
    # every key's events in order: a delivery of seq s comes after one of each seq < s
    runs = await db.fetch("SELECT okey, seq FROM runs WHERE okey IS NOT NULL ORDER BY run")
    seen: dict[str, set[int]] = {}
    for okey, seq in runs:
        before = seen.setdefault(okey, set())
        assert set(range(seq)) <= before, f"{okey}: seq {seq} before {set(range(seq)) - before}"
        before.add(seq)
    assert recovery < lease + 30
    print(f"held at the kill {len(held)}, ran twice {len(twice)}, recovery {recovery:.1f}s")
    assert held  # the kill came mid-batch
