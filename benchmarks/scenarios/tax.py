"""``tax``: the producer's tax: one-event transactions/s with the wake-up trigger enabled against
disabled, beside three different baseline consumers, and the trigger taken apart.

Baselines (aiooutbox at the benchmark's settings unless said):

- ``none``: no consumer at all; the producers have the machine to themselves;
- ``poll``: a poll-only consumer (``listen=False, poll_interval=1.0``): it never
  advertises itself idle, so the trigger never notifies; it drains once a second;
- ``listen``: a listening consumer with a 0.1 s fallback poll, what the producers
  scenario runs: it drains as the events arrive.

The dissection runs server-side, in one backend: a PL/pgSQL loop of ``n`` single-row
INSERTs, the backend's CPU µs per INSERT (from /proc/<pid>/schedstat), with the wake-up
trigger off, on (no idle consumer: its first EXISTS returns), on with an idle consumer of the topic
advertised (``pg_notify`` per statement, rolled back so nothing is delivered), and
stand-ins that isolate its parts: an empty PL/pgSQL statement trigger with the transition
table (``REFERENCING NEW TABLE``), the same ``SECURITY DEFINER``, the same without the
transition table. Each call runs in a transaction that is rolled back. Then the same
variants under the producers' real load (no consumer): commits/s and the database's
backend CPU per commit, where per-transaction and cold-cache costs show that a tight
loop in one backend hides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..harness.bench import AIO, Bench
from ..harness.cpu import BackendCpu
from ..harness.databases import free_connections
from ..harness.load import commit_rate, trigger_rounds
from ..harness.processes import child_process
from ..harness.rounds import make_fixture, rotated
from ..harness.scenario import Scenario, sizes_of
from ..harness.stats import median, ratio

BASELINES: dict[str, dict[str, Any] | None] = {
    "none": None,
    "poll": {"listen": False, "poll_interval": 1.0},
    "listen": {"poll_interval": 0.1},
}
# n single-row INSERTs in one backend; returns the wall µs per INSERT
LOOP_FUNCTION = """
CREATE OR REPLACE FUNCTION public.bench_insert_loop(n int) RETURNS float8
LANGUAGE plpgsql AS $$
DECLARE t0 timestamptz := clock_timestamp();
BEGIN
    FOR i IN 1..n LOOP
        INSERT INTO {table} (topic, payload) VALUES ('bench', '{{}}');
    END LOOP;
    RETURN extract(epoch FROM clock_timestamp() - t0) * 1e6 / n;
END $$;
"""
PROBES = ["off", "on", "on_idle_advertised", "empty", "empty_definer", "empty_definer_no_table"]


@dataclass
class Sizes:
    tax_levels: list[int] = field(default_factory=lambda: [32])
    tax_rounds: int = 6
    tax_probe_inserts: int = 3_000
    tax_probe_rounds: int = 6
    tax_probe_load_rounds: int = 6


async def run(bench: Bench) -> None:
    config = sizes_of(bench.config, Sizes)
    system = await make_fixture(bench, "tax", patched=False)
    out: dict[str, Any] = {"levels": config.tax_levels, "baselines": {}}
    bench.log(f"producer tax: {config.tax_levels} producers, baselines {list(BASELINES)}")
    for name, extra in BASELINES.items():
        out["baselines"][name] = await baseline(bench, system, name, extra)
    out["probes"] = await dissect(bench, system)
    bench.results["tax"] = out


async def baseline(
    bench: Bench, system: Any, name: str, extra: dict[str, Any] | None
) -> dict[str, Any]:
    config = sizes_of(bench.config, Sizes)
    await system.reset()
    levels: dict[str, Any] = {}

    async def measure() -> None:
        for level in config.tax_levels:
            if await free_connections(bench.admin_dsn, level + 4, wait=30.0) < level + 4:
                levels[str(level)] = {"skipped": "not enough free connections"}
                continue
            runs: dict[str, list[float]] = {"on": [], "off": []}
            cpu_us: dict[str, list[float]] = {"on": [], "off": []}
            client_us: dict[str, list[float]] = {"on": [], "off": []}
            notes: list[float] = []
            backlog: list[int] = []
            async for trigger in trigger_rounds(system, config.tax_rounds):
                mine = time.process_time()
                async with BackendCpu(bench.admin_dsn, system.database, 0.05) as cpu:
                    commits, produced, notified = await commit_rate(bench, system, level)
                    await cpu.sample_now()
                mine = time.process_time() - mine
                state["total"] += produced
                runs[trigger].append(round(commits, 1))
                if cpu.seconds is not None and produced:
                    cpu_us[trigger].append(round(cpu.seconds / produced * 1e6, 1))
                    client_us[trigger].append(round(mine / produced * 1e6, 1))
                backlog.append(await system.backlog())
                if trigger == "on":
                    notes.append(notified)
            on, off = median(runs["on"]), median(runs["off"])
            levels[str(level)] = {
                "on": round(on, 1),
                "off": round(off, 1),
                "ratio": round(ratio(on, off), 3),
                "round_ratios": [
                    round(ratio(a, b), 3) for a, b in zip(runs["on"], runs["off"], strict=True)
                ],
                "db_cpu_us_per_commit": {k: round(median(v), 1) for k, v in cpu_us.items()},
                "producer_cpu_us_per_commit": {
                    k: round(median(v), 1) for k, v in client_us.items()
                },
                # what the CPU per commit implies were the machine's CPU the only limit
                "cpu_implied_ratio": round(
                    ratio(
                        median(cpu_us["off"]) + median(client_us["off"]),
                        median(cpu_us["on"]) + median(client_us["on"]),
                    ),
                    3,
                ),
                "notifications_per_s": round(median(notes), 1),
                "backlog_after": backlog,
                "runs": runs,
            }
            bench.log(
                f"  {name:7} x{level:<3} on {on:>7,.0f}/s off {off:>7,.0f}/s ratio"
                f" {ratio(on, off):.3f}; {median(notes):,.0f} NOTIFY/s; backlog after {backlog}"
            )

    state = {"total": 0}
    try:
        if extra is None:
            await measure()
            handled = None
        else:
            settings = {**bench.settings[AIO], **extra}
            spec = bench.spec(system, "serve", settings)
            async with child_process(spec) as child:
                await child.wait_ready()
                await measure()
                child.send(stop_after=state["total"], timeout=60)
                handled = (await child.result(timeout=120))["handled"]
    finally:
        await system.set_wakeup_trigger(True)
    return {"consumer": extra, "levels": levels, "produced": state["total"], "handled": handled}


async def dissect(bench: Bench, system: Any) -> dict[str, Any]:
    """µs per single-row INSERT, server-side, per trigger variant (see the module doc)."""
    config, q = sizes_of(bench.config, Sizes), system.q
    conn = await system.connect()
    try:
        await conn.execute(LOOP_FUNCTION.format(table=q.qualified))
        await conn.execute(
            """
            CREATE OR REPLACE FUNCTION public.bench_noop() RETURNS trigger
            LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$;
            CREATE OR REPLACE FUNCTION public.bench_noop_definer() RETURNS trigger
            LANGUAGE plpgsql SECURITY DEFINER AS $$ BEGIN RETURN NULL; END $$;
            """
        )

        backend = await conn.fetchval("SELECT pg_backend_pid()")

        async def loop_probe(variant: str) -> float:
            async with conn.transaction():
                await set_probe(conn, q, variant)
                before = BackendCpu._cpu(backend) or 0.0
                wall: float = await conn.fetchval(
                    "SELECT public.bench_insert_loop($1)", config.tax_probe_inserts
                )
                after = BackendCpu._cpu(backend) or 0.0
                walls[variant].append(round(wall, 2))
                # the backend's own CPU: a wall clock counts the time it waited for a core
                raise _Rollback((after - before) / config.tax_probe_inserts * 1e6)

        samples: dict[str, list[float]] = {v: [] for v in PROBES}
        walls: dict[str, list[float]] = {v: [] for v in PROBES}
        for r in range(config.tax_probe_rounds):
            for variant in rotated(PROBES, r, reverse_odd=True):
                try:
                    await loop_probe(variant)
                except _Rollback as done:
                    samples[variant].append(round(done.value, 2))
        # the same variants under the producers' real load: `level` connections looping
        # one-event transactions, no consumer, the database's backends' CPU per commit
        level = config.tax_levels[0]
        loaded: dict[str, dict[str, list[float]]] = {
            v: {"rate": [], "cpu": [], "client": []} for v in PROBES
        }
        notes: dict[str, list[float]] = {v: [] for v in PROBES}
        for r in range(config.tax_probe_load_rounds):
            for variant in rotated(PROBES, r, reverse_odd=True):
                await set_probe(conn, q, variant)
                mine = time.process_time()
                try:
                    async with BackendCpu(bench.admin_dsn, system.database, 0.05) as cpu:
                        commits, produced, notified = await commit_rate(bench, system, level)
                        await cpu.sample_now()
                finally:
                    await clear_probe(conn, q)
                mine = time.process_time() - mine
                loaded[variant]["rate"].append(round(commits, 1))
                if cpu.seconds is not None and produced:
                    loaded[variant]["cpu"].append(round(cpu.seconds / produced * 1e6, 1))
                    loaded[variant]["client"].append(round(mine / produced * 1e6, 1))
                notes[variant].append(notified)
    finally:
        await conn.close()
    us = {v: round(median(s), 2) for v, s in samples.items()}
    rate = {v: round(median(x["rate"]), 1) for v, x in loaded.items()}
    cpu_us = {v: round(median(x["cpu"]), 1) for v, x in loaded.items()}
    client = {v: round(median(x["client"]), 1) for v, x in loaded.items()}
    total = {v: cpu_us[v] + client[v] for v in PROBES}
    result: dict[str, Any] = {
        "inserts_per_probe": config.tax_probe_inserts,
        "us_per_insert": us,
        "tax_us": {v: round(us[v] - us["off"], 2) for v in PROBES if v != "off"},
        "samples": samples,
        "wall_us_per_insert": {v: round(median(w), 2) for v, w in walls.items()},
        "load_level": level,
        "load_rounds": config.tax_probe_load_rounds,
        "commits_per_s": rate,
        "ratio_to_off": {v: round(ratio(rate[v], rate["off"]), 3) for v in PROBES},
        "db_cpu_us_per_commit": cpu_us,
        "producer_cpu_us_per_commit": client,
        "cpu_implied_ratio": {v: round(ratio(total["off"], total[v]), 3) for v in PROBES},
        "notifications_per_s": {v: round(median(n), 1) for v, n in notes.items()},
        "load_runs": loaded,
    }
    bench.log("  server-side us per INSERT: " + ", ".join(f"{v} {x:.2f}" for v, x in us.items()))
    bench.log(
        f"  x{level} no consumer, commits/s (ratio to off; db us/commit): "
        + ", ".join(
            f"{v} {rate[v]:,.0f} ({result['ratio_to_off'][v]:.3f}; {cpu_us[v]:.0f})" for v in PROBES
        )
    )
    return result


async def set_probe(conn: Any, q: Any, variant: str) -> None:
    """Make the table's insert triggers those of ``variant`` (see the module doc)."""
    if variant not in ("on", "on_idle_advertised"):
        await conn.execute(f'ALTER TABLE {q.qualified} DISABLE TRIGGER "{q.table}_wakeup"')
    if variant == "on_idle_advertised":
        await conn.execute(
            f"INSERT INTO {q.idle_table} (worker_id, topics, expires_at)"
            " VALUES ('bench-probe', '{bench}', now() + interval '1 hour')"
        )
    if variant.startswith("empty"):
        function = "bench_noop" if variant == "empty" else "bench_noop_definer"
        table = "" if variant.endswith("no_table") else "REFERENCING NEW TABLE AS n"
        await conn.execute(
            f"CREATE TRIGGER bench_probe AFTER INSERT ON {q.qualified} {table}"
            f" FOR EACH STATEMENT EXECUTE FUNCTION public.{function}()"
        )


async def clear_probe(conn: Any, q: Any) -> None:
    await conn.execute(f"DROP TRIGGER IF EXISTS bench_probe ON {q.qualified}")
    await conn.execute(f'ALTER TABLE {q.qualified} ENABLE TRIGGER "{q.table}_wakeup"')
    await conn.execute(f"DELETE FROM {q.idle_table} WHERE worker_id = 'bench-probe'")


class _Rollback(Exception):
    def __init__(self, value: float) -> None:
        super().__init__("rollback")
        self.value = value


def render(section: dict[str, Any]) -> list[str]:
    out = [
        "## Producer tax",
        "",
        "One-event transactions/s with the wake-up trigger on / off, rounds alternated;"
        " *db CPU* is that of every backend of the database (producers' and consumer's)"
        " per commit.",
        "",
        "| baseline consumer | producers | on / off | ratio | per-round ratios |"
        " db CPU µs/commit on / off | producers' CPU µs/commit on / off | CPU-implied ratio |"
        " NOTIFY/s |",
        "|---|---:|---|---:|---|---|---|---:|---:|",
    ]
    for name, base in section["baselines"].items():
        for level, row in base["levels"].items():
            if "skipped" in row:
                out.append(f"| {name} | {level} | skipped | | | | | | |")
                continue
            cpu, mine = row["db_cpu_us_per_commit"], row["producer_cpu_us_per_commit"]
            out.append(
                f"| {name} | {level} | {row['on']:,.0f} / {row['off']:,.0f} |"
                f" **{row['ratio']:.3f}** | {row['round_ratios']} |"
                f" {cpu.get('on', float('nan')):.0f} / {cpu.get('off', float('nan')):.0f} |"
                f" {mine.get('on', float('nan')):.0f} / {mine.get('off', float('nan')):.0f} |"
                f" {row['cpu_implied_ratio']:.3f} | {row['notifications_per_s']:,.0f} |"
            )
    probes = section.get("probes", {})
    if probes:
        out += [
            "",
            f"Server-side, {probes['inserts_per_probe']:,} single-row INSERTs in one"
            " PL/pgSQL loop per probe, the backend's CPU (wall clock beside it), medians:",
            "",
            "| trigger | CPU µs per INSERT | over `off` | wall µs per INSERT |",
            "|---|---:|---:|---:|",
        ]
        for variant, value in probes["us_per_insert"].items():
            over = probes["tax_us"].get(variant)
            wall = probes.get("wall_us_per_insert", {}).get(variant, float("nan"))
            out.append(
                f"| {variant} | {value:.2f} | {'' if over is None else f'{over:+.2f}'} |"
                f" {wall:.2f} |"
            )
        out += [
            "",
            f"The same triggers under load: {probes['load_level']} producers, no consumer,"
            f" {probes['load_rounds']} rounds rotated, medians:",
            "",
            "| trigger | commits/s | ratio to `off` | db CPU µs/commit |"
            " producers' CPU µs/commit | CPU-implied ratio | NOTIFY/s |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for variant, rate in probes["commits_per_s"].items():
            out.append(
                f"| {variant} | {rate:,.0f} | {probes['ratio_to_off'][variant]:.3f} |"
                f" {probes['db_cpu_us_per_commit'][variant]:.0f} |"
                f" {probes['producer_cpu_us_per_commit'][variant]:.0f} |"
                f" {probes['cpu_implied_ratio'][variant]:.3f} |"
                f" {probes['notifications_per_s'][variant]:,.0f} |"
            )
    out.append("")
    return out


def section(results: dict[str, Any]) -> list[str]:
    return ["", *render(results["tax"])] if results.get("tax") else []


SCENARIO = Scenario(
    "tax",
    run,
    sizes=Sizes,
    quick={
        "tax_rounds": 2,
        "tax_probe_inserts": 1_000,
        "tax_probe_rounds": 2,
        "tax_probe_load_rounds": 1,
    },
    sections=((160, section),),
)
