"""Each relay example in examples/ runs against the real brokers and prints what arrived."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

import asyncpg
import pytest

from tests.relay.brokers import AMQP_URL, NATS_URL, REDIS_URL, tansu
from tests.relay.common import unique


async def done(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM outbox_events WHERE status = 'done'"))
    finally:
        await conn.close()


async def test_relay_nats_example(dsn: str) -> None:
    from examples.relay_nats import main

    messages = await main(dsn, NATS_URL, stream=unique("EXAMPLE"))
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
