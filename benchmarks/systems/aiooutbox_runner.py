"""aiooutbox under benchmark: its database, loading, producers, and the child consumer."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import asyncpg

import aiooutbox
from aiooutbox._sql.lock_waits import TRIED_AGAIN
from aiooutbox._sql.plans import hot_path_plans
from aiooutbox._sql.statements import queries

from ..harness.databases import TOPIC, recreate_database
from .observers import observing

NAME = "aiooutbox"

# best drain settings found on the 2-core machine (see docs/benchmarks-history.md,
# "Prefetch at high concurrency": claiming up to 1,500 rows ahead keeps 500 handlers fed)
DEFAULT_SETTINGS: dict[str, Any] = {"concurrency": 500, "pool_size": 6, "prefetch": 1500}

_CHUNK = 100_000
_TRUNCATE_TRIES = 10
# what a producer may not write (migration 0013's insert check refuses it)
_CONSUMER_COLUMNS = {
    "status", "attempts", "locked_by", "locked_at", "lease_expires_at", "finished_at",
    "last_error", "blocks_key", "holds_key", "flow_counted",
}  # fmt: skip
# event ids each consumer process handled, written after its drain (double claims)
HANDLED_TABLE = "bench_handled"


class System:
    """Parent-side handle on aiooutbox's benchmark database (default table names)."""

    name = NAME

    def __init__(self, admin_dsn: str, database: str, *, sql_patch: str | None = None) -> None:
        self.admin_dsn = admin_dsn
        self.database = database
        self.sql_patch = sql_patch
        self.dsn = ""
        self.q = queries()
        self.history_max_id = 0
        self.channel = self.q.channel
        self.short_poll: dict[str, Any] = {"poll_interval": 0.1}

    async def setup(self) -> None:
        self.dsn = await recreate_database(self.admin_dsn, self.database)
        conn = await asyncpg.connect(self.dsn)
        try:
            await aiooutbox.migrate(conn)
            if self.sql_patch:
                # an experimental schema change to measure (see --sql-patch)
                template = Path(self.sql_patch).read_text(encoding="utf-8")
                await conn.execute(self.q.render(template))
        finally:
            await conn.close()

    async def connect(self) -> asyncpg.Connection:
        return await asyncpg.connect(self.dsn)

    async def reset(self) -> None:
        """Back to the starting state: empty, or only the history rows if there are any."""
        conn = await self.connect()
        try:
            if self.history_max_id:
                for table in (self.q.qualified, self.q.done_table):
                    await conn.execute(f"DELETE FROM {table} WHERE id > $1", self.history_max_id)
            else:
                await self._truncate(conn, f"{self.q.qualified}, {self.q.done_table}")
            await self._truncate(conn, self.q.idle_table)
            await conn.execute(f"VACUUM (ANALYZE) {self.q.qualified}, {self.q.done_table}")
        finally:
            await conn.close()

    @staticmethod
    async def _truncate(conn: asyncpg.Connection, tables: str) -> None:
        """TRUNCATE, tried again when the server ends it to break a deadlock: an open
        dashboard's queries read these tables while the drain beside it resets them."""
        for tries_left in range(_TRUNCATE_TRIES - 1, -1, -1):
            try:
                await conn.execute(f"TRUNCATE {tables} RESTART IDENTITY")
                return
            except TRIED_AGAIN:
                if not tries_left:
                    raise
                await asyncio.sleep(0.1)

    async def load(self, n: int, *, history: bool = False, traceparent: bool = False) -> None:
        """Insert ``n`` no-op events (or ``done`` history rows) with plain SQL, then
        VACUUM ANALYZE, as autovacuum would have after a load (it is off on our server).
        ``traceparent``: each event carries one, as if a traced request enqueued it."""
        if traceparent:
            columns = "topic, payload, headers"
            values = (
                "'bench', jsonb_build_object('i', g), jsonb_build_object('traceparent',"
                " '00-' || md5(g::text) || '-' || left(md5(g::text || 's'), 16) || '-01')"
            )
        elif history:
            columns = "topic, payload, status, attempts, locked_by, finished_at"
            values = (
                "'bench', jsonb_build_object('i', g), 'done', 1, 'history',"
                " now() - interval '1 hour'"
            )
        else:
            columns = "topic, payload"
            values = "'bench', jsonb_build_object('i', g)"
        await self.insert_series(n, columns, values)
        if history:
            await self.keep_loaded()

    async def insert_series(
        self, n: int, columns: str, values: str, *, order_trigger: bool = True
    ) -> None:
        """``INSERT INTO the table (columns) SELECT values FROM generate_series`` (``g``
        from 1 to ``n``) in chunks, then VACUUM ANALYZE. ``order_trigger=False``: with
        the ordering trigger disabled, for loads that set each row's status themselves
        (the trigger's per-row head check can be a full scan: see `ordering.keyed_series`).
        Loads that write columns only consumers set (a history of `done` rows, rows
        running elsewhere) go past the insert check, as a restore would."""
        conn = await self.connect()
        triggers: list[str] = []
        names = [] if order_trigger else [f"{self.q.table}_order"]
        if not order_trigger or _CONSUMER_COLUMNS & {c.strip() for c in columns.split(",")}:
            # the insert check exists from migration 0013 on
            names.append(f"{self.q.table}_insert_check")
        if names:
            present = await conn.fetch(
                "SELECT tgname FROM pg_trigger WHERE tgrelid = $1::regclass"
                " AND tgname = ANY ($2::text[])",
                self.q.qualified,
                names,
            )
            triggers = [f'"{r[0]}"' for r in present]
        try:
            for start in range(0, n, _CHUNK):
                stop = min(n, start + _CHUNK)
                async with conn.transaction():
                    for trigger in triggers:
                        await conn.execute(
                            f"ALTER TABLE {self.q.qualified} DISABLE TRIGGER {trigger}"
                        )
                    await conn.execute(
                        f"INSERT INTO {self.q.qualified} ({columns})"
                        f" SELECT {values} FROM generate_series($1::int, $2::int) AS g",
                        start + 1,
                        stop,
                    )
                    for trigger in triggers:
                        await conn.execute(
                            f"ALTER TABLE {self.q.qualified} ENABLE TRIGGER {trigger}"
                        )
            await conn.execute(f"VACUUM (ANALYZE) {self.q.qualified}")
        finally:
            await conn.close()

    async def execute(self, sql: str, *args: Any) -> str:
        conn = await self.connect()
        try:
            status: str = await conn.execute(sql, *args)
        finally:
            await conn.close()
        return status

    async def keep_loaded(self) -> None:
        """Keep the rows now in the table across `reset` (history, a backlog fixture);
        `counts` and `finished` count only the rows added after."""
        conn = await self.connect()
        try:
            # the outbox's rows and the finished ones in its ring (0022)
            self.history_max_id = int(
                await conn.fetchval(
                    f"SELECT greatest((SELECT max(id) FROM {self.q.qualified}),"
                    f" (SELECT max(id) FROM {self.q.done_table}), 0)"
                )
            )
        finally:
            await conn.close()

    async def produce_many(self, conn: asyncpg.Connection, count: int, sent: float) -> float:
        """One transaction with ``count`` events, through the public API; returns the
        wall time just before COMMIT was sent."""
        event = aiooutbox.NewEvent(TOPIC, {"t": sent})
        async with conn.transaction():
            await aiooutbox.enqueue_many(conn, [event] * count)
            committing = time.time()
        return committing

    async def produce_one(self, conn: asyncpg.Connection, sent: float) -> float:
        """A producer's business transaction that writes one event; returns the wall
        time just before COMMIT was sent."""
        async with conn.transaction():
            await aiooutbox.enqueue(conn, TOPIC, {"t": sent})
            committing = time.time()
        return committing

    async def set_wakeup_trigger(self, enabled: bool) -> None:
        action = "ENABLE" if enabled else "DISABLE"
        conn = await self.connect()
        try:
            await conn.execute(
                f'ALTER TABLE {self.q.qualified} {action} TRIGGER "{self.q.table}_wakeup"'
            )
        finally:
            await conn.close()

    async def counts(self) -> dict[str, int]:
        conn = await self.connect()
        try:
            rows = await conn.fetch(
                # the view: a finished event without a dedupe key is in the ring (0022)
                f"SELECT status::text, count(*) FROM {self.q.all_events} WHERE id > $1 GROUP BY 1",
                self.history_max_id,
            )
        finally:
            await conn.close()
        return {r[0]: r[1] for r in rows}

    async def backlog(self) -> int:
        """Events not yet claimed."""
        conn = await self.connect()
        try:
            count: int = await conn.fetchval(
                f"SELECT count(*) FROM {self.q.qualified} WHERE status IN ('pending', 'retry')"
            )
        finally:
            await conn.close()
        return count

    async def finished(self) -> int:
        return (await self.counts()).get("done", 0)

    async def explain_claim(self, *, analyze: bool = False) -> dict[str, Any]:
        """The claim's plans (custom, and generic as a consumer's connection ends up
        using), read inside the claim function with auto_explain, and whether both read
        the claimable partial index."""
        index = f"{self.q.table}_topic_claimable_idx"
        plans: dict[str, dict[str, str]] = {}
        for mode, generic in (("custom", False), ("generic", True)):
            conn = await self.connect()  # a fresh plan cache for each mode
            try:
                plans[mode] = await hot_path_plans(
                    conn, self.q, [TOPIC], analyze=analyze, generic=generic
                )
            finally:
                await conn.close()
        custom, generic_plan = plans["custom"]["claim"], plans["generic"]["claim"]
        return {
            "index": index,
            "custom_plan": custom,
            "generic_plan": generic_plan,
            "watermark_generic_plan": plans["generic"]["claim_after"],
            "uses_index": index in custom and index in generic_plan,
            "seq_scan": any("Seq Scan" in p for m in plans.values() for p in m.values()),
        }


async def consume(dsn: str, settings: dict[str, Any], recorder: Any, stop: asyncio.Event) -> None:
    """Child side: run an OutboxConsumer with a no-op handler until ``stop``.
    ``{"defaults": true}``: what a user who sets nothing runs, ``OutboxConsumer(pool)``
    on ``asyncpg.create_pool(dsn)``."""
    defaults = bool(settings.get("defaults"))
    pool_size = int(settings.get("pool_size", 6))
    options: dict[str, Any] = {
        "concurrency": int(settings.get("concurrency", 500)),
        "listen": bool(settings.get("listen", True)),
    }
    for key in ("batch_size", "poll_interval", "prefetch"):
        if settings.get(key) is not None:
            options[key] = settings[key]
    if defaults:
        options = {}
    if "retention" in settings:  # seconds, or None: no purge
        options["retention"] = settings["retention"]

    if recorder.latency:

        async def handler(event: aiooutbox.Event) -> None:
            recorder.hit(event.payload["t"])

    elif settings.get("record_ids"):

        async def handler(event: aiooutbox.Event) -> None:
            recorder.count(event.id)

    else:

        async def handler(event: aiooutbox.Event) -> None:
            recorder.count()

    registered: Any = handler
    if settings.get("handler_batch"):
        # a batch handler: one call per batch of up to this many events, counted as the
        # per-event handler counts each (what the bare loop does per row)
        count = recorder.count

        async def batch_handler(events: list[aiooutbox.Event]) -> None:
            for _ in events:
                count()

        registered = aiooutbox.Handler(batch_handler, batch=int(settings["handler_batch"]))

    topics = list(settings.get("topics") or [TOPIC])
    copies = int(settings.get("consumers", 1))
    observe = settings.get("observe", "off")
    sized: dict[str, int] = {} if defaults else {"min_size": pool_size, "max_size": pool_size}
    async with (
        asyncpg.create_pool(dsn, **sized) as pool,
        observing(observe, pool) as make_observers,
    ):
        consumers = [
            aiooutbox.OutboxConsumer(pool, **options, observers=make_observers())
            for _ in range(copies)
        ]
        for consumer in consumers:
            await consumer.__aenter__()

        async def watch() -> None:
            while not all(c.running for c in consumers) or (
                options.get("listen", True) and not all(c.listening for c in consumers)
            ):
                await asyncio.sleep(0.005)
            recorder.ready.set()
            await stop.wait()
            for consumer in consumers:
                consumer.stop()

        watcher = asyncio.ensure_future(watch())
        recorder.started()
        try:
            await asyncio.gather(*(c.run(dict.fromkeys(topics, registered)) for c in consumers))
        finally:
            watcher.cancel()
            for consumer in consumers:
                await consumer.__aexit__(None, None, None)
        if settings.get("record_ids"):
            # after the drain, so recording costs the measured handlers nothing
            async with pool.acquire() as conn:
                await conn.copy_records_to_table(
                    HANDLED_TABLE, records=[(i, os.getpid()) for i in recorder.ids]
                )
        stats = [vars(c.stats) for c in consumers]
        recorder.extra["stats"] = {k: sum(s[k] for s in stats) for k in stats[0]}
