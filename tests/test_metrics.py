"""Prometheus metrics, queue gauges and /healthz (issue 15), on real PostgreSQL.

What `/metrics` serves is read back with prometheus_client's own parser; the outage
test stops a private server, never the shared one.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import aiooutbox
from aiooutbox._sql.statements import queries
from aiooutbox.health import ConsumerHealth
from aiooutbox.metrics import MetricsServer, OutboxMetrics
from tests.clirunner import Runner, clean_env, cli
from tests.faults.private_pg import private_postgres
from tests.helpers import backdate, insert_unchecked, running, truthy, wait_until

ROOT = Path(__file__).resolve().parent.parent


async def http_get(port: int, path: str, method: str = "GET") -> tuple[int, str]:
    """One request to the server on 127.0.0.1:port; (status code, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return int(head.split(" ", 2)[1]), body


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics body, keyed by name and sorted labels."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(found: dict[Any, float], name: str, **labels: str) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


async def test_counters_are_exact_after_a_known_mix_of_outcomes(
    pool: asyncpg.Pool, registry: CollectorRegistry
) -> None:
    metrics = OutboxMetrics(registry)
    slow_started = asyncio.Event()
    slow_running = 0

    async def ok(event: aiooutbox.Event) -> None:
        pass

    async def flaky(event: aiooutbox.Event) -> None:
        if event.attempts == 1:
            raise aiooutbox.Retry(delay=0)

    async def dead(event: aiooutbox.Event) -> None:
        raise aiooutbox.Dead("no")

    async def slow(event: aiooutbox.Event) -> None:
        nonlocal slow_running
        slow_running += 1
        if slow_running == 2:
            slow_started.set()
        await asyncio.sleep(60)

    handlers = {"t.ok": ok, "t.flaky": flaky, "t.dead": dead, "t.slow": slow}
    events = [aiooutbox.NewEvent("t.ok", {}) for _ in range(3)]
    events += [aiooutbox.NewEvent("t.flaky", {}) for _ in range(2)]
    events += [aiooutbox.NewEvent("t.dead", {})]
    events += [aiooutbox.NewEvent("t.slow", {}) for _ in range(2)]
    await aiooutbox.enqueue_many(pool, events)
    consumer = aiooutbox.OutboxConsumer(
        pool, poll_interval=0.1, shutdown_grace=0.05, observers=[metrics]
    )
    async with MetricsServer(registry, port=0) as server, consumer:
        async with running(consumer, handlers):
            await asyncio.wait_for(slow_started.wait(), 30)
            await wait_until(truthy(lambda: consumer.stats.done == 5))
            status, body = await http_get(server.port, "/metrics")
            assert status == 200
            during = samples(body)
            assert value(during, "aiooutbox_in_flight") == 2
            assert value(during, "aiooutbox_listener_connected") == 1
            assert value(during, "aiooutbox_settle_backlog") is not None
        status, body = await http_get(server.port, "/metrics")
    assert status == 200
    found = samples(body)
    expected = {
        ("t.ok", "done"): 3,
        ("t.flaky", "retry"): 2,
        ("t.flaky", "done"): 2,
        ("t.dead", "dead"): 1,
        ("t.slow", "released"): 2,
    }
    counted = {
        (dict(labels)["topic"], dict(labels)["outcome"]): v
        for (name, labels), v in found.items()
        if name == "aiooutbox_events_total"
    }
    assert counted == expected
    runs = {"t.ok": 3, "t.flaky": 4, "t.dead": 1, "t.slow": 2}
    for topic, count in runs.items():
        assert value(found, "aiooutbox_handler_duration_seconds_count", topic=topic) == count
        assert (
            value(found, "aiooutbox_handler_duration_seconds_bucket", topic=topic, le="+Inf")
            == count
        )
    assert value(found, "aiooutbox_claimed_total") == 10
    claims = value(found, "aiooutbox_claims_total")
    assert claims is not None and claims >= 1
    assert value(found, "aiooutbox_claim_duration_seconds_count") == claims
    # a stopped consumer holds nothing
    assert value(found, "aiooutbox_in_flight") == 0
    assert value(found, "aiooutbox_listener_connected") is None


async def test_queue_lag_moves_while_a_topic_is_left_unconsumed(
    pool: asyncpg.Pool, registry: CollectorRegistry
) -> None:
    metrics = OutboxMetrics(registry)
    old = await aiooutbox.enqueue(pool, "nobody.consumes", {})
    await backdate(
        pool, "UPDATE outbox_events SET available_at = now() - interval '30 s' WHERE id = $1", old
    )
    await aiooutbox.enqueue(pool, "nobody.consumes", {})
    await aiooutbox.enqueue(pool, "later", {}, delay=3600)
    async with (
        MetricsServer(registry, port=0) as server,
        metrics.queue_gauges(pool, interval=0.05) as gauges,
    ):
        first = samples((await http_get(server.port, "/metrics"))[1])
        lag = value(first, "aiooutbox_queue_lag_seconds", topic="nobody.consumes")
        assert lag is not None and 29 < lag < 3600, first
        assert value(first, "aiooutbox_queue_depth", topic="nobody.consumes", status="pending") == 2
        # delayed, not due: counted in the depth as scheduled, no lag
        assert value(first, "aiooutbox_queue_depth", topic="later", status="scheduled") == 1
        assert value(first, "aiooutbox_queue_depth", topic="later", status="pending") is None
        assert value(first, "aiooutbox_queue_lag_seconds", topic="later") == 0
        assert value(first, "aiooutbox_queue_stats_timestamp_seconds") is not None
        refreshes = gauges.refreshes

        async def moved() -> bool:
            now = samples((await http_get(server.port, "/metrics"))[1])
            later = value(now, "aiooutbox_queue_lag_seconds", topic="nobody.consumes")
            return gauges.refreshes > refreshes and later is not None and later > lag + 0.2

        await wait_until(moved, timeout=30)


async def test_queue_gauges_count_processing_rows_and_drop_when_stale(pool: asyncpg.Pool) -> None:
    registry = CollectorRegistry()
    metrics = OutboxMetrics(registry)
    await aiooutbox.enqueue(pool, "busy", {})
    await pool.execute(
        "UPDATE outbox_events SET status = 'processing', locked_by = 'w',"
        " lease_expires_at = now() + interval '1 minute'"
    )
    async with metrics.queue_gauges(pool, interval=0.05) as gauges:
        found = samples(_exposition(registry))
        assert value(found, "aiooutbox_queue_depth", topic="busy", status="processing") == 1
        assert value(found, "aiooutbox_queue_lag_seconds", topic="busy") == 0
        gauges._fresh_until = 0.0  # as if the last refresh were three intervals old
        assert (
            value(
                samples(_exposition(registry)),
                "aiooutbox_queue_depth",
                topic="busy",
                status="processing",
            )
            is None
        )
    with pytest.raises(RuntimeError, match="already tracks"):
        async with metrics.queue_gauges(pool), metrics.queue_gauges(pool):
            pass


async def test_group_gauges_show_only_the_top_groups(pool: asyncpg.Pool) -> None:
    """Thousands of tenants make no label explosion: the ten groups with the most due
    events, and the ten with the most running, are shown."""
    registry = CollectorRegistry()
    metrics = OutboxMetrics(registry)
    await aiooutbox.enqueue_many(
        pool,
        [aiooutbox.NewEvent("t", {}, group=f"tenant-{i:04d}") for i in range(1000)]
        + [aiooutbox.NewEvent("t", {}, group="big") for _ in range(5)]
        + [aiooutbox.NewEvent("t", {}) for _ in range(9)],
    )
    await pool.execute(
        "UPDATE outbox_events SET status = 'processing', locked_by = 'w',"
        " lease_expires_at = now() + interval '1 minute'"
        " WHERE id IN (SELECT id FROM outbox_events_all WHERE grp = 'big' LIMIT 2)"
    )
    async with metrics.queue_gauges(pool, interval=0.05):
        text = _exposition(registry)
    lines = [x for x in text.splitlines() if x.startswith("aiooutbox_group_events{")]
    due = [x for x in lines if 'state="due"' in x]
    running = [x for x in lines if 'state="running"' in x]
    assert len(due) == 10 and len(running) == 1, lines
    assert any('group="big"' in x and x.endswith(" 3.0") for x in due), due
    assert 'group="big"' in running[0] and running[0].endswith(" 2.0")


def _exposition(registry: CollectorRegistry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()


async def test_queue_gauges_query_reads_only_unfinished_rows_of_a_big_table(
    conn: asyncpg.Connection,
) -> None:
    q = queries()
    await insert_unchecked(
        conn,
        "INSERT INTO outbox_events (topic, payload, status, attempts, finished_at)"
        " SELECT 't' || (g % 5), '{}', 'done', 1, now() FROM generate_series(1, 200000) g",
    )
    await conn.execute(
        "INSERT INTO outbox_events (topic, payload) SELECT 't' || (g % 5), '{}'"
        " FROM generate_series(1, 500) g"
    )
    await insert_unchecked(
        conn,
        "INSERT INTO outbox_events (topic, payload, status, locked_by, lease_expires_at)"
        " SELECT 't1', '{}', 'processing', 'w', now() + interval '1 minute'"
        " FROM generate_series(1, 20)",
    )
    for key in ("a", "b"):  # an ordered key: one head, the rest waiting
        for _ in range(3):
            await aiooutbox.enqueue(conn, "t2", {}, ordering_key=key)
    await conn.execute("ANALYZE outbox_events")
    plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + q.queue_gauges))
    assert "Seq Scan" not in plan, plan
    assert "outbox_events_topic_claimable_idx" in plan, plan
    assert "outbox_events_key_idx" in plan, plan
    assert "outbox_events_lease_idx" in plan, plan
    rows = await conn.fetch(q.queue_gauges)
    depth = {(r[0], r[1]): r[2] for r in rows}
    assert sum(v for (_, s), v in depth.items() if s == "pending") == 502
    assert depth[("t1", "processing")] == 20
    assert depth[("t2", "waiting")] == 4


async def test_mvcc_gauges_follow_a_transaction_that_pins_the_horizon(dsn: str) -> None:
    """A REPEATABLE READ transaction held open while the consumer drains events: the
    horizon's age gauge rises while it lasts and falls back once it ends, and the drain's
    dead tuples show. The numbers come from the watchdog's own checks, never a query per
    scrape; a stopped consumer serves none."""
    registry = CollectorRegistry()
    metrics = OutboxMetrics(registry)
    table = "public.outbox_events"
    holder = await asyncpg.connect(dsn, server_settings={"application_name": "long-report"})
    handled = 0

    async def handler(event: aiooutbox.Event) -> None:
        nonlocal handled
        handled += 1

    def age(found: dict[Any, float]) -> float | None:
        return value(found, "aiooutbox_xmin_horizon_age_seconds", holder="backend")

    try:
        async with asyncpg.create_pool(dsn, min_size=1, max_size=4) as pool:
            consumer = aiooutbox.OutboxConsumer(
                pool, poll_interval=0.1, watchdog_interval=1.0, observers=[metrics]
            )
            async with (
                MetricsServer(registry, port=0) as server,
                consumer,
                running(consumer, {"t": handler}),
            ):

                async def scrape() -> dict[Any, float]:
                    return samples((await http_get(server.port, "/metrics"))[1])

                async def checked() -> bool:
                    return age(await scrape()) is not None

                await wait_until(checked, 30)
                before = await scrape()
                tx = holder.transaction(isolation="repeatable_read")
                await tx.start()
                await holder.fetchval("SELECT count(*) FROM outbox_events_all")  # the snapshot
                await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("t", {})] * 500)
                await wait_until(truthy(lambda: handled == 500), 60)

                async def pinned() -> bool:
                    found = await scrape()
                    held, dead = age(found), value(found, "aiooutbox_dead_tuples", table=table)
                    return held is not None and held >= 3 and dead is not None and dead >= 500

                await wait_until(pinned, 60)
                during = await scrape()
                await tx.rollback()
                ended = time.time()

                async def released() -> bool:
                    found = await scrape()
                    at = value(found, "aiooutbox_mvcc_check_timestamp_seconds", table=table)
                    now = age(found)
                    return at is not None and at > ended and now is not None and now < 1.0

                await wait_until(released, 60)
                after = await scrape()
        stopped = samples(_exposition(registry))
    finally:
        await holder.close()
    mvcc = [
        (name, dict(labels), v)
        for when in (before, during, after)
        for (name, labels), v in when.items()
        if "horizon" in name or "tuples" in name
    ]
    print(*mvcc, sep="\n")
    during_age = age(during)
    assert during_age is not None and during_age >= 3
    after_age = age(after)
    assert after_age is not None and after_age < during_age
    xid_before = value(before, "aiooutbox_xmin_horizon_xid_age", holder="backend")
    xid_held = value(during, "aiooutbox_xmin_horizon_xid_age", holder="backend")
    # the enqueue, the claims and the settles took transaction ids since the snapshot
    assert xid_before is not None and xid_held is not None and xid_held > xid_before
    assert value(during, "aiooutbox_xmin_horizon_age_seconds", holder="prepared_transaction") == 0
    assert value(during, "aiooutbox_xmin_horizon_xid_age", holder="replication_slot") is not None
    live = value(during, "aiooutbox_live_tuples", table=table)
    assert live is not None
    assert age(stopped) is None
    assert value(stopped, "aiooutbox_dead_tuples", table=table) is None


@pytest.mark.slow  # starts and stops a private server
async def test_healthz_is_503_while_the_database_is_down_and_200_after() -> None:
    with private_postgres() as server:
        admin = await asyncpg.connect(server.dsn)
        try:
            await aiooutbox.migrate(admin)
        finally:
            await admin.close()
        health = ConsumerHealth()
        async with asyncpg.create_pool(server.dsn, min_size=1, max_size=4, timeout=2) as pool:
            consumer = aiooutbox.OutboxConsumer(
                pool, poll_interval=0.1, statement_timeout=1.0, observers=[health]
            )
            assert health.max_silence == pytest.approx(1.3)

            async def answer() -> int:
                return (await http_get(web.port, "/healthz"))[0]

            async def answers(code: int) -> bool:
                return await answer() == code

            async with MetricsServer(CollectorRegistry(), health, port=0) as web, consumer:
                assert await answer() == 503  # not running yet
                async with running(consumer, {"t": _noop}):
                    await consumer.wait_started()
                    await wait_until(lambda: answers(200), timeout=30)
                    body = json.loads((await http_get(web.port, "/healthz"))[1])
                    assert body["status"] == "ok" and body["reason"] == "claiming"
                    t0 = time.monotonic()
                    server.stop("fast")
                    try:
                        await wait_until(lambda: answers(503), timeout=60, interval=0.1)
                    except AssertionError:
                        raise AssertionError(
                            f"/healthz still 200 {time.monotonic() - t0:.1f}s after the stop"
                        ) from None
                    down = json.loads((await http_get(web.port, "/healthz"))[1])
                    assert "no successful claim" in down["reason"], down
                    t1 = time.monotonic()
                    server.start()
                    try:
                        await wait_until(lambda: answers(200), timeout=90, interval=0.1)
                    except AssertionError:
                        raise AssertionError(
                            f"/healthz not 200 {time.monotonic() - t1:.1f}s after the restart"
                        ) from None
                assert await answer() == 503  # stopped


async def _noop(event: aiooutbox.Event) -> None:
    pass


async def test_health_of_a_busy_consumer_probes_the_database(pool: asyncpg.Pool) -> None:
    health = ConsumerHealth(max_silence=0.2)
    release = asyncio.Event()

    async def hold(event: aiooutbox.Event) -> None:
        await release.wait()

    await aiooutbox.enqueue(pool, "t", {})
    consumer = aiooutbox.OutboxConsumer(pool, concurrency=1, observers=[health])
    status = await health.check()
    assert not status.ok and status.http_status == 503 and "not running" in status.reason
    async with consumer, running(consumer, {"t": hold}):
        await wait_until(truthy(lambda: consumer.stats.in_flight == 1))
        await asyncio.sleep(0.3)  # past max_silence with every slot busy: no claim is due

        async def probed() -> bool:
            result = await health.check()
            return result.ok and "slot busy" in result.reason

        await wait_until(probed)
        assert (await health.check()).details["probe"] == "answered"
        release.set()
    with pytest.raises(RuntimeError, match="one consumer"):
        aiooutbox.OutboxConsumer(pool, observers=[health])
    with pytest.raises(aiooutbox.InvalidArgument):
        ConsumerHealth(max_silence=0)


async def test_server_answers_only_what_it_serves(registry: CollectorRegistry) -> None:
    async with MetricsServer(registry, port=0) as server:
        assert server.host == "127.0.0.1"
        assert (await http_get(server.port, "/healthz"))[0] == 404  # no health given
        assert (await http_get(server.port, "/nothing"))[0] == 404
        assert (await http_get(server.port, "/metrics", "POST"))[0] == 405
        status, body = await http_get(server.port, "/metrics", "HEAD")
        assert status == 200 and body == ""
        # a client that connects and says nothing does not keep the server from stopping
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    with pytest.raises(aiooutbox.InvalidArgument):
        MetricsServer(registry, port=70000)
    with pytest.raises(TypeError):
        MetricsServer(registry, port="80")  # type: ignore[arg-type]


def test_one_set_of_families_per_registry(registry: CollectorRegistry) -> None:
    metrics = OutboxMetrics(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        OutboxMetrics(registry)
    metrics.unregister()
    OutboxMetrics(registry)  # free again


def _metric_names() -> set[str]:
    """Every sample name aiooutbox can serve, gauges of a consumer and the table included."""
    registry = CollectorRegistry()
    metrics = OutboxMetrics(registry)
    metrics.settled("t", "done")
    metrics.claimed(1, 0.01)
    metrics.handler_finished(aiooutbox.Event(1, "t", {}, None), None, "done", 0.1, None)
    names = {f.name for f in registry.collect()}
    names |= {s.name for f in registry.collect() for s in f.samples}
    names |= {
        "aiooutbox_listener_connected",
        "aiooutbox_queue_depth",
        "aiooutbox_queue_lag_seconds",
    }
    return names


def test_grafana_dashboard_is_json_naming_metrics_that_exist() -> None:
    dashboard = json.loads((ROOT / "examples" / "grafana_dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert exprs, "no panel queries"
    known = _metric_names()
    used = {name for e in exprs for name in re.findall(r"\baiooutbox_[a-z_]+", e)}
    assert used, exprs
    assert used <= known, sorted(used - known)
    required = {
        "aiooutbox_events_total", "aiooutbox_handler_duration_seconds_bucket",
        "aiooutbox_queue_lag_seconds", "aiooutbox_queue_depth", "aiooutbox_in_flight",
        "aiooutbox_listener_connected",
    }  # fmt: skip
    assert required <= used, sorted(required - used)


def test_alert_rules_in_the_docs_name_metrics_that_exist() -> None:
    text = (ROOT / "docs" / "observability.md").read_text()
    rules = re.findall(r"expr: (.+)", text)
    assert len(rules) >= 3, rules
    used = {name for r in rules for name in re.findall(r"\baiooutbox_[a-z_]+", r)}
    assert used <= _metric_names(), sorted(used - _metric_names())


# -- the command line -----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--metrics-port", "abc"], {}, "--metrics-port: expected a TCP port"),
        (["--metrics-port", "70000"], {}, "--metrics-port: expected a TCP port"),
        (["--metrics-port", "-1"], {}, "expected a TCP port"),
        ([], {"AIOOUTBOX_METRICS_PORT": "x"}, "$AIOOUTBOX_METRICS_PORT: expected a TCP port"),
        (["--metrics-host", "127.0.0.1"], {}, "--metrics-host needs --metrics-port"),
        (["--metrics-port", "9", "--metrics-host", "a b"], {}, "expected a host name"),
    ],
)
async def test_cli_refuses_bad_metrics_options_in_one_line(
    args: list[str], env: dict[str, str], message: str
) -> None:
    result = await cli("run", "tests.cli_handlers:handlers", *args, env=clean_env(**env))
    assert result.rc == 2, result
    # one error line (argparse's own errors add the house's "(see --help)" hint)
    errors = [line for line in result.err_lines if not line.startswith("(see ")]
    assert len(errors) == 1, result.err
    assert message in errors[0], result.err


async def test_cli_port_in_use_is_one_line_and_exit_1(dsn: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = await cli(
            "run", "tests.cli_handlers:handlers", "--dsn", dsn, "--metrics-port", str(port)
        )
    assert result.rc == 1, result
    assert len(result.err_lines) == 1, result.err
    assert (
        f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}: address already in use"
        in result.err
    )


async def test_cli_serves_metrics_and_healthz(dsn: str, pool: asyncpg.Pool) -> None:
    port = _free_port()
    await aiooutbox.enqueue(pool, "t.wait", {})
    env = clean_env(AIOOUTBOX_METRICS_PORT=str(port))
    async with Runner(
        "tests.cli_handlers:handlers", "--dsn", dsn, "--poll-interval", "0.2", env=env
    ) as runner:
        await runner.wait_for_line(r"serving /metrics and /healthz on http://127\.0\.0\.1:\d+")
        await runner.wait_for_line("consuming")

        async def healthy() -> bool:
            return (await http_get(port, "/healthz"))[0] == 200

        await wait_until(healthy)
        scraped: list[tuple[int, str]] = []

        async def gauges_filled() -> bool:
            # the listener connects and the queue gauges refresh in the background
            scraped.append(await http_get(port, "/metrics"))
            found = samples(scraped[-1][1])
            return (
                value(found, "aiooutbox_listener_connected") == 1
                and value(found, "aiooutbox_queue_depth", topic="t.wait", status="pending") == 1
            )

        try:
            await wait_until(gauges_filled, timeout=20, interval=0.05)
        except AssertionError:
            raise AssertionError(f"gauges never filled; last /metrics: {scraped[-1]}") from None
        status, body = scraped[-1]
        assert status == 200
        found = samples(body)
        assert any(name == "process_cpu_seconds_total" for name, _ in found)  # global registry
        runner.signal()
        assert await runner.wait() == 0


# -- docs/web.md: the health snippets run ----------------------------------------------

HEALTH_SNIPPETS = re.findall(
    r"```python health\n(.*?)```", (ROOT / "docs" / "web.md").read_text(), re.DOTALL
)


def test_web_doc_shows_fastapi_and_aiohttp_health_routes() -> None:
    assert len(HEALTH_SNIPPETS) == 2
    assert "FastAPI" in HEALTH_SNIPPETS[0] and "aiohttp" in HEALTH_SNIPPETS[1]


@pytest.mark.parametrize("index", range(len(HEALTH_SNIPPETS)))
async def test_web_doc_health_snippet(
    index: int, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiohttp import web
    from fastapi import FastAPI

    from tests.test_examples import load
    from tests.test_integrations import serve_aiohttp, serve_asgi

    monkeypatch.setenv("AIOOUTBOX_DSN", dsn)
    module = load(HEALTH_SNIPPETS[index], 100 + index)
    app = module.app

    async def get(client: Any, path: str) -> tuple[int, str]:
        response = await client.get(path)
        if isinstance(app, FastAPI):
            return response.status_code, response.text
        return response.status, await response.text()

    assert isinstance(app, (FastAPI, web.Application))
    serve: Callable[[Any], AbstractAsyncContextManager[Any]] = (
        serve_asgi if isinstance(app, FastAPI) else serve_aiohttp
    )
    async with serve(app) as client:

        async def healthy() -> bool:
            return (await get(client, "/healthz"))[0] == 200

        await wait_until(healthy)
        status, text = await get(client, "/metrics")
        assert status == 200
        assert value(samples(text), "aiooutbox_listener_connected") == 1
    status = await module.health.check()
    assert status.http_status == 503 and "not running" in status.reason


def test_histogram_buckets_are_cumulative_and_inclusive(registry: CollectorRegistry) -> None:
    metrics = OutboxMetrics(registry)
    event = aiooutbox.Event(1, "t", {}, None)
    for seconds in (0.0005, 0.001, 0.0011, 70.0, 1000.0):
        metrics.handler_finished(event, None, "done", seconds, None)
    found = samples(_exposition(registry))

    def bucket(le: str) -> float | None:
        return value(found, "aiooutbox_handler_duration_seconds_bucket", topic="t", le=le)

    assert (bucket("0.001"), bucket("0.0025"), bucket("60.0"), bucket("120.0")) == (2, 3, 3, 4)
    assert bucket("+Inf") == 5
    assert value(found, "aiooutbox_handler_duration_seconds_count", topic="t") == 5
    total = value(found, "aiooutbox_handler_duration_seconds_sum", topic="t")
    assert total == pytest.approx(1070.0026)
    with pytest.raises(aiooutbox.InvalidArgument):
        OutboxMetrics(CollectorRegistry(), handler_buckets=(1.0, 1.0))


def test_constructors_refuse_hostile_arguments_before_registering(
    registry: CollectorRegistry,
) -> None:
    for bad_registry in ("registry", 5, CollectorRegistry):
        with pytest.raises(TypeError, match="registry must be"):
            OutboxMetrics(bad_registry)  # type: ignore[arg-type]
    bad_buckets: list[Any] = ["123", b"1", {1: 2}, None, 5, ["1", "2"], (True, 2.0)]
    for buckets in bad_buckets:
        with pytest.raises(TypeError, match="handler_buckets must"):
            OutboxMetrics(registry, handler_buckets=buckets)
    # +Inf is always the last bucket: a second one ("inf") would be a duplicate series
    for buckets in ((1.0, float("inf")), (float("nan"),), (10**400,), (), (0.0, 1.0), (-1,)):
        with pytest.raises(aiooutbox.InvalidArgument, match="handler_buckets must"):
            OutboxMetrics(registry, handler_buckets=buckets)
    assert not list(registry.collect())  # nothing was registered on the way
    assert OutboxMetrics(registry, handler_buckets=(2, 0.5, 1)).registry is registry
    with pytest.raises(TypeError, match="registry must be"):
        MetricsServer("registry")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="registry must be"):
        MetricsServer(CollectorRegistry)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="health must"):
        MetricsServer(registry, "healthy")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="host must"):
        MetricsServer(registry, host=127)  # type: ignore[arg-type]


async def test_hostile_topics_keep_the_exposition_valid(pool: asyncpg.Pool) -> None:
    """A raw SQL producer may store any topic text the column allows: the label values
    are escaped, in both exposition formats, for the counters and the queue gauges."""
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as parse_openmetrics,
    )

    registry = CollectorRegistry()
    metrics = OutboxMetrics(registry)
    topics = ['a"b', "a\nb", "{x}", "back\\slash", 'q"}\n{z="1"', "é\u2028\x01", "x" * 255]
    for topic in topics:
        await pool.execute(
            "INSERT INTO outbox_events (topic, payload, grp) VALUES ($1, '{}', $1)", topic
        )

    async def handler(event: aiooutbox.Event) -> None:
        pass

    def families() -> dict[str, Any]:
        text = openmetrics(registry).decode()  # type: ignore[no-untyped-call]
        list(parse_openmetrics(text))  # type: ignore[no-untyped-call]  # valid OpenMetrics too
        return {f.name: f for f in text_string_to_metric_families(_exposition(registry))}

    async with metrics.queue_gauges(pool, interval=0.05):
        found = families()
        assert {s.labels["topic"] for s in found["aiooutbox_queue_lag_seconds"].samples} == set(
            topics
        )
        assert {s.labels["group"] for s in found["aiooutbox_group_events"].samples} == set(topics)
        consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.1, observers=[metrics])
        async with consumer, running(consumer, {"*": handler}):
            await wait_until(truthy(lambda: consumer.stats.done == len(topics)))
    found = families()
    assert {s.labels["topic"] for s in found["aiooutbox_events"].samples} == set(topics)
