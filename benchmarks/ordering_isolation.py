"""The speed targets of ordered delivery (issue 12) and topic isolation (issue 16).

``ordering``: (a) a drain of events spread over many keys vs the same count unordered;
(b) one key vs unordered; (c) a drain of other keys' events with one blocked key (its
head retrying far in the future, a large backlog waiting behind it) vs without.

``isolation``: (a) a drain of topic A with a large pending backlog of a topic B that no
consumer handles (older than A's events) vs without; (b) idle wake-up of an A event
with that backlog; (c) a consumer of many topics with a few rows each, the backlog in a
topic it does not handle, vs without; (d) several consumer processes draining one
table vs one, with double claims counted from the ids each process handled; (e)
COMMIT -> handler latency at light loads, aiooutbox and PgQueuer.

Every ratio is of medians over rounds that alternate the variants in one run. The
fixtures (the blocked key, the B backlog) live in databases of their own, built once
and kept across the rounds (`System.keep_loaded`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

from . import aiooutbox_runner
from .common import TOPIC, BackendCpu, child_process, median, ratio

if TYPE_CHECKING:
    from .scenarios import Bench

AIO = aiooutbox_runner.NAME
BLOCKED_KEY = "blocked"
OTHER_TOPIC = "unconsumed"  # the topic with the backlog no consumer handles


def _keyed(system: aiooutbox_runner.System, keys: int) -> tuple[str, str]:
    """Columns and values of ``insert_series`` for no-op events over ``keys`` keys
    (event g has key g % keys), each key's first event its head and the rest waiting:
    what the insert trigger decides, written out (load with ``order_trigger=False``).
    Left to the trigger, a bulk load is quadratic on a freshly emptied table (its head
    check was planned for an empty table: a scan of the rows inserted so far) and costs
    a full scan per head beside the blocked key (ordering_key's statistics say one key
    is the whole table, so the check's generic plan is a sequential scan: 150 ms per row
    at 1M, measured with EXPLAIN (ANALYZE, BUFFERS))."""
    status = f"(CASE WHEN g <= {keys} THEN 'pending' ELSE 'waiting' END)::{system.q.status_type}"
    return (
        "topic, payload, ordering_key, status",
        f"'{TOPIC}', jsonb_build_object('i', g), 'k' || (g % {keys}), {status}",
    )


def _rates(runs: list[dict[str, Any]], variant: str) -> float:
    return median([r["rate"] for r in runs if r["variant"] == variant and "error" not in r])


async def _rounds(
    bench: Bench, rounds: int, variants: list[tuple[str, Any]], **drain: Any
) -> list[dict[str, Any]]:
    """Drain each variant once per round, the order rotating by round. A variant is
    (label, (system, n, loader, settings))."""
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        shift = r % len(variants)
        for label, (system, n, loader, settings) in variants[shift:] + variants[:shift]:
            run = await bench.drain_once(
                system, n, settings, label=f"{label:14} ", loader=loader, **drain
            )
            run["variant"] = label
            runs.append({k: v for k, v in run.items() if k != "rss"})
    return runs


async def _fixture(bench: Bench, name: str) -> aiooutbox_runner.System:
    system = aiooutbox_runner.System(
        bench.admin_dsn, bench.prefix + name, sql_patch=bench.config.sql_patch
    )
    bench.extra_systems.append(system)
    await system.setup()
    return system


# -- ordering ------------------------------------------------------------------------------
async def ordering(bench: Bench) -> None:
    config, aio = bench.config, bench.systems[AIO]
    settings = bench.settings[AIO]
    n, keys, one = config.ordering_size, config.ordering_keys, config.ordering_one_key
    bench.log(f"ordering: {n:,} events over {keys:,} keys / {one:,} on one key / {n:,} unordered")

    async def keyed(count: int, nkeys: int) -> None:
        await aio.insert_series(count, *_keyed(aio, nkeys), order_trigger=False)

    async def load_keyed() -> None:
        await keyed(n, keys)

    async def load_one() -> None:
        await keyed(one, 1)

    runs = await _rounds(
        bench,
        config.ordering_rounds,
        [
            ("unordered", (aio, n, None, settings)),
            ("keyed", (aio, n, load_keyed, settings)),
            ("one_key", (aio, one, load_one, settings)),
        ],
    )
    rates = {v: _rates(runs, v) for v in ("unordered", "keyed", "one_key")}

    # (c) one blocked key: its head retries in 30 days, the backlog waits behind it
    backlog, others, other_keys = config.blocked_backlog, config.blocked_others, config.blocked_keys
    bench.log(f"  building the blocked key: 1 head + {backlog:,} waiting events")
    blocked = await _fixture(bench, "aiooutbox_blocked")
    t = time.perf_counter()
    q = blocked.q
    await blocked.insert_series(
        1,
        "topic, payload, ordering_key, status, attempts, available_at, last_error",
        f"'{TOPIC}', '{{}}', '{BLOCKED_KEY}', 'retry', 1, now() + interval '30 days',"
        " 'the failing head of a blocked key'",
        order_trigger=False,
    )
    await blocked.insert_series(
        backlog,
        "topic, payload, ordering_key, status",
        f"'{TOPIC}', jsonb_build_object('i', g), '{BLOCKED_KEY}', 'waiting'",
        order_trigger=False,
    )
    await blocked.keep_loaded()
    build_s = time.perf_counter() - t
    bench.log(f"  built in {build_s:.1f}s")

    async def others_on(system: aiooutbox_runner.System) -> None:
        await system.insert_series(others, *_keyed(system, other_keys), order_trigger=False)

    async def load_plain() -> None:
        await others_on(aio)

    async def load_blocked() -> None:
        await others_on(blocked)

    blocked_runs = await _rounds(
        bench,
        config.blocked_rounds,
        [
            ("no_blocked", (aio, others, load_plain, settings)),
            ("blocked", (blocked, others, load_blocked, settings)),
        ],
    )
    still = await blocked.execute(
        f"SELECT 1 FROM {q.qualified} WHERE ordering_key = $1 AND status = 'waiting'",
        BLOCKED_KEY,
    )
    blocked_rates = {v: _rates(blocked_runs, v) for v in ("no_blocked", "blocked")}
    out: dict[str, Any] = {
        "size": n,
        "keys": keys,
        "one_key_size": one,
        "runs": runs,
        "rates": {k: round(v, 1) for k, v in rates.items()},
        "ratios": {
            "keyed_vs_unordered": round(ratio(rates["keyed"], rates["unordered"]), 3),
            "one_key_vs_unordered": round(ratio(rates["one_key"], rates["unordered"]), 3),
            "blocked_vs_none": round(
                ratio(blocked_rates["blocked"], blocked_rates["no_blocked"]), 3
            ),
        },
        "blocked": {
            "backlog": backlog,
            "others": others,
            "other_keys": other_keys,
            "build_s": round(build_s, 1),
            "backlog_left": int(still.split()[-1]),
            "runs": blocked_runs,
            "rates": {k: round(v, 1) for k, v in blocked_rates.items()},
        },
    }
    bench.results["ordering"] = out
    bench.log(
        "  keyed/unordered = {keyed_vs_unordered:.3f}, one key/unordered = "
        "{one_key_vs_unordered:.3f}, blocked/none = {blocked_vs_none:.3f}".format(**out["ratios"])
    )


# -- isolation -----------------------------------------------------------------------------
async def isolation(bench: Bench) -> None:
    config, aio = bench.config, bench.systems[AIO]
    settings = bench.settings[AIO]
    backlog, n = config.isolation_backlog, config.isolation_size
    bench.log(f"isolation: {backlog:,} pending events of a topic nobody consumes")
    fixture = await _fixture(bench, "aiooutbox_backlog")
    t = time.perf_counter()
    await fixture.insert_series(
        backlog, "topic, payload", f"'{OTHER_TOPIC}', jsonb_build_object('i', g)"
    )
    await fixture.keep_loaded()
    build_s = time.perf_counter() - t
    bench.log(f"  built in {build_s:.1f}s")
    out: dict[str, Any] = {"backlog": backlog, "build_s": round(build_s, 1)}

    # (a) drain A with and without the B backlog (older than A's events)
    runs = await _rounds(
        bench,
        config.isolation_rounds,
        [("no_backlog", (aio, n, None, settings)), ("backlog", (fixture, n, None, settings))],
    )
    rates = {v: _rates(runs, v) for v in ("no_backlog", "backlog")}
    out["drain"] = {
        "size": n,
        "runs": runs,
        "rates": {k: round(v, 1) for k, v in rates.items()},
        "ratio": round(ratio(rates["backlog"], rates["no_backlog"]), 3),
    }
    bench.log(f"  drain A with/without the backlog = {out['drain']['ratio']:.3f}")

    # (b) idle wake-up of an A event, with and without the backlog
    out["wakeup"] = {}
    for label, system in (("backlog", fixture), ("no_backlog", aio)):
        out["wakeup"][label] = await bench.wakeup_once(system, settings)
        lat = out["wakeup"][label]["latency_ms"]
        bench.log(
            f"  wake-up {label:10} p50 {lat.get('p50')} ms, p99 {lat.get('p99')} ms "
            f"(n={lat.get('n')})"
        )

    # (c) a consumer of many topics with a few rows each; the backlog in one more
    topics = [f"t{i:02d}" for i in range(config.isolation_topics)]
    per = config.isolation_per_topic
    many = {**settings, "topics": topics}

    def load_topics(system: aiooutbox_runner.System) -> Any:
        async def load() -> None:
            await system.insert_series(
                len(topics) * per,
                "topic, payload",
                f"'t' || lpad(((g - 1) % {len(topics)})::text, 2, '0'), jsonb_build_object('i', g)",
            )

        return load

    count = len(topics) * per
    topic_runs = await _rounds(
        bench,
        config.isolation_topic_rounds,
        [
            ("no_backlog", (aio, count, load_topics(aio), many)),
            ("backlog", (fixture, count, load_topics(fixture), many)),
        ],
    )
    topic_rates = {v: _rates(topic_runs, v) for v in ("no_backlog", "backlog")}
    elapsed = {
        v: median([r["elapsed_s"] for r in topic_runs if r["variant"] == v])
        for v in ("no_backlog", "backlog")
    }
    out["topics"] = {
        "topics": len(topics),
        "per_topic": per,
        "runs": topic_runs,
        "rates": {k: round(v, 1) for k, v in topic_rates.items()},
        "elapsed_s": {k: round(v, 3) for k, v in elapsed.items()},
        "ratio": round(ratio(topic_rates["backlog"], topic_rates["no_backlog"]), 3),
    }
    bench.log(f"  {len(topics)} topics x {per}, with/without = {out['topics']['ratio']:.3f}")

    # (d) several consumer processes on one table vs one
    out["processes"] = await processes(bench)

    # (e) COMMIT -> handler at light loads, both systems
    light: list[dict[str, Any]] = []
    for i, rate in enumerate(config.light_rates):
        for name in (AIO, "pgqueuer") if i % 2 == 0 else ("pgqueuer", AIO):
            run = await bench.steady_once(
                bench.systems[name], None, rate, seconds=config.light_seconds
            )
            light.append({k: v for k, v in run.items() if k != "latency_series"})
    out["light"] = light
    bench.results["isolation"] = out


async def processes(bench: Bench) -> dict[str, Any]:
    """Drain one table with 1 and with ``multi_processes`` consumer processes, rounds
    alternating; rate = events / (last handler start - first), over all processes."""
    config, aio = bench.config, bench.systems[AIO]
    n, many = config.multi_size, config.multi_processes
    bench.log(f"  {many} consumer processes vs 1, draining {n:,}")
    await aio.execute(
        f"CREATE TABLE IF NOT EXISTS {aiooutbox_runner.HANDLED_TABLE} (id bigint, pid int)"
    )
    runs: list[dict[str, Any]] = []
    for r in range(config.multi_rounds):
        for count in (1, many) if r % 2 == 0 else (many, 1):
            runs.append(await _drain_by(bench, count, n))
    rates = {c: median([x["rate"] for x in runs if x["processes"] == c]) for c in (1, many)}
    return {
        "size": n,
        "processes": many,
        "runs": runs,
        "rates": {str(k): round(v, 1) for k, v in rates.items()},
        "ratio": round(ratio(rates[many], rates[1]), 3),
        "double_claims": sum(x["double_handled"] for x in runs),
        "reclaimed": sum(x["reclaimed"] for x in runs),
    }


async def _drain_by(bench: Bench, count: int, n: int) -> dict[str, Any]:
    aio = bench.systems[AIO]
    await aio.reset()
    await aio.execute(f"TRUNCATE {aiooutbox_runner.HANDLED_TABLE}")
    await aio.load(n)
    settings = {**bench.settings[AIO], "record_ids": True}
    spec = bench._spec(aio, "serve", settings, times=True)
    q = aio.q
    async with (
        BackendCpu(bench.admin_dsn, aio.database) as cpu,
        contextlib.AsyncExitStack() as stack,
    ):
        entered = [await stack.enter_async_context(child_process(spec)) for _ in range(count)]
        await asyncio.gather(*(c.wait_ready() for c in entered))
        deadline = time.monotonic() + max(120.0, n / 500)
        conn = await aio.connect()
        try:
            while time.monotonic() < deadline:
                left = await conn.fetchval(
                    f"SELECT EXISTS (SELECT 1 FROM {q.qualified}"
                    "  WHERE status IN ('pending', 'retry'))"
                    f" OR EXISTS (SELECT 1 FROM {q.qualified} WHERE status = 'processing')"
                )
                if not left:
                    break
                await asyncio.sleep(0.05)
        finally:
            await conn.close()
        for c in entered:
            c.send(stop_after=0, timeout=5)
        results = [await c.result(timeout=60) for c in entered]
    conn = await aio.connect()
    try:
        double = await conn.fetchval(
            f"SELECT count(*) FROM (SELECT id FROM {aiooutbox_runner.HANDLED_TABLE}"
            " GROUP BY id HAVING count(*) > 1) AS d"
        )
        distinct = await conn.fetchval(
            f"SELECT count(DISTINCT id) FROM {aiooutbox_runner.HANDLED_TABLE}"
        )
        reclaimed = await conn.fetchval(f"SELECT count(*) FROM {q.qualified} WHERE attempts > 1")
    finally:
        await conn.close()
    handled = [r["handled"] for r in results]
    first = min(r["t_first"] for r in results if r["handled"])
    last = max(r["t_last"] for r in results)
    run = {
        "processes": count,
        "size": n,
        "handled": handled,
        "distinct_handled": distinct,
        "double_handled": double,
        "reclaimed": reclaimed,
        "finished": await aio.finished(),
        "elapsed_s": round(last - first, 3),
        "rate": round(sum(handled) / (last - first), 1) if last > first else 0.0,
        "client_cpu_s": round(sum(r["cpu_s"] for r in results), 3),
        "db_cpu_s": cpu.seconds,
    }
    if run["finished"] != n or distinct != n:
        run["error"] = f"{run['finished']} finished, {distinct} distinct handled, of {n}"
    bench.log(
        f"    {count} process(es): {run['rate']:>9,.0f}/s ({run['elapsed_s']:.2f}s, "
        f"handled {handled}, double {double}, re-claimed {reclaimed})"
        + (f" {run['error']}" if "error" in run else "")
    )
    return run
