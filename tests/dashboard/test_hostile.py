"""Stored text is hostile input: producers write topics, keys, payloads and headers,
handlers write error texts, workers name themselves. In a real browser every one of
them renders as text, wherever it is shown (text, attributes, URLs, form values): no
dialog opens, no request leaves for anything but the dashboard's own files, no element
or attribute of theirs appears, and every document carries the CSP."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import asyncpg
import pytest

from tests.dashboard.browser import Watched, browser_page
from tests.dashboard.server import dashboard
from tests.helpers import insert_unchecked
from tests.programs import needs

pytestmark = pytest.mark.slow

HOSTILE = [
    "<script>alert('s')</script>",
    '"><img src=x onerror=alert(1)>',
    "javascript:alert(2)",
    "</textarea><script>alert(3)</script>",
    "'><svg onload=alert(4)>",
    "{{7*7}}<style>body{display:none}</style>",
]
_OURS = re.compile(
    r"^/(|events(/\d+|/confirm|/act)?|dead(/confirm|/act)?|keys|consumers|audit|live|topics/.*"
    r"|static/dashboard\.(js|css))$"
)
# topic names that are hard to carry in a URL path
AWKWARD = [".", "..", "a/b", "a/../b", "q?x=1", "h#frag", "100%", " spaced ", "tr\u00e4ilin/"]


async def plant(conn: asyncpg.Connection) -> list[int]:
    ids = []
    for i, text in enumerate(HOSTILE):
        payload = {"text": text, text: [text], "nested": {"html": text}}
        headers = {"x-evil": text, "traceparent": text}
        [[dead]] = await insert_unchecked(
            conn,
            "INSERT INTO outbox_events (topic, payload, headers, ordering_key, dedupe_key,"
            " status, attempts, last_error, finished_at, blocks_key)"
            " VALUES ($1, $2::jsonb, $3::jsonb, $4, $5, 'dead', 5, $6, now(), true) RETURNING id",
            text,
            json.dumps(payload),
            json.dumps(headers),
            text,
            f"{text}#{i}",
            f"Traceback: {text}\n  raise {text}",
        )
        # an event waiting behind the dead head of the hostile key
        await conn.execute(
            "INSERT INTO outbox_events (topic, payload, ordering_key) VALUES ($1, '{}', $1)", text
        )
        [[held]] = await insert_unchecked(
            conn,
            "INSERT INTO outbox_events (topic, payload, status, attempts, locked_by, locked_at,"
            " lease_expires_at, grp) VALUES ($1, $2::jsonb, 'processing', 1, $1, now(),"
            " now() + interval '1 hour', $1) RETURNING id",
            text,
            json.dumps(payload),
        )
        # its failed attempts, as the settlement keeps them: error and worker are hostile
        failures = [
            {
                "attempt": 1,
                "at": 1.5e9,
                "worker": text,
                "seconds": 0.25,
                "error": text,
                "outcome": "retry",
            },
            {
                "attempt": "<b>2</b>",
                "at": text,
                "worker": None,
                "seconds": text,
                "error": {"x": text},
                "outcome": text,
            },
            # a time no datetime holds (before the year 1): shown as its number
            {"attempt": 3, "at": -62135596801, "worker": text, "error": text, "outcome": "retry"},
        ]
        await conn.execute(
            "UPDATE outbox_events SET failures = $2::jsonb WHERE id = $1",
            dead,
            json.dumps(failures),
        )
        # per-minute counts of the hostile topic: its charts carry its name
        await conn.execute(
            "INSERT INTO outbox_events_rollups (minute, topic, done, retried, dead, claimed,"
            " lag_sum, lag_max) VALUES (date_trunc('minute', now()) - interval '2 minutes', $1,"
            " 5, 1, 1, 5, 5, 2)",
            text,
        )
        # a finished event, settled as a consumer settles it: it leaves the outbox table
        # for the ring of finished events (migration 0022), which the event pages read too
        [[finished]] = await insert_unchecked(
            conn,
            "INSERT INTO outbox_events (topic, payload, headers, ordering_key, status, attempts,"
            " locked_by, locked_at, lease_expires_at, last_error, grp) VALUES ($1, $2::jsonb,"
            " $3::jsonb, $4, 'processing', 1, 'w', now(), now() + interval '1 hour', $5, $1)"
            " RETURNING id",
            text,
            json.dumps(payload),
            json.dumps(headers),
            f"{text}#done",
            f"Traceback: {text}",
        )
        await conn.execute(
            "SELECT * FROM outbox_events_settle_done_v5(ARRAY[$1::bigint], 'w', 1)", finished
        )
        assert await conn.fetchval(
            "SELECT count(*) FROM outbox_events_done WHERE id = $1", finished
        )
        # times PostgreSQL stores but no datetime holds, shown as stored beside the text
        odd = await conn.fetchval(
            "INSERT INTO outbox_events (topic, payload, headers, available_at, created_at)"
            " VALUES ($1, $2::jsonb, $3::jsonb, 'infinity', '10000-01-01 00:00+00') RETURNING id",
            text,
            json.dumps(payload),
            json.dumps(headers),
        )
        ids += [dead, held, finished, odd]
    for name in AWKWARD:
        await conn.execute(
            "INSERT INTO outbox_events (topic, payload, available_at)"
            " VALUES ($1, '{}', now() + interval '1 hour')",
            name,
        )
    await conn.execute(
        "INSERT INTO outbox_events_idle (worker_id, topics, expires_at)"
        " VALUES ($1, $2::text[], now() + interval '1 hour')",
        HOSTILE[1],
        HOSTILE,
    )
    # consumers name themselves and their host in the registry
    for i, text in enumerate(HOSTILE):
        await conn.execute(
            "INSERT INTO outbox_events_consumers (worker_id, host, pid, concurrency, prefetch,"
            " topics, lease_timeout, version, expires_at)"
            " VALUES ($1, $2, 1, 3, 0, $3::text[], 30, $2, now() + interval '1 hour')",
            f"{text} #{i}",
            text,
            HOSTILE,
        )
        # a relay names its destination in its worker id: the relays table shows it, in
        # text and in the row's data-relay attribute
        await conn.execute(
            "INSERT INTO outbox_events_consumers (worker_id, host, pid, concurrency, prefetch,"
            " topics, lease_timeout, version, expires_at)"
            " VALUES ($1, $2, 1, 3, 0, $3::text[], 30, $2, now() + interval '1 hour')",
            f"relay redis:{text} @h:1:{i}",
            text,
            HOSTILE,
        )
    return ids


async def check(w: Watched, base: str) -> None:
    page = w.page
    assert await page.locator("script").count() == 1  # ours, from /static
    assert await page.locator("img, svg[onload], style, [onerror], [onload]").count() == 0
    assert await page.locator("textarea").count() == 0
    for href in await page.locator("a[href]").evaluate_all("as => as.map(a => a.href)"):
        assert href.startswith(base), href  # nothing stored starts a URL
    # (getAttribute: a form's .action is shadowed by its input named "action")
    for action in await page.locator("form[action]").evaluate_all(
        "fs => fs.map(f => f.getAttribute('action'))"
    ):
        assert action.startswith("/") and not action.startswith("//"), action


@pytest.mark.timeout(300)  # some forty pages in a browser, on a machine that may be busy
@needs("chromium")
async def test_hostile_text_renders_as_text_everywhere(dsn: str, tmp_path: Path) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        ids = await plant(conn)
        async with dashboard(dsn) as d, browser_page() as w:
            base = d.url
            paths = ["/", "/events", "/dead", "/keys", "/consumers", "/audit"]
            paths += [f"/events/{i}" for i in ids]
            paths += ["/events?" + urlencode({"status": "scheduled", "topic": t}) for t in AWKWARD]
            for text in HOSTILE:
                # each text as a filter value: reflected in form values, links and counts
                query = {"topic": text, "ordering_key": text, "payload": json.dumps({"t": text})}
                paths.append("/events?" + urlencode(query))
                paths.append("/dead?" + urlencode({"error": text, "topic": text}))
            for path in paths:
                response = await w.page.goto(base.rstrip("/") + path)
                assert response is not None and response.status == 200, path
                await check(w, base)
            # each topic's page, reached by its link on the overview: the name survives the
            # URL (slashes, dots, ?, #, %) and every label of its charts is text
            for name in HOSTILE + AWKWARD:
                await w.page.goto(base)
                rows = w.page.locator("#topics tbody tr")
                names = await rows.evaluate_all("rs => rs.map(r => r.dataset.topic)")
                assert names.count(name) == 1, (name, names)
                link = rows.nth(names.index(name)).locator("a.topic")
                await link.click()
                await w.page.wait_for_load_state()
                assert w.documents[-1].status == 200, (name, w.page.url)
                await check(w, base)
                shown = await w.page.locator("#topic-name").text_content()
                assert shown == name, (name, w.page.url)
                if name in HOSTILE:
                    label = await w.page.get_attribute("#done-hour svg", "aria-label")
                    assert label == f"events of {name} done per minute"
                    assert name in await w.page.inner_text("#done-hour figcaption")
                    # its running event's group (the same text) is listed among the busiest, as text
                    assert name in await w.page.inner_text("#busiest-groups")
            # the text is shown, literally
            await w.page.goto(base.rstrip("/") + f"/events/{ids[0]}")
            timeline = await w.page.inner_text("#timeline")
            assert timeline.count(HOSTILE[0]) >= 2, timeline  # the error and the worker
            assert HOSTILE[0] in await w.page.inner_text("#payload")
            # (in full, under the timeline: one click away, so read as the DOM has it)
            assert HOSTILE[0] in (await w.page.text_content("#last-error") or "")
            assert HOSTILE[0] in await w.page.inner_text("#headers")
            # the same for a finished event, read from the ring
            await w.page.goto(base.rstrip("/") + f"/events/{ids[2]}")
            await check(w, base)
            assert HOSTILE[0] in await w.page.inner_text("#payload")
            assert HOSTILE[0] in await w.page.inner_text("#headers")
            assert HOSTILE[0] in (await w.page.text_content("#last-error") or "")
            await w.page.goto(base.rstrip("/") + "/consumers")
            workers = await w.page.inner_text("table.workers")
            for i, text in enumerate(HOSTILE):
                assert f"{text} #{i}" in workers and f"{text}:1" in workers, workers
            relays = w.page.locator("table.relays tr.relay")
            shown = await relays.evaluate_all("rs => rs.map(r => r.dataset.relay)")
            for i, text in enumerate(HOSTILE):  # as text, the attribute intact
                assert f"relay redis:{text} @h:1:{i}" in shown, shown
            await w.page.goto(base.rstrip("/") + "/events?" + urlencode({"topic": HOSTILE[1]}))
            assert await w.page.input_value('input[name="topic"]') == HOSTILE[1]
            # dead, waiting, processing, done, and the one at times no datetime holds
            assert await w.page.inner_text("#matching") == "5"
            # an action on a hostile filter: the audit shows it as text too
            await w.page.goto(base.rstrip("/") + "/dead?" + urlencode({"topic": HOSTILE[3]}))
            await w.page.click("#retry-matching")
            assert await w.page.inner_text("#confirm-count") == "1"
            await w.page.click("#confirm")
            await w.page.wait_for_url(re.compile(r"/dead\?.*done=\d+"))
            await check(w, base)
            assert await w.page.input_value('input[name="topic"]') == HOSTILE[3]
            await w.page.goto(base.rstrip("/") + "/audit")
            await check(w, base)
            assert HOSTILE[3] in await w.page.inner_text("#audit")
            # what the page did: nothing but our own requests, no dialog, CSP each time
            assert w.dialogs == []
            for url in w.requests:
                parts = urlsplit(url)
                assert url.startswith(base) and _OURS.match(parts.path), url
            assert w.documents
            for doc in w.documents:
                csp = doc.headers["content-security-policy"]
                assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    finally:
        await conn.close()
