"""Actions keep your place, in Chromium against a real server: after retry, purge, pause,
a limit, run now and cancel the browser is back where it acted (its filter intact) with
a message saying what was done to how many; a refused form shows its reason beside the
buttons. Run now and cancel act on waiting work, and cancelling the head of an ordering
key moves the key on, in order, for a real consumer. Purging dead events does not
rewrite the failures shown over time."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import asyncpg
import pytest

import aiooutbox
from tests.dashboard.browser import browser_page, screenshot
from tests.dashboard.server import dashboard
from tests.helpers import insert_unchecked, running, wait_until
from tests.programs import needs

pytestmark = [pytest.mark.slow, needs("chromium")]


async def _dead(conn: asyncpg.Connection, topic: str, n: int, error: str = "boom") -> list[int]:
    rows = await insert_unchecked(
        conn,
        "INSERT INTO outbox_events (topic, payload, status, attempts, finished_at, last_error)"
        " SELECT $1, jsonb_build_object('i', g), 'dead', 5, now(), $3"
        " FROM generate_series(1, $2) g RETURNING id",
        topic,
        n,
        error,
    )
    return [r[0] for r in rows]


async def test_each_action_returns_where_it_was_with_a_message(dsn: str, tmp_path: Path) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await _dead(conn, "emails.send", 3, "SMTP 550")
        await _dead(conn, "emails.send", 2, "timeout")
        await _dead(conn, "orders.paid", 1)
        later = [
            i
            for i in [
                await aiooutbox.enqueue(conn, "reports.build", {}, delay=3600) for _ in range(3)
            ]
            if i is not None
        ]
        async with dashboard(dsn) as d, browser_page() as w:
            page = w.page
            # retry two of a filtered dead list: back on that list, filter kept
            await page.goto(d.at("/dead?topic=emails.send&error=SMTP"))
            boxes = page.locator('table.events input[name="ids"]')
            await boxes.nth(0).check()
            await boxes.nth(1).check()
            await page.click("#retry-selected")
            assert await page.inner_text("#confirm-count") == "2"
            await screenshot(page, "confirm", tmp_path)
            await page.click("#confirm")
            await page.wait_for_url(re.compile(r"/dead\?topic=emails\.send&error=SMTP&done=\d+$"))
            assert await page.inner_text("#flash") == "Retried 2 dead events."
            assert await page.input_value('input[name="error"]') == "SMTP"
            assert await page.inner_text("#matching") == "1"
            # purge every match of a filter
            await page.goto(d.at("/dead?topic=emails.send&error=timeout"))
            await page.click("#purge-matching")
            await page.click("#confirm")
            await page.wait_for_url(re.compile(r"/dead\?topic=emails\.send&error=timeout&done="))
            assert await page.inner_text("#flash") == "Purged 2 dead events."
            # a refused form: nothing ticked; the reason beside the buttons, same page
            await page.goto(d.at("/dead?topic=orders.paid"))
            await page.click("#purge-selected")
            assert "no event selected" in await page.inner_text("#form-error")
            assert await page.input_value('input[name="topic"]') == "orders.paid"
            assert (
                await conn.fetchval("SELECT count(*) FROM outbox_events_all WHERE status = 'dead'")
                == 2
            )
            # run now, from the scheduled list of a topic
            await page.goto(d.at("/events?topic=reports.build&status=scheduled"))
            await page.locator('table.events input[name="ids"]').nth(0).check()
            await page.click("#run-selected")
            assert await page.inner_text("#confirm-count") == "1"
            await page.click("#confirm")
            await page.wait_for_url(
                re.compile(r"/events\?topic=reports\.build&status=scheduled&done=\d+$")
            )
            assert await page.inner_text("#flash") == "Ran 1 waiting event."
            assert await page.inner_text("#matching") == "2"
            # cancel every match: confirmed with the count first
            await page.click("#cancel-matching")
            assert await page.inner_text("#confirm-count") == "2"
            await page.click("#confirm")
            await page.wait_for_url(re.compile(r"status=scheduled&done=\d+$"))
            assert await page.inner_text("#flash") == "Cancelled 2 waiting events."
            assert await page.inner_text("#matching") == "0"
            left = await conn.fetch(
                "SELECT id, available_at <= now() AS due FROM outbox_events_all"
                " WHERE topic = 'reports.build'"
            )
            assert len(left) == 1 and left[0]["due"] and left[0]["id"] in later
            # pause and limit a topic on its own page: back on it, with a message
            await page.goto(d.at("/topics/reports.build"))
            await page.click("button.pause")
            await page.wait_for_url(re.compile(r"/topics/reports\.build\?done=\d+#topics$"))
            assert await page.inner_text("#flash") == "Paused topic reports.build."
            await page.fill('input[name="rate"]', "5/s")
            await page.click("button.set-limits")
            await page.wait_for_url(re.compile(r"/topics/reports\.build\?done=\d+#topics$"))
            assert await page.inner_text("#flash") == "Limited topic reports.build: rate 5/s."
            # a refused limit: the reason beside the field, the input kept, nothing written
            await page.fill('input[name="max_running"]', "0")
            await page.click("button.set-limits")
            error = page.locator('.field-error[data-field="max_running"]')
            assert "from 1 to" in await error.inner_text()
            assert await page.input_value('input[name="max_running"]') == "0"
            assert await page.input_value('input[name="rate"]') == "5/s"
            assert await page.inner_text("#topic-name") == "reports.build"
            limits = await conn.fetchrow(
                "SELECT max_running, rate_text FROM outbox_events_flow WHERE topic = $1",
                "reports.build",
            )
            assert tuple(limits) == (None, "5/s")
            # the audit says each in words, the JSON one click away
            await page.goto(d.at("/audit"))
            said = await page.locator("#audit .said").all_inner_texts()
            assert said[-1].startswith("retried 2 dead events (ids ")
            assert said[:4] == [
                "limited topic reports.build: rate 5/s",
                "paused topic reports.build",
                "cancelled (deleted) 2 waiting events matching topic reports.build;"
                f" status scheduled, up to id {max(later)}",
                f"ran 1 waiting event (id {later[-1]})",
            ], said
            details = page.locator("#audit details").first
            json_text = details.locator("pre.json")
            assert not await json_text.is_visible()
            await details.locator("summary").click()
            assert '"rate": "5/s"' in await json_text.inner_text()
            await screenshot(page, "audit", tmp_path)
            assert not w.dialogs, w.dialogs
    finally:
        await conn.close()


async def test_run_now_and_cancel_with_ordering_keys(dsn: str) -> None:
    """Cancelling a key's head moves the key on: the next event runs, the rest in order;
    running a retrying head now makes it run, and its key after it."""
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=6)
    ran: list[tuple[str, int]] = []

    async def handle(event: aiooutbox.Event) -> None:
        ran.append((event.ordering_key or "", event.payload["i"]))

    try:
        # key A: a head scheduled in an hour, three waiting behind it; key B: a head
        # retrying in an hour (failed once), two behind it
        a = [
            await aiooutbox.enqueue(
                pool, "ledger", {"i": i}, ordering_key="A", delay=3600 if i == 0 else 0
            )
            for i in range(4)
        ]
        b = [await aiooutbox.enqueue(pool, "ledger", {"i": i}, ordering_key="B") for i in range(3)]
        await pool.execute(
            "UPDATE outbox_events SET status = 'retry', attempts = 1,"
            " available_at = now() + interval '1 hour', last_error = 'try again'"
            " WHERE id = $1",
            b[0],
        )
        states = dict(await pool.fetch("SELECT id, status::text FROM outbox_events_all"))
        assert [states[i] for i in a] == ["pending", "waiting", "waiting", "waiting"]
        consumer = aiooutbox.OutboxConsumer(pool, concurrency=4, poll_interval=0.2)
        async with running(consumer, {"ledger": handle}), dashboard(dsn) as d, browser_page() as w:
            page = w.page
            await asyncio.sleep(1.0)  # the consumer claims nothing: both heads wait
            assert ran == []
            # cancel A's head: the key moves on, A's others run in order
            await page.goto(d.at(f"/events/{a[0]}"))
            await page.click("#cancel-one")
            assert await page.inner_text("#confirm-count") == "1"
            assert "heads an ordering key" in await page.inner_text("#confirm-heads")
            await page.click("#confirm")
            await page.wait_for_url(re.compile(rf"/events/{a[0]}\?done=\d+$"))
            assert await page.inner_text("#flash") == (
                "Cancelled 1 waiting event; 1 ordering key moved on."
            )
            assert "Not found" in await page.inner_text("main")  # it is gone
            await wait_until(lambda: _ran(ran, "A", 3), timeout=30)
            assert [i for k, i in ran if k == "A"] == [1, 2, 3]
            # run B's retrying head now: it runs, then the rest of B in order
            await page.goto(d.at(f"/events/{b[0]}"))
            await page.click("#run-one")
            await page.click("#confirm")
            await page.wait_for_url(re.compile(rf"/events/{b[0]}\?done=\d+$"))
            assert await page.inner_text("#flash") == "Ran 1 waiting event."
            await wait_until(lambda: _ran(ran, "B", 3), timeout=30)
            assert [i for k, i in ran if k == "B"] == [0, 1, 2]
        audit = await pool.fetch(
            "SELECT action, affected, target::text FROM outbox_events_audit ORDER BY id"
        )
        assert [(r[0], r[1]) for r in audit] == [("events cancel", 1), ("events run", 1)]
        assert '"keys_moved_on": 1' in audit[0][2]
    finally:
        await pool.close()


def _ran(ran: list[tuple[str, int]], key: str, n: int) -> Any:
    async def check() -> bool:
        return sum(1 for k, _ in ran if k == key) == n

    return check()


async def test_purging_dead_events_does_not_rewrite_the_failures_shown(dsn: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=6)

    async def hopeless(event: aiooutbox.Event) -> None:
        raise aiooutbox.Dead("declined")

    try:
        consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.2)
        async with running(consumer, {"payments": hopeless}):
            for i in range(4):
                await aiooutbox.enqueue(pool, "payments", {"i": i})

            async def all_dead() -> bool:
                n = await pool.fetchval(
                    "SELECT count(*) FROM outbox_events_all WHERE status = 'dead'"
                )
                return bool(n == 4)

            await wait_until(all_dead)
        # (the consumer's stop flushed what it counted)
        async with dashboard(dsn) as d, browser_page() as w:
            await w.page.goto(d.url)
            row = w.page.locator('#topics tr[data-topic="payments"]')
            assert await row.locator('[data-count="died_day"]').inner_text() == "4"
            assert await row.locator('td[data-count="dead"]').inner_text() == "4"
            await w.page.goto(d.at("/dead?topic=payments"))
            await w.page.click("#purge-matching")
            await w.page.click("#confirm")
            await w.page.wait_for_url(re.compile(r"done=\d+$"))
            await w.page.goto(d.url)
            row = w.page.locator('#topics tr[data-topic="payments"]')
            assert await row.locator('td[data-count="dead"]').inner_text() == "0"
            assert await row.locator('[data-count="died_day"]').inner_text() == "4"
            await w.page.goto(d.at("/topics/payments"))
            assert await w.page.inner_text('#topic-counts td[data-count="failed_day"]') == "4"
    finally:
        await pool.close()
