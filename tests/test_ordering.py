"""Ordered delivery per key (``ordering_key``), against a real PostgreSQL.

The run log is written by the handlers themselves (a row when a run starts, completed
when it ends) and checked with SQL: no two runs of a key overlap, and every run of an
event starts after a successful run of each earlier event of its key has ended (or a
run in which it died, for a key that a purge of its dead head moved on). A run that was
going on while its process's event loop stood still (``stalls``) is the one repeat the
guarantees allow to overlap what ran elsewhere meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time

import asyncpg
import pytest

import aiooutbox
from aiooutbox.errors import InvalidArgument
from tests.faults.ordered_moves_proc import MOVES_DDL
from tests.faults.ordered_proc import RUNS_DDL
from tests.helpers import all_in, running, status_counts, truthy, wait_until
from tests.ordered_moves import DeadHeads, freezes_measured, show
from tests.ordered_producers import SideTraffic

FAST = aiooutbox.RetryPolicy(base=0.02, max_delay=0.1)

# runs going on while their process's loop stood still for half its lease or longer
FROZEN = """frozen AS (SELECT DISTINCT r.run FROM runs r JOIN stalls s ON s.worker = r.worker
    AND s.started < coalesce(r.ended, 'infinity') AND r.started < s.ended)"""
# runs that overlap in time another run of their key (killed runs, never ended, are left
# out, and so are the runs a stalled loop held up)
OVERLAPPING = f"""WITH {FROZEN}
SELECT unnest(ARRAY[a.run, b.run]) AS run FROM runs a JOIN runs b ON a.okey = b.okey
WHERE a.run < b.run AND a.ended IS NOT NULL AND b.ended IS NOT NULL
  AND a.started < b.ended AND b.started < a.ended
  AND a.run NOT IN (SELECT run FROM frozen) AND b.run NOT IN (SELECT run FROM frozen)
"""
# runs that started before a successful run of an earlier event of their key had ended
# (earlier: a lower seq from the same producer, `src`; producers of one key that do not
# serialize with each other get some order between them, never an overlap); a run in
# which the event died counts as its end (a purge of the dead head moved the key on)
OUT_OF_ORDER = """
SELECT r.run FROM runs r
WHERE EXISTS (
    SELECT 1 FROM runs p WHERE p.okey = r.okey AND p.src = r.src AND p.seq < r.seq
    GROUP BY p.event_id
    HAVING NOT bool_or(p.outcome IN ('ok', 'dead') AND p.ended <= r.started))
   OR EXISTS (  -- an earlier event of the key that never ran to its end at all
    SELECT 1 FROM generate_series(0, r.seq - 1) AS s(seq)
    WHERE NOT EXISTS (SELECT 1 FROM runs p WHERE p.okey = r.okey AND p.src = r.src
                      AND p.seq = s.seq AND p.outcome IN ('ok', 'dead')
                      AND p.ended <= r.started))
"""
# runs started while the database showed their row as not this worker's, or not
# processing (a consumer starting more of a claim after its lease lapsed)
UNHELD = f"""WITH {FROZEN}
SELECT r.run FROM runs r WHERE r.held IS NOT TRUE AND r.run NOT IN (SELECT run FROM frozen)
"""


async def _count(pool: asyncpg.Pool, runs: str) -> int:
    """How many runs the query ``runs`` names."""
    got: int = await pool.fetchval(f"SELECT count(DISTINCT run) FROM ({runs}) x")
    return got


async def _produce(pool: asyncpg.Pool, keys: int, per_key: int) -> None:
    # interleaved across keys, in order within each key
    events = [
        aiooutbox.NewEvent("t", {"seq": seq}, ordering_key=f"key-{k}")
        for seq in range(per_key)
        for k in range(keys)
    ]
    for i in range(0, len(events), 2000):
        await aiooutbox.enqueue_many(pool, events[i : i + 2000])


async def _check(pool: asyncpg.Pool) -> None:
    assert await _count(pool, OVERLAPPING) == 0
    assert await _count(pool, OUT_OF_ORDER) == 0


@pytest.fixture
async def runs(pool: asyncpg.Pool) -> asyncpg.Pool:
    await pool.execute(RUNS_DDL)
    await pool.execute(MOVES_DDL)
    return pool


def _recorder(pool: asyncpg.Pool, fail_rate: float = 0.0) -> aiooutbox.HandlerFunc:
    async def handle(event: aiooutbox.Event) -> None:
        run = await pool.fetchval(
            "INSERT INTO runs (event_id, okey, seq, worker, attempt) VALUES ($1, $2, $3, 'w', $4)"
            " RETURNING run",
            event.id,
            event.ordering_key,
            event.payload["seq"],
            event.attempts,
        )
        await asyncio.sleep(random.random() * 0.003)
        fail = event.attempts == 1 and random.random() < fail_rate
        await pool.execute(
            "UPDATE runs SET ended = clock_timestamp(), outcome = $2 WHERE run = $1",
            run,
            "failed" if fail else "ok",
        )
        if fail:
            raise RuntimeError("first attempt fails")

    return handle


async def test_keys_run_in_order_one_at_a_time_across_consumers(runs: asyncpg.Pool) -> None:
    await _produce(runs, keys=40, per_key=15)
    consumers = [
        aiooutbox.OutboxConsumer(runs, concurrency=32, retry=FAST, worker_id=f"c{i}")
        for i in range(3)
    ]
    handler = _recorder(runs, fail_rate=0.1)
    async with (
        running(consumers[0], {"t": handler}),
        running(consumers[1], {"t": handler}),
        running(consumers[2], {"t": handler}),
    ):
        await wait_until(all_in(runs, "done", 600), timeout=90)
    await _check(runs)
    failed = await runs.fetchval("SELECT count(*) FROM runs WHERE outcome = 'failed'")
    assert failed > 0  # the failures really happened, and order held through them


async def test_unordered_events_are_unaffected(runs: asyncpg.Pool) -> None:
    ids = await aiooutbox.enqueue_many(runs, [aiooutbox.NewEvent("u", i) for i in range(50)])
    seen: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        assert event.ordering_key is None
        seen.append(event.id)

    async with running(aiooutbox.OutboxConsumer(runs), {"u": handle}):
        await wait_until(all_in(runs, "done", 50))
    assert sorted(seen) == ids


async def test_a_dead_head_lets_its_key_move_on_by_default(runs: asyncpg.Pool) -> None:
    poison = await aiooutbox.enqueue(runs, "t", {"seq": 0}, ordering_key="k", max_attempts=2)
    later = await aiooutbox.enqueue(runs, "t", {"seq": 1}, ordering_key="k")
    seen: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        if event.id == poison:
            raise RuntimeError("never works")
        seen.append(event.id)

    async with running(aiooutbox.OutboxConsumer(runs, retry=FAST), {"t": handle}):
        await wait_until(truthy(lambda: seen == [later]), timeout=20)
    assert await status_counts(runs) == {"dead": 1, "done": 1}


async def test_a_dead_head_blocks_its_key_when_the_handler_says_so(runs: asyncpg.Pool) -> None:
    poison = await aiooutbox.enqueue(runs, "t", {"seq": 0}, ordering_key="k", max_attempts=2)
    later = await aiooutbox.enqueue_many(
        runs,
        [aiooutbox.NewEvent("t", {"seq": n}, ordering_key="k") for n in (1, 2)]
        + [aiooutbox.NewEvent("t", {"seq": 0}, ordering_key="other")],
    )
    seen: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        if event.id == poison:
            raise aiooutbox.Dead("bad data")
        seen.append(event.id)

    handlers = {"t": aiooutbox.Handler(handle, on_dead="block")}
    async with running(aiooutbox.OutboxConsumer(runs, retry=FAST, poll_interval=0.1), handlers):
        await wait_until(truthy(lambda: seen == [later[2]]), timeout=20)
        await asyncio.sleep(0.5)  # several polls: the blocked key stays blocked
        assert seen == [later[2]]
        assert await status_counts(runs) == {"dead": 1, "done": 1, "waiting": 2}
        # the operator retries the dead head: the key resumes, in order
        await runs.execute(
            "UPDATE outbox_events SET status = 'pending', attempts = 0, blocks_key = false,"
            " available_at = now() WHERE id = $1",
            poison,
        )
        await runs.execute("SELECT * FROM outbox_events_promote(ARRAY['k'])")

        async def handle_fixed(event: aiooutbox.Event) -> None:
            seen.append(event.id)

        # (the handler is looked up per event: swap in a fixed one)
        handlers["t"] = aiooutbox.Handler(handle_fixed, on_dead="block")
    consumer = aiooutbox.OutboxConsumer(runs, retry=FAST)
    async with running(consumer, {"t": handlers["t"]}):
        await wait_until(all_in(runs, "done", 4), timeout=20)
    assert seen == [later[2], poison, later[0], later[1]]


async def test_a_delayed_event_holds_back_the_rest_of_its_key(runs: asyncpg.Pool) -> None:
    first = await aiooutbox.enqueue(runs, "t", {"seq": 0}, ordering_key="k", delay=1.0)
    second = await aiooutbox.enqueue(runs, "t", {"seq": 1}, ordering_key="k")
    seen: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        seen.append(event.id)

    async with running(aiooutbox.OutboxConsumer(runs, poll_interval=0.2), {"t": handle}):
        await asyncio.sleep(0.5)
        assert seen == []
        await wait_until(truthy(lambda: seen == [first, second]), timeout=20)


async def test_a_raw_sql_producer_sets_the_ordering_key(runs: asyncpg.Pool) -> None:
    for n in range(5):
        await runs.execute(
            "INSERT INTO outbox_events (topic, payload, ordering_key) VALUES ('t', $1, 'raw')",
            json.dumps({"seq": n}),
        )
    assert await status_counts(runs) == {"pending": 1, "waiting": 4}
    seq: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        seq.append(event.payload["seq"])

    async with running(aiooutbox.OutboxConsumer(runs), {"t": handle}):
        await wait_until(all_in(runs, "done", 5))
    assert seq == [0, 1, 2, 3, 4]


async def test_producers_serialized_on_an_aggregate_are_handled_in_commit_order(
    runs: asyncpg.Pool,
) -> None:
    await runs.execute("CREATE TABLE orders (id int PRIMARY KEY, version int NOT NULL)")
    await runs.execute("INSERT INTO orders VALUES (42, 0)")

    async def produce() -> None:
        async with runs.acquire() as conn, conn.transaction():
            version = await conn.fetchval(
                "UPDATE orders SET version = version + 1 WHERE id = 42 RETURNING version"
            )
            await asyncio.sleep(random.random() * 0.01)
            await aiooutbox.enqueue(conn, "t", {"version": version}, ordering_key="order-42")

    await asyncio.gather(*(produce() for _ in range(16)))
    versions: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        versions.append(event.payload["version"])

    async with running(aiooutbox.OutboxConsumer(runs, concurrency=16), {"t": handle}):
        await wait_until(all_in(runs, "done", 16))
    assert versions == list(range(1, 17))


async def test_enqueue_many_keeps_input_order_within_a_key(runs: asyncpg.Pool) -> None:
    events = [
        aiooutbox.NewEvent("t", {"seq": n}, ordering_key="k", dedupe_key=f"d{9 - n}")
        for n in range(10)
    ]
    ids = await aiooutbox.enqueue_many(runs, events)
    inserted = [i for i in ids if i is not None]
    # ids follow input order within the key, whatever the dedupe keys
    assert inserted == ids and ids == sorted(inserted)
    seq: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        seq.append(event.payload["seq"])

    async with running(aiooutbox.OutboxConsumer(runs), {"t": handle}):
        await wait_until(all_in(runs, "done", 10))
    assert seq == list(range(10))


@pytest.mark.parametrize(
    ("key", "error", "message"),
    [
        (42, TypeError, "ordering_key must be a str or None"),
        ("", InvalidArgument, "ordering_key must not be empty"),
        ("x" * 513, InvalidArgument, "ordering_key must be at most 512 bytes"),
        ("é" * 300, InvalidArgument, "ordering_key must be at most 512 bytes"),
        ("a\x00b", InvalidArgument, "without NUL"),
        ("\udcff", InvalidArgument, "ordering_key is not valid Unicode"),
    ],
)
async def test_bad_ordering_keys_are_refused_before_anything_is_written(
    pool: asyncpg.Pool, key: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        await aiooutbox.enqueue(pool, "t", {}, ordering_key=key)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", {}, ordering_key=key)])  # type: ignore[arg-type]
    assert await pool.fetchval("SELECT count(*) FROM outbox_events_all") == 0


@pytest.mark.slow
@pytest.mark.timeout(240)  # 60-110 s on a shared 2-core machine, ~170 s beside a copy
async def test_order_holds_through_a_sigkilled_consumer_process(
    dsn: str, runs: asyncpg.Pool
) -> None:
    """150 keys x 40 events, three consumer processes (concurrency 64 each), 10% of first
    attempts failing; one process is SIGKILLed mid-run and replaced, and another blocks
    its event loop (``time.sleep`` in a handler) for three times its lease every few
    seconds, so lease recovery hands its keys to the others. Meanwhile producers at READ
    COMMITTED, REPEATABLE READ and SERIALIZABLE write to four more keys at once, with
    snapshots taken while the consumers claim and settle those keys, a raw SQL producer
    tries every status (`SideTraffic`), and 30 keys of topic ``d`` block behind events
    that die (``on_dead="block"``) while an operator purges the dead heads with each of
    the CLI's and `admin`'s tools in turn (`DeadHeads`)."""
    await _produce(runs, keys=150, per_key=40)
    heads = DeadHeads(runs, dsn)
    await heads.produce(per_key=20)
    procs: dict[str, asyncio.subprocess.Process] = {}

    async def start(name: str, **extra: object) -> asyncio.subprocess.Process:
        config = {"dsn": dsn, "worker_id": name, "concurrency": 64, "lease_timeout": 3}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.faults.ordered_moves_proc",
            json.dumps({**config, **extra}),
            stdout=asyncio.subprocess.PIPE,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 60)).strip() == b"READY"
        procs[name] = proc
        return proc

    traffic = SideTraffic(runs)
    stop = asyncio.Event()  # the producers stop
    drained = asyncio.Event()  # the operator stops purging
    side: list[asyncio.Future[None]] = []
    finished: str | None = None
    began = time.monotonic()
    phases: dict[str, float] = {}  # seconds from the start
    drain = float("nan")

    async def moves_done(done: int) -> bool:
        for task in side:
            if task.done():
                task.result()  # a producer or the operator failed: say how, now
        freezes = await runs.fetchval("SELECT count(*) FROM stalls WHERE deliberate")
        return freezes >= 3 and heads.purged.total() >= 10 and await _done_at_least(runs, done)

    try:
        victim = await start("p0")
        await start("p1")
        # the freezer: a lease of 2 s, and the loop blocked 6 s once 5 s passed since
        await start("p2", lease_timeout=2, freeze_every=5, freeze_seconds=6)
        side += [
            asyncio.ensure_future(traffic.run(stop)),
            asyncio.ensure_future(heads.append(stop)),
            asyncio.ensure_future(heads.purge(drained)),
        ]
        await wait_until(lambda: _done_at_least(runs, 1500), timeout=120, interval=0.05)
        phases["kill"] = time.monotonic() - began
        victim.send_signal(signal.SIGKILL)
        await victim.wait()
        await start("p3")
        await wait_until(lambda: moves_done(4500), timeout=150, interval=0.2)
        phases["producers stop"] = time.monotonic() - began
        stop.set()
        await asyncio.wait_for(asyncio.gather(*side[:2]), 120)
        total = 6_000 + traffic.accepted + len(heads.ids)
        expected = {"done": total - len(heads.dying)}

        async def all_done() -> bool:
            if side[2].done():
                side[2].result()
            return await status_counts(runs) == expected

        try:
            drain = await wait_until(all_done, timeout=150, interval=0.5)
            phases["drained"] = time.monotonic() - began
        except AssertionError as exc:
            finished = str(exc)
    finally:
        stop.set()
        drained.set()
        if side:
            await asyncio.wait_for(asyncio.gather(*side, return_exceptions=True), 120)
        for proc in procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            await asyncio.wait_for(proc.wait(), 60)
    side[2].result()  # the operator's purges all went through
    lapses = {name: await _last_words(proc) for name, proc in procs.items()}
    killed = await runs.fetchval("SELECT count(*) FROM runs WHERE ended IS NULL")
    overlaps = await _count(runs, OVERLAPPING)
    out_of_order = await _count(runs, OUT_OF_ORDER)
    unheld = await _count(runs, UNHELD)
    measured = await freezes_measured(runs)
    left = await status_counts(runs)
    problems = await heads.unaccounted()
    phases["checked"] = time.monotonic() - began
    print(
        f"runs cut short by the kill: {killed}; side events {traffic.accepted}, stale snapshots"
        f" refused {traffic.refusals} {traffic.kinds}, raw statuses refused"
        f" {traffic.raw_refused}; freezes and lapsed leases by process {lapses}, {measured};"
        f" events of d {len(heads.ids)}, dead heads {len(heads.dying)}, purged"
        f" {dict(heads.purged)} in {dict(heads.rounds)} rounds; drained in {drain:.1f} s"
        f" (seconds from the start: {phases}); overlapping runs {overlaps}, out of order"
        f" {out_of_order}, started on a row not held {unheld}; statuses {left}"
    )
    for count, query in ((overlaps, OVERLAPPING), (out_of_order, OUT_OF_ORDER), (unheld, UNHELD)):
        if count:
            await show(runs, query)
    assert (overlaps, out_of_order) == (0, 0), "two runs of a key overlapped, or ran out of order"
    # (`seen` tells what the database showed. Seen once in 16 runs, `done` before the run:
    # a lapsed claim's outcome of a run member, whose attempt recovery gave back, was
    # being written as this consumer claimed the row again at the same attempt; the
    # settle's UPDATE waited for the claim's row locks and landed on the new claim, and
    # its reply was read before the claim's, so the hand-out no longer saw it. The
    # claim now keeps the writes that end while it is under way and does not start such
    # a row; tests/test_stale_outcomes.py forces that order)
    assert unheld == 0, "a handler started on a row its worker no longer held"
    assert finished is None and left == expected, f"events left unhandled: {left} ({expected})"
    assert measured["events done that never ran"] == 0 and problems == [], problems
    assert traffic.unexpected == [], traffic.unexpected[:5]
    # the stale snapshots did happen, and were refused rather than trusted
    assert traffic.kinds["head"] + traffic.kinds["snapshot"] > 0, traffic.kinds
    assert traffic.raw_refused > 0
    # the freezes did hand keys over to the other consumers
    handed_over = measured["runs of a frozen loop whose key ran elsewhere meanwhile"]
    assert lapses["p2"]["freezes"] >= 3 and handed_over, (lapses["p2"], handed_over)


async def _last_words(proc: asyncio.subprocess.Process) -> dict[str, int]:
    """The counts a consumer process of `tests.faults.ordered_moves_proc` prints as it
    stops (none from a killed one)."""
    assert proc.stdout is not None
    lines = (await proc.stdout.read()).splitlines()
    return json.loads(lines[-1]) if lines else {}


async def _done_at_least(pool: asyncpg.Pool, n: int) -> bool:
    got = await pool.fetchval("SELECT count(*) FROM outbox_events_all WHERE status = 'done'")
    return bool(got >= n)


async def test_stats_reports_blocked_keys_and_dead_retry_resumes_them(
    runs: asyncpg.Pool,
) -> None:
    from aiooutbox import admin

    head = await aiooutbox.enqueue(runs, "t", {"seq": 0}, ordering_key="k", max_attempts=1)
    assert head is not None
    behind = await aiooutbox.enqueue_many(
        runs, [aiooutbox.NewEvent("t", {"seq": n}, ordering_key="k") for n in (1, 2)]
    )
    seen: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        if event.id == head and not seen:
            raise RuntimeError("poison")
        seen.append(event.id)

    handlers = {"t": aiooutbox.Handler(handle, on_dead="block")}
    async with running(aiooutbox.OutboxConsumer(runs, poll_interval=0.1), handlers):
        await wait_until(lambda: _status_is(runs, head, "dead"), timeout=20)
        report = await admin.stats(runs)
        assert [(b.ordering_key, b.head_id, b.status, b.waiting) for b in report.blocked_keys] == [
            ("k", head, "dead", 2)
        ]
        assert report.as_dict()["blocked_keys"][0]["head_id"] == head
        assert report.totals["waiting"] == 2
        seen.append(-1)  # from now on the head succeeds
        assert await admin.dead_retry(runs, ids=[head]) == {"t": 1}
        await wait_until(all_in(runs, "done", 3), timeout=20)
    assert seen == [-1, head, *behind]
    assert (await admin.stats(runs)).blocked_keys == []


async def test_purging_a_blocking_dead_head_lets_the_key_move_on(runs: asyncpg.Pool) -> None:
    from aiooutbox import admin

    head = await aiooutbox.enqueue(runs, "t", {"seq": 0}, ordering_key="k")
    later = await aiooutbox.enqueue(runs, "t", {"seq": 1}, ordering_key="k")
    assert head is not None
    await runs.execute(
        "UPDATE outbox_events SET status = 'dead', blocks_key = true WHERE id = $1", head
    )
    assert await admin.dead_purge(runs, ids=[head]) == 1
    assert await runs.fetchval(
        "SELECT status::text FROM outbox_events_all WHERE id = $1", later
    ) == ("pending")


async def _status_is(pool: asyncpg.Pool, event_id: int, status: str) -> bool:
    got = await pool.fetchval("SELECT status::text FROM outbox_events_all WHERE id = $1", event_id)
    return bool(got == status)


async def test_the_insert_trigger_reads_the_key_index_beside_a_big_key(pool: asyncpg.Pool) -> None:
    """Regression: beside one key with a large backlog the statistics say that key fills
    the table, and the trigger's head check became a sequential scan (150 ms per ordered
    insert beside 1M rows)."""
    from aiooutbox._sql.plans import nested_plans
    from aiooutbox._sql.statements import queries

    for _ in range(4):
        await aiooutbox.enqueue_many(
            pool, [aiooutbox.NewEvent("t", {}, ordering_key="big") for _ in range(1000)]
        )
    await pool.execute("ANALYZE outbox_events")
    q = queries()
    insert = f"INSERT INTO {q.qualified} (topic, payload, ordering_key) VALUES ('t', '{{}}', $1)"
    async with pool.acquire() as conn:
        plans = await nested_plans(conn, q, [("insert", insert, ("big",))])
    assert "outbox_events_key_idx" in plans["insert"], plans
    assert "Seq Scan" not in plans["insert"], plans
