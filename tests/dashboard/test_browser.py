"""The dashboard in a real browser (headless Chromium): every page renders and shows
what SQL counts, filters narrow, actions act on exactly what they said, and pages
update live without a reload. Screenshots for docs/dashboard.md are taken here
(AIOOUTBOX_SCREENSHOTS=1 writes them into docs/images)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import asyncpg
import pytest

import aiooutbox
from aiooutbox.web import create_app
from tests.dashboard.browser import browser_page, screenshot
from tests.dashboard.server import dashboard, in_process
from tests.helpers import insert_unchecked, running, wait_until
from tests.programs import needs

pytestmark = [pytest.mark.slow, needs("chromium")]

STATUS_COLUMNS = ("pending", "scheduled", "retry", "processing", "waiting", "dead")


async def populate(conn: asyncpg.Connection) -> None:
    """A bit of everything, in two topics and one blocked ordering key."""
    await conn.execute(
        "INSERT INTO outbox_events (topic, payload, headers)"
        " SELECT 'orders.created', jsonb_build_object('order', g, 'customer', 'c-' || (g % 2)),"
        ' \'{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}\''
        " FROM generate_series(1, 6) g"
    )
    await conn.execute(
        "INSERT INTO outbox_events (topic, payload) SELECT 'emails.send', '{}'"
        " FROM generate_series(1, 4)"
    )
    await conn.execute(
        "UPDATE outbox_events SET status = 'retry', attempts = 1, last_error = 'TimeoutError',"
        " available_at = now() + interval '1 hour' WHERE id IN (1, 2)"
    )
    await conn.execute(
        "UPDATE outbox_events SET status = 'processing', attempts = 1, locked_by = 'host:1:w',"
        " locked_at = now(), lease_expires_at = now() + interval '30 seconds' WHERE id = 3"
    )
    await conn.execute(
        "UPDATE outbox_events SET status = 'done', attempts = 1, finished_at = now()"
        " WHERE id IN (4, 5)"
    )
    await conn.execute(
        "UPDATE outbox_events SET status = 'dead', attempts = 5, finished_at = now(),"
        " last_error = 'ValueError: no such customer' WHERE id IN (6, 7)"
    )
    for i in range(3):
        await aiooutbox.enqueue(conn, "orders.paid", {"i": i}, ordering_key="order-7")
    await aiooutbox.enqueue(conn, "emails.send", {"digest": "weekly"}, delay=3600)
    await conn.execute(
        "UPDATE outbox_events SET status = 'dead', blocks_key = true, attempts = 5,"
        " finished_at = now(), last_error = 'card declined'"
        " WHERE ordering_key = 'order-7' AND status = 'pending'"
    )
    # 23 hours of what consumers counted, minute by minute (the charts, the numbers over
    # time), none within five minutes of an hour ago: the page and the test read "the last
    # 60 minutes" and "since the hour 23 hours ago" at different times, which may fall on
    # either side of a minute's or an hour's turn
    await conn.execute(
        "INSERT INTO outbox_events_rollups (minute, topic, done, retried, dead, claimed,"
        " lag_sum, lag_max) SELECT date_trunc('minute', now()) - m * interval '1 minute', t,"
        " 30 + (m * 7 + length(t)) % 25, (m % 13 = 0)::int, (m % 211 = 0)::int, 30, 6,"
        " 0.1 + (m % 17) / 20.0 FROM generate_series(0, 1379) m,"
        " unnest('{orders.created,emails.send}'::text[]) t WHERE m NOT BETWEEN 55 AND 65"
    )


async def sql_counts(conn: asyncpg.Connection) -> dict[tuple[str, str], int]:
    rows = await conn.fetch(
        "SELECT topic, CASE WHEN status = 'pending' AND available_at > now() THEN 'scheduled'"
        " ELSE status::text END, count(*) FROM outbox_events_all GROUP BY 1, 2"
    )
    return {(r[0], r[1]): r[2] for r in rows}


async def test_every_page_renders_and_shows_the_sql_counts(dsn: str, tmp_path: Path) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await populate(conn)
        counts = await sql_counts(conn)
        topics = sorted({t for t, _ in counts})
        async with (
            dashboard(dsn, "--trace-url", "https://tempo.example.com/trace/{trace_id}") as d,
            browser_page() as w,
        ):
            page = w.page
            await page.goto(d.url)
            for topic in topics:
                row = page.locator(f'#topics tr[data-topic="{topic}"]')
                for status in STATUS_COLUMNS:
                    shown = await row.locator(f'td[data-count="{status}"]').inner_text()
                    assert shown == str(counts.get((topic, status), 0)), (topic, status)
            # the numbers over time: what the consumers counted, over the chart's 24 hours
            # and the last 60 minutes
            for topic in ("orders.created", "emails.send"):
                day, died, hour = await conn.fetchrow(
                    "SELECT sum(done) FILTER (WHERE minute >= date_trunc('hour', now())"
                    " - interval '23 hours'), sum(dead) FILTER (WHERE minute >="
                    " date_trunc('hour', now()) - interval '23 hours'), sum(done) FILTER"
                    " (WHERE minute >= now() - interval '1 hour')"
                    " FROM outbox_events_rollups WHERE topic = $1",
                    topic,
                )
                row = page.locator(f'#topics tr[data-topic="{topic}"]')
                assert await row.locator('[data-count="done_day"]').inner_text() == f"{day:,}"
                assert await row.locator('[data-count="died_day"]').inner_text() == f"{died:,}"
                assert await row.locator('[data-count="done_hour"]').inner_text() == f"{hour:,}"
            await screenshot(page, "overview", tmp_path)

            await page.goto(d.at("/events"))
            assert await page.inner_text("#matching") == str(sum(counts.values()))
            assert await page.get_attribute("#matching", "data-exact") == "yes"
            # a filter narrows the list to what SQL finds
            await page.fill('input[name="topic"]', "orders.created")
            await page.click('form.filter button[type="submit"]')
            await page.wait_for_url(re.compile(r"topic=orders.created"))
            expected = sum(n for (t, _), n in counts.items() if t == "orders.created")
            assert await page.inner_text("#matching") == str(expected)
            shown_topics = await page.locator("table.events tbody tr td.name").all_inner_texts()
            assert shown_topics == ["orders.created"] * expected
            await page.fill('input[name="payload"]', '{"customer": "c-1"}')
            await page.click('form.filter button[type="submit"]')
            await page.wait_for_url(re.compile(r"payload="))
            ids = await conn.fetch(
                "SELECT id FROM outbox_events_all WHERE topic = 'orders.created'"
                ' AND payload @> \'{"customer": "c-1"}\' ORDER BY id DESC'
            )
            rows = page.locator("table.events tbody tr")
            assert [int(x) for x in await rows.evaluate_all("rs => rs.map(r => r.dataset.id)")] == [
                r[0] for r in ids
            ]
            await screenshot(page, "events", tmp_path)

            await page.goto(d.at("/events/1"))
            assert '"customer": "c-1"' in await page.inner_text("#payload")
            link = page.locator('a[href^="https://tempo.example.com/trace/"]')
            assert await link.get_attribute("href") == (
                "https://tempo.example.com/trace/0af7651916cd43dd8448eb211c80319c"
            )

            await page.goto(d.at("/dead"))
            dead = sum(n for (_, s), n in counts.items() if s == "dead")
            assert await page.inner_text("#matching") == str(dead)
            await screenshot(page, "dead", tmp_path)

            await page.goto(d.at("/keys"))
            key_row = page.locator("table.keys tbody tr", has_text="order-7")
            assert await key_row.count() == 1
            assert "2" in await key_row.locator("td:nth-child(7)").inner_text()
            blocked = await conn.fetchval(
                "SELECT count(*) FROM outbox_events_all WHERE status = 'dead' AND blocks_key"
            )
            assert await page.inner_text("#keys-count") == (
                f"{blocked} blocked key(s), exact; the waiting counts are exact below 50,000"
                " (≈ above)."
            )
            await screenshot(page, "keys", tmp_path)

            await page.goto(d.at("/topics/orders.created"))
            for status in STATUS_COLUMNS:
                shown = await page.inner_text(f'#topic-counts td[data-count="{status}"]')
                assert shown == str(counts.get(("orders.created", status), 0)), status
            await screenshot(page, "topic", tmp_path)

            await page.goto(d.at("/consumers"))
            worker = page.locator('table.workers tr[data-worker="host:1:w"]')
            assert await worker.locator("td.state").inner_text() == "unregistered"
            await page.goto(d.at("/audit"))
            assert "Nothing changed yet" in await page.inner_text("#audit")
            for response in w.documents:
                assert "script-src 'self'" in response.headers["content-security-policy"]
            assert not w.dialogs and not w.console_errors, (w.dialogs, w.console_errors)
    finally:
        await conn.close()


async def test_retrying_a_dead_event_in_the_ui_makes_it_run(dsn: str, tmp_path: Path) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    handled: list[int] = []
    fail = True

    async def handler(event: aiooutbox.Event) -> None:
        handled.append(event.id)
        if fail:
            raise aiooutbox.Dead("the mail server said no")

    try:
        consumer = aiooutbox.OutboxConsumer(pool, concurrency=4, poll_interval=0.5)
        async with running(consumer, {"emails.send": handler}):
            [event_id] = await aiooutbox.enqueue_many(
                pool, [aiooutbox.NewEvent("emails.send", {"to": "a@example.com"})]
            )
            assert event_id is not None

            async def status() -> str:
                return str(
                    await pool.fetchval(
                        "SELECT status::text FROM outbox_events_all WHERE id = $1", event_id
                    )
                )

            await wait_until(lambda: _is(status, "dead"))
            fail = False
            async with dashboard(dsn) as d, browser_page() as w:
                await w.page.goto(d.at(f"/events/{event_id}"))
                await w.page.click("#retry-one")
                assert await w.page.inner_text("#confirm-count") == "1"
                await w.page.click("#confirm")
                # back on the event's page, saying what was done
                await w.page.wait_for_url(re.compile(rf"/events/{event_id}\?done=\d+"))
                assert await w.page.inner_text("#flash") == "Retried 1 dead event."
                await wait_until(lambda: _is(status, "done"))
                assert handled == [event_id, event_id]
                entry = int(w.page.url.rsplit("done=", 1)[1])
                await w.page.goto(d.at("/audit"))
                row = w.page.locator(f'#audit tr[data-entry="{entry}"]')
                assert await row.locator("td.affected").inner_text() == "1"
                assert await row.locator(".said").inner_text() == (
                    f"retried 1 dead event (id {event_id})"
                )
    finally:
        await pool.close()


async def _text_is(locator: Any, expected: str) -> bool:
    return bool(await locator.inner_text() == expected)


async def _is(read: object, expected: str) -> bool:
    return bool(await read() == expected)  # type: ignore[operator]


async def test_bulk_retry_by_filter_in_the_browser(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for topic, n in (("a", 3), ("b", 2)):
            await insert_unchecked(
                conn,
                "INSERT INTO outbox_events (topic, payload, status, attempts, finished_at,"
                " last_error) SELECT $1, jsonb_build_object('i', g), 'dead', 5, now(),"
                " CASE WHEN g % 2 = 0 THEN 'even' ELSE 'odd' END FROM generate_series(1, $2) g",
                topic,
                n,
            )
        async with dashboard(dsn) as d, browser_page() as w:
            await w.page.goto(d.at("/dead"))
            await w.page.fill('input[name="topic"]', "a")
            await w.page.fill('input[name="error"]', "odd")
            await w.page.click('form.filter button[type="submit"]')
            await w.page.wait_for_url(re.compile(r"error=odd"))
            assert await w.page.inner_text("#matching") == "2"
            await w.page.click("#retry-matching")
            assert await w.page.inner_text("#confirm-count") == "2"
            await w.page.click("#confirm")
            # back on the filtered list, with a message
            await w.page.wait_for_url(re.compile(r"/dead\?.*error=odd.*done=\d+"))
            assert await w.page.inner_text("#flash") == "Retried 2 dead events."
            assert await w.page.input_value('input[name="error"]') == "odd"
            assert await w.page.inner_text("#matching") == "0"
        rows = await conn.fetch(
            "SELECT topic, last_error, status::text FROM outbox_events_all ORDER BY id"
        )
        changed = [(r[0], r[1]) for r in rows if r[2] == "pending"]
        assert changed == [("a", "odd"), ("a", "odd")]
        assert sum(r[2] == "dead" for r in rows) == 3
        audit = await conn.fetchrow(
            "SELECT action, affected, target::text FROM outbox_events_audit"
        )
        assert audit["action"] == "dead retry" and audit["affected"] == 2
        assert '"error": "odd"' in audit["target"]
    finally:
        await conn.close()


async def test_a_new_event_appears_without_a_reload(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await aiooutbox.enqueue(conn, "orders.created", {"n": 1})
        async with dashboard(dsn) as d, browser_page() as w:
            await w.page.goto(d.at("/events"))
            await w.page.evaluate("window.__loaded_once = true")
            documents = len(w.documents)
            new_id = await aiooutbox.enqueue(conn, "orders.created", {"n": 2})
            await w.page.wait_for_selector(f'tr[data-id="{new_id}"]', timeout=15_000)
            assert await w.page.inner_text("#matching") == "2"
            # the same document: no navigation, no reload
            assert await w.page.evaluate("window.__loaded_once") is True
            assert len(w.documents) == documents
            # and the overview counts move too
            await w.page.goto(d.at("/"))
            cell = w.page.locator(
                '#topics tr[data-topic="orders.created"] td[data-count="pending"]'
            )
            assert await cell.inner_text() == "2"
            await aiooutbox.enqueue(conn, "orders.created", {"n": 3})
            # (polled from here: the page's CSP forbids the eval wait_for_function needs)
            await wait_until(lambda: _text_is(cell, "3"), timeout=15)
    finally:
        await conn.close()


INTERVAL = 0.5  # the live interval of the pulse test (seconds)
WINDOW = 6.0  # each counted window: twelve intervals


async def test_the_pulse_is_one_query_per_interval_for_any_number_of_pages(dsn: str) -> None:
    """One open page and five open pages (real Chromium pages, each with its own
    server-sent event stream) cost the database the same: one pulse statement per
    interval, nothing else while nothing changes. Counted exactly: the app runs in this
    process, so the test reads its live hub's count of pulses, and every statement its
    pool sends is logged on the client side (asyncpg's query logger), so the count is
    checked against what the database was actually asked.

    The bound is exact, not a timing guess: the hub's loop waits out the rest of each
    interval after a pulse, so a window of T seconds holds at most T / interval + 2
    pulses (+1 for the window's edges, +1 for a slow pulse finishing just inside it),
    however loaded the machine; one pulse per page would be five times that. Below, a
    generous floor only shows the loop kept running (a stall of most of a window under
    load does not fail the test's point, so the floor is a third)."""
    sent: list[str] = []

    async def log_queries(conn: asyncpg.Connection) -> None:
        conn.add_query_logger(lambda q: sent.append(q.query))

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4, init=log_queries)
    app = create_app(pool=pool, refresh=INTERVAL)
    hub = app.state.dashboard.hub
    pulse_sql = app.state.dashboard.w.pulse
    try:
        async with in_process(app) as url, browser_page() as w:
            await w.page.goto(url + "audit")
            await wait_until(lambda: _listening(hub, 1))
            one = await _window(hub, sent, pulse_sql, pages=1)
            pages = [w.page]
            for view in ("", "events", "dead", "consumers"):
                page = await w.page.context.new_page()
                await page.goto(url + view)
                pages.append(page)
            await wait_until(lambda: _listening(hub, 5))
            five = await _window(hub, sent, pulse_sql, pages=5)
            measured = f"one page: {one}; five pages: {five}"
            for found in (one, five):
                ceiling = found["seconds"] / INTERVAL + 2
                assert found["pulses"] <= ceiling, measured
                assert found["pulses"] >= found["seconds"] / INTERVAL / 3, measured
                # the database saw the pulses and nothing else (the pool's reset on
                # release aside: one per pulse, same connection, no table read)
                assert found["other"] == [], measured
                assert abs(found["sent"] - found["pulses"]) <= 1, measured
                assert found["listeners"] == found["pages"], measured
                assert not found["changed"], measured  # nothing wrote: no page refetched
            # and they are live: one change reaches every page, which fetches its view
            shown = [await p.get_attribute("body", "data-refreshed") for p in pages]
            conn = await asyncpg.connect(dsn)
            try:
                await aiooutbox.enqueue(conn, "orders.created", {"n": 1})
            finally:
                await conn.close()

            async def all_refreshed() -> bool:
                now = [await p.get_attribute("body", "data-refreshed") for p in pages]
                return all(a != b for a, b in zip(now, shown, strict=True))

            await wait_until(all_refreshed, timeout=30)
        # over the whole run (the server stopped): every pulse the hub counted is a
        # statement the database ran, and no other pulse ran
        ran = sum(1 for q in sent if q == pulse_sql)
        assert ran == hub.polls, (ran, hub.polls, measured)
        print(measured)
    finally:
        await pool.close()


async def _listening(hub: Any, n: int) -> bool:
    return bool(hub.listeners == n)


async def _window(hub: Any, sent: list[str], pulse_sql: str, *, pages: int) -> dict[str, Any]:
    """Pulses the hub ran and statements the pool sent over `WINDOW` seconds, after the
    pages' loads have settled."""
    await asyncio.sleep(2 * INTERVAL)
    loop = asyncio.get_running_loop()
    polls, first, started, pulse = hub.polls, len(sent), loop.time(), hub.pulse
    await asyncio.sleep(WINDOW)
    statements = sent[first:]
    return {
        "pages": pages,
        "listeners": hub.listeners,
        "seconds": round(loop.time() - started, 2),
        "pulses": hub.polls - polls,
        "sent": sum(1 for q in statements if q == pulse_sql),
        "other": sorted({q for q in statements if q != pulse_sql and not _reset(q)}),
        "changed": hub.pulse != pulse,
    }


def _reset(query: str) -> bool:
    # asyncpg's pool resets a connection on release (RESET ALL, UNLISTEN, ...)
    return "RESET ALL" in query
