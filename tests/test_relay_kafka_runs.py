"""Kafka takes a batch in one call, several events of a key in it (`relay._kafka_send`):
a key's events of one partition share a record batch, in order; one that cannot join it
(the record batch is full) goes after the ones before it are stored, and is held back
when one of them failed (after a refused one only with ``on_dead="block"``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import aiooutbox
from aiooutbox.relay import HeldBack, KafkaSink
from tests.programs import needs
from tests.relay.brokers import Tansu, tansu
from tests.relay.common import kafka_read, kafka_topic, unique
from tests.test_relay_batch import event

pytestmark = needs("tansu")


@pytest.fixture(scope="module")
def kafka() -> Iterator[Tansu]:
    with tansu() as broker:
        yield broker


def by_key(found: list[Any]) -> dict[str, list[int]]:
    """Each key's sequence numbers in the order the broker holds them."""
    seen: dict[str, list[int]] = {}
    for m in sorted(found, key=lambda m: (m.partition, m.offset)):
        body = json.loads(m.value)
        seen.setdefault(body["key"], []).append(body["seq"])
    return seen


async def test_a_key_longer_than_a_record_batch_keeps_its_order(kafka: Tansu) -> None:
    topic = unique("relay.runs.")
    await kafka_topic(kafka.bootstrap, topic)
    # record batches of about 1 KB: a key's 30 events of ~300 bytes need several
    options = {"max_batch_size": 1024}
    async with KafkaSink(
        kafka.bootstrap, enable_idempotence=False, producer_options=options
    ) as sink:
        events = [
            event(topic, {"key": k, "seq": seq, "pad": "x" * 100}, key=k)
            for seq in range(30)
            for k in ("a", "b", "c")
        ]
        assert await sink.publish_batch(events) is None
    found = await kafka_read(kafka.bootstrap, topic, len(events))
    assert len(found) == len(events)
    assert by_key(found) == {k: list(range(30)) for k in ("a", "b", "c")}


async def test_a_refused_event_holds_its_key_only_when_blocking(kafka: Tansu) -> None:
    topic = unique("relay.runs.")
    await kafka_topic(kafka.bootstrap, topic)
    async with KafkaSink(kafka.bootstrap, enable_idempotence=False) as sink:
        for hold in (False, True):
            key = f"k{hold}"
            batch = [
                event(topic, {"key": key, "seq": 0}, key=key),
                event(topic, {"key": key, "seq": 1, "pad": "x" * 2 * 1024 * 1024}, key=key),
                event(topic, {"key": key, "seq": 2}, key=key),
                event(topic, {"key": "other" + key, "seq": 0}, key="other" + key),
            ]
            failures = await sink.publish_batch(batch, hold_after_dead=hold)
            assert failures is not None
            assert isinstance(failures[batch[1].id], aiooutbox.Dead)
            if hold:
                assert set(failures) == {batch[1].id, batch[2].id}
                assert isinstance(failures[batch[2].id], HeldBack)
            else:
                assert set(failures) == {batch[1].id}
    found = await kafka_read(kafka.bootstrap, topic, 5)
    assert by_key(found) == {"kFalse": [0, 2], "otherkFalse": [0], "kTrue": [0], "otherkTrue": [0]}
