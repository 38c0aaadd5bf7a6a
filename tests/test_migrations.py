"""Versioned migrations: idempotent, race-free, per-outbox, refusing newer schemas."""

from __future__ import annotations

import asyncio
import json
import re
import uuid

import asyncpg
import pytest

import aiooutbox
from aiooutbox import NewEvent, SchemaNotReady, SchemaTooNew
from aiooutbox._sql.statements import queries
from aiooutbox.migrations import latest_version, migrations
from tests.helpers import all_in, running, wait_until

OUTBOX_OBJECTS = {
    ("outbox_events", "r"),
    ("outbox_events_idle", "r"),
    ("outbox_events_migrations", "r"),
    ("outbox_events_migrations_compat", "r"),
    ("outbox_events_dedupe_key_idx", "i"),
    ("outbox_events_topic_claimable_idx", "i"),
    ("outbox_events_key_head_idx", "i"),
    ("outbox_events_key_idx", "i"),
    ("outbox_events_lease_idx", "i"),
    ("outbox_events_finished_idx", "i"),
}


async def relations(conn: asyncpg.Connection, schema: str = "public") -> set[tuple[str, str]]:
    rows = await conn.fetch(
        "SELECT c.relname, c.relkind::text FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = $1 AND c.relkind IN ('r', 'i')",
        schema,
    )
    return {(r[0], r[1]) for r in rows}


async def versions(
    conn: asyncpg.Connection, schema: str = "public", table: str = "outbox_events"
) -> list[tuple[int, str]]:
    # migrations that schema-2 releases may run beside are recorded in the compat table
    rows = await conn.fetch(
        f'SELECT version, name FROM "{schema}"."{table}_migrations"'
        f' UNION SELECT version, name FROM "{schema}"."{table}_migrations_compat"'
        " ORDER BY version"
    )
    return [tuple(r) for r in rows]


def shipped() -> list[tuple[int, str]]:
    return [(m.version, m.name) for m in migrations()]


ALL = [m.version for m in migrations()]


async def test_the_library_ships_numbered_migrations() -> None:
    found = shipped()
    assert found[0] == (1, "outbox")
    versions = [v for v, _ in found]
    # numbered in order, each once; a number may be skipped while branches that each
    # add a migration land one after the other (the runner applies what is missing)
    assert versions == sorted(set(versions))
    assert latest_version() == found[-1][0]


async def test_migrate_applies_once_then_is_a_no_op(empty_dsn: str) -> None:
    conn = await asyncpg.connect(empty_dsn)
    try:
        assert await relations(conn) == set()
        with pytest.raises(SchemaNotReady, match="migrate"):
            await aiooutbox.check_schema(conn)
        assert await aiooutbox.migrate(conn) == [v for v, _ in shipped()]
        assert await relations(conn) >= OUTBOX_OBJECTS
        assert await versions(conn) == shipped()
        await aiooutbox.check_schema(conn)
        before = await relations(conn)
        assert await aiooutbox.migrate(conn) == []
        assert await aiooutbox.migrate(conn) == []
        assert await relations(conn) == before
        assert await versions(conn) == shipped()
        # the result works: the seed's insert and the API
        await conn.execute(
            "INSERT INTO outbox_events (dedupe_key, topic, payload) "
            """VALUES ('order-42-created', 'orders.created', '{"order_id": 42}') """
            "ON CONFLICT (dedupe_key) DO NOTHING"
        )
        assert await aiooutbox.enqueue(conn, "t", 1, dedupe_key="order-42-created") is None
        assert await conn.fetchval("SELECT count(*) FROM outbox_events") == 1
        # and the advisory lock was released
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1",
                conn.get_server_pid(),
            )
            == 0
        )
    finally:
        await conn.close()


async def test_migrate_on_the_template_database_is_current(conn: asyncpg.Connection) -> None:
    await aiooutbox.check_schema(conn)
    assert await aiooutbox.migrate(conn) == []
    assert await versions(conn) == shipped()


async def test_migrate_accepts_a_pool(empty_dsn: str) -> None:
    async with asyncpg.create_pool(empty_dsn, min_size=1, max_size=2) as pool:
        assert await aiooutbox.migrate(pool) == ALL
        assert await aiooutbox.migrate(pool) == []
        await aiooutbox.check_schema(pool)
        assert await aiooutbox.enqueue(pool, "t", {"ok": 1}) is not None
        assert await pool.fetchval("SELECT count(*) FROM outbox_events") == 1


async def test_concurrent_migrations_apply_exactly_once(empty_dsn: str) -> None:
    conns = await asyncio.gather(*(asyncpg.connect(empty_dsn) for _ in range(8)))
    try:
        results = await asyncio.gather(*(aiooutbox.migrate(c) for c in conns))
        # every migration applied exactly once (a step may go to any of the callers)
        assert sorted(v for r in results for v in r) == ALL
        assert await versions(conns[0]) == shipped()
        assert await relations(conns[0]) >= OUTBOX_OBJECTS
        # every connection sees a ready schema and can produce
        for n, c in enumerate(conns):
            await aiooutbox.check_schema(c)
            assert await aiooutbox.enqueue(c, "t", n) is not None
        assert await conns[0].fetchval("SELECT count(*) FROM outbox_events") == 8
    finally:
        await asyncio.gather(*(c.close() for c in conns))


async def test_concurrent_migrations_from_one_pool(empty_dsn: str) -> None:
    async with asyncpg.create_pool(empty_dsn, min_size=4, max_size=4) as pool:
        results = await asyncio.gather(*(aiooutbox.migrate(pool) for _ in range(8)))
        assert sorted(v for r in results for v in r) == ALL
        await aiooutbox.check_schema(pool)


async def test_concurrent_migrations_of_outboxes_sharing_a_new_schema(empty_dsn: str) -> None:
    # all of them need CREATE SCHEMA "jobs": they must not race on it
    conns = await asyncio.gather(*(asyncpg.connect(empty_dsn) for _ in range(6)))
    try:
        results = await asyncio.gather(
            *(aiooutbox.migrate(c, schema="jobs", table=f"box{n}") for n, c in enumerate(conns))
        )
        assert results == [ALL] * 6
        for n in range(6):
            await aiooutbox.check_schema(conns[0], schema="jobs", table=f"box{n}")
    finally:
        await asyncio.gather(*(c.close() for c in conns))


async def test_custom_schema_and_table_are_independent_outboxes(empty_dsn: str) -> None:
    conn = await asyncpg.connect(empty_dsn)
    try:
        assert await aiooutbox.migrate(conn) == ALL
        assert await aiooutbox.migrate(conn, schema="billing", table="jobs") == ALL
        assert await aiooutbox.migrate(conn, table="other_outbox") == ALL
        assert await aiooutbox.migrate(conn, schema="billing", table="jobs") == []
        await aiooutbox.check_schema(conn, schema="billing", table="jobs")
        await aiooutbox.check_schema(conn, table="other_outbox")

        assert {r for r, _ in await relations(conn, "billing")} >= {
            "jobs",
            "jobs_idle",
            "jobs_migrations",
            "jobs_topic_claimable_idx",
        }
        assert await versions(conn, "billing", "jobs") == shipped()
        assert await versions(conn, "public", "other_outbox") == shipped()

        # the same dedupe key is independent in each outbox
        a = await aiooutbox.enqueue(conn, "t", "default", dedupe_key="k")
        b = await aiooutbox.enqueue(
            conn, "t", "billing", dedupe_key="k", schema="billing", table="jobs"
        )
        c = await aiooutbox.enqueue_many(
            conn, [NewEvent("t", "other", dedupe_key="k"), NewEvent("t", "x")], table="other_outbox"
        )
        assert None not in (a, b, *c)
        again = await aiooutbox.enqueue(
            conn, "t", 2, dedupe_key="k", schema="billing", table="jobs"
        )
        assert again is None

        async def payloads(qualified: str) -> list[object]:
            rows = await conn.fetch(f"SELECT payload::text FROM {qualified} ORDER BY id")
            return [json.loads(r[0]) for r in rows]

        assert await payloads("public.outbox_events") == ["default"]
        assert await payloads("billing.jobs") == ["billing"]
        assert await payloads("public.other_outbox") == ["other", "x"]

        # each has its own status type and trigger
        types = await conn.fetch(
            "SELECT n.nspname || '.' || t.typname FROM pg_type t"
            " JOIN pg_namespace n ON n.oid = t.typnamespace"
            " WHERE t.typname LIKE '%\\_status' AND t.typtype = 'e' ORDER BY 1"
        )
        assert [r[0] for r in types] == [
            "billing.jobs_status",
            "public.other_outbox_status",
            "public.outbox_events_status",
        ]
        triggers = await conn.fetch(
            "SELECT tgrelid::regclass::text, tgname FROM pg_trigger WHERE NOT tgisinternal"
            " ORDER BY 1, 2"
        )
        assert [tuple(r) for r in triggers] == [
            ("billing.jobs", "jobs_insert_check"),
            ("billing.jobs", "jobs_order"),
            ("billing.jobs", "jobs_position"),
            ("billing.jobs", "jobs_position_row"),
            ("billing.jobs", "jobs_wakeup"),
            ("other_outbox", "other_outbox_insert_check"),
            ("other_outbox", "other_outbox_order"),
            ("other_outbox", "other_outbox_position"),
            ("other_outbox", "other_outbox_position_row"),
            ("other_outbox", "other_outbox_wakeup"),
            ("outbox_events", "outbox_events_insert_check"),
            ("outbox_events", "outbox_events_order"),
            ("outbox_events", "outbox_events_position"),
            ("outbox_events", "outbox_events_position_row"),
            ("outbox_events", "outbox_events_wakeup"),
        ]
    finally:
        await conn.close()


async def test_a_custom_outbox_alone_does_not_satisfy_the_default(empty_dsn: str) -> None:
    conn = await asyncpg.connect(empty_dsn)
    try:
        await aiooutbox.migrate(conn, schema="billing", table="jobs")
        with pytest.raises(SchemaNotReady, match=r'"public"\."outbox_events"'):
            await aiooutbox.check_schema(conn)
        assert ("outbox_events", "r") not in await relations(conn)
    finally:
        await conn.close()


async def test_migrate_refuses_a_schema_newer_than_the_library(conn: asyncpg.Connection) -> None:
    future = latest_version() + 1
    await conn.execute(
        "INSERT INTO outbox_events_migrations (version, name) VALUES ($1, 'from_the_future')",
        future,
    )
    before = await relations(conn)
    with pytest.raises(SchemaTooNew, match=rf"migration {future}.*upgrade aiooutbox"):
        await aiooutbox.migrate(conn)
    with pytest.raises(SchemaTooNew, match="upgrade aiooutbox"):
        await aiooutbox.check_schema(conn)
    # nothing was touched, and the refused migrate released its lock
    assert await relations(conn) == before
    assert await versions(conn) == [*shipped(), (future, "from_the_future")]
    assert (
        await conn.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1",
            conn.get_server_pid(),
        )
        == 0
    )


async def test_migrate_refuses_a_newer_schema_before_applying_anything(empty_dsn: str) -> None:
    conn = await asyncpg.connect(empty_dsn)
    try:
        await conn.execute(queries().create_versions_table)
        await conn.execute(
            "INSERT INTO outbox_events_migrations (version, name) VALUES (99, 'future')"
        )
        with pytest.raises(SchemaTooNew):
            await aiooutbox.migrate(conn)
        assert await relations(conn) == {
            ("outbox_events_migrations", "r"),
            ("outbox_events_migrations_pkey", "i"),
        }
    finally:
        await conn.close()


async def test_check_schema_on_an_empty_database(empty_dsn: str) -> None:
    conn = await asyncpg.connect(empty_dsn)
    try:
        with pytest.raises(SchemaNotReady, match="aiooutbox migrate") as info:
            await aiooutbox.check_schema(conn)
        assert isinstance(info.value, aiooutbox.OutboxError)
        with pytest.raises(SchemaNotReady):
            await aiooutbox.check_schema(conn, schema="billing", table="jobs")
        # checking does not create anything
        assert await relations(conn) == set()
        assert not await conn.fetchval(
            "SELECT count(*) FROM pg_namespace WHERE nspname = 'billing'"
        )
    finally:
        await conn.close()


async def test_check_schema_reports_missing_migrations(empty_dsn: str) -> None:
    # the version table exists but nothing was applied (e.g. migration_sql(since=latest))
    conn = await asyncpg.connect(empty_dsn)
    try:
        await conn.execute(aiooutbox.migration_sql(since=latest_version()))
        with pytest.raises(SchemaNotReady, match=re.escape(f"lacks migration(s) {ALL}")):
            await aiooutbox.check_schema(conn)
        assert await aiooutbox.migrate(conn) == ALL
        await aiooutbox.check_schema(conn)
    finally:
        await conn.close()


async def test_an_outbox_from_version_1_upgrades_and_keeps_its_events(empty_dsn: str) -> None:
    conn = await asyncpg.connect(empty_dsn)
    try:
        # what aiooutbox with only migration 0001 left behind
        q = queries()
        first = migrations()[0]
        await conn.execute(q.create_versions_table)
        await conn.execute(q.render(first.template))
        await conn.execute(q.record_version, first.version, first.name)
        # a producer of that release (the classic INSERT)
        event_id = await conn.fetchval(
            "INSERT INTO outbox_events (topic, payload) VALUES ('t', '{\"before\": \"upgrade\"}')"
            " RETURNING id"
        )
        # this release's producer says what to do instead of failing on a missing column
        with pytest.raises(SchemaNotReady, match="run `python -m aiooutbox migrate` before"):
            await aiooutbox.enqueue(conn, "t", {"too": "early"})
        later = ALL[1:]
        with pytest.raises(SchemaNotReady, match=re.escape(f"lacks migration(s) {later}")):
            await aiooutbox.check_schema(conn)
        assert await aiooutbox.migrate(conn) == later
        await aiooutbox.check_schema(conn)
        seen: list[int] = []

        async def handle(event: aiooutbox.Event) -> None:
            seen.append(event.id)

        async with asyncpg.create_pool(empty_dsn, min_size=1, max_size=3) as pool:
            consumer = aiooutbox.OutboxConsumer(pool)
            async with running(consumer, {"t": handle}):
                await wait_until(all_in(pool, "done", 1))
        assert seen == [event_id]
    finally:
        await conn.close()


async def test_a_failed_migration_leaves_nothing_half_applied(empty_dsn: str) -> None:
    conn = await asyncpg.connect(empty_dsn)
    other = await asyncpg.connect(empty_dsn)
    try:
        # a table with a name the new outbox would use: refused before anything is made
        await conn.execute("CREATE TABLE outbox_events_idle (x int)")
        with pytest.raises(aiooutbox.InvalidArgument, match="outbox_events_idle"):
            await aiooutbox.migrate(conn)
        assert await relations(conn) == {("outbox_events_idle", "r")}
        await conn.execute("DROP TABLE outbox_events_idle")
        # an unrelated type in the way of one the first migration creates: it fails there
        await conn.execute("CREATE TYPE outbox_events_status AS ENUM ('mine')")
        with pytest.raises(asyncpg.DuplicateObjectError):
            await aiooutbox.migrate(conn)
        assert await relations(conn) == {
            ("outbox_events_migrations", "r"),
            ("outbox_events_migrations_pkey", "i"),
            # bookkeeping, like the versions table: created before any migration runs
            ("outbox_events_migrations_compat", "r"),
            ("outbox_events_migrations_compat_pkey", "i"),
        }
        assert await versions(conn) == []
        assert await conn.fetchval("SELECT enum_range(NULL::outbox_events_status)::text[]") == [
            "mine"
        ]
        # the lock was released: another session migrates once the obstacle is gone
        await conn.execute("DROP TYPE outbox_events_status")
        assert await asyncio.wait_for(aiooutbox.migrate(other), 10) == ALL
        await aiooutbox.check_schema(conn)
    finally:
        await conn.close()
        await other.close()


@pytest.mark.parametrize(("schema", "table"), [("public", "outbox_events"), ("ops", "jobs")])
async def test_migration_sql_applied_by_hand_is_current(
    empty_dsn: str, schema: str, table: str
) -> None:
    sql = aiooutbox.migration_sql(schema=schema, table=table)
    assert "{{" not in sql
    assert sql.count("BEGIN;") == sql.count("COMMIT;") == len(shipped())
    conn = await asyncpg.connect(empty_dsn)
    try:
        # one plain simple-query execute, as psql -f or a migration tool would run it
        await conn.execute(sql)
        await aiooutbox.check_schema(conn, schema=schema, table=table)
        assert await aiooutbox.migrate(conn, schema=schema, table=table) == []
        assert await versions(conn, schema, table) == shipped()
        # the same objects as migrate() creates
        names = {r for r, _ in await relations(conn, schema)}
        assert {n.replace("outbox_events", table) for n, _ in OUTBOX_OBJECTS} <= names
        ids = await aiooutbox.enqueue_many(
            conn,
            [NewEvent("t", 1, dedupe_key="k"), NewEvent("t", 2, dedupe_key="k")],
            schema=schema,
            table=table,
        )
        assert ids[0] is not None
        assert ids[1] is None
        assert await conn.fetchval(
            "SELECT tgenabled = 'O' FROM pg_trigger WHERE tgname = $1", f"{table}_wakeup"
        )
    finally:
        await conn.close()


async def test_migration_sql_matches_what_migrate_builds(empty_dsn: str, dsn: str) -> None:
    """The hand-applied schema and the migrated one have the same columns and indexes."""

    async def describe(c: asyncpg.Connection) -> list[tuple[object, ...]]:
        cols = await c.fetch(
            "SELECT table_name::text, column_name::text, data_type::text, is_nullable::text,"
            " coalesce(column_default, '') FROM information_schema.columns"
            " WHERE table_schema = 'public' ORDER BY 1, 2"
        )
        idx = await c.fetch(
            "SELECT indexname::text, indexdef FROM pg_indexes WHERE schemaname = 'public'"
            " ORDER BY 1"
        )
        functions = await c.fetch(
            "SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid) FROM pg_proc p"
            " WHERE p.pronamespace = 'public'::regnamespace ORDER BY 1"
        )
        return [tuple(r) for r in cols + idx + functions]

    by_hand = await asyncpg.connect(empty_dsn)
    try:
        await by_hand.execute(aiooutbox.migration_sql())
        hand = await describe(by_hand)
    finally:
        await by_hand.close()
    migrated = await asyncpg.connect(dsn)
    try:
        assert await describe(migrated) == hand
    finally:
        await migrated.close()


@pytest.mark.parametrize("how", ["migrate", "migration_sql"])
async def test_a_role_with_rights_on_the_schema_only_can_migrate(empty_dsn: str, how: str) -> None:
    # DBAs often grant an app role CREATE on one schema and nothing on the database
    role = f"aiooutbox_migrator_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(empty_dsn)
    try:
        await admin.execute(f"CREATE ROLE {role} NOLOGIN")
        database = await admin.fetchval("SELECT current_database()")
        await admin.execute(f'REVOKE ALL ON DATABASE "{database}" FROM PUBLIC')
        await admin.execute("CREATE SCHEMA app")
        await admin.execute(f"GRANT USAGE, CREATE ON SCHEMA app TO {role}")
        await admin.execute(f"SET ROLE {role}")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await admin.execute("CREATE SCHEMA IF NOT EXISTS app")
        if how == "migration_sql":  # the rendered script, as psql -f runs it
            await admin.execute(aiooutbox.migration_sql(schema="app"))
        else:
            assert await aiooutbox.migrate(admin, schema="app") == ALL
        assert await aiooutbox.migrate(admin, schema="app") == []
        await aiooutbox.check_schema(admin, schema="app")
        assert await aiooutbox.enqueue(admin, "t", 1, schema="app") is not None
        # a schema it may not create is refused by PostgreSQL, not half-made
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await aiooutbox.migrate(admin, schema="elsewhere")
        await admin.execute("RESET ROLE")
        assert await admin.fetchval(
            "SELECT tableowner = $1 FROM pg_tables WHERE schemaname = 'app'"
            " AND tablename = 'outbox_events'",
            role,
        )
    finally:
        await admin.execute("RESET ROLE")
        await admin.execute(f"DROP OWNED BY {role}")
        await admin.execute(f"DROP ROLE {role}")
        await admin.close()


@pytest.mark.parametrize(("first", "second"), [("ev", "ev_done"), ("ev_done", "ev")])
async def test_a_new_outbox_may_not_take_another_outboxs_names(
    empty_dsn: str, first: str, second: str
) -> None:
    conn = await asyncpg.connect(empty_dsn)
    try:
        assert await aiooutbox.migrate(conn, table=first) == ALL
        before = {r for r, _ in await relations(conn, "public")}
        with pytest.raises(aiooutbox.InvalidArgument, match="choose another table name"):
            await aiooutbox.migrate(conn, table=second)
        # nothing of the refused outbox was made; the first goes on as it was
        assert {r for r, _ in await relations(conn, "public")} == before
        await aiooutbox.check_schema(conn, table=first)
        assert await aiooutbox.enqueue(conn, "t", 1, table=first) is not None
    finally:
        await conn.close()


async def test_information_schema_is_no_outbox_schema() -> None:
    with pytest.raises(aiooutbox.InvalidArgument, match="reserved"):
        queries("information_schema", "outbox_events")
