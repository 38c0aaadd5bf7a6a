"""Results out: the JSON document, a markdown summary with the targets, PNG plots.

Plotting needs matplotlib (the ``bench`` extra) and is imported only by `plot`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import median
from typing import Any

AIO = "aiooutbox"
PGQ = "pgqueuer"


def _num(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
        return float(value)
    return None


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with what this run measured and whether it holds."""
    out: list[dict[str, Any]] = []

    def add(
        what: str, target: str, measured: float | None, ok: bool | None, note: str = ""
    ) -> None:
        out.append(
            {
                "what": what,
                "target": target,
                "measured": None if measured is None else round(measured, 3),
                "ok": ok,
                "note": note,
            }
        )

    drain = results.get("drain", {}).get("summary", {})
    if drain:
        sizes = sorted(int(s) for s in drain)
        small, large = str(sizes[0]), str(sizes[-1])
        r = _num(drain[small].get("ratio"))
        add(
            f"drain {int(small):,} no-op events, aiooutbox / PgQueuer",
            ">= 3.0",
            r,
            None if r is None else r >= 3.0,
        )
        r = _num(drain[small].get("defaults_ratio"))
        if r is not None:
            add(
                f"drain {int(small):,} at the defaults (OutboxConsumer(pool), asyncpg's"
                " default pool) / PgQueuer tuned",
                ">= 2.5",
                r,
                r >= 2.5,
                f"{_fmt(drain[small].get(AIO + '_defaults'))} events/s",
            )
        a_small, a_large = _num(drain[small].get(AIO)), _num(drain[large].get(AIO))
        r = a_large / a_small if a_small and a_large else None
        add(
            f"drain rate at {int(large):,} vs {int(small):,} backlog (aiooutbox)",
            ">= 0.8",
            r,
            None if r is None else r >= 0.8,
        )
        mid = [s for s in sizes if drain[str(s)].get(PGQ)]
        if len(mid) > 1:
            p_small, p_large = drain[str(mid[0])][PGQ], drain[str(mid[-1])][PGQ]
            add(
                f"(for scale) PgQueuer at {mid[-1]:,} vs {mid[0]:,}",
                "-",
                p_large / p_small,
                None,
            )
    producers = results.get("producers", {}).get(AIO, {}).get("levels", {})
    level = producers.get("32") or (producers[max(producers, key=int)] if producers else None)
    if level and "ratio" in level:
        r = _num(level["ratio"])
        label = "32" if "32" in producers else max(producers, key=int)
        add(
            f"producer commits/s, {label} producers + consumer, trigger on / off",
            ">= 0.9",
            r,
            None if r is None else r >= 0.9,
        )
    wake = results.get("wakeup", {}).get("aiooutbox_notify", {}).get("latency_ms", {})
    if wake.get("n"):
        add("idle wake-up p50 (ms, COMMIT -> handler)", "<= 3", wake["p50"], wake["p50"] <= 3)
        add("idle wake-up p99 (ms, COMMIT -> handler)", "<= 15", wake["p99"], wake["p99"] <= 15)
    for run in results.get("steady", []):
        if run["system"] == AIO and run["fraction"] == 0.5 and run["latency_ms"].get("n"):
            p99 = run["latency_ms"]["p99"]
            basis = run.get("max_basis", "drain")
            add(f"steady state at 50% of {basis} max, e2e p99 (ms)", "<= 20", p99, p99 <= 20)
    history = results.get("history", {}).get("summary")
    if history:
        r = _num(history.get("ratio"))
        add(
            f"drain with {results['history']['rows']:,} done rows / empty table",
            ">= 0.8",
            r,
            None if r is None else r >= 0.8,
        )
        plan = results["history"]["explain"]
        add(
            "claim plan (custom and generic) on the claimable partial index",
            "yes",
            None,
            plan.get("uses_index"),
        )
    observe = results.get("observe", {})
    for field, how in (("ratios", "drain"), ("cpu_ratios", "consumer CPU per event")):
        measured = observe.get(field)
        if not measured:
            continue
        for key, what, floor in (
            ("metrics_vs_off", "Prometheus metrics on / off", 0.95),
            ("tracing_vs_off", "tracing (SDK, no-op exporter) on / off", 0.85),
            ("otel_api_vs_absent", "opentelemetry-api, no SDK / not installed", 0.98),
        ):
            r = _num(measured.get(key))
            add(f"{what} ({how})", f">= {floor}", r, None if r is None else r >= floor)
    ordering = results.get("ordering")
    if ordering:
        blocked = ordering["blocked"]
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
        ):
            r = _num(ordering["ratios"].get(key))
            add(what, f">= {floor}", r, None if r is None else r >= floor)
    isolation = results.get("isolation")
    if isolation:
        b = isolation["backlog"]
        r = _num(isolation["drain"]["ratio"])
        add(
            f"drain {isolation['drain']['size']:,} of A with {b:,} pending of unconsumed B "
            "/ without",
            ">= 0.8",
            r,
            None if r is None else r >= 0.8,
        )
        wake = isolation["wakeup"]["backlog"]["latency_ms"]
        if wake.get("n"):
            add(
                f"idle wake-up p50 with {b:,} pending B (ms)", "<= 3", wake["p50"], wake["p50"] <= 3
            )
            add(
                f"idle wake-up p99 with {b:,} pending B (ms)",
                "<= 15",
                wake["p99"],
                wake["p99"] <= 15,
            )
        topics = isolation["topics"]
        r = _num(topics["ratio"])
        add(
            f"consumer of {topics['topics']} topics x {topics['per_topic']} rows, {b:,} pending "
            "in another topic / without",
            ">= 0.8",
            r,
            None if r is None else r >= 0.8,
        )
        procs = isolation["processes"]
        r = _num(procs["ratio"])
        add(
            f"{procs['processes']} consumer processes / 1, draining {procs['size']:,}",
            ">= 0.9",
            r,
            None if r is None else r >= 0.9,
        )
        add(
            f"double claims with {procs['processes']} processes",
            "0",
            procs["double_claims"],
            procs["double_claims"] == 0,
        )
        light = isolation.get("light", [])
        for rate in sorted({run["offered_rate"] for run in light}, reverse=True):
            mine = {
                run["system"]: run["latency_ms"] for run in light if run["offered_rate"] == rate
            }
            lat, theirs = mine.get(AIO, {}), mine.get(PGQ, {})
            if not lat.get("n"):
                continue
            add(f"COMMIT -> handler p50 at {rate:g}/s (ms)", "<= 3", lat["p50"], lat["p50"] <= 3)
            add(f"COMMIT -> handler p99 at {rate:g}/s (ms)", "<= 10", lat["p99"], lat["p99"] <= 10)
            if theirs.get("n"):
                add(
                    f"COMMIT -> handler p99 at {rate:g}/s, aiooutbox / PgQueuer",
                    "<= 1",
                    lat["p99"] / theirs["p99"] if theirs["p99"] else None,
                    lat["p99"] <= theirs["p99"],
                )
    flowed = results.get("flow")
    if flowed:
        size, backlog = f"{flowed['size']:,}", f"{flowed['backlog']:,}"
        for key, what, floor in (
            ("paused_vs_none", f"drain {size} of A beside {backlog} of a paused topic / none", 0.9),
            (
                "at_limit_vs_none",
                f"drain {size} of A beside {backlog} of a topic at its max_running / none",
                0.9,
            ),
            (
                "limits_vs_none",
                f"drain {size} over 4 topics, 2 with limits that do not bind / no limits",
                0.95,
            ),
        ):
            r = _num(flowed["ratios"].get(key))
            add(what, f">= {floor}", r, None if r is None else r >= floor)
    rss = results.get("rss", {}).get(AIO)
    if rss:
        add(
            f"consumer RSS growth over {rss['events']:,} events (MB)",
            "<= 20",
            rss["growth_mb"],
            rss["growth_mb"] <= 20,
        )
    return out


def _fmt(value: Any, digits: int = 0) -> str:
    number = _num(value)
    if number is None:
        return "-" if value is None else str(value)
    return f"{number:,.{digits}f}"


def _loads(values: Any) -> str:
    return " / ".join(f"{v:.1f}" for v in values) if values else "?"


def _ok(value: bool | None) -> str:
    return {True: "✅", False: "❌", None: "-"}[value]


def markdown(results: dict[str, Any]) -> str:
    lines: list[str] = []
    meta = results.get("meta", {})
    settings = results.get("settings", {})
    lines += ["## Targets", "", "| what | target | measured | ok |", "|---|---|---|---|"]
    for t in results.get("targets") or targets(results):
        lines.append(f"| {t['what']} | {t['target']} | {_fmt(t['measured'], 2)} | {_ok(t['ok'])} |")

    drain = results.get("drain", {}).get("summary", {})
    if drain:
        lines += [
            "",
            "## Drain throughput (events/s, median of rounds)",
            "",
            "| backlog | aiooutbox | PgQueuer | aiooutbox / PgQueuer | rounds |",
            "|---:|---:|---:|---:|---|",
        ]
        for size, row in sorted(drain.items(), key=lambda kv: int(kv[0])):
            lines.append(
                f"| {int(size):,} | {_fmt(row[AIO])} | {_fmt(row[PGQ])} "
                f"| {_fmt(row['ratio'], 2) + 'x' if row['ratio'] else '-'} "
                f"| {row[f'{AIO}_rounds']} / {row[f'{PGQ}_rounds']} |"
            )
        for size, row in sorted(drain.items(), key=lambda kv: int(kv[0])):
            if row.get(f"{AIO}_defaults"):
                lines.append(
                    f"\naiooutbox at its defaults (`OutboxConsumer(pool)`, concurrency 64, on"
                    f" `asyncpg.create_pool(dsn)`), {int(size):,} events:"
                    f" {_fmt(row[f'{AIO}_defaults'])}/s,"
                    f" {_fmt(row.get('defaults_ratio'), 2)}x PgQueuer tuned."
                )
        runs = results["drain"]["runs"]
        lines += [
            "",
            "CPU per event in the drains (median of all sizes; client = the consumer process,"
            " db = the server backends of its database):",
            "",
            "| system | client CPU µs / event | db CPU µs / event |",
            "|---|---:|---:|",
        ]
        for name in (AIO, PGQ):
            mine = [r for r in runs if r["system"] == name]
            if not mine:
                continue
            client = sorted(1e6 * r["client_cpu_s"] / r["size"] for r in mine)
            db = sorted(1e6 * r["db_cpu_s"] / r["size"] for r in mine if r["db_cpu_s"])
            lines.append(
                f"| {name} | {_fmt(client[len(client) // 2], 1)} | "
                f"{_fmt(db[len(db) // 2] if db else None, 1)} |"
            )

    capacity = results.get("capacity", {})
    if capacity:
        lines += [
            "",
            "## Sustained maximum (producers on the same machine; bisection per system)",
            "",
            "| system | drain max/s | sustained max/s "
            "| probes: offered/s (achieved) → sustained, p50/p99 ms |",
            "|---|---:|---:|---|",
        ]
        for name, cap in capacity.items():
            probes = "; ".join(
                f"{_fmt(p['offered_rate'])} ({_fmt(p['achieved_offered_rate'])}) → "
                f"{_ok(p['sustained'])} {_fmt(p.get('p50_ms'), 1)}/{_fmt(p['p99_ms'], 1)}"
                for p in cap["probes"]
            )
            lines.append(
                f"| {name} | {_fmt(cap['drain_max'])} | {_fmt(cap['sustained_max'])} | {probes} |"
            )

    steady = results.get("steady", [])
    if steady:
        lines += [
            "",
            "## Steady state (paced producers; ms from the producer's COMMIT to handler start)",
            "",
            "| system | load | offered/s | p50 | p95 | p99 | p99 from BEGIN | producer tx p50 "
            "| catch-up s | keeps up |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for run in steady:
            lat = run["latency_ms"]
            load = (
                "fixed"
                if run["fraction"] is None
                else f"{run['fraction']:.0%} of {run.get('max_basis', 'drain')} max"
            )
            lines.append(
                f"| {run['system']} | {load} | {_fmt(run['achieved_offered_rate'])} "
                f"| {_fmt(lat.get('p50'), 1)} | {_fmt(lat.get('p95'), 1)} "
                f"| {_fmt(lat.get('p99'), 1)} "
                f"| {_fmt(run.get('latency_from_begin_ms', {}).get('p99'), 1)} "
                f"| {_fmt(run['producer_statement_ms'].get('p50'), 1)} "
                f"| {_fmt(run['catch_up_s'], 2)} | {_ok(run['keeps_up'])} |"
            )

    floor = results.get("floor")
    if floor:
        lines += [
            "",
            f"Floor of this machine after {floor['gap_s']} s idle, {floor['samples']} samples "
            "(benchmarks/floor.py; ms, p50 / p99): what any LISTEN-woken queue pays from a "
            "producer's COMMIT before its handler could start.",
            "",
            "| round trip | p50 | p99 |",
            "|---|---:|---:|",
        ]
        for key, what in (
            ("select1_warm", "`SELECT 1`, back to back"),
            ("select1_idle", "`SELECT 1` after the pause"),
            ("write_idle", "one-row `INSERT`, committed, after the pause"),
            ("heard_idle", "COMMIT (insert + `pg_notify`) to the notification heard"),
            ("chain_idle", "COMMIT to heard, then a one-row write on a third connection"),
        ):
            p50, p99 = floor[key].get("p50"), floor[key].get("p99")
            lines.append(f"| {what} | {_fmt(p50, 2)} | {_fmt(p99, 2)} |")

    wake = results.get("wakeup", {})
    if wake:
        lines += [
            "",
            "## Idle wake-up (one event into an idle consumer; ms from the producer's COMMIT)",
            "",
            "| mode | n | p50 | p95 | p99 | max | p50 from BEGIN | producer tx p50 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for mode, row in wake.items():
            lat = row["latency_ms"]
            lines.append(
                f"| {mode} | {lat.get('n', 0)} | {_fmt(lat.get('p50'), 1)} "
                f"| {_fmt(lat.get('p95'), 1)} | {_fmt(lat.get('p99'), 1)} "
                f"| {_fmt(lat.get('max'), 1)} "
                f"| {_fmt(row.get('latency_from_begin_ms', {}).get('p50'), 1)} "
                f"| {_fmt(row['producer_transaction_ms'].get('p50'), 1)} |"
            )

    producers = results.get("producers", {})
    if producers:
        lines += [
            "",
            "## Producer cost (one-event transactions/s with the consumer running)",
            "",
            "| system | producers | trigger on | trigger off | on / off | NOTIFYs/s (on) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, data in producers.items():
            for level, row in data["levels"].items():
                if "skipped" in row:
                    lines.append(f"| {name} | {level} | {row['skipped']} | | |")
                    continue
                lines.append(
                    f"| {name} | {level} | {_fmt(row['on'])} | {_fmt(row['off'])} "
                    f"| {_fmt(row['ratio'], 2)} | {_fmt(row.get('notifications_per_s'))} |"
                )

    drivers = results.get("drivers", {})
    if drivers:
        first = next(iter(drivers.values()))
        lines += [
            "",
            "## Producer throughput per driver (one-event transactions/s, "
            f"{first.get('connections', 8)} connections, no consumer)",
            "",
            "| driver path | commits/s | x asyncpg |",
            "|---|---:|---:|",
        ]
        for name, row in drivers.items():
            if "error" in row:
                lines.append(f"| {name} | failed: {row['error'][:80]} | |")
                continue
            lines.append(
                f"| {name} | {_fmt(row['commits_per_s'])} "
                f"| {_fmt(row.get('ratio_to_asyncpg'), 2)} |"
            )

    board = results.get("dashboard")
    if board and board.get("pages"):
        lines += [
            "",
            f"## Dashboard pages beside {board['rows']:,} rows (server time, cache emptied)",
            "",
            "| page | median ms | max ms |",
            "|---|---:|---:|",
        ]
        for name, row in board["pages"].items():
            lines.append(f"| {name} | {_fmt(row['median_ms'], 1)} | {_fmt(row['max_ms'], 1)} |")
    drain = (board or {}).get("drain")
    if drain:
        pairs = drain.get("round_ratios") or []
        lines += [
            "",
            f"## Drain of {drain['events']:,} events with a dashboard open / without",
            "",
            f"{drain['browsers']} simulated pages ({', '.join(drain.get('views', []))}),"
            f" refresh {drain.get('refresh_s', 2):g} s. Ratio of medians"
            f" **{_fmt(drain['ratio'], 3)}** over {len(drain['rates_on'])} alternated rounds"
            f" each (medians {_fmt(median(drain['rates_on']))} vs"
            f" {_fmt(median(drain['rates_off']))}/s"
            + (f"; per round {min(pairs):.3f}-{max(pairs):.3f}" if pairs else "")
            + ").",
        ]
        if drain.get("pulse"):
            share = drain.get("dashboard_db_cpu_share")
            lines.append(
                ""
                if share is None
                else f"The dashboard's database sessions used {share * 100:.2f}% of a core"
                f" while open; the pulse statement takes {drain['pulse']['server_ms']} ms"
                f" on the server ({drain['pulse']['round_trip_ms']} ms round trip)."
            )

    relay = results.get("relay")
    if relay:
        lines += [
            "",
            f"## Relay vs bare client loops ({relay['jetstream']['events']:,} events, "
            f"{relay['jetstream']['in_flight']} in flight, alternated rounds, medians)",
            "",
            "| broker | bare loop | bare/s | relay/s | relay / bare "
            "| relay at concurrency 256 /s | / bare |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for name in ("jetstream", "rabbitmq"):
            row = relay[name]
            variants = row.get("ratios") or {row.get("bare_loop", "bare"): row["ratio"]}
            c256 = row.get("relay_c256_per_s")
            for variant, value in variants.items():
                rates = row.get(f"{variant}_per_s", row["bare_per_s"])
                base = median(rates)
                tail = f"{_fmt(median(c256))} | {_fmt(median(c256) / base, 2)} |" if c256 else "| |"
                lines.append(
                    f"| {name} | {variant} | {_fmt(base)} | "
                    f"{_fmt(median(row['relay_per_s']))} | {_fmt(value, 2)} | {tail}"
                )
        star, lat = relay["all_topics"], relay["latency"]
        lines += [
            "",
            f'All-topics claim (`"*"`) / topic-list claim drain rate: {_fmt(star["ratio"], 2)}.',
        ]
        for name, row in lat.items() if "rate" not in lat else [("jetstream", lat)]:
            lines.append(
                f"Commit → {name} ack at a steady {_fmt(row.get('offered_per_s', row['rate']))}"
                f" events/s: p50 {_fmt(row['p50'], 1)} ms, p99 {_fmt(row['p99'], 1)} ms."
            )

    history = results.get("history")
    if history:
        s = history["summary"]
        lines += [
            "",
            f"## Cost of history ({history['rows']:,} done rows; drain of "
            f"{history['drain_size']:,})",
            "",
            "| table | drain/s (median) |",
            "|---|---:|",
            f"| empty | {_fmt(s['empty'])} |",
            f"| with history | {_fmt(s['history'])} |",
            f"| ratio | {_fmt(s['ratio'], 2)} |",
            "",
            "Claim plan with history (generic plan, as a prepared statement may use):",
            "",
            "```",
            history["explain"]["generic_plan"],
            "```",
        ]
    observe = results.get("observe")
    if observe:
        lines += [
            "",
            f"## Cost of observability (drain of {observe['size']:,}, median of "
            f"{observe['rounds']} round(s))",
            "",
            "Drain rate to the last handler, and the consumer's CPU per event (all its"
            " threads, startup and shutdown left out):",
            "",
            "| variant | drain/s | CPU us/event |",
            "|---|---:|---:|",
            *(
                f"| {k} | {_fmt(v)} | {_fmt(observe.get('cpu_us_per_event', {}).get(k), 2)} |"
                for k, v in observe["rates"].items()
            ),
            "",
            "| ratio | drain | CPU (off's CPU / the variant's) |",
            "|---|---:|---:|",
            *(
                f"| {k} | {_fmt(v, 3)} | {_fmt(observe.get('cpu_ratios', {}).get(k), 3)} |"
                for k, v in observe["ratios"].items()
            ),
            "",
            "Hook CPU per event, timed in-process (best of 3), and the drain ratio it"
            " implies at the `off` rate:",
            "",
            "| variant | us/event | implied ratio |",
            "|---|---:|---:|",
            *(
                f"| {k} | {_fmt(v, 2)} | {_fmt(observe['implied_ratios'].get(k), 3)} |"
                for k, v in observe.get("hook_us_per_event", {}).items()
            ),
            "",
            "The SDK's own span (`tracer.start_span('a').end()`, BatchSpanProcessor):"
            f" {_fmt(observe.get('sdk_bare_span_us'), 2)} us of CPU.",
        ]
    rss = results.get("rss", {})
    if rss:
        lines += [
            "",
            "## Consumer RSS over the largest drain (MB)",
            "",
            "| system | events | start | after 10% | max | end | growth after 10% |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, row in rss.items():
            lines.append(
                f"| {name} | {row['events']:,} | {_fmt(row['start_mb'], 1)} "
                f"| {_fmt(row['warm_mb'], 1)} | {_fmt(row['max_mb'], 1)} "
                f"| {_fmt(row['end_mb'], 1)} | {_fmt(row['growth_mb'], 1)} |"
            )
    lines += ordering_isolation_markdown(results)
    from . import producer_tax, references, retention

    for key, module in (
        ("references", references),
        ("tax", producer_tax),
        ("retention", retention),
    ):
        if results.get(key):
            lines += ["", *module.render(results[key])]
    if settings:
        lines += ["", "## Settings", ""]
        for name, value in settings.items():
            lines.append(f"- {name}: `{json.dumps(value)}`")
    if meta:
        pg = meta.get("postgresql", {})
        machine = meta.get("machine", {})
        lines += [
            "",
            "## Run",
            "",
            f"- command: `{meta.get('command')}`; started {meta.get('started')}, "
            f"took {meta.get('duration_s')} s",
            f"- aiooutbox: {meta.get('source')}"
            + (f"; with `--patch {meta['patch']}`" if meta.get("patch") else "")
            + (f" `--sql-patch {meta['sql_patch']}`" if meta.get("sql_patch") else ""),
            f"- machine: {machine.get('platform')}, {machine.get('cpus')} CPUs, "
            f"{machine.get('memory_gb')} GB, Python {machine.get('python')}; "
            f"load average at start {_loads(machine.get('loadavg_start'))}, "
            f"at end {_loads(meta.get('loadavg_end'))} (a shared machine)",
            f"- {pg.get('version')}",
            f"- server settings: `{json.dumps(pg.get('settings', {}))}`",
            f"- packages: `{json.dumps(meta.get('packages', {}))}`",
        ]
    return "\n".join(lines) + "\n"


def ordering_isolation_markdown(results: dict[str, Any]) -> list[str]:
    """The rates behind the ordering and isolation ratios (medians of rounds)."""
    lines: list[str] = []
    ordering, isolation = results.get("ordering"), results.get("isolation")
    if not ordering and not isolation:
        return lines
    lines += [
        "",
        "## Ordered delivery and topic isolation (events/s, median of rounds)",
        "",
        "| case | variant | rate | rounds |",
        "|---|---|---:|---:|",
    ]

    def rows(case: str, runs: list[dict[str, Any]], rates: dict[str, Any]) -> None:
        for variant, rate in rates.items():
            rounds = sum(1 for r in runs if r.get("variant") == variant)
            lines.append(f"| {case} | {variant} | {_fmt(rate)} | {rounds} |")

    if ordering:
        rows(f"{ordering['size']:,} events", ordering["runs"], ordering["rates"])
        blocked = ordering["blocked"]
        rows(
            f"{blocked['others']:,} over {blocked['other_keys']:,} keys, blocked key "
            f"with {blocked['backlog']:,} waiting (built in {blocked['build_s']} s)",
            blocked["runs"],
            blocked["rates"],
        )
    if isolation:
        b = isolation["backlog"]
        rows(
            f"{isolation['drain']['size']:,} of A, {b:,} pending B",
            isolation["drain"]["runs"],
            isolation["drain"]["rates"],
        )
        topics = isolation["topics"]
        rows(
            f"{topics['topics']} topics x {topics['per_topic']}, {b:,} pending in another",
            topics["runs"],
            topics["rates"],
        )
        procs = isolation["processes"]
        for count, rate in procs["rates"].items():
            rounds = sum(1 for r in procs["runs"] if str(r["processes"]) == count)
            lines.append(
                f"| {procs['size']:,} by {count} process(es) | double claims "
                f"{procs['double_claims']}, re-claimed {procs['reclaimed']} | {_fmt(rate)} "
                f"| {rounds} |"
            )
        lines += [
            "",
            "| latency, COMMIT -> handler start (ms) | p50 | p95 | p99 | max | n |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for label, run in isolation["wakeup"].items():
            lat = run["latency_ms"]
            lines.append(
                f"| idle wake-up, {label} ({b:,} pending B) | {_fmt(lat.get('p50'), 2)} "
                f"| {_fmt(lat.get('p95'), 2)} | {_fmt(lat.get('p99'), 2)} "
                f"| {_fmt(lat.get('max'), 2)} | {lat.get('n')} |"
            )
        for run in isolation.get("light", []):
            lat = run["latency_ms"]
            lines.append(
                f"| {run['system']} at {run['offered_rate']:g}/s | {_fmt(lat.get('p50'), 2)} "
                f"| {_fmt(lat.get('p95'), 2)} | {_fmt(lat.get('p99'), 2)} "
                f"| {_fmt(lat.get('max'), 2)} | {lat.get('n')} |"
            )
    return lines


def plot(results: dict[str, Any], out: Path) -> list[Path]:
    """Write PNG plots next to the JSON; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    colors = {AIO: "tab:blue", PGQ: "tab:orange"}

    def save(fig: Any, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    drain = results.get("drain", {}).get("summary", {})
    if drain:
        sizes = sorted(drain, key=int)
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.38
        for i, name in enumerate((AIO, PGQ)):
            values = [drain[s][name] or 0 for s in sizes]
            xs = [j + (i - 0.5) * width for j in range(len(sizes))]
            ax.bar(xs, values, width, label=name, color=colors[name])
        ax.set_xticks(range(len(sizes)), [f"{int(s):,}" for s in sizes])
        ax.set_xlabel("pre-enqueued no-op events")
        ax.set_ylabel("events/s (median)")
        ax.set_title("Drain throughput")
        ax.legend()
        save(fig, "drain.png")

    steady = results.get("steady", [])
    if steady:
        cols = min(3, len(steady))
        rows = -(-len(steady) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.3 * rows), squeeze=False)
        for ax in axes.flat[len(steady) :]:
            ax.set_visible(False)
        for ax, run in zip(axes.flat, steady, strict=False):
            series = run["latency_series"]
            if series:
                ax.plot([s[0] for s in series], [s[1] for s in series], label="p50")
                ax.plot([s[0] for s in series], [s[2] for s in series], label="p99")
            ax.set_yscale("log")
            load = "" if run["fraction"] is None else f"{run['fraction']:.0%} "
            ax.set_title(f"{run['system']} {load}({run['offered_rate']:,.0f}/s)")
            ax.set_xlabel("s (by send time; handled events only)")
            ax.set_ylabel("ms from producer BEGIN")
            ax.legend()
        save(fig, "steady_latency.png")

    wake = results.get("wakeup", {})
    if wake:
        fig, ax = plt.subplots(figsize=(7, 4))
        modes = list(wake)
        for i, q in enumerate(("p50", "p95", "p99")):
            values = [wake[m]["latency_ms"].get(q) or 0 for m in modes]
            ax.bar([j + (i - 1) * 0.27 for j in range(len(modes))], values, 0.27, label=q)
        ax.set_xticks(range(len(modes)), modes)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title("Idle wake-up latency")
        ax.legend()
        save(fig, "wakeup.png")

    producers = results.get("producers", {})
    if producers:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, data in producers.items():
            levels = [k for k, v in data["levels"].items() if "on" in v]
            for trigger, style in (("on", "-"), ("off", "--")):
                ax.plot(
                    [int(k) for k in levels],
                    [data["levels"][k][trigger] for k in levels],
                    style,
                    marker="o",
                    color=colors.get(name),
                    label=f"{name}, trigger {trigger}",
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent producers")
        ax.set_ylabel("commits/s")
        ax.set_title("Producer commit rate, consumer running")
        ax.legend()
        save(fig, "producers.png")

    rss = results.get("rss", {})
    if rss:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, row in rss.items():
            ax.plot(
                [s[1] for s in row["samples"]],
                [s[2] for s in row["samples"]],
                color=colors.get(name),
                label=f"{name} ({row['events']:,} events)",
            )
        ax.set_xlabel("events handled")
        ax.set_ylabel("RSS MB")
        ax.set_title("Consumer RSS during the largest drain")
        ax.legend()
        save(fig, "rss.png")
    return written


def write(results: dict[str, Any], out: Path, *, plots: bool = True) -> dict[str, Path]:
    """Write results.json, results.md and (if matplotlib is installed) the plots."""
    out.mkdir(parents=True, exist_ok=True)
    results["targets"] = targets(results)
    paths = {"json": out / "results.json", "markdown": out / "results.md"}
    paths["json"].write_text(json.dumps(results, indent=1, default=str) + "\n")
    paths["markdown"].write_text(markdown(results))
    if plots:
        try:
            for path in plot(results, out):
                paths[path.stem] = path
        except ImportError:
            pass  # pip install 'aiooutbox[bench]' for plots
    return paths
