"""Values a client may send or a producer may store that the pages once answered with a
500 or acted on wrongly: a form token with non-ASCII characters, a blank topic name
(stored by raw SQL), times outside the years a Python datetime holds, an attempt history
dated before the year 1, and text that is not UTF-8. Against a real PostgreSQL, through
the real command's server or the app over ASGI; nothing is mocked."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from urllib.parse import quote

import asyncpg
import httpx
import pytest

from aiooutbox.errors import InvalidArgument
from aiooutbox.web import create_app
from tests.dashboard.server import dashboard
from tests.dashboard.test_security import audit_rows, check_headers, dead_events, statuses, token
from tests.helpers import insert_unchecked

pytestmark = pytest.mark.slow


async def controls(dsn: str) -> list[tuple[str, bool]]:
    conn = await asyncpg.connect(dsn)
    try:
        return [
            (r[0], r[1]) for r in await conn.fetch("SELECT topic, paused FROM outbox_events_flow")
        ]
    finally:
        await conn.close()


async def group_limits(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM outbox_events_group_limits"))
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def app_client(dsn: str) -> AsyncIterator[httpx.AsyncClient]:
    """The app made by create_app(dsn=...), over ASGI, as a loopback client (write)."""
    app = create_app(dsn)
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            yield client
    finally:
        await app.state.dashboard.aclose()


async def test_a_form_token_with_non_ascii_characters_is_refused_like_a_wrong_one(
    dsn: str,
) -> None:
    [dead] = await dead_events(dsn, 1)
    before = await statuses(dsn)
    forms = [
        ("/topics/flow", {"action": "pause", "topic": "emails.send"}),
        ("/topics/groups", {"action": "default", "topic": "emails.send", "max_running": "2"}),
        ("/dead/confirm", {"action": "retry", "mode": "selection", "ids": str(dead)}),
        ("/dead/act", {"action": "purge", "mode": "selection", "ids": str(dead)}),
        ("/events/act", {"action": "cancel", "mode": "selection", "ids": str(dead)}),
    ]
    async with dashboard(dsn) as d, httpx.AsyncClient() as client:
        good = await token(client, d)
        for path, data in forms:
            for bad in ("é", "\u2603" * 64, good[:-1] + "ü", "0" * 64):
                r = await client.post(d.at(path), data={**data, "csrf": bad})
                assert r.status_code == 403, (path, bad, r.status_code, r.text[-300:])
                assert "form token" in r.text
                check_headers(r)
        # a session cookie of latin-1 bytes, with an ASCII token: refused the same way
        r = await client.post(
            d.at("/topics/flow"),
            data={"csrf": "0" * 64, "action": "pause", "topic": "emails.send"},
            headers={b"Cookie": "aiooutbox_dashboard_session=\xe9t\xe9".encode("latin-1")},
        )
        assert r.status_code == 403
    assert await controls(dsn) == []
    assert await group_limits(dsn) == 0
    assert await statuses(dsn) == before
    assert await audit_rows(dsn) == []


async def test_a_blank_topic_a_raw_sql_producer_stored_has_a_page(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        # the table's check tests the length only: a raw INSERT may store a blank topic
        for topic in (" ", "\t", "\u2003"):
            await conn.execute(
                "INSERT INTO outbox_events (topic, payload) VALUES ($1, '{}'::jsonb)", topic
            )
    finally:
        await conn.close()
    async with dashboard(dsn) as d, httpx.AsyncClient() as client:
        overview = await client.get(d.at("/"))
        assert overview.status_code == 200
        for topic in (" ", "\t", "\u2003"):
            link = "/topics/" + quote(topic, safe="")
            assert f'href="{link}"' in overview.text, topic
            page = await client.get(d.at(link))
            assert page.status_code == 200, (topic, page.text[-300:])
            assert "Pause" in page.text or "pause" in page.text
        # by name in the query too; a blank name nothing was stored under is not found
        assert (await client.get(d.at("/topics/?name=%E2%80%83"))).status_code == 200
        for missing in ("/topics/%20%20%20", "/topics/?name=%20%20%20", "/topics/%0B"):
            r = await client.get(d.at(missing))
            assert r.status_code == 404, (missing, r.status_code, r.text[-300:])
        # acting on it is refused with the reason, and writes nothing
        csrf = await token(client, d, "/topics/%20")
        r = await client.post(
            d.at("/topics/flow"), data={"csrf": csrf, "action": "pause", "topic": " "}
        )
        assert r.status_code == 400 and "blank" in r.text
    assert await controls(dsn) == []
    assert await audit_rows(dsn) == []


async def test_a_library_refusal_of_a_request_value_is_a_400_with_the_reason(dsn: str) -> None:
    def resolver(request: object) -> str:
        # a host application's resolver checks a request value with the library's error
        raise InvalidArgument("tenant header missing: send X-Tenant")

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        app = create_app(pool=pool, auth=resolver)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            r = await client.get("/")
            assert r.status_code == 400
            assert "tenant header missing: send X-Tenant" in r.text
            assert "internal error" not in r.text
            check_headers(r)
        await app.state.dashboard.aclose()
    finally:
        await pool.close()


# times PostgreSQL stores and a datetime cannot hold (asyncpg decodes 'infinity' as 9999)
ODD = {
    "available_at": ["infinity", "10000-01-01 00:00:00+00"],
    "created_at": ["infinity", "10000-01-01 00:00:00+00", "0044-03-15 00:00:00+00 BC"],
}
SHOWN = {
    "infinity": "infinity",
    "10000-01-01 00:00:00+00": "10000-01-01 00:00:00 UTC",
    "0044-03-15 00:00:00+00 BC": "0044-03-15 00:00:00 UTC BC",
}


async def test_times_outside_a_datetime_render_as_stored(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        # 'never': the only event of its topic, scheduled at infinity
        never = await conn.fetchval(
            "INSERT INTO outbox_events (topic, payload, available_at)"
            " VALUES ('never', '{}', 'infinity') RETURNING id"
        )
        ids = {}
        for column, values in ODD.items():
            for value in values:
                ids[column, value] = await conn.fetchval(
                    f"INSERT INTO outbox_events (topic, payload, {column})"
                    " VALUES ('odd', '{}', $1::text::timestamptz) RETURNING id",
                    value,
                )
        # a failing ordering key's head due again in the year 10000 (the keys pages)
        [[head]] = await insert_unchecked(
            conn,
            "INSERT INTO outbox_events (topic, payload, ordering_key, status, attempts,"
            " last_error, available_at) VALUES ('keyed', '{}', 'k-1', 'retry', 1, 'boom',"
            " '10000-01-01 00:00:00+00') RETURNING id",
        )
    finally:
        await conn.close()
    async with app_client(dsn) as client:
        for path in ("/", "/topics/never", "/consumers", "/topics/odd", "/keys", "/topics/keyed"):
            r = await client.get(path)
            assert r.status_code == 200, (path, r.status_code, r.text[-300:])
        assert "10000-01-01 00:00:00 UTC" in (await client.get("/keys")).text
        listed = await client.get("/events")
        assert listed.status_code == 200, listed.text[-300:]
        for (column, value), event_id in ids.items():
            assert f"/events/{event_id}" in listed.text
            page = await client.get(f"/events/{event_id}")
            assert page.status_code == 200, (column, value, page.text[-300:])
            assert SHOWN[value] in page.text, (column, value)
        never_page = await client.get(f"/events/{never}")
        assert never_page.status_code == 200
        assert "Scheduled: due infinity" in never_page.text
        assert (await client.get(f"/events/{head}")).status_code == 200
        for status in ("pending", "scheduled"):
            r = await client.get(f"/events?status={status}")
            assert r.status_code == 200, (status, r.text[-300:])
        assert "infinity" in (await client.get("/events?status=scheduled")).text


async def test_an_attempt_history_dated_before_the_year_1_renders(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    ids = {}
    try:
        for at in (-9e10, -62135596801, 9.99e10, 1.5e9):
            failures = [
                {"attempt": 1, "at": at, "worker": "w-1", "seconds": 1, "error": "boom"},
            ]
            [[ids[at]]] = await insert_unchecked(
                conn,
                "INSERT INTO outbox_events (topic, payload, status, attempts, last_error,"
                " finished_at, failures) VALUES ('hist', '{}', 'dead', 1, 'boom', now(),"
                " $1::jsonb) RETURNING id",
                json.dumps(failures),
            )
    finally:
        await conn.close()
    async with app_client(dsn) as client:
        for at, event_id in ids.items():
            r = await client.get(f"/events/{event_id}")
            assert r.status_code == 200, (at, r.status_code, r.text[-300:])
            assert "w-1" in r.text and "boom" in r.text
        early = (await client.get(f"/events/{ids[-62135596801]}")).text
        assert "-62135596801 s from 1970 (outside the years 1-9999)" in early


async def test_text_that_is_not_utf8_is_refused_and_nothing_is_written(dsn: str) -> None:
    [dead] = await dead_events(dsn, 1, topic="\ufffd")
    before = await statuses(dsn)
    form = "application/x-www-form-urlencoded"
    async with dashboard(dsn) as d, httpx.AsyncClient() as client:
        csrf = await token(client, d)
        for path, body in (
            ("/topics/flow", "action=pause&topic=%ff&back=/"),
            ("/topics/flow", "action=pause&topic=%ED%A0%80&back=/"),  # a surrogate's bytes
            ("/topics/flow", "action=pause&topic=ok&back=/&x%ff=1"),
            ("/topics/groups", "action=default&topic=%c3&max_running=2&back=/"),
            ("/dead/confirm", "action=retry&mode=filter&topic=%ff"),
            ("/dead/act", "action=retry&mode=filter&topic=%ff&max_id=999"),
            ("/events/act", "action=cancel&mode=filter&status=pending&topic=%fe"),
        ):
            r = await client.post(
                d.at(path), content=f"csrf={csrf}&{body}", headers={"Content-Type": form}
            )
            assert r.status_code == 400, (path, body, r.status_code)
            assert "not valid UTF-8" in r.text, (path, body)
            check_headers(r)
        for path in ("/events?topic=%ff", "/dead?ordering_key=%ff", "/events?error=%e2%82"):
            r = await client.get(d.at(path))
            assert r.status_code == 400, (path, r.status_code)
            assert "not valid UTF-8" in r.text
        # the same forms with UTF-8 are taken: the check refuses only what is not
        ok = await client.post(
            d.at("/topics/flow"),
            content=f"csrf={csrf}&action=pause&topic=%C3%A9t%C3%A9&back=/",
            headers={"Content-Type": form},
        )
        assert ok.status_code == 303
    assert await controls(dsn) == [("été", True)]
    assert await statuses(dsn) == before
    assert [r["action"] for r in await audit_rows(dsn)] == ["topic pause"]
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT status FROM outbox_events WHERE id = $1", dead) == "dead"
    finally:
        await conn.close()
