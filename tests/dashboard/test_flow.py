"""Flow control on the dashboard: the overview shows each topic's pause and limits, and a
writer pauses, resumes and limits a topic there; the change is `aiooutbox.admin`'s (in
the flow log, by ``dashboard:<user>``) and in the dashboard's audit. Bad values, other
origins, missing tokens and read-only dashboards change nothing."""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest

import aiooutbox
from aiooutbox import admin
from tests.dashboard.browser import browser_page, screenshot
from tests.dashboard.server import Dashboard, dashboard
from tests.dashboard.test_hostile import HOSTILE, check
from tests.dashboard.test_security import audit_rows, check_headers, token
from tests.helpers import running, wait_until
from tests.programs import needs

pytestmark = pytest.mark.slow

ACTOR = "dashboard:anonymous at 127.0.0.1"


async def controls(dsn: str) -> dict[str, tuple[bool, int | None, str | None]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT topic, paused, max_running, rate_text FROM outbox_events_flow"
        )
        return {r[0]: (r[1], r[2], r[3]) for r in rows}
    finally:
        await conn.close()


async def flow_log(dsn: str) -> list[tuple[str, str, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT actor, topic, action FROM outbox_events_flow_log ORDER BY id"
        )
        return [(r[0], r[1], r[2]) for r in rows]
    finally:
        await conn.close()


def cell(topic: str, key: str) -> str:
    return f'tr[data-topic="{topic}"] [data-flow="{key}"]'


@needs("chromium")
async def test_pause_resume_and_limit_a_topic_in_the_browser(dsn: str, tmp_path: Path) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    handled: list[tuple[str, int]] = []

    async def handler(event: aiooutbox.Event) -> None:
        handled.append((event.topic, event.id))

    async def status_of(ids: list[int]) -> set[str]:
        rows = await pool.fetch(
            "SELECT status::text FROM outbox_events_all WHERE id = ANY ($1::bigint[])", ids
        )
        return {r[0] for r in rows}

    async def all_done(ids: list[int]) -> bool:
        return await status_of(ids) == {"done"}

    try:
        consumer = aiooutbox.OutboxConsumer(pool, concurrency=4, poll_interval=0.5)
        handlers = {"emails.send": handler, "orders.created": handler}
        async with running(consumer, handlers), dashboard(dsn) as d, browser_page() as w:
            first = await aiooutbox.enqueue_many(pool, [aiooutbox.NewEvent("emails.send", {})])
            await wait_until(lambda: all_done([i for i in first if i]))
            page = w.page
            await page.goto(d.url)
            row = 'tr[data-topic="emails.send"]'
            assert await page.inner_text(cell("emails.send", "flow")) == ""
            await page.click(f"{row} button.pause")
            await page.wait_for_url(re.compile(r"/(\?done=\d+)?(#topics)?$"))
            assert (await controls(dsn))["emails.send"][0] is True
            assert await page.inner_text(cell("emails.send", "flow")) == "paused"
            assert await page.locator(f"{row} button.resume").count() == 1
            assert await flow_log(dsn) == [(ACTOR, "emails.send", "pause")]
            assert [(r["actor"], r["action"]) for r in await audit_rows(dsn)] == [
                ("anonymous at 127.0.0.1", "topic pause")
            ]
            # the running consumer claims no more of the paused topic, but of others
            held = [
                i
                for i in await aiooutbox.enqueue_many(
                    pool, [aiooutbox.NewEvent("emails.send", {"n": n}) for n in range(3)]
                )
                if i
            ]
            other = [
                i
                for i in await aiooutbox.enqueue_many(
                    pool, [aiooutbox.NewEvent("orders.created", {})]
                )
                if i
            ]
            await wait_until(lambda: all_done(other))
            await asyncio.sleep(1.5)  # three poll intervals more
            assert await status_of(held) == {"pending"}, handled
            await screenshot(page, "flow-paused", tmp_path)
            # resume: the held events run
            await page.goto(d.url)
            await page.click(f"{row} button.resume")
            await page.wait_for_url(re.compile(r"/(\?done=\d+)?(#topics)?$"))
            await wait_until(lambda: all_done(held))
            assert "emails.send" not in await controls(dsn)
            assert await page.inner_text(cell("emails.send", "flow")) == ""
            # limits: shown in the table once set
            await page.fill(f'{row} input[name="max_running"]', "3")
            await page.fill(f'{row} input[name="rate"]', "10/min")
            await page.click(f"{row} button.set-limits")
            await page.wait_for_url(re.compile(r"/(\?done=\d+)?(#topics)?$"))
            assert (await controls(dsn))["emails.send"] == (False, 3, "10/min")
            assert await page.inner_text(cell("emails.send", "max_running")) == "≤3 running"
            assert await page.inner_text("#flash") == (
                "Limited topic emails.send: at most 3 running, rate 10/min."
            )
            assert await page.inner_text(cell("emails.send", "rate")) == "10/min"
            # a bad value: refused with its reason beside the field, what was typed kept,
            # nothing written
            await page.fill(f'{row} input[name="max_running"]', "4")
            await page.fill(f'{row} input[name="rate"]', "0/s")
            await page.click(f"{row} button.set-limits")
            error = page.locator(f'{row} .field-error[data-field="rate"]')
            assert "lets nothing through" in await error.inner_text()
            assert await page.input_value(f'{row} input[name="rate"]') == "0/s"
            assert await page.input_value(f'{row} input[name="max_running"]') == "4"
            assert await page.get_attribute(f'{row} input[name="rate"]', "aria-invalid") == "true"
            assert (await controls(dsn))["emails.send"] == (False, 3, "10/min")
            # removing both limits (empty fields) removes the control
            await page.goto(d.url)
            await page.fill(f'{row} input[name="max_running"]', "")
            await page.fill(f'{row} input[name="rate"]', "")
            await page.click(f"{row} button.set-limits")
            await page.wait_for_url(re.compile(r"/(\?done=\d+)?(#topics)?$"))
            assert "emails.send" not in await controls(dsn)
            assert await page.inner_text(cell("emails.send", "max_running")) == ""
            assert [a for _, _, a in await flow_log(dsn)] == ["pause", "resume", "limit", "limit"]
            assert w.dialogs == []
            # the one error: the refused page's status, 400
            assert len(w.console_errors) == 1 and "400" in w.console_errors[0], w.console_errors
    finally:
        await pool.close()


async def post(client: httpx.AsyncClient, d: Dashboard, **form: str) -> httpx.Response:
    return await client.post(d.at("/topics/flow"), data=form)


async def one_event(dsn: str, topic: str = "t") -> None:
    """A row in the overview's topic table (where the forms, and so the token, are)."""
    conn = await asyncpg.connect(dsn)
    try:
        await aiooutbox.enqueue(conn, topic, {})
    finally:
        await conn.close()


async def test_bad_values_are_refused_with_a_reason_and_nothing_written(dsn: str) -> None:
    await one_event(dsn)
    async with dashboard(dsn) as d, httpx.AsyncClient() as client:
        csrf = await token(client, d, "/")
        bad = [
            ({"max_running": "0"}, "from 1 to"),
            ({"max_running": "-1"}, "whole number"),
            ({"max_running": "2.5"}, "whole number"),
            ({"max_running": "99999999999"}, "from 1 to"),
            ({"rate": "0/s"}, "lets nothing through"),
            ({"rate": "-5/s"}, "invalid rate"),
            ({"rate": "1e9/s"}, "above the highest limit"),
            ({"rate": "1/day"}, "invalid rate"),
            ({"rate": "1/" + "s" * 100}, "use N/s"),
        ]
        for fields, reason in bad:
            r = await post(client, d, csrf=csrf, action="limit", topic="t", **fields)
            assert r.status_code == 400, (fields, r.text[:300])
            assert reason in r.text, (fields, r.text)
            check_headers(r)
        for form in (
            {"action": "explode", "topic": "t"},
            {"action": "pause", "topic": ""},
            {"action": "pause", "topic": "x" * 300},
            {"action": "pause"},
        ):
            r = await post(client, d, csrf=csrf, **form)
            assert r.status_code == 400, (form, r.text[:300])
        assert await controls(dsn) == {}
        # the same form with good values goes through
        r = await post(
            client, d, csrf=csrf, action="limit", topic="t", max_running="5", rate="50/s"
        )
        assert r.status_code == 303, r.text
    assert await controls(dsn) == {"t": (False, 5, "50/s")}
    assert await flow_log(dsn) == [(ACTOR, "t", "limit")]
    [entry] = await audit_rows(dsn)
    assert entry["action"] == "topic limit" and '"max_running": 5' in entry["target"]


async def test_flow_posts_refuse_other_origins_missing_tokens_and_read_only(dsn: str) -> None:
    await one_event(dsn)
    async with dashboard(dsn) as d, httpx.AsyncClient() as client:
        csrf = await token(client, d, "/")
        assert 'action="/topics/flow"' in (await client.get(d.at("/"))).text
        form = {"csrf": csrf, "action": "pause", "topic": "t"}
        async with httpx.AsyncClient() as other:
            stolen = await token(other, d, "/")
        refused = [
            await client.post(
                d.at("/topics/flow"), data=form, headers={"Origin": "http://evil.example"}
            ),
            await client.post(
                d.at("/topics/flow"), data=form, headers={"Sec-Fetch-Site": "cross-site"}
            ),
            await client.post(d.at("/topics/flow"), data={**form, "csrf": ""}),
            await client.post(
                d.at("/topics/flow"), data={k: v for k, v in form.items() if k != "csrf"}
            ),
            await client.post(d.at("/topics/flow"), data={**form, "csrf": stolen}),
            await client.get(d.at("/topics/flow"), params=form),
        ]
        # (a GET is the page of a topic named "flow": there is none, and nothing changes)
        assert [r.status_code for r in refused] == [403] * 5 + [404], [
            r.text[:200] for r in refused
        ]
        assert await controls(dsn) == {}
        ok = await client.post(d.at("/topics/flow"), data=form)
        assert ok.status_code == 303
        assert await controls(dsn) == {"t": (True, None, None)}
    async with dashboard(dsn, "--read-only") as d, httpx.AsyncClient() as client:
        page = await client.get(d.at("/"))
        assert page.status_code == 200
        # the state shows, the controls do not
        assert 'data-flow="flow">paused<' in page.text
        assert "/topics/flow" not in page.text and "Resume" not in page.text
        for action in ("resume", "limit"):
            r = await client.post(
                d.at("/topics/flow"),
                data={"csrf": "x", "action": action, "topic": "t", "max_running": "2"},
            )
            assert r.status_code == 403 and "read-only" in r.text
    assert await controls(dsn) == {"t": (True, None, None)}
    assert len(await flow_log(dsn)) == 1
    assert len(await audit_rows(dsn)) == 1


@pytest.mark.timeout(120)
@needs("chromium")
async def test_hostile_topic_names_in_the_flow_columns_render_as_text(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for i, text in enumerate(HOSTILE):
            await aiooutbox.enqueue(conn, text, {})
            await admin.limit_topic(conn, text, max_running=i + 1, rate=f"{i + 1}/s")
        await admin.pause_topic(conn, HOSTILE[0])
        await admin.pause_topic(conn, HOSTILE[2] + "-no-events")
        async with dashboard(dsn) as d, browser_page() as w:
            await w.page.goto(d.url)
            await check(w, d.url)
            for i, text in enumerate(HOSTILE):
                row = w.page.locator("#topics tbody tr").filter(
                    has=w.page.locator("td.name a", has_text=text)
                )
                assert await row.locator('[data-flow="rate"]').first.inner_text() == f"{i + 1}/s"
            rows = w.page.locator("#topics tbody tr")
            topics = await rows.evaluate_all("rs => rs.map(r => r.dataset.topic)")
            assert set(HOSTILE) | {HOSTILE[2] + "-no-events"} <= set(topics)
            # steering a hostile topic from the page works on exactly that topic
            hostile_row = rows.nth(topics.index(HOSTILE[1]))
            await hostile_row.locator("button.pause").click()
            await w.page.wait_for_url(re.compile(r"/(\?done=\d+)?(#topics)?$"))
            await check(w, d.url)
            assert (await controls(dsn))[HOSTILE[1]] == (True, 2, "2/s")
            assert w.dialogs == []
            for url in w.requests:
                assert url.startswith(d.url), url
                assert urlsplit(url).path in ("/", "/topics/flow", "/live") or urlsplit(
                    url
                ).path.startswith("/static/"), url
    finally:
        await conn.close()


async def test_a_role_that_may_not_read_the_controls_still_sees_the_overview(dsn: str) -> None:
    """The viewer grants of the previous release (no SELECT on the controls table): the
    overview renders without the flow columns and says which grant is missing."""
    from aiooutbox.web import create_app
    from tests.test_roles import as_user

    role = f"aiooutbox_oldviewer_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'CREATE ROLE "{role}" LOGIN')
        await conn.execute(f'GRANT USAGE ON SCHEMA public TO "{role}"')
        await conn.execute(
            "GRANT SELECT ON outbox_events, outbox_events_idle, outbox_events_audit,"
            f' outbox_events_migrations, outbox_events_migrations_compat TO "{role}"'
        )
        await aiooutbox.enqueue(conn, "t", {})
        await admin.pause_topic(conn, "t")
        pool = await asyncpg.create_pool(as_user(dsn, role), min_size=1, max_size=2)
        try:
            app = create_app(pool=pool, read_only=True)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                r = await client.get("/")
            await app.state.dashboard.aclose()
        finally:
            await pool.close()
        assert r.status_code == 200, r.text[-2000:]
        assert "may not read outbox_events_flow" in r.text
        assert 'data-topic="t"' in r.text and "data-flow=" not in r.text
    finally:
        await conn.execute(f'DROP OWNED BY "{role}"')
        await conn.execute(f'DROP ROLE IF EXISTS "{role}"')
        await conn.close()
