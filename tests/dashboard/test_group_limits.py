"""Per-group limits on the topic page: a writer sets the topic's default for every group,
one group's override, and removes an override; the change is `admin.limit_groups`' (in
the flow log, by ``dashboard:<user>``) and in the dashboard's audit. Bad values, hostile
group names, other origins, missing tokens and read-only dashboards change nothing."""

from __future__ import annotations

import asyncio
import html
import itertools
import re
from pathlib import Path

import asyncpg
import httpx
import pytest
from markupsafe import escape

import aiooutbox
from aiooutbox import admin
from tests.dashboard.browser import browser_page, screenshot
from tests.dashboard.server import Dashboard, dashboard
from tests.dashboard.test_hostile import HOSTILE, check
from tests.dashboard.test_security import audit_rows, check_headers, token
from tests.programs import needs

pytestmark = pytest.mark.slow

ACTOR = "dashboard:anonymous at 127.0.0.1"
PAGE = "/topics/invoices"
Limits = dict[str | None, tuple[int | None, str | None, float | None]]


async def limits(dsn: str, topic: str = "invoices") -> Limits:
    conn = await asyncpg.connect(dsn)
    try:
        found = await admin.group_limits(conn, topic)
    finally:
        await conn.close()
    return {g.group: (g.max_running, g.rate_text, g.burst) for g in found}


async def group_log(dsn: str) -> list[tuple[str, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT actor, topic FROM outbox_events_flow_log WHERE action = 'limit groups'"
            " ORDER BY id"
        )
    finally:
        await conn.close()
    return [(r[0], r[1]) for r in rows]


async def grouped_events(dsn: str, topic: str = "invoices") -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await aiooutbox.enqueue_many(
            conn, [aiooutbox.NewEvent(topic, i, group=f"tenant-{i % 2}") for i in range(4)]
        )
    finally:
        await conn.close()


async def post(
    client: httpx.AsyncClient, d: Dashboard, csrf: str, back: str = PAGE, **form: str
) -> httpx.Response:
    data = {"csrf": csrf, "topic": "invoices", "back": back, **form}
    return await client.post(d.at("/topics/groups"), data=data)


def flash(page: str) -> str:
    match = re.search(r'id="flash"[^>]*>(.*?)<', page, re.S)
    assert match, "no message on the page"
    return html.unescape(match[1]).strip()


def field_error(page: str) -> tuple[str, str]:
    match = re.search(r'class="problem field-error"[^>]*data-field="([^"]*)">(.*?)</span>', page)
    assert match, "no error beside a field"
    return match[1], html.unescape(match[2])


def value_of(page: str, form: str, name: str) -> str:
    part = page.split(f'id="{form}"')[1].split("</form>")[0]
    match = re.search(rf'name="{name}"[^>]*value="([^"]*)"', part)
    assert match, (form, name)
    return html.unescape(match[1])


async def test_set_a_default_an_override_and_remove_it(dsn: str) -> None:
    await grouped_events(dsn)
    async with dashboard(dsn) as d, httpx.AsyncClient() as client:
        page = (await client.get(d.at(PAGE))).text
        assert 'id="no-group-limits"' in page and 'id="group-default"' in page
        csrf = await token(client, d, PAGE)
        r = await post(client, d, csrf, action="default", group_max_running="4", group_rate="10/s")
        assert r.status_code == 303, r.text
        assert re.fullmatch(r"/topics/invoices\?done=\d+#group-limits", r.headers["location"])
        page = (await client.get(d.at(r.headers["location"].split("#")[0]))).text
        assert (
            flash(page)
            == "Limited every group of topic invoices: at most 4 running, rate 10/s in bursts of 1."
        )
        assert await limits(dsn) == {None: (4, "10/s", 1.0)}
        # the form starts from what is set; the list shows it
        assert value_of(page, "group-default", "group_max_running") == "4"
        assert value_of(page, "group-default", "group_rate") == "10/s"
        assert value_of(page, "group-default", "group_burst") == ""
        listed = page.split('id="group-limit-list"')[1].split("</table>")[0]
        assert "every group" in listed and ">4<" in listed and ">10/s<" in listed
        # an override for one group (with no events yet), its own burst
        r = await post(
            client,
            d,
            csrf,
            action="override",
            group="tenant-42",
            group_max_running="20",
            group_rate="100/s",
            group_burst="50",
        )
        assert r.status_code == 303, r.text
        page = (await client.get(d.at(r.headers["location"].split("#")[0]))).text
        assert flash(page) == (
            "Limited group tenant-42 of topic invoices: at most 20 running,"
            " rate 100/s in bursts of 50."
        )
        assert (await limits(dsn))["tenant-42"] == (20, "100/s", 50.0)
        listed = page.split('id="group-limit-list"')[1].split("</table>")[0]
        assert "tenant-42" in listed and ">50<" in listed
        # an override of one field: the others take the default
        r = await post(client, d, csrf, action="override", group="tenant-0", group_max_running="1")
        assert r.status_code == 303
        assert (await limits(dsn))["tenant-0"] == (1, None, None)
        # remove an override: the group takes the default again
        r = await post(client, d, csrf, action="remove", group="tenant-42")
        assert r.status_code == 303, r.text
        page = (await client.get(d.at(r.headers["location"].split("#")[0]))).text
        assert flash(page) == "Removed the limits of group tenant-42 of topic invoices."
        assert await limits(dsn) == {None: (4, "10/s", 1.0), "tenant-0": (1, None, None)}
        # empty fields remove the default
        r = await post(client, d, csrf, action="default", group_max_running="", group_rate="")
        assert r.status_code == 303
        assert await limits(dsn) == {"tenant-0": (1, None, None)}
        # the audit says each in words
        audit = (await client.get(d.at("/audit"))).text
        assert "limited group tenant-42 of topic invoices" in html.unescape(audit)
    assert await group_log(dsn) == [(ACTOR, "invoices")] * 5
    entries = await audit_rows(dsn)
    assert [e["action"] for e in entries] == ["group limit"] * 5
    assert '"group": "tenant-42"' in entries[1]["target"]


async def test_bad_values_are_refused_beside_the_field_and_kept(dsn: str) -> None:
    await grouped_events(dsn)
    async with dashboard(dsn) as d, httpx.AsyncClient() as client:
        csrf = await token(client, d, PAGE)
        bad = [
            ({"action": "default", "group_max_running": "0"}, "group_max_running", "from 1 to"),
            ({"action": "default", "group_max_running": "-1"}, "group_max_running", "whole"),
            ({"action": "default", "group_max_running": "2.5"}, "group_max_running", "whole"),
            ({"action": "default", "group_max_running": "١٢"}, "group_max_running", "whole"),
            ({"action": "default", "group_rate": "0/s"}, "group_rate", "lets nothing through"),
            ({"action": "default", "group_rate": "1e9/s"}, "group_rate", "above the highest"),
            ({"action": "default", "group_rate": "1/day"}, "group_rate", "invalid rate"),
            ({"action": "default", "group_rate": "1/" + "s" * 100}, "group_rate", "use N/s"),
            ({"action": "default", "group_burst": "5"}, "group_burst", "needs a rate"),
            (
                {"action": "default", "group_rate": "5/s", "group_burst": "0"},
                "group_burst",
                "from 1 to",
            ),
            (
                {"action": "default", "group_rate": "5/s", "group_burst": "nan"},
                "group_burst",
                "from 1 to",
            ),
            ({"action": "override", "group": "", "group_max_running": "3"}, "group", "name the"),
            ({"action": "remove"}, "group", "name the group"),
        ]
        for fields, field, reason in bad:
            r = await post(client, d, csrf, **fields)
            assert r.status_code == 400, (fields, r.text[:300])
            check_headers(r)
            shown, message = field_error(r.text)
            assert shown == field and reason in message, (fields, shown, message)
            kind = "group-default" if fields["action"] == "default" else "group-override"
            assert f'id="{kind}-error"' in r.text
            for name, typed in fields.items():  # what was typed, kept
                if name != "action":
                    assert value_of(r.text, kind, name) == typed, (fields, name)
            assert 'aria-invalid="true"' in r.text
            assert r.text.count('class="problem field-error"') == 1
        # malformed posts: 400 pages with the security headers
        for form in (
            {"action": "explode"},
            {"action": "default", "topic": ""},
            {"action": "default", "topic": "x" * 300},
            {"action": "default", "topic": "a\x00b"},
        ):
            r = await post(client, d, csrf, back="", **form)
            assert r.status_code == 400, (form, r.text[:300])
            check_headers(r)
            assert 'id="refused"' in r.text
        r = await client.post(d.at("/topics/groups"), data={"csrf": csrf, "action": "default"})
        assert r.status_code == 400
        check_headers(r)
    assert await limits(dsn) == {}
    assert await group_log(dsn) == [] and await audit_rows(dsn) == []


HOSTILE_GROUPS = [
    *HOSTILE,
    "\uff54\uff45\uff4e\uff41\uff4e\uff54-42",  # fullwidth: not tenant-42
    "ten\u0430nt-42",  # a Cyrillic a
    "tenant-42\u202e<b>",  # a right-to-left override
    "é" * 256,  # 512 UTF-8 bytes: the longest name
]


async def test_hostile_group_names_are_text_and_refused_when_the_library_would(
    dsn: str,
) -> None:
    await grouped_events(dsn)
    async with dashboard(dsn) as d, httpx.AsyncClient() as client:
        csrf = await token(client, d, PAGE)
        for i, name in enumerate(HOSTILE_GROUPS):
            r = await post(
                client, d, csrf, action="override", group=name, group_max_running=str(i + 1)
            )
            assert r.status_code == 303, (name, r.text[:300])
            page = (await client.get(d.at(r.headers["location"].split("#")[0]))).text
            assert (
                flash(page) == f"Limited group {name} of topic invoices: at most {i + 1} running."
            )
        stored = await limits(dsn)
        assert {g: v[0] for g, v in stored.items()} == {
            name: i + 1 for i, name in enumerate(HOSTILE_GROUPS)
        }
        assert "tenant-42" not in stored  # the confusables are groups of their own
        page = (await client.get(d.at(PAGE))).text
        listed = page.split('id="group-limit-list"')[1].split("</table>")[0]
        for name in HOSTILE_GROUPS:  # as text, in the cell and in the Remove form's value
            assert listed.count(str(escape(name))) == 2, name
        assert "<script>" not in listed and "<img" not in listed and "<svg" not in listed
        # refused names: NUL, over 512 bytes, a megabyte; what was typed comes back as text
        for name, reason in (
            ("a\x00<b>", "without NUL"),
            ("é" * 257, "at most 512 bytes"),
            ("x" * 999_990 + "<i>", "at most 512 bytes"),  # a megabyte
        ):
            r = await post(client, d, csrf, action="override", group=name, group_rate="1/s")
            assert r.status_code == 400, r.text[:300]
            check_headers(r)
            shown, message = field_error(r.text)
            assert shown == "group" and reason in message
            kept = value_of(r.text, "group-override", "group")
            assert kept == name.replace("\x00", "\ufffd")[:600]
            assert "\x00" not in r.text and "<i><i>" not in r.text
        # a field over the form parser's bound (1 MiB as sent): refused before any of ours
        r = await post(client, d, csrf, action="override", group="<i>" * 350_000)
        assert r.status_code == 400 and "<i>" not in r.text
        check_headers(r)
        # a hostile name removed by its own Remove form
        r = await post(client, d, csrf, action="remove", group=HOSTILE[1])
        assert r.status_code == 303
    after = await limits(dsn)
    assert HOSTILE[1] not in after and len(after) == len(HOSTILE_GROUPS) - 1


async def test_group_posts_refuse_other_origins_missing_tokens_and_read_only(dsn: str) -> None:
    await grouped_events(dsn)
    form = {"action": "default", "topic": "invoices", "group_max_running": "2"}
    async with dashboard(dsn) as d, httpx.AsyncClient() as client:
        csrf = await token(client, d, PAGE)
        async with httpx.AsyncClient() as other:
            stolen = await token(other, d, PAGE)
        at = d.at("/topics/groups")
        refused = [
            await client.post(
                at, data={**form, "csrf": csrf}, headers={"Origin": "http://evil.example"}
            ),
            await client.post(
                at, data={**form, "csrf": csrf}, headers={"Sec-Fetch-Site": "cross-site"}
            ),
            await client.post(at, data={**form, "csrf": ""}),
            await client.post(at, data=form),
            await client.post(at, data={**form, "csrf": stolen}),
        ]
        assert [r.status_code for r in refused] == [403] * 5, [r.text[:200] for r in refused]
        for r in refused:
            check_headers(r)
        assert await limits(dsn) == {}
        ok = await client.post(at, data={**form, "csrf": csrf})
        assert ok.status_code == 303
    async with dashboard(dsn, "--read-only") as d, httpx.AsyncClient() as client:
        page = await client.get(d.at(PAGE))
        assert page.status_code == 200
        # the limits show, the controls do not
        assert 'id="group-limit-list"' in page.text
        assert "/topics/groups" not in page.text and "Set group limits" not in page.text
        for action in ("default", "override", "remove"):
            r = await client.post(
                d.at("/topics/groups"),
                data={**form, "csrf": "x", "action": action, "group": "tenant-0"},
            )
            assert r.status_code == 403 and "read-only" in r.text
            check_headers(r)
    assert await limits(dsn) == {None: (2, None, None)}
    assert len(await group_log(dsn)) == 1 and len(await audit_rows(dsn)) == 1


async def test_two_operators_setting_one_group_at_once_are_serialised(dsn: str) -> None:
    await grouped_events(dsn)
    async with dashboard(dsn) as d, httpx.AsyncClient() as a, httpx.AsyncClient() as b:
        csrf_a, csrf_b = await token(a, d, PAGE), await token(b, d, PAGE)
        for round_ in range(5):
            results = await asyncio.gather(
                post(a, d, csrf_a, action="override", group="tenant-1",
                     group_max_running=str(10 + round_), group_rate="5/s"),
                post(b, d, csrf_b, action="override", group="tenant-1",
                     group_max_running=str(20 + round_)),
            )  # fmt: skip
            assert [r.status_code for r in results] == [303, 303], [r.text[:300] for r in results]
            got = (await limits(dsn))["tenant-1"]
            # a form sends every field: the later change wins whole, never a mix
            assert got in ((10 + round_, "5/s", 1.0), (20 + round_, None, None)), got
    # every change logged and audited; one after the other: each saw the one before
    conn = await asyncpg.connect(dsn)
    try:
        log = await conn.fetch(
            "SELECT before::text, after::text FROM outbox_events_flow_log"
            " WHERE action = 'limit groups' ORDER BY id"
        )
    finally:
        await conn.close()
    assert len(log) == 10 and len(await audit_rows(dsn)) == 10
    for earlier, later in itertools.pairwise(log):
        assert later["before"] == earlier["after"], (earlier, later)


async def test_a_topic_page_for_a_role_without_the_group_limits_table(dsn: str) -> None:
    """A viewer of the previous release's grants (no SELECT on the group limits): the
    page renders and says which grant is missing."""
    import uuid

    from aiooutbox.web import create_app
    from tests.test_roles import as_user

    role = f"aiooutbox_groupviewer_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'CREATE ROLE "{role}" LOGIN')
        await conn.execute(f'GRANT USAGE ON SCHEMA public TO "{role}"')
        await conn.execute(
            "GRANT SELECT ON outbox_events, outbox_events_idle, outbox_events_audit,"
            " outbox_events_flow, outbox_events_migrations, outbox_events_migrations_compat"
            f' TO "{role}"'
        )
        await aiooutbox.enqueue(conn, "invoices", {}, group="tenant-0")
        pool = await asyncpg.create_pool(as_user(dsn, role), min_size=1, max_size=2)
        try:
            app = create_app(pool=pool, read_only=True)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                r = await client.get(PAGE)
            await app.state.dashboard.aclose()
        finally:
            await pool.close()
        assert r.status_code == 200, r.text[-2000:]
        assert "may not read outbox_events_group_limits" in r.text
    finally:
        await conn.execute(f'DROP OWNED BY "{role}"')
        await conn.execute(f'DROP ROLE IF EXISTS "{role}"')
        await conn.close()


@needs("chromium")
async def test_set_a_group_limit_in_the_browser(dsn: str, tmp_path: Path) -> None:
    await grouped_events(dsn)
    async with dashboard(dsn) as d, browser_page() as w:
        page = w.page
        await page.goto(d.at(PAGE))
        await page.fill('#group-default input[name="group_max_running"]', "4")
        await page.fill('#group-default input[name="group_rate"]', "10/s")
        await page.click("button.set-group-limits")
        await page.wait_for_url(re.compile(r"/topics/invoices\?done=\d+#group-limits$"))
        assert await page.inner_text("#flash") == (
            "Limited every group of topic invoices: at most 4 running, rate 10/s in bursts of 1."
        )
        default = page.locator("#group-limit-list tr.default")
        assert await default.locator('[data-limit="max_running"]').inner_text() == "4"
        assert await default.locator('[data-limit="rate"]').inner_text() == "10/s"
        # an override of one group
        await page.fill('#group-override input[name="group"]', "tenant-42")
        await page.fill('#group-override input[name="group_max_running"]', "20")
        await page.fill('#group-override input[name="group_rate"]', "100/s")
        await page.fill('#group-override input[name="group_burst"]', "50")
        await page.click("button.set-group-override")
        await page.wait_for_url(re.compile(r"done=\d+#group-limits$"))
        assert await page.inner_text("#flash") == (
            "Limited group tenant-42 of topic invoices: at most 20 running,"
            " rate 100/s in bursts of 50."
        )
        row = page.locator("#group-limit-list tbody tr", has_text="tenant-42")
        assert await row.locator('[data-limit="burst"]').inner_text() == "50"
        await screenshot(page, "group-limits", tmp_path)
        # an override of a hostile group, from the page
        await page.fill('#group-override input[name="group"]', HOSTILE[1])
        await page.fill('#group-override input[name="group_max_running"]', "9")
        await page.click("button.set-group-override")
        await page.wait_for_url(re.compile(r"done=\d+#group-limits$"))
        assert await page.inner_text("#flash") == (
            f"Limited group {HOSTILE[1]} of topic invoices: at most 9 running."
        )
        row = page.locator("#group-limit-list tbody tr", has_text=HOSTILE[1])
        assert await row.locator('[data-limit="max_running"]').inner_text() == "9"
        assert await row.locator('[data-limit="rate"]').inner_text() == "default"
        await check(w, d.url)
        # a refused value: the reason beside the field, what was typed kept
        await page.fill('#group-override input[name="group"]', "tenant-0")
        await page.fill('#group-override input[name="group_rate"]', "0/s")
        await page.click("button.set-group-override")
        error = page.locator('#group-override .field-error[data-field="group_rate"]')
        assert "lets nothing through" in await error.inner_text()
        assert await page.input_value('#group-override input[name="group_rate"]') == "0/s"
        assert await page.input_value('#group-override input[name="group"]') == "tenant-0"
        # remove the override with its button
        await page.goto(d.at(PAGE))
        await row.locator("button.remove-group-limit").click()
        await page.wait_for_url(re.compile(r"done=\d+#group-limits$"))
        assert await page.inner_text("#flash") == (
            f"Removed the limits of group {HOSTILE[1]} of topic invoices."
        )
        assert await limits(dsn) == {None: (4, "10/s", 1.0), "tenant-42": (20, "100/s", 50.0)}
        assert w.dialogs == []
        assert len(w.console_errors) == 1 and "400" in w.console_errors[0], w.console_errors


async def test_the_documented_operator_grants_set_group_limits(dsn: str) -> None:
    """docs/dashboard.md's grants (after the viewer's and consumer's of guarantees.md)
    are what a dashboard that lists and sets group limits needs."""
    import uuid

    from aiooutbox.web import create_app
    from tests.test_roles import as_user, documented_grants

    doc = (Path(__file__).resolve().parents[2] / "docs" / "dashboard.md").read_text()
    section = doc.split("### Database roles")[1].split("\n## ")[0]
    blocks = re.findall(r"```sql\n(.*?)```", section, re.S)
    assert any("group_limits" in b for b in blocks)
    role = f"aiooutbox_groupop_{uuid.uuid4().hex[:10]}"
    statements = documented_grants("viewer", role) + documented_grants("consumer", role)
    statements += [
        s.strip().replace("outbox_operator", f'"{role}"')
        for b in blocks
        for s in b.split(";")
        if s.strip()
    ]
    await grouped_events(dsn)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'CREATE ROLE "{role}" LOGIN')
        for statement in statements:
            await conn.execute(statement)
        pool = await asyncpg.create_pool(as_user(dsn, role), min_size=1, max_size=2)
        try:
            app = create_app(pool=pool)
            transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
            # (served on loopback: writes without credentials)
            base = "http://127.0.0.1"
            async with httpx.AsyncClient(transport=transport, base_url=base) as client:
                page = await client.get(PAGE)
                assert page.status_code == 200 and 'id="group-default"' in page.text
                csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
                assert csrf
                data = {"csrf": csrf[1], "topic": "invoices", "back": PAGE}
                for form in (
                    {"action": "default", "group_rate": "10/s"},
                    {"action": "override", "group": "tenant-0", "group_max_running": "2"},
                    {"action": "remove", "group": "tenant-0"},
                ):
                    r = await client.post("/topics/groups", data={**data, **form})
                    assert r.status_code == 303, r.text[-2000:]
            await app.state.dashboard.aclose()
        finally:
            await pool.close()
        assert await limits(dsn) == {None: (None, "10/s", 1.0)}
        assert len(await audit_rows(dsn)) == 3
    finally:
        await conn.execute(f'DROP OWNED BY "{role}"')
        await conn.execute(f'DROP ROLE IF EXISTS "{role}"')
        await conn.close()
