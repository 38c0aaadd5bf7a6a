"""``ordering``: the speed targets of ordered delivery. (a) A drain of events spread over
many keys against the same count unordered; (b) one key against unordered; (c) a drain
of other keys' events beside one blocked key (its head retrying far in the future, a
large backlog waiting behind it) against without.

Every ratio is of medians over rounds that alternate the variants in one run. The
blocked key lives in a database of its own, built once and kept across the rounds
(`System.keep_loaded`). Its rates are in the table isolation renders
(`isolation.section`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..harness.bench import AIO, Bench
from ..harness.databases import TOPIC
from ..harness.markdown import at_least, fmt
from ..harness.rounds import drain_rounds, make_fixture, median_rate
from ..harness.scenario import Scenario, sizes_of
from ..harness.stats import ratio
from ..systems import aiooutbox_runner

BLOCKED_KEY = "blocked"


@dataclass
class Sizes:
    # keyed vs unordered, one key, one blocked key
    ordering_size: int = 50_000
    ordering_keys: int = 10_000
    ordering_one_key: int = 20_000
    ordering_rounds: int = 5
    blocked_backlog: int = 1_000_000
    blocked_others: int = 20_000
    blocked_keys: int = 4_000
    blocked_rounds: int = 5


def keyed_series(system: aiooutbox_runner.System, keys: int) -> tuple[str, str]:
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


async def run(bench: Bench) -> None:
    config, aio = sizes_of(bench.config, Sizes), bench.systems[AIO]
    settings = bench.settings[AIO]
    n, keys, one = config.ordering_size, config.ordering_keys, config.ordering_one_key
    bench.log(f"ordering: {n:,} events over {keys:,} keys / {one:,} on one key / {n:,} unordered")

    async def keyed(count: int, nkeys: int) -> None:
        await aio.insert_series(count, *keyed_series(aio, nkeys), order_trigger=False)

    async def load_keyed() -> None:
        await keyed(n, keys)

    async def load_one() -> None:
        await keyed(one, 1)

    runs = await drain_rounds(
        bench,
        config.ordering_rounds,
        [
            ("unordered", (aio, n, None, settings)),
            ("keyed", (aio, n, load_keyed, settings)),
            ("one_key", (aio, one, load_one, settings)),
        ],
    )
    rates = {v: median_rate(runs, v) for v in ("unordered", "keyed", "one_key")}

    # (c) one blocked key: its head retries in 30 days, the backlog waits behind it
    backlog, others, other_keys = config.blocked_backlog, config.blocked_others, config.blocked_keys
    bench.log(f"  building the blocked key: 1 head + {backlog:,} waiting events")
    blocked = await make_fixture(bench, "aiooutbox_blocked")
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
        await system.insert_series(others, *keyed_series(system, other_keys), order_trigger=False)

    async def load_plain() -> None:
        await others_on(aio)

    async def load_blocked() -> None:
        await others_on(blocked)

    blocked_runs = await drain_rounds(
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
    blocked_rates = {v: median_rate(blocked_runs, v) for v in ("no_blocked", "blocked")}
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


def variant_rows(case: str, runs: list[dict[str, Any]], rates: dict[str, Any]) -> list[str]:
    """Rows of the ordering and isolation table: a case's median rate per variant."""
    out = []
    for variant, rate in rates.items():
        rounds = sum(1 for r in runs if r.get("variant") == variant)
        out.append(f"| {case} | {variant} | {fmt(rate)} | {rounds} |")
    return out


def rows(results: dict[str, Any]) -> list[str]:
    """Ordering's rows of the table `isolation.section` renders."""
    ordering = results.get("ordering")
    if not ordering:
        return []
    blocked = ordering["blocked"]
    return [
        *variant_rows(f"{ordering['size']:,} events", ordering["runs"], ordering["rates"]),
        *variant_rows(
            f"{blocked['others']:,} over {blocked['other_keys']:,} keys, blocked key "
            f"with {blocked['backlog']:,} waiting (built in {blocked['build_s']} s)",
            blocked["runs"],
            blocked["rates"],
        ),
    ]


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    ordering = results.get("ordering")
    if not ordering:
        return []
    blocked = ordering["blocked"]
    return [
        at_least(what, floor, ordering["ratios"].get(key))
        for key, what, floor in (
            (
                "keyed_vs_unordered",
                f"drain {ordering['size']:,} over {ordering['keys']:,} keys / unordered",
                0.8,
            ),
            (
                "one_key_vs_unordered",
                f"drain {ordering['one_key_size']:,} on one key / {ordering['size']:,} unordered",
                0.25,
            ),
            (
                "blocked_vs_none",
                f"drain {blocked['others']:,} of other keys with {blocked['backlog']:,} behind "
                "a blocked key / without",
                0.8,
            ),
        )
    ]


SCENARIO = Scenario(
    "ordering",
    run,
    sizes=Sizes,
    quick={
        "ordering_size": 10_000,
        "ordering_keys": 2_000,
        "ordering_one_key": 5_000,
        "ordering_rounds": 1,
        "blocked_backlog": 50_000,
        "blocked_others": 5_000,
        "blocked_keys": 1_000,
        "blocked_rounds": 1,
    },
    targets=((70, targets),),
)
