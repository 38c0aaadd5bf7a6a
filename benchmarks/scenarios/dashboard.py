"""``dashboard`` (only with ``--only``: it builds a 10M-row database, minutes):

1. every page's server time beside 10M rows (1M pending over 50 topics, 9M done): the
   app in-process, each request through the whole ASGI stack with the page cache
   emptied first, so each one reads the database;
2. a drain with a dashboard open (a real server at the default 2 s refresh, and
   browsers simulated as the page's own script behaves: an SSE stream, each changed
   pulse refetching the page's content; on the overview, consumers, events and dead
   views) vs none, rounds alternated; the ratio of medians should stay ≥ 0.97. Also
   measured: the CPU the dashboard's own database sessions use, and the pulse
   statement's cost. ``--only dashboard-drain`` runs this part alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx

from .. import dashboard_data
from ..harness.bench import AIO, Bench
from ..harness.cpu import BackendCpu
from ..harness.databases import with_database
from ..harness.markdown import fmt, table
from ..harness.rounds import alternated
from ..harness.scenario import Scenario, sizes_of
from ..harness.stats import median


@dataclass
class Sizes:
    dashboard_done: int = 9_000_000
    dashboard_pending: int = 1_000_000
    dashboard_repeat: int = 5
    dashboard_drain: int = 200_000
    dashboard_rounds: int = 8
    dashboard_browsers: int = 4


PAGES = [
    ("overview", "GET", "/", None),
    ("events", "GET", "/events", None),
    ("events topic", "GET", "/events?topic=topic.07", None),
    ("events pending of a topic", "GET", "/events?status=pending&topic=topic.07", None),
    ("events done", "GET", "/events?status=done", None),
    ("events payload @>", "GET", '/events?payload={{"customer":"c-5"}}', None),
    ("events ordering key", "GET", "/events?ordering_key=key-5", None),
    (
        "events time range",
        "GET",
        "/events?created_from=2000-01-01T00:00&created_to=2100-01-01T00:00",
        None,
    ),
    ("event (done)", "GET", "/events/{done_id}", None),
    ("event (dead, attempt history)", "GET", "/events/{dead_id}", None),
    ("topic page", "GET", "/topics/topic.07", None),
    ("events scheduled of a topic", "GET", "/events?status=scheduled&topic=topic.07", None),
    ("event (waiting, position)", "GET", "/events/{waiting_id}", None),
    ("dead", "GET", "/dead", None),
    ("dead of a topic", "GET", "/dead?topic=topic.03", None),
    ("dead retry, confirm count", "POST", "/dead/confirm", {"action": "retry", "mode": "filter"}),
    ("ordering keys", "GET", "/keys", None),
    ("consumers", "GET", "/consumers", None),
    ("audit", "GET", "/audit", None),
]


async def _dataset(bench: Bench, done: int, pending: int) -> tuple[str, bool]:
    """The big database: reused when it already holds this dataset (it takes minutes)."""
    name = f"{bench.prefix}aiooutbox_dashboard"
    dsn = with_database(bench.admin_dsn, name)
    with contextlib.suppress(asyncpg.InvalidCatalogNameError, OSError):
        conn = await asyncpg.connect(dsn)
        try:
            await _migrate(conn)
            await dashboard_data.add_history(conn)  # a dataset made before it existed
            rows = await conn.fetchval(
                "SELECT reltuples FROM pg_class WHERE oid = 'outbox_events'::regclass"
            )
            expected = done + pending + dashboard_data.EXTRA_ROWS
            if abs(rows - expected) < 0.02 * expected:
                return dsn, True
        finally:
            await conn.close()
    bench.log(f"  creating {name}: {done + pending:,} rows (minutes)")
    return await dashboard_data.create(
        bench.admin_dsn, name, done=done, pending=pending, log=bench.log
    ), False


async def _migrate(conn: asyncpg.Connection) -> None:
    import aiooutbox

    await aiooutbox.migrate(conn)


async def pages(bench: Bench, done: int, pending: int, repeat: int) -> dict[str, Any]:
    from aiooutbox.web import create_app

    dsn, reused = await _dataset(bench, done, pending)
    pool = await asyncpg.create_pool(
        dsn, min_size=1, max_size=4, server_settings={"jit": "off", "statement_timeout": "10s"}
    )
    out: dict[str, Any] = {
        "rows": done + pending,
        "reused_dataset": reused,
        "pages": {},
        "loadavg_start": list(os.getloadavg()),  # the machine is shared: say how busy
    }
    try:
        done_id = await pool.fetchval("SELECT max(id) FROM outbox_events WHERE id < 9000000")
        waiting_id = await pool.fetchval(
            "SELECT max(id) FROM outbox_events WHERE ordering_key = 'key-5' AND status = 'waiting'"
        )
        dead_id = await pool.fetchval("SELECT max(id) FROM outbox_events WHERE status = 'dead'")
        app = create_app(pool=pool, anonymous="write")
        dashboard = app.state.dashboard
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
            first = await client.get("/dead")
            csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', first.text)
            for name, method, path, form in PAGES:
                path = path.format(done_id=done_id, waiting_id=waiting_id, dead_id=dead_id)
                times = []
                for _ in range(repeat):
                    dashboard.cache.clear()
                    started = time.perf_counter()
                    if method == "GET":
                        r = await client.get(path)
                    else:
                        r = await client.post(
                            path, data={**(form or {}), "csrf": csrf[1] if csrf else ""}
                        )
                    times.append((time.perf_counter() - started) * 1000)
                    assert r.status_code == 200, (name, r.status_code, r.text[-500:])
                out["pages"][name] = {
                    "median_ms": round(median(times), 1),
                    "max_ms": round(max(times), 1),
                }
                bench.log(f"  {name:28} median {median(times):7.1f} ms, max {max(times):7.1f} ms")
            out["backlog"] = cost = await _backlog_cost(dashboard, repeat)
            bench.log(
                f"  {'backlog (exact, when the pulse moved)':28} median {cost['median_ms']:7.1f}"
                f" ms, max {cost['max_ms']:7.1f} ms"
            )
        await dashboard.aclose()
    finally:
        await pool.close()
    out["loadavg_end"] = list(os.getloadavg())
    return out


async def _backlog_cost(dashboard: Any, repeat: int) -> dict[str, float]:
    """The exact backlog counts the pages share (cached with the pulse, apart from the
    page cache cleared above): what one count costs when the pulse has moved."""
    from aiooutbox.web._backlog import read_backlog

    times = []
    for _ in range(repeat):
        async with dashboard.connection() as conn:
            started = time.perf_counter()
            counted = await read_backlog(conn, dashboard.w)
            times.append((time.perf_counter() - started) * 1000)
    assert counted.exact
    return {"median_ms": round(median(times), 1), "max_ms": round(max(times), 1)}


# what the simulated browsers show: one each, in turn (the views the operator keeps open)
VIEWS = ["/", "/consumers", "/events", "/dead"]
REFRESH = 2.0  # the dashboard's documented default interval (--refresh 2s)


@contextlib.asynccontextmanager
async def open_dashboard(dsn: str, browsers: int) -> AsyncIterator[dict[str, int]]:
    """A dashboard server (``python -m aiooutbox dashboard --refresh 2s``) with
    ``browsers`` simulated pages, each behaving as the page's own script does: load the
    page, keep its server-sent event stream open, and on each pulse that differs from
    what the page shows fetch the page's content again (one fetch at a time; a pulse
    that arrives during a fetch is fetched once after it)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aiooutbox",
        "dashboard",
        "--dsn",
        dsn,
        "--port",
        "0",
        "--refresh",
        f"{REFRESH:g}s",
        "--log-level",
        "warning",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
    match = re.search(r"on (http://\S+/)", line)
    assert match, line
    url = match[1].rstrip("/")
    stats = {"pulses": 0, "refreshes": 0, "streams": 0}

    async def browser(view: str) -> None:
        async with httpx.AsyncClient(timeout=None) as client:
            first = await client.get(url + view)
            shown = first.headers.get("x-dashboard-pulse", "")
            pending = asyncio.Event()

            async def fetcher() -> None:
                nonlocal shown
                while True:
                    await pending.wait()
                    pending.clear()
                    r = await client.get(url + view, headers={"X-Dashboard-Partial": "1"})
                    shown = r.headers.get("x-dashboard-pulse", shown)
                    stats["refreshes"] += 1

            fetching = asyncio.create_task(fetcher())
            try:
                async with client.stream("GET", url + "/live") as stream:
                    stats["streams"] += 1
                    async for raw in stream.aiter_lines():
                        if raw.startswith("data: "):
                            stats["pulses"] += 1
                            if raw[6:] != shown:
                                pending.set()
            finally:
                fetching.cancel()

    import psutil

    server = psutil.Process(proc.pid)
    cpu = server.cpu_times()
    tasks = [asyncio.create_task(browser(VIEWS[i % len(VIEWS)])) for i in range(browsers)]
    try:
        yield stats
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        end = server.cpu_times()
        # the dashboard process itself (rendering, SSE), on the same cores as the drain
        stats["process_cpu_ms"] = round((end.user + end.system - cpu.user - cpu.system) * 1000)
        proc.terminate()
        await proc.wait()


async def pulse_cost(dsn: str, samples: int = 300) -> dict[str, float]:
    """The pulse statement's cost: client round trip and server execution time (median)."""
    from aiooutbox._sql.statements import queries
    from aiooutbox.web._sql import WebQueries

    sql = WebQueries(queries("public", "outbox_events")).pulse
    conn = await asyncpg.connect(dsn)
    try:
        for _ in range(20):
            await conn.fetchrow(sql, "public", "outbox_events")
        trips = []
        for _ in range(samples):
            started = time.perf_counter()
            await conn.fetchrow(sql, "public", "outbox_events")
            trips.append((time.perf_counter() - started) * 1000)
        explain = "EXPLAIN (ANALYZE, FORMAT JSON) " + sql
        server = []
        for _ in range(50):
            plan = await conn.fetchval(explain, "public", "outbox_events")
            server.append(json.loads(plan)[0]["Execution Time"])
    finally:
        await conn.close()
    return {"round_trip_ms": round(median(trips), 3), "server_ms": round(median(server), 3)}


async def drain_with_dashboard(bench: Bench, n: int, rounds: int, browsers: int) -> dict[str, Any]:
    system = bench.systems[AIO]
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    seen: list[dict[str, Any]] = []
    load_start = list(os.getloadavg())
    # this process's own CPU per drain: the drain's monitoring both ways, and on the
    # dashboard's rounds the simulated browsers too (a real browser runs elsewhere)
    bench_cpu: dict[str, list[float]] = {"off": [], "on": []}
    loads: list[float] = []  # the 1-minute load average as each round began
    for r in range(rounds):
        loads.append(round(os.getloadavg()[0], 2))
        for variant in alternated(("off", "on"), r):
            label = f"r{r + 1} {'dashboard' if variant == 'on' else 'no dashboard'} "
            cpu_before = time.process_time()
            if variant == "on":
                async with (
                    open_dashboard(system.dsn, browsers) as stats,
                    BackendCpu(
                        bench.admin_dsn, system.database, application="aiooutbox dashboard"
                    ) as dash_cpu,
                ):
                    started = time.perf_counter()
                    result = await bench.drain_once(system, n, label=label)
                    wall = time.perf_counter() - started
                seen.append(
                    {
                        **stats,
                        "wall_s": round(wall, 2),
                        "dashboard_db_cpu_s": dash_cpu.seconds,
                        "drain_s": result["elapsed_s"],
                    }
                )
            else:
                result = await bench.drain_once(system, n, label=label)
            bench_cpu[variant].append(round(time.process_time() - cpu_before, 3))
            runs[variant].append(result)
    on = [x["rate"] for x in runs["on"]]
    off = [x["rate"] for x in runs["off"]]
    ratio = median(on) / median(off)
    pairs = [a / b for a, b in zip(on, off, strict=True)]
    geomean = math.exp(sum(math.log(p) for p in pairs) / len(pairs))
    process_per_s = [x["process_cpu_ms"] / 1000 / x["wall_s"] for x in seen]
    cpu_per_s = [
        x["dashboard_db_cpu_s"] / x["wall_s"] for x in seen if x["dashboard_db_cpu_s"] is not None
    ]
    cost = await pulse_cost(system.dsn)
    bench.log(
        f"  drain with a dashboard open / without: {ratio:.3f} (medians {median(on):,.0f}"
        f" vs {median(off):,.0f}/s; per round {min(pairs):.3f}-{max(pairs):.3f},"
        f" their geometric mean {geomean:.3f})"
    )
    bench.log(
        f"  the dashboard's database CPU: {median(cpu_per_s) * 100:.2f}% of a core"
        f" ({median(cpu_per_s) * REFRESH * 1000:.1f} ms per {REFRESH:g} s interval);"
        f" pulse: {cost['server_ms']} ms server, {cost['round_trip_ms']} ms round trip;"
        f" the dashboard process: {median(process_per_s) * 100:.1f}% of a core"
    )
    return {
        "events": n,
        "browsers": browsers,
        "views": [VIEWS[i % len(VIEWS)] for i in range(browsers)],
        "refresh_s": REFRESH,
        "rates_off": off,
        "rates_on": on,
        "round_ratios": [round(p, 3) for p in pairs],
        "round_ratios_geomean": round(geomean, 3),
        "round_loadavg": loads,
        "bench_cpu_off_s": bench_cpu["off"],
        "bench_cpu_on_s": bench_cpu["on"],
        "db_cpu_off_s": [x["db_cpu_s"] for x in runs["off"]],
        "db_cpu_on_s": [x["db_cpu_s"] for x in runs["on"]],
        "dashboard": seen,
        "dashboard_db_cpu_share": round(median(cpu_per_s), 5) if cpu_per_s else None,
        "dashboard_process_cpu_share": round(median(process_per_s), 4),
        "pulse": cost,
        "ratio": round(ratio, 3),
        "loadavg_start": load_start,
        "loadavg_end": list(os.getloadavg()),
    }


async def drain_only(bench: Bench) -> None:
    """``--only dashboard-drain``: the drain part alone (no 10M-row database)."""
    config = sizes_of(bench.config, Sizes)
    bench.log("dashboard: drain with a dashboard open vs without")
    result = await drain_with_dashboard(
        bench, config.dashboard_drain, config.dashboard_rounds, config.dashboard_browsers
    )
    bench.results["dashboard"] = {"drain": result}


async def run(bench: Bench) -> None:
    config = sizes_of(bench.config, Sizes)
    bench.log("dashboard: pages beside a large table")
    result: dict[str, Any] = await pages(
        bench, config.dashboard_done, config.dashboard_pending, config.dashboard_repeat
    )
    bench.log("dashboard: drain with a dashboard open vs without")
    result["drain"] = await drain_with_dashboard(
        bench, config.dashboard_drain, config.dashboard_rounds, config.dashboard_browsers
    )
    bench.results["dashboard"] = result


def section(results: dict[str, Any]) -> list[str]:
    board = results.get("dashboard")
    if not board or not board.get("pages"):
        return []
    lines = table(
        f"Dashboard pages beside {board['rows']:,} rows (server time, cache emptied)",
        "| page | median ms | max ms |",
        "|---|---:|---:|",
    )
    for name, row in board["pages"].items():
        lines.append(f"| {name} | {fmt(row['median_ms'], 1)} | {fmt(row['max_ms'], 1)} |")
    return lines


def drain_section(results: dict[str, Any]) -> list[str]:
    drain = (results.get("dashboard") or {}).get("drain")
    if not drain:
        return []
    pairs = drain.get("round_ratios") or []
    lines = [
        "",
        f"## Drain of {drain['events']:,} events with a dashboard open / without",
        "",
        f"{drain['browsers']} simulated pages ({', '.join(drain.get('views', []))}),"
        f" refresh {drain.get('refresh_s', 2):g} s. Ratio of medians"
        f" **{fmt(drain['ratio'], 3)}** over {len(drain['rates_on'])} alternated rounds"
        f" each (medians {fmt(statistics.median(drain['rates_on']))} vs"
        f" {fmt(statistics.median(drain['rates_off']))}/s"
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
    return lines


SCENARIO = Scenario(
    "dashboard",
    run,
    sizes=Sizes,
    quick={
        "dashboard_done": 200_000,
        "dashboard_pending": 20_000,
        "dashboard_repeat": 2,
        "dashboard_drain": 20_000,
        "dashboard_rounds": 2,
    },
    default=False,
    sections=((80, section), (90, drain_section)),
)
#: the drain with a dashboard open, alone (no large database); its sizes are the above's
DRAIN_ONLY = Scenario("dashboard-drain", drain_only, sizes=Sizes, default=False)
