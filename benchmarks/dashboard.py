"""The dashboard scenario (``--only dashboard``; not in the default run):

1. every page's server time beside 10M rows (1M pending over 50 topics, 9M done): the
   app in-process, each request through the whole ASGI stack with the page cache
   emptied first, so each one reads the database;
2. a drain with a dashboard open (a real server, and browsers simulated as the page's
   own script behaves: an SSE stream, each pulse refetching the overview) vs none,
   rounds alternated; the ratio of medians should stay ≥ 0.97.
"""

from __future__ import annotations

import asyncio
import contextlib
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
            if abs(rows - done - pending) < 0.02 * (done + pending):
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
    out: dict[str, Any] = {"rows": done + pending, "reused_dataset": reused, "pages": {}}
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
    return out


@contextlib.asynccontextmanager
async def open_dashboard(dsn: str, browsers: int) -> AsyncIterator[dict[str, int]]:
    """A dashboard server with ``browsers`` simulated pages on its overview."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aiooutbox",
        "dashboard",
        "--dsn",
        dsn,
        "--port",
        "0",
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
    stats = {"pulses": 0, "refreshes": 0}

    async def browser() -> None:
        async with httpx.AsyncClient(timeout=None) as client:
            await client.get(url + "/")
            async with client.stream("GET", url + "/live") as stream:
                async for raw in stream.aiter_lines():
                    if raw.startswith("data: "):
                        stats["pulses"] += 1
                        await client.get(url + "/", headers={"X-Dashboard-Partial": "1"})
                        stats["refreshes"] += 1

    tasks = [asyncio.create_task(browser()) for _ in range(browsers)]
    try:
        yield stats
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        proc.terminate()
        await proc.wait()


async def drain_with_dashboard(bench: Any, n: int, rounds: int, browsers: int) -> dict[str, Any]:
    from .aiooutbox_runner import NAME

    system = bench.systems[NAME]
    runs: dict[str, list[float]] = {"off": [], "on": []}
    refreshes = []
    for r in range(rounds):
        for variant in ("off", "on") if r % 2 == 0 else ("on", "off"):
            if variant == "on":
                async with open_dashboard(system.dsn, browsers) as stats:
                    result = await bench.drain_once(system, n, label=f"r{r + 1} dashboard ")
                refreshes.append(stats["refreshes"])
            else:
                result = await bench.drain_once(system, n, label=f"r{r + 1} no dashboard ")
            runs[variant].append(result["rate"])
    ratio = median(runs["on"]) / median(runs["off"])
    bench.log(f"  drain with a dashboard open / without: {ratio:.3f}")
    return {
        "events": n,
        "browsers": browsers,
        "rates_off": runs["off"],
        "rates_on": runs["on"],
        "overview_refreshes": refreshes,
        "ratio": round(ratio, 3),
    }


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
