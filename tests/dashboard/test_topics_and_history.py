"""The operator's second look, in Chromium against a real server and real consumers: an
event's failed attempts on its page, scheduled events counted apart, a topic's page with
its per-minute charts (drawn from known counts), lags that tick on an open page, and
topics that nothing consumes flagged in words."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import asyncpg
import pytest

import aiooutbox
from aiooutbox import admin
from tests.dashboard.browser import browser_page, screenshot
from tests.dashboard.server import dashboard
from tests.helpers import running, wait_until
from tests.programs import needs

pytestmark = [pytest.mark.slow, needs("chromium")]


async def test_an_event_that_failed_twice_then_succeeded_shows_both_errors(
    dsn: str, tmp_path: Path
) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=6)
    tries: dict[int, int] = {}

    async def flaky(event: aiooutbox.Event) -> None:
        tries[event.id] = tries.get(event.id, 0) + 1
        if tries[event.id] == 1:
            raise ConnectionError("smtp.example.com refused the connection")
        if tries[event.id] == 2:
            raise TimeoutError("the mail server took more than 30 s")

    async def hopeless(event: aiooutbox.Event) -> None:
        raise aiooutbox.Dead("no such mailbox")

    try:
        consumer = aiooutbox.OutboxConsumer(
            pool,
            worker_id="mailer-1",
            poll_interval=0.2,
            retry=aiooutbox.RetryPolicy(base=0.05, max_delay=0.05, jitter=0.0),
        )
        async with running(consumer, {"emails.send": flaky, "emails.bounce": hopeless}):
            sent = await aiooutbox.enqueue(pool, "emails.send", {"to": "a@example.com"})
            bounce_id = await aiooutbox.enqueue(pool, "emails.bounce", {"to": "b@example.com"})
            await wait_until(lambda: _status(pool, sent, "done"))
            await wait_until(lambda: _status(pool, bounce_id, "dead"))
        async with dashboard(dsn) as d, browser_page() as w:
            await w.page.goto(d.at(f"/events/{sent}"))
            failures = w.page.locator("#timeline li.failure")
            assert await failures.count() == 2
            first, second = await failures.all_inner_texts()
            assert "attempt 1 failed" in first and "on mailer-1" in first
            assert "ConnectionError: smtp.example.com refused the connection" in first
            assert "attempt 2 failed" in second and "TimeoutError" in second
            assert "attempt 3 succeeded" in await w.page.inner_text("#timeline li.done")
            assert (await w.page.inner_text("#summary")).startswith("Done ")
            assert "after 2 failed attempts" in await w.page.inner_text("#summary")
            # each time is relative, the absolute time on hover
            when = w.page.locator("#timeline li.failure time").first
            assert re.fullmatch(r"\d+s ago", await when.inner_text())
            title = await when.get_attribute("title")
            assert title is not None and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", title)
            await screenshot(w.page, "event", tmp_path)
            # a dead event says why and when it died, not a stale lease
            await w.page.goto(d.at(f"/events/{bounce_id}"))
            summary = await w.page.inner_text("#summary")
            assert summary.startswith("Died ") and "no such mailbox" in summary, summary
            assert "lease until" not in await w.page.inner_text("main")
            assert "dead" in await w.page.inner_text("#timeline li.died")
            assert not w.dialogs and not w.console_errors, w.console_errors
    finally:
        await pool.close()


async def _status(pool: asyncpg.Pool, event_id: int | None, status: str) -> bool:
    found = await pool.fetchval(
        "SELECT status::text FROM outbox_events_all WHERE id = $1", event_id
    )
    return bool(found == status)


async def test_scheduled_events_are_counted_apart_from_pending(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for _ in range(3):
            await aiooutbox.enqueue(conn, "reports.build", {})
        for _ in range(4):
            await aiooutbox.enqueue(conn, "reports.build", {}, delay=3600)
        async with dashboard(dsn) as d, browser_page() as w:
            await w.page.goto(d.url)
            row = w.page.locator('#topics tr[data-topic="reports.build"]')
            assert await row.locator('td[data-count="pending"]').inner_text() == "3"
            assert await row.locator('td[data-count="scheduled"]').inner_text() == "4"
            assert await row.locator('td[data-count="due"]').inner_text() == "3"
            await w.page.goto(d.at("/topics/reports.build"))
            assert await w.page.inner_text('#topic-counts td[data-count="scheduled"]') == "4"
            assert await w.page.inner_text('#topic-counts td[data-count="pending"]') == "3"
            # the filter: scheduled and pending lists, each with its own events
            await w.page.goto(d.at("/events?status=scheduled"))
            assert await w.page.inner_text("#matching") == "4"
            states = await w.page.locator("table.events .status").all_inner_texts()
            assert states == ["scheduled"] * 4
            await w.page.goto(d.at("/events?status=pending"))
            assert await w.page.inner_text("#matching") == "3"
        stats = await admin.stats(conn)
        assert (stats.totals["pending"], stats.totals["scheduled"]) == (3, 4)
    finally:
        await conn.close()


async def test_the_topic_page_draws_its_charts_from_known_counts(dsn: str) -> None:
    topic = "orders.created"
    conn = await asyncpg.connect(dsn)
    try:
        await aiooutbox.enqueue(conn, topic, {})
        # known per-minute counts: 3 minutes ago 42 done, 2 failed (1 retried, 1 dead),
        # a claim lag of 7.5 s at most; 90 minutes ago 10 done; 2 days ago 999 done
        # (outside the day: not drawn)
        await conn.execute(
            "INSERT INTO outbox_events_rollups (minute, topic, done, retried, dead, claimed,"
            " lag_sum, lag_max) VALUES"
            " (date_trunc('minute', now()) - interval '3 minutes', $1, 42, 1, 1, 44, 100, 7.5),"
            " (date_trunc('minute', now()) - interval '90 minutes', $1, 10, 0, 0, 10, 1, 0.2),"
            " (date_trunc('minute', now()) - interval '2 days', $1, 999, 0, 0, 0, 0, 0)",
            topic,
        )
        async with dashboard(dsn) as d, browser_page() as w:
            await w.page.goto(d.url)
            await w.page.click(f'#topics tr[data-topic="{topic}"] a.topic')
            await w.page.wait_for_url(re.compile(r"/topics/orders\.created$"))
            assert await w.page.inner_text("#topic-name") == topic
            counts = w.page.locator("#topic-counts")
            assert await counts.locator('td[data-count="done_hour"]').inner_text() == "42"
            assert await counts.locator('td[data-count="failed_hour"]').inner_text() == "2"
            assert await counts.locator('td[data-count="done_day"]').inner_text() == "52"
            hour = w.page.locator("#done-hour")
            assert await hour.locator("text.peak").text_content() == "peak 42"
            drawn = await _bars(hour, "rect.bar")
            # "3m ago", or "4m ago" when a minute turned between the insert and the page
            ago = drawn[0][0].split(":")[0] if drawn else "3m ago"
            assert ago in ("3m ago", "4m ago"), drawn
            assert [label for label, _ in drawn] == [f"{ago}: 42 done"]
            assert drawn[0][1] == pytest.approx(100 - 14 - 16, abs=0.01)  # the full plot
            failed = await _bars(w.page.locator("#failed-hour"), "rect.failed")
            assert [label for label, _ in failed] == [f"{ago}: 2 failed"]
            lag = await _bars(w.page.locator("#lag-hour"), "rect.lag")
            assert [label for label, _ in lag] == [f"{ago}: 7s lag at claim (the longest)"]
            # the day: one area, a tooltip per quarter-hour, both minutes in it
            day = w.page.locator("#done-day")
            assert await day.locator("path.area").count() == 1
            assert await day.locator("text.peak").text_content() == "peak 42"
            tips = await day.locator("rect.hit title").all_text_contents()
            assert len(tips) == 96
            assert (
                sum(": 42 done" in t for t in tips) == 1
                and sum(": 10 done" in t for t in tips) == 1
            )
            ticks = await w.page.locator("#done-day text.tick").all_text_contents()
            assert ticks == ["24h ago", "18h", "12h", "6h", "now"]
            assert not w.dialogs and not w.console_errors
    finally:
        await conn.close()


async def _bars(chart: Any, selector: str) -> list[tuple[str, float]]:
    out = []
    for rect in await chart.locator(selector).all():
        label = await rect.locator("title").text_content() or ""
        out.append((label, float(await rect.get_attribute("height"))))
    return out


async def test_an_unconsumed_topics_lag_ticks_on_an_open_page_and_is_flagged(dsn: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)

    async def handle(event: aiooutbox.Event) -> None:
        pass

    try:
        # due for 6 minutes, and nothing consumes it (a consumer of another topic runs)
        stuck = await aiooutbox.enqueue(pool, "invoices.render", {})
        await pool.execute(
            "UPDATE outbox_events SET available_at = now() - interval '6 minutes' WHERE id = $1",
            stuck,
        )
        other = aiooutbox.OutboxConsumer(pool, poll_interval=0.2, worker_id="emails-1")
        async with running(other, {"emails.send": handle}), dashboard(dsn) as d:
            await wait_until(lambda: _registered(pool, 1))
            async with browser_page() as w:
                page = w.page
                await page.goto(d.url)
                row = page.locator('#topics tr[data-topic="invoices.render"]')
                assert await row.locator('[data-flag="unconsumed"]').inner_text() == "no consumer"
                assert "invoices.render" in await page.inner_text("#unconsumed")
                lag = row.locator("td.lag")
                first = await lag.inner_text()
                assert re.fullmatch(r"6m \d\ds", first), first
                await page.evaluate("window.__same_document = true")
                documents = len(w.documents)
                # nothing is written meanwhile: the lag moves on by itself
                await wait_until(lambda: _changed(lag, first), timeout=10)
                assert await page.evaluate("window.__same_document") is True
                assert len(w.documents) == documents
                # the topic's page says it too
                await page.goto(d.at("/topics/invoices.render"))
                assert await page.inner_text("#unconsumed") == "no consumer"
                # a consumer of the topic starts: the flag goes (live, no reload)
                await page.goto(d.url)
                await page.evaluate("window.__same_document = true")
                consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.2, worker_id="inv-1")
                seen, release = asyncio.Event(), asyncio.Event()

                async def render(event: aiooutbox.Event) -> None:
                    seen.set()
                    await release.wait()  # keeps it processing (and the flag off)

                async with running(consumer, {"invoices.render": render}):
                    await asyncio.wait_for(seen.wait(), 30)
                    flag = page.locator(
                        '#topics tr[data-topic="invoices.render"] [data-flag="unconsumed"]'
                    )
                    await wait_until(lambda: _count_is(flag, 0), timeout=20)
                    assert await page.evaluate("window.__same_document") is True
                    release.set()
                assert not w.dialogs, w.dialogs
    finally:
        await pool.close()


async def _registered(pool: asyncpg.Pool, n: int) -> bool:
    return bool(await pool.fetchval("SELECT count(*) FROM outbox_events_consumers") == n)


async def _changed(locator: Any, before: str) -> bool:
    return bool(await locator.inner_text() != before)


async def _count_is(locator: Any, n: int) -> bool:
    return bool(await locator.count() == n)
