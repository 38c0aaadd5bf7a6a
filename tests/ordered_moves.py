"""Dead heads that block their keys, and operators who purge them, for the SIGKILL
ordering test (`tests/test_ordering.py`).

`DeadHeads` writes events of topic ``d`` for ``keys`` keys, about one in eight told to
die (``"die": true``: the consumers of `tests.faults.ordered_moves_proc` raise
`aiooutbox.Dead` for it, and their handler of ``d`` keeps the key blocked behind a dead
event, ``on_dead="block"``). While the consumers run it appends more to those keys
(`append`), and an operator purges the dead heads every second or so (`purge`), with
each tool in turn: ``python -m aiooutbox purge --status dead``, ``dead purge --all``,
``dead purge --topic d``, and from Python `admin.purge(status="dead")` and
`admin.dead_purge` by ``everything``, ``topic`` and ``ids``. A purged head lets its key
move on: the events behind it must then run, in order.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import sys
from collections import Counter

import asyncpg

import aiooutbox
from aiooutbox import admin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPIC = "d"
TOOLS = (
    "cli purge --status dead",
    "cli dead purge --all",
    "cli dead purge --topic",
    "admin.purge(status='dead')",
    "admin.dead_purge(everything)",
    "admin.dead_purge(topic)",
    "admin.dead_purge(ids)",
)
CLI = {
    "cli purge --status dead": ["purge", "--status", "dead", "--older-than", "0s"],
    "cli dead purge --all": ["dead", "purge", "--all"],
    "cli dead purge --topic": ["dead", "purge", "--topic", TOPIC],
}


class DeadHeads:
    def __init__(self, pool: asyncpg.Pool, dsn: str, keys: int = 30, die: float = 0.12):
        self.pool = pool
        self.dsn = dsn
        self.die = die
        self.next = {f"dead-{k}": 0 for k in range(keys)}  # each key's next seq
        self.ids: list[int] = []
        self.dying: list[int] = []
        self.purged: Counter[str] = Counter()  # events deleted, by tool
        self.rounds: Counter[str] = Counter()  # purges run, by tool

    async def _write(self, keys: list[str]) -> None:
        """One event for each of ``keys`` (in that order), in one statement."""
        events, dies = [], []
        for key in keys:
            dies.append(random.random() < self.die)
            payload = {"seq": self.next[key], "die": dies[-1]}
            self.next[key] += 1
            events.append(aiooutbox.NewEvent(TOPIC, payload, ordering_key=key))
        ids = await aiooutbox.enqueue_many(self.pool, events)
        assert all(i is not None for i in ids)
        self.ids += [i for i in ids if i is not None]
        self.dying += [i for i, d in zip(ids, dies, strict=True) if d and i is not None]

    async def produce(self, per_key: int) -> None:
        """``per_key`` events for each key, interleaved across keys."""
        for _ in range(per_key):
            await self._write(list(self.next))

    async def append(self, stop: asyncio.Event) -> None:
        """One or two events at a time to a random key, until ``stop``."""
        keys = list(self.next)
        while not stop.is_set():
            key = random.choice(keys)
            await self._write([key] * random.choice((1, 2)))
            await asyncio.sleep(0.02 + random.random() * 0.03)

    async def purge(self, stop: asyncio.Event) -> None:
        """Purge the dead events with each tool in turn, until ``stop``."""
        turn = 0
        while not stop.is_set():
            tool = TOOLS[turn % len(TOOLS)]
            turn += 1
            self.purged[tool] += await self._purge(tool)
            self.rounds[tool] += 1
            await asyncio.sleep(0.3 + random.random() * 0.7)

    async def _purge(self, tool: str) -> int:
        if tool in CLI:
            return await self._cli(CLI[tool])
        if tool == "admin.purge(status='dead')":
            return await admin.purge(self.pool, status="dead", older_than=0)
        if tool == "admin.dead_purge(everything)":
            return await admin.dead_purge(self.pool, everything=True)
        if tool == "admin.dead_purge(topic)":
            return await admin.dead_purge(self.pool, topic=TOPIC)
        ids = await self.pool.fetch(
            "SELECT id FROM outbox_events_all WHERE status = 'dead' LIMIT 50"
        )
        if not ids:
            return 0
        return await admin.dead_purge(self.pool, ids=[r["id"] for r in ids])

    async def _cli(self, args: list[str]) -> int:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "aiooutbox",
            *args,
            "--dsn",
            self.dsn,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=ROOT,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, (args, out, err)
        found = re.search(rb"deleted (\d+) dead event", out)
        assert found is not None, (args, out, err)
        return int(found[1])

    async def unaccounted(self) -> list[str]:
        """What does not add up at the end: each event of ``d`` is done, or it died and
        was purged; each purge deleted only those."""
        problems = []
        left = await self.pool.fetch(
            "SELECT id, status::text FROM outbox_events_all WHERE id = ANY($1)", self.ids
        )
        gone = set(self.ids) - {r["id"] for r in left}
        if gone != set(self.dying):
            problems.append(
                f"purged {sorted(gone - set(self.dying))[:10]} that did not die, left"
                f" {sorted(set(self.dying) - gone)[:10]} that did"
            )
        not_done = [dict(r) for r in left if r["status"] != "done"]
        if not_done:
            problems.append(f"events of {TOPIC} not done: {not_done[:10]}")
        deaths = await self.pool.fetchval(
            "SELECT count(DISTINCT event_id) FROM runs WHERE event_id = ANY($1)"
            " AND outcome = 'dead'",
            self.dying,
        )
        if deaths != len(self.dying):
            problems.append(f"{len(self.dying)} events to die, {deaths} ran and died")
        if sum(self.purged.values()) != len(self.dying):
            problems.append(f"purges deleted {dict(self.purged)}, {len(self.dying)} died")
        return problems


# events done without a successful run
NEVER_RAN = """
SELECT count(*) FROM outbox_events_all e WHERE e.status = 'done'
  AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.event_id = e.id AND r.outcome = 'ok')
"""
# runs of a freezing loop whose key another consumer ran during the freeze
HANDED_OVER = """
SELECT count(DISTINCT r.run) FROM stalls s JOIN runs r ON r.worker = s.worker
  AND r.started < s.ended AND s.started < coalesce(r.ended, 'infinity')
WHERE s.deliberate AND EXISTS (
    SELECT 1 FROM runs o WHERE o.okey = r.okey AND o.worker <> r.worker
      AND o.started BETWEEN s.started AND s.ended)
"""


async def freezes_measured(pool: asyncpg.Pool) -> dict[str, object]:
    """What the run log says about stalled loops and lapsed leases."""
    stalls = await pool.fetch(
        "SELECT worker, deliberate, count(*), round(max(extract(epoch FROM ended - started))"
        "::numeric, 2) AS longest FROM stalls GROUP BY 1, 2 ORDER BY 1, 2"
    )
    # last_error names the worker a lease recovery took the row from (of the rows still
    # there whose last error it was)
    recovered = await pool.fetch(
        "SELECT substring(last_error FROM 'worker (p[0-9])') AS worker, count(*)"
        " FROM outbox_events_all WHERE last_error LIKE 'lease expired%' GROUP BY 1 ORDER BY 1"
    )
    return {
        "stalls (worker, deliberate, count, longest s)": [tuple(r) for r in stalls],
        "runs of a frozen loop whose key ran elsewhere meanwhile": await pool.fetchval(HANDED_OVER),
        "events recovered from an expired lease, by worker": [tuple(r) for r in recovered],
        "events done that never ran": await pool.fetchval(NEVER_RAN),
    }


async def show(pool: asyncpg.Pool, runs: str) -> None:
    """Print every run of the keys (and producers) of the runs the query ``runs`` names,
    the events of those keys and the stalls of the loops: enough to tell what happened."""
    keys = f"SELECT x.okey, x.src FROM runs x WHERE x.run IN (SELECT run FROM ({runs}) y)"
    print(f"runs named: {[r[0] for r in await pool.fetch(f'SELECT run FROM ({runs}) y')]}")
    for r in await pool.fetch(
        f"SELECT r.* FROM runs r WHERE (r.okey, r.src) IN ({keys}) ORDER BY r.okey, r.started"
    ):
        print(dict(r))
    # the events themselves: last_error names a lease recovery and the worker it took the
    # row from, which tells a late settlement from a lost one
    for r in await pool.fetch(
        "SELECT e.id, e.status::text, e.attempts, e.locked_by, e.last_error"
        " FROM outbox_events_all e"
        f" WHERE e.ordering_key IN (SELECT okey FROM ({keys}) k) ORDER BY e.ordering_key, e.id"
    ):
        print(dict(r))
    for r in await pool.fetch("SELECT * FROM stalls ORDER BY started"):
        print(dict(r))
