"""What the relay tests share: filling an outbox, running a relay, reading brokers back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg

import aiooutbox
from aiooutbox.relay import Sink

ROOT = Path(__file__).resolve().parents[2]
TOPICS = ("orders.created", "orders.paid")


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


async def fill(
    pool: asyncpg.Pool,
    total: int,
    topics: Sequence[str] = TOPICS,
    *,
    first: int = 0,
    headers: dict[str, Any] | None = None,
) -> None:
    """``total`` events over ``topics`` (alternating), payload ``{"n": i}``."""
    for start in range(first, first + total, 2000):
        batch = [
            aiooutbox.NewEvent(topics[i % len(topics)], {"n": i}, headers=headers)
            for i in range(start, min(start + 2000, first + total))
        ]
        async with pool.acquire() as conn:
            await aiooutbox.enqueue_many(conn, batch)


async def counts(pool: asyncpg.Pool) -> dict[str, int]:
    rows = await pool.fetch("SELECT status::text, count(*) FROM outbox_events_all GROUP BY 1")
    return {r[0]: r[1] for r in rows}


async def wait_done(pool: asyncpg.Pool, total: int, timeout: float = 90) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        found = await counts(pool)
        if found.get("done", 0) >= total:
            return
        if loop.time() > deadline:
            raise AssertionError(f"after {timeout}s: {found}, expected {total} done")
        await asyncio.sleep(0.1)


async def message_ids(pool: asyncpg.Pool) -> set[str]:
    return {r[0] for r in await pool.fetch("SELECT message_id::text FROM outbox_events_all")}


#: the events a relay's publish call takes, as ``python -m aiooutbox relay`` runs it
BATCH = 256


@contextlib.asynccontextmanager
async def relaying(
    pool: asyncpg.Pool,
    sink: Sink,
    *,
    topics: Sequence[str] | None = None,
    batch: int | None = BATCH,
    **options: Any,
) -> AsyncIterator[aiooutbox.OutboxConsumer]:
    """A started ``sink`` under a consumer of every topic (or ``topics``), for the block:
    its batch handler, up to ``batch`` events a call (None: the sink itself, one event a
    call)."""
    options.setdefault("retention", None)
    options.setdefault("poll_interval", 0.5)
    async with sink:
        consumer = aiooutbox.OutboxConsumer(pool, topics=topics, **options)
        handler: Any = sink if batch is None else sink.handler(batch)
        handlers = dict.fromkeys(topics, handler) if topics else {"*": handler}
        async with consumer:
            task = asyncio.ensure_future(consumer.run(handlers))
            try:
                yield consumer
            finally:
                consumer.stop()
                await asyncio.wait_for(task, 60)


class RelayProcess:
    """``python -m aiooutbox relay`` as a child process, as an operator runs it."""

    def __init__(self, dsn: str | Sequence[str], to: str, *args: str) -> None:
        """``dsn``: one, or several (each passed as ``--dsn``; none with ``--dsn-file``)."""
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in close()
        self.said = ""  # what it logged, once stopped
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIOOUTBOX_")}
        dsns = [dsn] if isinstance(dsn, str) else list(dsn)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "aiooutbox",
                "relay",
                "--to",
                to,
                *(flag for d in dsns for flag in ("--dsn", d)),
                "--retention",
                "none",
                "--lease-timeout",
                "2s",
                "--poll-interval",
                "0.5s",
                *args,
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            env=env,
        )

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._stderr.close()

    def stderr(self, tail: int | None = 4000) -> str:
        """What the relay logged: the last ``tail`` characters (``None``: all)."""
        if self._stderr.closed:
            text: str = self.said
        else:
            self._stderr.seek(0)
            text = self._stderr.read()
        return text if tail is None else text[-tail:]

    async def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(self.proc.wait, 60)
        self.said = self.stderr(None)
        self._stderr.close()
        return rc


#: the relay's statements still running on the server (the test's own backends are idle);
#: ``stuck`` counts those that wait on the frozen client: for the rest of a statement
#: (asyncpg prepares before it executes: a client frozen in between leaves its backend
#: ``active`` in ClientRead), to send it a result larger than the socket's buffers, or
#: on a lock its open transaction holds
_RUNNING = (
    "SELECT count(*) AS running, count(*) FILTER (WHERE wait_event_type = 'Client'"
    " OR cardinality(pg_blocking_pids(pid)) > 0) AS stuck"
    " FROM pg_stat_activity WHERE datname = current_database()"
    " AND backend_type = 'client backend' AND state = 'active' AND pid <> pg_backend_pid()"
)


async def activity(pool: asyncpg.Pool) -> str:
    """The database's backends, for a failure message."""
    rows = await pool.fetch(
        "SELECT pid, backend_type, state, wait_event_type, wait_event,"
        " pg_blocking_pids(pid) AS blocked_by, now() - state_change AS for, left(query, 120) AS q"
        " FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    return "\n".join(str(dict(r)) for r in rows)


async def kill_midway(pool: asyncpg.Pool, dsn: str, to: str, total: int, *args: str) -> str:
    """Relay ``total`` events in a child, SIGKILL it after about a third, relay the rest
    in a second child; every row must end ``done``. Returns the second child's last log
    lines (what it says when it stops)."""
    first = RelayProcess(dsn, to, "--concurrency", "256", *args)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 90
        # killed holding rows, so that the second relay has events to repeat: frozen
        # (SIGSTOP) once a third is done, and killed only if it still holds rows once
        # the statements it had sent are through; else thawed to try again (on a quiet
        # machine it sometimes stood between a settled batch and its next claim). A
        # statement stuck on the frozen client never gets through: it is not waited
        # for, and the kill rolls it back (a claim blocked sending its rows has not
        # committed; its row locks are on rows no settlement touches)
        freezes = 0
        while True:
            while (found := await counts(pool)).get("done", 0) < total // 3 or not found.get(
                "processing"
            ):
                assert first.proc.poll() is None, first.stderr()
                assert loop.time() < deadline, f"{found} after {freezes} freezes\n{first.stderr()}"
                await asyncio.sleep(0.02)
            first.proc.send_signal(signal.SIGSTOP)
            freezes += 1
            while (running := await pool.fetchrow(_RUNNING))["running"] > running["stuck"]:
                if loop.time() > deadline:
                    raise AssertionError(
                        f"frozen {freezes} times, statements still running:\n{await activity(pool)}"
                    )
                await asyncio.sleep(0.01)
            if (await counts(pool)).get("processing"):
                break
            first.proc.send_signal(signal.SIGCONT)
    except BaseException:
        print(first.stderr())
        raise
    finally:
        first.kill()
    killed_at = (await counts(pool)).get("done", 0)
    assert killed_at < total, "the relay finished before it could be killed"
    second = RelayProcess(dsn, to, "--concurrency", "256", *args)
    try:
        await wait_done(pool, total, timeout=120)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{second.stderr()}") from None
    finally:
        assert await second.stop() == 0, second.stderr()
    assert await counts(pool) == {"done": total}
    assert f"batches of {BATCH}" in second.said, "the relay published in batches"
    said = second.said.splitlines()
    return "\n".join([*[s for s in said if "WARNING" in s][:5], *said[-2:]])


# -- reading back -------------------------------------------------------------------------
async def nats_stream(js: Any, name: str, subjects: list[str], storage: str = "file") -> None:
    from nats.js.api import StorageType, StreamConfig

    await js.add_stream(
        StreamConfig(
            name=name,
            subjects=subjects,
            storage=StorageType.FILE if storage == "file" else StorageType.MEMORY,
        )
    )


async def nats_read(js: Any, stream: str, subject: str) -> list[Any]:
    """Every message of ``stream``, in stream order."""
    sub = await js.pull_subscribe(subject, stream=stream)
    info = await js.stream_info(stream)
    found: list[Any] = []
    while len(found) < info.state.messages:
        batch = await sub.fetch(min(1000, info.state.messages - len(found)), timeout=5)
        for msg in batch:
            await msg.ack()
        found.extend(batch)
    await sub.unsubscribe()
    return found


async def rabbit_read(url: str, queue: str, expect: int, timeout: float = 30) -> list[Any]:
    """Messages from ``queue`` until ``expect`` arrived and nothing more comes for 0.5 s."""
    import aio_pika

    found: list[Any] = []
    async with await aio_pika.connect(url) as connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=2000)
        q = await channel.get_queue(queue, ensure=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with q.iterator(no_ack=True) as messages:
            while loop.time() < deadline:
                try:
                    message = await asyncio.wait_for(messages.__anext__(), 0.5)
                except TimeoutError:
                    if len(found) >= expect:
                        break
                    continue
                found.append(message)
    return found


async def kafka_read(bootstrap: str, topic: str, expect: int, timeout: float = 30) -> list[Any]:
    import aiokafka

    consumer = aiokafka.AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None
    )
    await consumer.start()
    found: list[Any] = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        idle = 0
        while loop.time() < deadline:
            batch = await consumer.getmany(timeout_ms=500, max_records=5000)
            got = [m for msgs in batch.values() for m in msgs]
            found.extend(got)
            idle = 0 if got else idle + 1
            if len(found) >= expect and idle >= 2:
                break
    finally:
        await consumer.stop()
    return found


async def kafka_topic(bootstrap: str, name: str, partitions: int = 3) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        await admin.close()
