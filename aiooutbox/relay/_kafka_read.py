"""Reading a Kafka partition back from a time bound, for `KafkaSink`'s look-ups.

The partition an event would go to is the one its key hashes to (the producer's own
partitioner, over the topic's partitions now); an unkeyed event may be in any, so all
are read. Each is read from the first offset at or after the bound
(``offsets_for_times``, ListOffsets v1) to its end offset, collecting the
``outbox-message-id`` headers. A broker without timestamp look-ups, or one answering
"no timestamp" (Tansu answers offset 0 with timestamp -1 for a bound past its last
record), is read from its beginning, unless its last record is older than the bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable
from typing import Any, cast

from ._lookup import Seen
from ._message import MESSAGE_ID_HEADER

__all__ = ["KafkaReader"]

logger = logging.getLogger("aiooutbox.relay")

#: the producer options a reading consumer shares (where and how to connect)
_SHARED = (
    "client_id",
    "api_version",
    "security_protocol",
    "ssl_context",
    "sasl_mechanism",
    "sasl_plain_username",
    "sasl_plain_password",
    "sasl_kerberos_service_name",
    "sasl_kerberos_domain_name",
    "sasl_oauth_token_provider",
    "connections_max_idle_ms",
)
_HEADER = MESSAGE_ID_HEADER


class KafkaReader:
    """A consumer with no group, assigned the partitions looked up, read on demand."""

    def __init__(
        self, aiokafka: Any, errors: Any, servers: Any, options: dict[str, Any], timeout: float
    ) -> None:
        self._aiokafka = aiokafka
        self._errors = errors
        self._options = {k: v for k, v in options.items() if k in _SHARED}
        self._servers = servers
        self._timeout = timeout
        self._consumer: Any = None
        #: records read by look-ups (what they cost)
        self.records = 0
        #: partitions read from the beginning for want of a timestamp look-up
        self.from_start = 0

    async def close(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            await consumer.stop()

    async def _started(self) -> Any:
        if self._consumer is None:
            consumer = self._aiokafka.AIOKafkaConsumer(
                bootstrap_servers=self._servers,
                group_id=None,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                request_timeout_ms=int(self._timeout * 1000),
                **self._options,
            )
            try:
                await consumer.start()
            except BaseException:
                await consumer.stop()  # a half-started client: closed, made again next time
                raise
            self._consumer = consumer
        return self._consumer

    async def read(self, place: Hashable, seen: Seen) -> None:
        """Add the message ids of partition ``place`` (topic, partition) from where
        ``seen`` stopped (or its bound) to the partition's end offset now."""
        consumer = await self._started()
        topic, partition = cast(tuple[str, int], place)
        tp = self._aiokafka.TopicPartition(topic, partition)
        if tp not in consumer.assignment():
            consumer.assign([*consumer.assignment(), tp])
        end = (await consumer.end_offsets([tp]))[tp]
        if seen.position is None:
            seen.position = await self._first(consumer, tp, seen.since_ms, end)
        if seen.position >= end:
            return
        consumer.seek(tp, seen.position)
        loop = asyncio.get_running_loop()
        stalled = loop.time() + self._timeout
        while seen.position < end:
            batch = await consumer.getmany(tp, timeout_ms=200, max_records=5000)
            records = batch.get(tp, [])
            for record in records:
                for key, value in record.headers:
                    if key == _HEADER and value is not None:
                        seen.ids.add(bytes(value).decode("utf-8", "replace"))
            self.records += len(records)
            position = await consumer.position(tp)
            if position > seen.position:
                seen.position = position
                stalled = loop.time() + self._timeout
            elif loop.time() > stalled:
                raise self._errors.KafkaTimeoutError(
                    f"reading {place} back: no progress at offset {seen.position} of {end} "
                    f"within {self._timeout:g}s"
                )

    async def _first(self, consumer: Any, tp: Any, since_ms: int, end: int) -> int:
        """The first offset of ``tp`` whose record may be at or after ``since_ms``."""
        try:
            found = (await consumer.offsets_for_times({tp: since_ms})).get(tp)
        except self._errors.UnsupportedVersionError:
            found = -1
        if found is None:
            return end  # no record at or after the bound
        if found != -1 and found.timestamp >= 0:
            return int(found.offset)
        # no timestamp look-up: the last record tells whether anything is that recent
        start = (await consumer.beginning_offsets([tp]))[tp]
        if end > start and await self._last_before(consumer, tp, end, since_ms):
            return end
        self.from_start += 1
        logger.info("kafka: %s has no timestamp look-up; reading it back from offset %d", tp, start)
        return int(start)

    async def _last_before(self, consumer: Any, tp: Any, end: int, since_ms: int) -> bool:
        consumer.seek(tp, end - 1)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        while loop.time() < deadline:
            records = (await consumer.getmany(tp, timeout_ms=200, max_records=1)).get(tp, [])
            if records:
                return bool(records[-1].timestamp < since_ms)
            if await consumer.position(tp) >= end:
                return False  # not readable (compacted away, a marker): read it all
        return False
