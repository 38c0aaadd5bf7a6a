"""What a hostile client sends, answered like any other request: a foreign ``Host`` (DNS
rebinding) is refused before anything is read or changed, on the command's server and in
a mounted app; odd input (digits other than 0-9, JSON jsonb cannot hold, times that
leave the calendar once moved to UTC, ids past bigint) gets a 400 or 404 page, and every
answer carries the security headers. Through a real server (uvicorn, the command) and,
for the mounted app, through Starlette's ASGI stack: nothing is mocked."""

from __future__ import annotations

from urllib.parse import quote

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

import aiooutbox
from aiooutbox.errors import InvalidArgument
from aiooutbox.web import create_app
from tests.dashboard.server import dashboard
from tests.dashboard.test_security import check_headers, dead_events, statuses, token

pytestmark = pytest.mark.slow

REBIND = "rebind.attacker.example"


async def controls(dsn: str) -> list[tuple[str, bool, int | None]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT topic, paused, max_running FROM outbox_events_flow")
        return [(r[0], r[1], r[2]) for r in rows]
    finally:
        await conn.close()


async def test_a_foreign_host_is_refused_before_anything_is_read_or_changed(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        event_id = await aiooutbox.enqueue(conn, "orders.created", {"secret": "s3cr3t"})
    finally:
        await conn.close()
    async with dashboard(dsn) as d, httpx.AsyncClient() as client:
        port = d.url.rstrip("/").rsplit(":", 1)[1]
        # what a rebinding page's requests look like: its own name as the Host
        for host in (f"{REBIND}:{port}", REBIND, f"127.0.0.1.{REBIND}", f"localhost.{REBIND}"):
            for path in ("/", f"/events/{event_id}", "/dead", "/static/dashboard.js", "/live"):
                r = await client.get(d.at(path), headers={"Host": host})
                assert r.status_code == 400, (host, path, r.status_code)
                check_headers(r)
                assert "s3cr3t" not in r.text and "csrf" not in r.text
                assert "set-cookie" not in r.headers
        # the pause a rebinding page would post (with a token it cannot read anyway)
        csrf = await token(client, d, "/")
        refused = await client.post(
            d.at("/topics/flow"),
            data={"csrf": csrf, "action": "pause", "topic": "orders.created"},
            headers={"Host": f"{REBIND}:{port}", "Origin": f"http://{REBIND}:{port}"},
        )
        assert refused.status_code == 400
        check_headers(refused)
        assert await controls(dsn) == []
        # the names a browser on this machine uses are answered
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
            r = await client.get(d.at("/"), headers={"Host": host})
            assert r.status_code == 200, host
            check_headers(r)
    # a configured name is answered, and still nothing else
    async with (
        dashboard(dsn, "--allowed-host", "ops.example.com", "--allowed-host", ".corp.example") as d,
        httpx.AsyncClient() as client,
    ):
        for host, status in (
            ("ops.example.com", 200),
            ("OPS.EXAMPLE.COM.", 200),
            ("dash.corp.example:8040", 200),
            ("corp.example", 200),
            ("example.com", 400),
            ("ops.example.com.evil.example", 400),
            (REBIND, 400),
        ):
            r = await client.get(d.at("/"), headers={"Host": host})
            assert r.status_code == status, host
            check_headers(r)


async def test_a_mounted_dashboard_refuses_a_foreign_host(dsn: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        for allowed in (None, ["ops.example.com"]):
            board = create_app(pool=pool, auth=lambda request: "write", allowed_hosts=allowed)
            app = Starlette(routes=[Mount("/outbox", app=board)])
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
                ok = await client.get("/outbox/")
                assert ok.status_code == 200
                for host in ("localhost:8000", "127.0.0.1"):
                    assert (await client.get("/outbox/", headers={"Host": host})).status_code == 200
                refused = await client.get("/outbox/", headers={"Host": REBIND})
                assert refused.status_code == 400
                check_headers(refused)
                configured = await client.get("/outbox/", headers={"Host": "ops.example.com"})
                assert configured.status_code == (200 if allowed else 400)
            await board.state.dashboard.aclose()
        for bad in ("http://ops.example.com", "ops.example.com/x", "", "a b", 7):
            with pytest.raises(InvalidArgument):
                create_app(pool=pool, allowed_hosts=[bad])  # type: ignore[list-item]
        with pytest.raises(InvalidArgument):
            create_app(pool=pool, allowed_hosts="ops.example.com")  # type: ignore[arg-type]
    finally:
        await pool.close()


def _q(value: str) -> str:
    return quote(value, safe="")


# JSON filters jsonb cannot hold (each was a 500 without the security headers)
BAD_JSON = [
    '{"a": NaN}',
    '{"a": Infinity}',
    '{"a": -Infinity}',
    '{"a": 1e400}',
    '{"a": "\\u0000"}',
    '{"\\u0000": 1}',
    '{"a": "\\ud800"}',
    '{"a": ["\\udc00"]}',
]
# what Python takes for digits and PostgreSQL does not (or reads as another number)
ODD_NUMBERS = ["²", "١٢", "1_2", "+12", " 12a", "9999999999999999999", "-1", "0x10"]
# times that overflow once moved to UTC
ODD_TIMES = ["0001-01-01T00:00:00+05:00", "9999-12-31T23:59:59-05:00"]


async def test_odd_input_gets_a_400_or_404_page_with_the_security_headers(dsn: str) -> None:
    await dead_events(dsn, 1)
    conn = await asyncpg.connect(dsn)
    try:
        # a legal payload 3,000 levels deep (jsonb takes it; Python's json module does not)
        deep = "[" * 3000 + '"bottom"' + "]" * 3000
        deep_id = await conn.fetchval(
            "INSERT INTO outbox_events (topic, payload, headers) VALUES ('deep', $1::jsonb,"
            " jsonb_build_object('traceparent', $1::jsonb)) RETURNING id",
            deep,
        )
    finally:
        await conn.close()
    gets: list[tuple[str, int]] = []
    for n in ODD_NUMBERS:
        gets.append((f"/events/{_q(n)}", 404))
        gets += [(f"/events?id={_q(n)}", 400), (f"/events?before={_q(n)}", 400)]
        gets += [(f"/dead?before={_q(n)}", 400), (f"/audit?before={_q(n)}", 400)]
    for text in BAD_JSON:
        gets += [(f"/events?payload={_q(text)}", 400), (f"/dead?headers={_q(text)}", 400)]
    for text in ODD_TIMES:
        gets += [(f"/events?created_from={_q(text)}", 400), (f"/dead?created_to={_q(text)}", 400)]
    async with dashboard(dsn) as d, httpx.AsyncClient() as client:
        for path, status in gets:
            r = await client.get(d.at(path))
            assert r.status_code == status, (path, r.status_code, r.text[-300:])
            check_headers(r)
        # the deep payload's page renders, showing the payload as stored
        page = await client.get(d.at(f"/events/{deep_id}"))
        assert page.status_code == 200
        check_headers(page)
        assert "bottom" in page.text
        # forms: every odd number refused before anything is written
        csrf = await token(client, d)
        for n in ODD_NUMBERS:
            for path in ("/dead/confirm", "/dead/act"):
                r = await client.post(
                    d.at(path),
                    data={"csrf": csrf, "action": "retry", "mode": "selection", "ids": [n]},
                )
                assert r.status_code == 400, (path, n, r.text[-300:])
                check_headers(r)
            r = await client.post(
                d.at("/topics/flow"),
                data={"csrf": csrf, "action": "limit", "topic": "emails.send", "max_running": n},
            )
            assert r.status_code == 400, (n, r.text[-300:])
            check_headers(r)
        for text in BAD_JSON:
            r = await client.post(
                d.at("/dead/confirm"),
                data={"csrf": csrf, "action": "purge", "mode": "filter", "payload": text},
            )
            assert r.status_code == 400, (text, r.text[-300:])
            check_headers(r)
    assert await statuses(dsn) == {"dead": 1, "pending": 1}
    assert await controls(dsn) == []
