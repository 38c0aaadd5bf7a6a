"""Reading the dashboard at the widths operators use (1440 and 1280 px), in Chromium: no
word is broken in two (topic names, states, numbers, headers, buttons), no placeholder
is cut, and times in lists are relative with the absolute time on hover."""

from __future__ import annotations

import re
from typing import Any

import asyncpg
import pytest

import aiooutbox
from aiooutbox import admin
from tests.dashboard.browser import browser_page
from tests.dashboard.server import dashboard
from tests.helpers import insert_unchecked, running, wait_until
from tests.programs import needs

pytestmark = [pytest.mark.slow, needs("chromium")]

# every word of the page's text, as laid out: a word drawn on two lines is broken (the
# long tokens a producer may store, and preformatted text, may wrap anywhere)
BROKEN_WORDS = """root => {
  const broken = [];
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  const range = document.createRange();
  let node;
  while ((node = walker.nextNode())) {
    const el = node.parentElement;
    if (!el || el.closest("pre, td.error, svg, .sr, details:not([open]) > :not(summary)")) {
      continue;
    }
    const words = /\\S+/g;
    let m;
    while ((m = words.exec(node.textContent))) {
      if (m[0].length > 40) { continue; }
      range.setStart(node, m.index);
      range.setEnd(node, m.index + m[0].length);
      const tops = new Set(Array.from(range.getClientRects())
        .filter(r => r.width > 0).map(r => Math.round(r.top)));
      if (tops.size > 1) { broken.push(m[0]); }
    }
  }
  return broken;
}"""

# placeholders wider than their field (so cut)
CUT_PLACEHOLDERS = """() => {
  const measure = document.createElement("canvas").getContext("2d");
  return Array.from(document.querySelectorAll("input[placeholder]"))
    .filter(i => i.offsetParent !== null)
    .map(i => {
      const s = getComputedStyle(i);
      measure.font = s.font;
      const room = i.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight);
      return [i.placeholder, measure.measureText(i.placeholder).width, room];
    })
    .filter(([_, need, room]) => need > room);
}"""

PAGES = [
    "/",
    "/topics/orders.created.v2",
    "/events",
    "/events?status=scheduled",
    "/dead",
    "/keys",
    "/consumers",
    "/audit",
]


async def populate(conn: asyncpg.Connection) -> int:
    topics = ["orders.created.v2", "payments.captured", "emails.send", "invoices.render"]
    for topic in topics:
        for i in range(3):
            await aiooutbox.enqueue(conn, topic, {"i": i}, ordering_key=f"{topic}-key")
        await aiooutbox.enqueue(conn, topic, {}, delay=600)
    await insert_unchecked(
        conn,
        "INSERT INTO outbox_events (topic, payload, status, attempts, finished_at, last_error,"
        " failures) SELECT $1, '{}', 'dead', 5, now(), 'ValueError: no such customer c-42',"
        ' \'[{"attempt": 1, "at": 1.0, "worker": "w", "seconds": 0.5,'
        ' "error": "boom", "outcome": "retry"}]\' FROM generate_series(1, 3)',
        "payments.captured",
    )
    await admin.pause_topic(conn, "emails.send")
    await admin.limit_topic(conn, "payments.captured", max_running=120, rate="1500/min")
    await conn.execute(
        "INSERT INTO outbox_events_rollups (minute, topic, done, retried, dead, claimed,"
        " lag_sum, lag_max) SELECT date_trunc('minute', now()) - g * interval '1 minute', t,"
        " 12345, 67, 8, 100, 50, 3.5 FROM generate_series(0, 1439, 7) g, unnest($1::text[]) t",
        topics,
    )
    await conn.execute(
        "INSERT INTO outbox_events_audit (actor, action, target, affected) VALUES"
        " ('anonymous at 127.0.0.1', 'topic pause', '{\"topic\": \"emails.send\"}', 1)"
    )
    return int(await conn.fetchval("SELECT max(id) FROM outbox_events_all"))


@pytest.mark.parametrize("width", [1440, 1280])
@pytest.mark.timeout(180)
async def test_no_word_is_broken_and_no_placeholder_cut(dsn: str, width: int) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=6)

    async def handle(event: aiooutbox.Event) -> None:
        pass

    try:
        async with pool.acquire() as conn:
            newest = await populate(conn)
        consumer = aiooutbox.OutboxConsumer(
            pool, worker_id="billing-worker@host-17:1234:abcdef", poll_interval=0.5
        )
        # registered, consuming a topic with nothing to do (the others stay as they are)
        async with running(consumer, {"nothing.here": handle}), dashboard(dsn) as d:
            await wait_until(lambda: _registered(pool))
            async with browser_page(viewport={"width": width, "height": 900}) as w:
                for path in [*PAGES, f"/events/{newest}", f"/events/{newest - 2}"]:
                    response = await w.page.goto(d.at(path))
                    assert response is not None and response.status == 200, path
                    main = w.page.locator("main")
                    broken = await main.evaluate(BROKEN_WORDS)
                    assert broken == [], (width, path, broken)
                    assert await w.page.evaluate(CUT_PLACEHOLDERS) == [], (width, path)
                    await _relative_times(w.page, path)
    finally:
        await pool.close()


async def _registered(pool: asyncpg.Pool) -> bool:
    return bool(await pool.fetchval("SELECT count(*) FROM outbox_events_consumers") == 1)


async def _relative_times(page: Any, path: str) -> None:
    """In lists, times are relative, with the absolute time as the title (on hover)."""
    times = page.locator("main table time[data-at]")
    for i in range(min(await times.count(), 20)):
        t = times.nth(i)
        text = await t.inner_text()
        assert re.fullmatch(r"(in )?\d+[smhd]( \d+[smh])?( ago)?", text), (path, text)
        title = await t.get_attribute("title")
        assert title and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", title), (path, title)
