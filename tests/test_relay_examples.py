"""Each relay example in examples/ runs against the real brokers and prints what arrived."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

import asyncpg
import pytest

from tests.programs import needs
from tests.relay.brokers import AMQP_URL, NATS_URL, REDIS_URL, tansu
from tests.relay.common import unique


async def done(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(
            await conn.fetchval("SELECT count(*) FROM outbox_events_all WHERE status = 'done'")
        )
    finally:
        await conn.close()


async def test_relay_nats_example(dsn: str) -> None:
    from examples.relay_nats import main

    # subjects of its own: a stream elsewhere on the machine's NATS (a benchmark's) may
    # already capture `orders.>`
    messages = await main(dsn, NATS_URL, stream=unique("EXAMPLE"), prefix=unique("orders"))
    assert sorted(json.loads(m.data)["order_id"] for m in messages) == [1, 2, 3]
    assert await done(dsn) == 3


async def test_relay_rabbitmq_example(dsn: str) -> None:
    from examples.relay_rabbitmq import main

    messages = await main(dsn, AMQP_URL, queue=unique("example-"))
    assert sorted(json.loads(m.body)["order_id"] for m in messages) == [1, 2, 3]


async def test_relay_redis_example(dsn: str) -> None:
    from examples.relay_redis import main

    entries = await main(dsn, REDIS_URL, stream=unique("example:"))
    assert sorted(json.loads(f[b"payload"])["order_id"] for _, f in entries) == [1, 2, 3]


@needs("tansu")
async def test_relay_kafka_example(dsn: str) -> None:
    from examples.relay_kafka import main

    with tansu() as broker:
        from tests.relay.common import kafka_topic

        await kafka_topic(broker.bootstrap, "orders", partitions=3)
        records = await main(dsn, broker.bootstrap, idempotence=False)
    by_key: dict[bytes, set[int]] = {}
    for r in records:
        by_key.setdefault(r.key, set()).add(r.partition)
    assert set(by_key) == {b"order-1", b"order-2"}
    assert all(len(p) == 1 for p in by_key.values())


@pytest.mark.usefixtures("dsn")
async def test_relay_webhook_example(dsn: str) -> None:
    from examples.relay_webhook import main

    received = await main(dsn)
    assert sorted(json.loads(body)["order_id"] for _, body in received) == [1, 2, 3]


async def test_relay_doc_snippets_run(dsn: str, tmp_path: Path) -> None:
    doc = Path(__file__).resolve().parent.parent / "docs" / "relay.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    assert blocks
    for index, block in enumerate(blocks):
        script = tmp_path / f"relay_doc_{index}.py"
        script.write_text(block)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            env={**os.environ, "AIOOUTBOX_DSN": dsn},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        assert b"stored: 1" in out


@needs("tansu")
async def test_relay_doc_tansu_commands_relay_to_kafka(dsn: str) -> None:
    """docs/relay.md's commands, as written (another port, no pip install): Tansu
    starts, and the relay they start publishes an event to it."""
    from tests.relay.brokers import free_port
    from tests.relay.common import kafka_read

    doc = (Path(__file__).resolve().parent.parent / "docs" / "relay.md").read_text()
    (block,) = [b for b in re.findall(r"```sh\n(.*?)```", doc, flags=re.S) if "tansu" in b]
    port = free_port()
    script = "\n".join(
        line for line in block.replace("9092", str(port)).splitlines() if "pip install" not in line
    )
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "INSERT INTO outbox_events (topic, payload) VALUES ('docs.kafka', '{\"n\": 1}')"
        )
    finally:
        await conn.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOOUTBOX_")}
    proc = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        script,
        env={**env, "AIOOUTBOX_DSN": dsn},
        cwd=Path(__file__).resolve().parent.parent,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # the broker in the background and the relay: one group
    )
    try:
        for _ in range(600):
            if await done(dsn) == 1 or proc.returncode is not None:
                break
            await asyncio.sleep(0.1)
        if await done(dsn) != 1:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 60)
            pytest.fail(f"the relay did not publish the event (exit {proc.returncode}): {err!r}")
        (message,) = await kafka_read(f"127.0.0.1:{port}", "docs.kafka", 1)
        assert json.loads(message.value) == {"n": 1}
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert "error" not in err.decode().lower(), err.decode()
