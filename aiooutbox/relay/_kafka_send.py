"""`KafkaSink`'s pipelined publish: records put into record batches of their partition
by the sink (aiokafka's ``create_batch``), one delivery future a record batch, not one
a record.

A record batch is stored whole or not at all, so each of its records has the batch's
outcome; that lets several events of one ordering key go in one call (`send_runs`): the
events of a key that go to one partition are put in one record batch, in order, so a
later one is never stored without the earlier ones. An event that cannot join its key's
record batch (the batch is full, or it goes to another partition) waits for the outcome
of the ones before it: it is sent in a later round of the call, and held back
(`HeldBack`) when one before it failed. A record batch the broker refuses as a whole
(over its ``message.max.bytes``, an invalid record) names no record: each of its records
is sent again on its own, in order, so that only the one refused is dead.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from ._batch import held_back
from ._message import Message

__all__ = ["send_runs"]

Results = list[BaseException | None]
#: (the record's key, its headers, its topic and partition)
_Record = tuple[bytes | None, list[tuple[str, bytes]], tuple[str, int]]


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Take a late delivery's outcome, so that asyncio does not log it as lost."""
    if not future.cancelled():
        future.exception()


async def send_runs(sink: Any, messages: list[Message], hold_after_dead: bool) -> Results:
    """Publish ``messages`` (several of one ordering key allowed, in their order), each
    one's error or None; a key's later event is stored only if its earlier ones are,
    and held back after one that failed (after a refused one: ``hold_after_dead``)."""
    results: Results = [None] * len(messages)
    records = await _records(sink, messages, results)
    failed: set[str] = set()  # ordering keys whose later events are held back
    todo = list(range(len(messages)))
    while todo:
        sent, todo = await _round(sink, messages, records, todo, failed, results, hold_after_dead)
        await _alone(sink, messages, sent, results, failed, hold_after_dead)
    return results


def _note(
    sink: Any,
    failed: set[str],
    message: Message,
    error: BaseException | None,
    hold_after_dead: bool,
) -> None:
    """Note ``message``'s key in ``failed`` when ``error`` holds its later events back
    (as `relay._batch` does: a refusal only with ``hold_after_dead``)."""
    if error is None or message.key is None:
        return
    if hold_after_dead or sink._refusal(error, message) is None:
        failed.add(message.key)


async def _records(sink: Any, messages: list[Message], results: Results) -> list[_Record | None]:
    """Each message's record, or None with its error in ``results`` (refused by the
    client before sending, as ``send`` would: too large, or its topic unknown)."""
    producer = sink._producer
    errors = sink._errors
    # a topic whose partitions the client does not know yet is asked for at once
    missing = await sink._metadata({m.destination for m in messages})
    cluster = producer.client.cluster
    partitioner = producer._partitioner
    largest = producer._max_request_size
    estimate = sink._estimate
    places: dict[str, tuple[list[int], list[int]] | None] = {}
    records: list[_Record | None] = [None] * len(messages)
    for i, message in enumerate(messages):
        topic = message.destination
        problem = missing.get(topic)
        if problem is not None:
            results[i] = problem
            continue
        key = sink._key(message)
        headers = [(k, v.encode()) for k, v in message.headers.items()]
        size = estimate(key, message.body, headers)
        if size > largest:
            results[i] = errors.MessageSizeTooLargeError(
                f"The message is {size} bytes when serialized which is larger than the "
                "maximum request size you have configured with the max_request_size "
                "configuration"
            )
            continue
        if topic in places:
            known = places[topic]
        else:
            found = cluster.partitions_for_topic(topic)
            available = cluster.available_partitions_for_topic(topic)
            known = places[topic] = (list(found), list(available)) if found else None
        if known is None:  # its partitions gone since (a topic deleted): wait for them
            results[i] = errors.UnknownTopicOrPartitionError(f"no partitions known for {topic}")
            continue
        records[i] = (key, headers, (topic, partitioner(key, *known)))
    return records


async def _round(
    sink: Any,
    messages: list[Message],
    records: list[_Record | None],
    todo: list[int],
    failed: set[str],
    results: Results,
    hold_after_dead: bool,
) -> tuple[list[int], list[int]]:
    """Send what can go now, await the deliveries: (the indexes sent, those that wait
    for them)."""
    producer = sink._producer
    current: dict[tuple[str, int], tuple[Any, list[int]]] = {}  # each partition's open batch
    owner: dict[str, list[int]] = {}  # ordering key -> the batch holding its events
    waiting: set[str] = set()  # ordering keys with an event left for the next round
    later: list[int] = []
    sent: list[int] = []
    deliveries: dict[asyncio.Future[Any], list[int]] = {}
    for i in todo:
        message = messages[i]
        order = message.key
        if order is not None:
            if order in waiting:
                later.append(i)
                continue
            if order in failed:
                results[i] = held_back(order)
                continue
        record = records[i]
        if record is None:  # refused before sending
            _note(sink, failed, message, results[i], hold_after_dead)
            continue
        key, headers, place = record
        batch = current.get(place)
        if order is not None and order in owner and (batch is None or owner[order] is not batch[1]):
            waiting.add(order)  # its batch was closed, or it goes elsewhere
            later.append(i)
            continue
        if batch is None:
            batch = current[place] = (producer.create_batch(), [])
        if batch[0].append(key=key, value=message.body, timestamp=None, headers=headers) is None:
            _deliver(sink, batch, place, deliveries, results)  # full
            if order is not None and owner.get(order) is batch[1]:
                del current[place]
                waiting.add(order)
                later.append(i)
                continue
            batch = current[place] = (producer.create_batch(), [])
            batch[0].append(key=key, value=message.body, timestamp=None, headers=headers)
        batch[1].append(i)
        sent.append(i)
        if order is not None:
            owner[order] = batch[1]
    for place, batch in current.items():
        _deliver(sink, batch, place, deliveries, results)
    if deliveries:
        done, late = await asyncio.wait(deliveries, timeout=sink.publish_timeout)
        for future in done:
            error = future.exception()
            for i in deliveries[future]:
                results[i] = error
        if late:
            timeout = sink._errors.KafkaTimeoutError(
                f"no acknowledgement within {sink.publish_timeout:g}s"
            )
            for future in late:
                for i in deliveries[future]:
                    results[i] = timeout
                future.add_done_callback(_retrieved)  # its late outcome is nobody's
    return sent, later


def _deliver(
    sink: Any,
    batch: tuple[Any, list[int]],
    place: tuple[str, int],
    deliveries: dict[asyncio.Future[Any], list[int]],
    results: Results,
) -> None:
    """Queue a record batch for its partition. Not through ``send_batch``, which waits
    until the partition has no batch queued: the calls of several batches queue for one
    partition at once, and its wait gave up (KafkaTimeoutError) under that load. The
    window (``max_in_flight``, the consumer's ``concurrency``) bounds what is queued."""
    builder, taken = batch
    if not taken:
        return
    queue = sink._producer._message_accumulator
    if queue._closed or queue._exception is not None:
        error = sink._errors.ProducerClosed() if queue._closed else queue._exception
        for i in taken:
            results[i] = error
        return
    tp = sink._aiokafka.structs.TopicPartition(*place)
    deliveries[queue._append_batch(builder, tp).future] = taken


async def _alone(
    sink: Any,
    messages: list[Message],
    sent: list[int],
    results: Results,
    failed: set[str],
    hold_after_dead: bool,
) -> None:
    """Each record of a batch the broker refused as a whole sent again on its own, in
    order (a key's later ones held back after one that failed); the keys that failed
    noted in ``failed``."""
    shared = collections.Counter(id(results[i]) for i in sent if results[i] is not None)
    for i in sent:
        message = messages[i]
        order = message.key
        result = results[i]
        if (
            result is not None
            and shared[id(result)] > 1
            and sink._refusal(result, message) is not None
        ):
            if order is not None and order in failed:
                results[i] = held_back(order)
            else:
                try:
                    await sink._send(message)
                except Exception as exc:
                    results[i] = exc
                else:
                    results[i] = None
        _note(sink, failed, message, results[i], hold_after_dead)
