"""Upgrading with least-privilege roles: the grants the previous release documented.

The roles here get exactly the GRANT blocks of the previous release's
docs/guarantees.md (read from git), on a database migrated by this release, as an
operator who upgrades and runs `migrate` has them. Whatever this release needs beyond
them must be named by the upgrade notes, and a consumer lacking it must stop at start
with one line that names the GRANT to run, not a raw permission error.
"""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

import aiooutbox
from aiooutbox._sql.db import PermanentDatabaseError
from tests.clirunner import cli
from tests.helpers import running, wait_until
from tests.test_roles import as_user, documented_grants

PREVIOUS = "ab0edab"
ROOT = Path(__file__).resolve().parent.parent
CHANGELOG = ROOT / "CHANGELOG.md"


def previous_grants(kind: str, role: str) -> list[str]:
    """The grant block for ``kind`` of the previous release's docs/guarantees.md."""
    text = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{PREVIOUS}:docs/guarantees.md"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    match = re.search(rf"<!-- grants:{kind} -->\s*```sql\n(.*?)```", text, re.S)
    assert match, f"{PREVIOUS}:docs/guarantees.md has no grants:{kind} block"
    body = "\n".join(
        line for line in match.group(1).splitlines() if not line.lstrip().startswith("--")
    )
    return [s.strip().replace(f"outbox_{kind}", role) for s in body.split(";") if s.strip()]


def upgrading_notes() -> str:
    text = CHANGELOG.read_text(encoding="utf-8")
    unreleased = text.split("## [Unreleased]", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"### Upgrading\n(.*?)(?=\n### |\Z)", unreleased, re.S)
    assert match, "CHANGELOG.md's Unreleased section has no Upgrading notes"
    return " ".join(match.group(1).split())


@pytest.fixture
async def old_roles(dsn: str) -> AsyncIterator[tuple[str, str]]:
    suffix = uuid.uuid4().hex[:10]
    producer, consumer = f"old_producer_{suffix}", f"old_consumer_{suffix}"
    admin = await asyncpg.connect(dsn)
    try:
        for role, kind in ((producer, "producer"), (consumer, "consumer")):
            await admin.execute(f'CREATE ROLE "{role}" LOGIN')
            for statement in previous_grants(kind, role):
                await admin.execute(statement)
        yield producer, consumer
    finally:
        for role in (producer, consumer):
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role
            )
            await admin.execute(f'DROP OWNED BY "{role}"')
            await admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        await admin.close()


def test_every_new_grant_is_in_the_upgrade_notes() -> None:
    notes = upgrading_notes()
    for kind in ("producer", "consumer"):
        old = set(previous_grants(kind, f"outbox_{kind}"))
        new = [s for s in documented_grants(kind, f"outbox_{kind}") if s not in old]
        for statement in new:
            assert statement in notes, f"the upgrade notes do not say: {statement};"


async def test_a_consumer_with_the_previous_grants_says_which_grant_is_missing(
    dsn: str, old_roles: tuple[str, str]
) -> None:
    _, role = old_roles
    grant = f'GRANT SELECT ON "public"."outbox_events_migrations_compat" TO {role};'
    async with asyncpg.create_pool(as_user(dsn, role), min_size=1, max_size=4) as pool:
        consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.1)
        with pytest.raises(PermanentDatabaseError) as refused:
            async with consumer:
                pass
        message = str(refused.value)
        assert "\n" not in message and grant in message, message

    result = await cli("run", "tests.cli_handlers:handlers", "--dsn", as_user(dsn, role))
    context = f"rc={result.rc}\nstderr={result.err}"
    assert result.rc == 1 and "Traceback" not in result.err, context
    assert grant in result.err_lines[-1], context

    # the statement it names is the fix; then the next grant this release adds (flow
    # control's table) is named the same way
    flow_grant = f'GRANT SELECT, UPDATE ON "public"."outbox_events_flow" TO {role};'
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(grant)
        async with asyncpg.create_pool(as_user(dsn, role), min_size=1, max_size=4) as pool:
            consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.1)
            with pytest.raises(PermanentDatabaseError) as refused:
                async with consumer:
                    await asyncio.wait_for(consumer.run({"t": _nothing}), 30)
            message = str(refused.value)
            assert "\n" not in message and flow_grant in message, message
        await admin.execute(flow_grant)
        await aiooutbox.enqueue(admin, "t", {})
    finally:
        await admin.close()
    seen: list[int] = []

    async def handle(event: aiooutbox.Event) -> None:
        seen.append(event.id)

    async with asyncpg.create_pool(as_user(dsn, role), min_size=1, max_size=4) as pool:
        consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.1)
        async with consumer, running(consumer, {"t": handle}):
            await wait_until(lambda: _settled(pool), timeout=20)
    assert len(seen) == 1


async def _nothing(event: aiooutbox.Event) -> None:
    pass


async def _settled(pool: asyncpg.Pool) -> bool:
    # with the previous release's grants the role reads the outbox table only: its
    # finished events have left it for the ring (0022), which it may not read
    left = await pool.fetchval("SELECT count(*) FROM outbox_events WHERE status <> 'done'")
    return bool(left == 0)


async def test_a_producer_with_the_previous_grants_still_enqueues(
    dsn: str, old_roles: tuple[str, str]
) -> None:
    role, _ = old_roles
    conn = await asyncpg.connect(as_user(dsn, role))
    try:
        assert await aiooutbox.enqueue(conn, "t", {}, dedupe_key="a") is not None
        assert await aiooutbox.enqueue(conn, "t", {}, dedupe_key="a") is None
        batch = [aiooutbox.NewEvent("t", {"n": i}) for i in range(3)]
        batch += [aiooutbox.NewEvent("t", {}, dedupe_key=k) for k in ("a", "b")]
        ids = await aiooutbox.enqueue_many(conn, batch)
        assert None not in ids[:3] and ids[3] is None and ids[4] is not None, ids
        # ordered delivery is new: a batch with ordering keys reads them back, which
        # needs the producer grant of this release (the upgrade notes say so)
        ordered = [aiooutbox.NewEvent("t", {}, ordering_key="k") for _ in range(2)]
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await aiooutbox.enqueue_many(conn, ordered)
        admin = await asyncpg.connect(dsn)
        try:
            for statement in documented_grants("producer", role):
                await admin.execute(statement)
        finally:
            await admin.close()
        first, second = await aiooutbox.enqueue_many(conn, ordered)
        assert first is not None and second is not None and first < second
    finally:
        await conn.close()


async def test_a_consumer_without_the_registry_grant_runs_unregistered_and_names_it(
    dsn: str, old_roles: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """The registry only informs operators: a role without its grant gets one warning
    naming the GRANT, and the consumer handles events all the same."""
    _, role = old_roles
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(f'GRANT SELECT ON "public"."outbox_events_migrations_compat" TO {role}')
        await admin.execute(f'GRANT SELECT, UPDATE ON "public"."outbox_events_flow" TO {role}')
        await aiooutbox.enqueue(admin, "t", {})
    finally:
        await admin.close()
    grant = f'GRANT SELECT, INSERT, UPDATE, DELETE ON "public"."outbox_events_consumers" TO {role};'
    caplog.set_level(logging.WARNING, logger="aiooutbox")
    async with asyncpg.create_pool(as_user(dsn, role), min_size=1, max_size=4) as pool:
        consumer = aiooutbox.OutboxConsumer(pool, poll_interval=0.1, lease_timeout=3.0)
        async with running(consumer, {"t": _nothing}):
            await wait_until(lambda: _settled(pool), timeout=20)
            await asyncio.sleep(1.5)  # a heartbeat: it does not try (and warn) again
    warned = [r.getMessage() for r in caplog.records if "unregistered" in r.getMessage()]
    assert len(warned) == 1 and grant in warned[0] and "\n" not in warned[0], warned
