"""The hand-off starts its workers as items need them (`Handoff.staff`): an item that
finds no worker waiting starts one, up to the limit, one on its way at a time; a
closed hand-off starts none. No database: the channel alone."""

from __future__ import annotations

import asyncio

from aiooutbox._engine.handoff import Handoff


async def test_workers_start_as_items_find_none_waiting() -> None:
    handoff: Handoff[int] = Handoff()
    taken: list[int] = []
    release = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    async def worker() -> None:
        handoff.joins()
        while (item := handoff.take_nowait()) is not None or (item := await handoff.get()):
            taken.append(item)
            await release.wait()  # a handler that suspends: its worker stays busy

    handoff.staff(lambda: tasks.append(asyncio.ensure_future(worker())), 3)
    assert tasks == []  # nothing queued: nobody started
    handoff.put_all([1])
    assert len(tasks) == 1  # one on its way
    handoff.put_all([2])
    assert len(tasks) == 1  # ... and the next waits for it to take its item (the relay)
    for _ in range(10):
        await asyncio.sleep(0)
    assert len(tasks) == 2 and sorted(taken) == [1, 2]
    # every worker busy: each item that found none waiting started one, up to 3
    handoff.put_all([3, 4, 5])
    for _ in range(10):
        await asyncio.sleep(0)
    assert len(tasks) == 3
    assert sorted(taken) == [1, 2, 3]
    release.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert sorted(taken) == [1, 2, 3, 4, 5]
    assert len(tasks) == 3  # the idle ones took the rest
    handoff.close()
    await asyncio.gather(*tasks)


async def test_a_closed_handoff_starts_no_worker() -> None:
    handoff: Handoff[int] = Handoff()
    started: list[int] = []
    handoff.staff(lambda: started.append(1), 5)
    handoff.close()
    handoff.put_all([1, 2])
    assert handoff.take_nowait() == 1
    assert started == []


async def test_workers_started_for_items_queued_before_staffing() -> None:
    handoff: Handoff[int] = Handoff()
    started: list[int] = []
    handoff.put_all([1, 2])
    handoff.staff(lambda: started.append(1), 5)
    assert started == [1]  # one on its way; it relays for the rest
