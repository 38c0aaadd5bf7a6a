"""The topic page lists its busiest and most-waiting groups (fair groups)."""

from __future__ import annotations

import asyncpg
import httpx
import pytest

import aiooutbox
from aiooutbox import NewEvent
from tests.dashboard.server import dashboard

pytestmark = pytest.mark.slow  # a dashboard server


async def test_the_topic_page_lists_the_busiest_and_most_waiting_groups(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await aiooutbox.enqueue_many(
            conn,
            [NewEvent("invoices", i, group="tenant-<b>") for i in range(7)]
            + [NewEvent("invoices", i, group="small") for i in range(2)],
        )
        await conn.execute(
            "UPDATE outbox_events SET status = 'processing', attempts = 1, locked_by = 'w',"
            " locked_at = now(), lease_expires_at = now() + interval '1 hour'"
            " WHERE id = (SELECT min(id) FROM outbox_events_all WHERE grp = 'small')"
        )
    finally:
        await conn.close()
    async with dashboard(dsn) as d, httpx.AsyncClient() as client:
        page = (await client.get(d.at("/topics/invoices"))).text
    busiest = page.split('id="busiest-groups"')[1].split("</table>")[0]
    waiting = page.split('id="waiting-groups"')[1].split("</table>")[0]
    assert "small" in busiest and "tenant" not in busiest
    assert waiting.index("tenant-&lt;b&gt;") < waiting.index("small")  # escaped, 7 before 1
    assert "<b>" not in page.split('id="waiting-groups"')[1]
