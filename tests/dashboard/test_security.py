"""Who may change what, over real HTTP against the real server: credentials, the bind,
--read-only, same-origin and token checks on every mutation, the audit log, and the
security headers on every response."""

from __future__ import annotations

import re

import asyncpg
import httpx
import pytest

import aiooutbox
from tests.clirunner import cli
from tests.dashboard.server import Dashboard, dashboard

pytestmark = pytest.mark.slow

_CSRF = re.compile(r'name="csrf" value="([0-9a-f]+)"')


async def dead_events(dsn: str, n: int, topic: str = "emails.send") -> list[int]:
    conn = await asyncpg.connect(dsn)
    try:
        ids = await aiooutbox.enqueue_many(
            conn, [aiooutbox.NewEvent(topic, {"n": i}) for i in range(n)]
        )
        await conn.execute(
            "UPDATE outbox_events SET status = 'dead', attempts = 5, finished_at = now(),"
            " last_error = 'boom' WHERE id = ANY ($1::bigint[])",
            ids,
        )
        return [i for i in ids if i is not None]
    finally:
        await conn.close()


async def statuses(dsn: str) -> dict[str, int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT status::text, count(*) FROM outbox_events_all GROUP BY 1")
        return {r[0]: r[1] for r in rows}
    finally:
        await conn.close()


async def audit_rows(dsn: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        rows: list[asyncpg.Record] = await conn.fetch(
            "SELECT actor, action, target::text, affected FROM outbox_events_audit ORDER BY id"
        )
        return rows
    finally:
        await conn.close()


async def token(client: httpx.AsyncClient, d: Dashboard, path: str = "/dead") -> str:
    page = await client.get(d.at(path))
    assert page.status_code == 200, page.text
    match = _CSRF.search(page.text)
    assert match, "no form token on the page"
    return match[1]


def check_headers(response: httpx.Response) -> None:
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp
    assert "unsafe-inline" not in csp
    assert "frame-ancestors 'none'" in csp
    assert response.headers["x-content-type-options"] == "nosniff"


async def test_loopback_without_credentials_may_act_and_is_audited(dsn: str) -> None:
    ids = await dead_events(dsn, 3)
    async with dashboard(dsn) as d, httpx.AsyncClient() as client:
        assert "read and write" in d.access and "loopback" in d.access
        csrf = await token(client, d)
        # the confirmation shows the count and changes nothing
        confirm = await client.post(
            d.at("/dead/confirm"),
            data={"csrf": csrf, "action": "retry", "mode": "selection", "ids": ids[:2]},
        )
        assert confirm.status_code == 200
        assert 'id="confirm-count">2<' in confirm.text
        check_headers(confirm)
        assert (await statuses(dsn)) == {"dead": 3}
        done = await client.post(
            d.at("/dead/act"),
            data={"csrf": csrf, "action": "retry", "mode": "selection", "ids": ids[:2]},
        )
        assert done.status_code == 303, done.text
        assert (await statuses(dsn)) == {"dead": 1, "pending": 2}
        purged = await client.post(
            d.at("/dead/act"),
            data={"csrf": csrf, "action": "purge", "mode": "selection", "ids": ids[2:]},
        )
        assert purged.status_code == 303
        assert (await statuses(dsn)) == {"pending": 2}
        audit = await client.get(d.at("/audit"))
        assert audit.text.count(">anonymous at 127.0.0.1</td>") == 2
    rows = await audit_rows(dsn)
    assert [(r["action"], r["affected"]) for r in rows] == [("dead retry", 2), ("dead purge", 1)]
    assert all(r["actor"] == "anonymous at 127.0.0.1" for r in rows)
    assert str(ids[0]) in rows[0]["target"]


async def test_cross_origin_or_tokenless_posts_are_refused(dsn: str) -> None:
    ids = await dead_events(dsn, 1)
    async with dashboard(dsn) as d, httpx.AsyncClient() as client:
        csrf = await token(client, d)
        form = {"csrf": csrf, "action": "retry", "mode": "selection", "ids": ids}
        host = d.url.split("/")[2]
        refused = [
            await client.post(
                d.at("/dead/act"), data=form, headers={"Origin": "http://evil.example"}
            ),
            await client.post(d.at("/dead/act"), data=form, headers={"Origin": "null"}),
            await client.post(
                d.at("/dead/act"), data=form, headers={"Sec-Fetch-Site": "cross-site"}
            ),
            await client.post(
                d.at("/dead/act"), data=form, headers={"Sec-Fetch-Site": "same-site"}
            ),
            await client.post(d.at("/dead/act"), data={**form, "csrf": ""}),
            await client.post(
                d.at("/dead/act"), data={k: v for k, v in form.items() if k != "csrf"}
            ),
            await client.post(d.at("/dead/act"), data={**form, "csrf": "0" * 64}),
        ]
        # a token is bound to its session: another browser's token does not work here
        async with httpx.AsyncClient() as other:
            stolen = await token(other, d)
        refused.append(await client.post(d.at("/dead/act"), data={**form, "csrf": stolen}))
        # a GET never changes anything
        refused.append(await client.get(d.at("/dead/act"), params={"csrf": csrf, "ids": ids}))
        assert [r.status_code for r in refused] == [403] * 7 + [403, 405], [
            r.text[:200] for r in refused
        ]
        for r in refused[:8]:
            check_headers(r)
        assert (await statuses(dsn)) == {"dead": 1}
        # the same request from our own origin goes through
        ok = await client.post(
            d.at("/dead/act"),
            data=form,
            headers={"Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"},
        )
        assert ok.status_code == 303
    assert (await statuses(dsn)) == {"pending": 1}
    assert len(await audit_rows(dsn)) == 1


async def test_a_non_loopback_bind_without_credentials_refuses_every_mutation(dsn: str) -> None:
    ids = await dead_events(dsn, 2)
    async with dashboard(dsn, host="0.0.0.0") as d, httpx.AsyncClient() as client:
        assert "READ-ONLY" in d.access and "0.0.0.0" in d.access
        page = await client.get(d.at("/dead"))
        assert page.status_code == 200
        assert "Retry selected" not in page.text and "Read-only" in page.text
        check_headers(page)
        csrf = _CSRF.search(page.text)
        assert csrf is None  # no forms at all
        # a token from a loopback dashboard would not help either: forge the form
        for path in ("/dead/confirm", "/dead/act"):
            for action in ("retry", "purge"):
                r = await client.post(
                    d.at(path),
                    data={"csrf": "x", "action": action, "mode": "selection", "ids": ids},
                )
                assert r.status_code == 403, r.text
                assert "read permission only" in r.text
    assert (await statuses(dsn)) == {"dead": 2}
    assert await audit_rows(dsn) == []


async def test_basic_credentials(dsn: str, tmp_path: object) -> None:
    ids = await dead_events(dsn, 1)
    from pathlib import Path

    users = Path(str(tmp_path)) / "users"
    users.write_text(
        "# who may use the dashboard\nops:write:s3cret:with:colons\nviewer:read:look\n"
    )
    async with dashboard(dsn, "--users-file", str(users), host="0.0.0.0") as d:
        assert "HTTP Basic" in d.access
        async with httpx.AsyncClient() as anonymous:
            r = await anonymous.get(d.at("/"))
            assert r.status_code == 401
            assert r.headers["www-authenticate"].startswith("Basic ")
            check_headers(r)
            assert (await anonymous.get(d.at("/static/dashboard.js"))).status_code == 401
        for wrong in (("ops", "s3cret"), ("ops", "wrong"), ("nobody", "look"), ("viewer", "")):
            async with httpx.AsyncClient(auth=wrong) as client:
                assert (await client.get(d.at("/"))).status_code == 401, wrong
        async with httpx.AsyncClient(auth=("viewer", "look")) as viewer:
            page = await viewer.get(d.at("/dead"))
            assert page.status_code == 200 and "Retry selected" not in page.text
            r = await viewer.post(
                d.at("/dead/act"),
                data={"csrf": "x", "action": "retry", "mode": "selection", "ids": ids},
            )
            assert r.status_code == 403
        async with httpx.AsyncClient(auth=("ops", "s3cret:with:colons")) as ops:
            csrf = await token(ops, d)
            r = await ops.post(
                d.at("/dead/act"),
                data={"csrf": csrf, "action": "retry", "mode": "selection", "ids": ids},
            )
            assert r.status_code == 303
    rows = await audit_rows(dsn)
    assert [(r["actor"], r["action"], r["affected"]) for r in rows] == [("ops", "dead retry", 1)]


async def test_read_only_hides_and_refuses_actions(dsn: str) -> None:
    ids = await dead_events(dsn, 1)
    async with dashboard(dsn, "--read-only") as d, httpx.AsyncClient() as client:
        assert "read-only" in d.access
        for path in ("/dead", f"/events/{ids[0]}", "/keys"):
            page = await client.get(d.at(path))
            assert page.status_code == 200
            assert "Retry" not in page.text and "Purge" not in page.text, path
            assert "started read-only" in page.text
        r = await client.post(
            d.at("/dead/act"),
            data={"csrf": "x", "action": "retry", "mode": "selection", "ids": ids},
        )
        assert r.status_code == 403 and "read-only" in r.text
    assert (await statuses(dsn)) == {"dead": 1}


async def test_bulk_retry_by_filter_acts_on_the_confirmed_rows_only(dsn: str) -> None:
    await dead_events(dsn, 3, topic="a")
    others = await dead_events(dsn, 2, topic="b")
    async with dashboard(dsn) as d, httpx.AsyncClient() as client:
        csrf = await token(client, d)
        confirm = await client.post(
            d.at("/dead/confirm"),
            data={"csrf": csrf, "action": "retry", "mode": "filter", "topic": "a"},
        )
        assert 'data-exact="yes">3<' in confirm.text
        max_id = re.search(r'name="max_id" value="(\d+)"', confirm.text)
        assert max_id
        # one more dead event of topic a after the count was shown: not included
        late = await dead_events(dsn, 1, topic="a")
        r = await client.post(
            d.at("/dead/act"),
            data={
                "csrf": csrf,
                "action": "retry",
                "mode": "filter",
                "topic": "a",
                "max_id": max_id[1],
            },
        )
        assert r.status_code == 303
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT id, topic, status::text FROM outbox_events_all ORDER BY id")
    finally:
        await conn.close()
    by_id = {r["id"]: (r["topic"], r["status"]) for r in rows}
    assert sorted(s for t, s in by_id.values() if t == "a") == [
        "dead",
        "pending",
        "pending",
        "pending",
    ]
    assert by_id[late[0]][1] == "dead"
    assert all(by_id[i][1] == "dead" for i in others)
    [entry] = await audit_rows(dsn)
    assert entry["affected"] == 3 and '"topic": "a"' in entry["target"]


async def test_bad_command_lines_get_one_line(dsn: str, tmp_path: object) -> None:
    bad = [
        ("--trace-url", "ftp://x/{trace_id}"),
        ("--users-file", "/nonexistent/users"),
        ("--port", "99999"),
    ]
    for args in bad:
        r = await cli("dashboard", "--dsn", dsn, *args, timeout=30)
        assert r.rc in (1, 2), r
        # one line saying what is wrong (a usage error adds where to read more)
        lines = [line for line in r.err_lines if not line.startswith("(see ")]
        assert len(lines) == 1 and "error:" in lines[0], r.err
        assert "Traceback" not in r.err
    # a port already taken
    async with dashboard(dsn) as d:
        port = d.url.rstrip("/").rsplit(":", 1)[1]
        r = await cli("dashboard", "--dsn", dsn, "--port", port, timeout=30)
        assert r.rc == 1 and len(r.err_lines) == 1, r.err
        assert "cannot serve on" in r.err
