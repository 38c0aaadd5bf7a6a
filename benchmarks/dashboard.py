"""The dashboard scenario (``--only dashboard``; not in the default run):

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
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx

from . import dashboard_data
from .common import median, with_database

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
    ("event (waiting, position)", "GET", "/events/{waiting_id}", None),
    ("dead", "GET", "/dead", None),
    ("dead of a topic", "GET", "/dead?topic=topic.03", None),
    ("dead retry, confirm count", "POST", "/dead/confirm", {"action": "retry", "mode": "filter"}),
    ("ordering keys", "GET", "/keys", None),
    ("consumers", "GET", "/consumers", None),
    ("audit", "GET", "/audit", None),
]


async def _dataset(bench: Any, done: int, pending: int) -> tuple[str, bool]:
    """The big database: reused when it already holds this dataset (it takes minutes)."""
    name = f"{bench.prefix}aiooutbox_dashboard"
    dsn = with_database(bench.admin_dsn, name)
    with contextlib.suppress(asyncpg.InvalidCatalogNameError, OSError):
        conn = await asyncpg.connect(dsn)
        try:
            await _migrate(conn)
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


async def pages(bench: Any, done: int, pending: int, repeat: int) -> dict[str, Any]:
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
        app = create_app(pool=pool, anonymous="write")
        dashboard = app.state.dashboard
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
            first = await client.get("/dead")
            csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', first.text)
            for name, method, path, form in PAGES:
                path = path.format(done_id=done_id, waiting_id=waiting_id)
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
        await dashboard.aclose()
    finally:
        await pool.close()
    out["loadavg_end"] = list(os.getloadavg())
    return out


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


async def drain_with_dashboard(bench: Any, n: int, rounds: int, browsers: int) -> dict[str, Any]:
    from .aiooutbox_runner import NAME
    from .common import BackendCpu

    system = bench.systems[NAME]
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    seen: list[dict[str, Any]] = []
    load_start = list(os.getloadavg())
    # this process's own CPU per drain: the drain's monitoring both ways, and on the
    # dashboard's rounds the simulated browsers too (a real browser runs elsewhere)
    bench_cpu: dict[str, list[float]] = {"off": [], "on": []}
    loads: list[float] = []  # the 1-minute load average as each round began
    for r in range(rounds):
        loads.append(round(os.getloadavg()[0], 2))
        for variant in ("off", "on") if r % 2 == 0 else ("on", "off"):
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


async def drain_only(bench: Any) -> None:
    """``--only dashboard-drain``: the drain part alone (no 10M-row database)."""
    config = bench.config
    bench.log("dashboard: drain with a dashboard open vs without")
    result = await drain_with_dashboard(
        bench, config.dashboard_drain, config.dashboard_rounds, config.dashboard_browsers
    )
    bench.results["dashboard"] = {"drain": result}


async def run(bench: Any) -> None:
    config = bench.config
    bench.log("dashboard: pages beside a large table")
    result: dict[str, Any] = await pages(
        bench, config.dashboard_done, config.dashboard_pending, config.dashboard_repeat
    )
    bench.log("dashboard: drain with a dashboard open vs without")
    result["drain"] = await drain_with_dashboard(
        bench, config.dashboard_drain, config.dashboard_rounds, config.dashboard_browsers
    )
    bench.results["dashboard"] = result
