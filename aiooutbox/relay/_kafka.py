"""`KafkaSink`: produce with ``acks="all"``, keyed by the event's ordering key.

The record key is the event's ``ordering_key`` (else ``default_key``), so all events of
one aggregate land in one partition, in the order the consumer published them (one at a
time per key): downstream consumers see per-aggregate order, as with Debezium's outbox
router. The event's ``message_id`` travels in the ``outbox-message-id`` header; Kafka
does not dedupe across producer sessions, so a repeat (an event whose earlier attempt
may have been stored: its relay died, or an attempt failed) is looked up first: the
partition its key goes to (every partition, unkeyed) is read from the offset of a time
before its first attempt (its ``created_at`` less ``clock_skew``, by
``offsets_for_times``) to the end, matching that header; found, it is not produced
again (`relay._lookup`, `relay._kafka_read`). First attempts never look. Idempotence
(on by default) removes duplicates from the producer's own retries within one session.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Hashable
from datetime import timedelta
from typing import Any

from ..events import Event
from ._kafka_read import KafkaReader
from ._kafka_send import send_runs
from ._lookup import Lookup, check_skew
from ._sink import BrokerUnavailable, Message, Sink, require

__all__ = ["KafkaSink", "topic_problem"]

KeyFunc = Callable[[Event], "str | None"]

#: Kafka's topic names: 1-249 of these characters, and not "." or ".."
_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")
#: errors the broker (or the client, before sending) answers for this record whatever
#: the retries: too large, an invalid topic, a message format the topic cannot hold
_REFUSED = (
    "MessageSizeTooLargeError",
    "RecordListTooLargeError",
    "InvalidTopicError",
    "UnsupportedForMessageFormatError",
)
#: INVALID_RECORD (e.g. no key for a compacted topic); aiokafka has no class for it
_INVALID_RECORD = 87


def topic_problem(topic: str) -> str | None:
    """Why Kafka cannot have a topic named ``topic`` (None: it can)."""
    if _TOPIC.fullmatch(topic) and topic not in (".", ".."):
        return None
    return (
        "not a valid Kafka topic name: Kafka allows 1-249 characters of "
        "[a-zA-Z0-9._-], and not '.' or '..'"
    )


class _QuietStart(logging.Filter):
    """Drop aiokafka's own log lines of a failed start (an unreachable bootstrap
    server, a refused idempotent producer): the sink's `BrokerUnavailable` says it, in
    one line, with the way out."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(
            ("Unexpected error during InitProducerIdRequest", 'Unable connect to "')
        )


class KafkaSink(Sink):
    """Produce each event to the Kafka topic named by the destination and await the ack.

    ``default_key`` keys events without an ``ordering_key``: a string, a function of the
    event, or ``None`` (unkeyed: spread over partitions). ``enable_idempotence=True``
    needs a broker that supports idempotent producers; Tansu's memory store does not.
    ``producer_options`` go to `aiokafka.AIOKafkaProducer`. The client reconnects on its
    own; publishes wait for it (``reconnect_wait``).

    Refused at once (`Dead`): a destination that breaks Kafka's topic-name rules (the
    client would wait for metadata of a topic that cannot exist), a record over
    ``max_request_size`` (1 MiB by default) or the broker's ``message.max.bytes``, and
    the broker's other answers for this record alone (invalid topic, invalid record).
    Kafka has no wildcards in a produce: any valid name is literal.

    ``read_back=True`` (the default) looks a repeated event up in its partition before
    producing it again (see the module); ``clock_skew`` (seconds) is how far the record
    timestamps (the relay's clock, or the broker's with LogAppendTime) may run behind
    the database's.
    """

    name = "kafka"
    cloudevents_binding = "kafka"

    def __init__(
        self,
        bootstrap_servers: str | list[str] = "127.0.0.1:9092",
        *,
        destination: str = "{topic}",
        default_key: str | KeyFunc | None = None,
        enable_idempotence: bool = True,
        connect_timeout: float | timedelta = 10.0,
        publish_timeout: float | timedelta = 10.0,
        reconnect_wait: float | timedelta = 60.0,
        max_in_flight: int | None = None,
        format: str = "outbox",
        cloudevents_source: str | None = None,
        producer_options: dict[str, Any] | None = None,
        read_back: bool = True,
        clock_skew: float | timedelta = 60.0,
    ) -> None:
        super().__init__(
            destination=destination,
            connect_timeout=connect_timeout,
            publish_timeout=publish_timeout,
            reconnect_wait=reconnect_wait,
            max_in_flight=max_in_flight,
            format=format,
            cloudevents_source=cloudevents_source,
        )
        if not (isinstance(bootstrap_servers, (str, list))):
            raise TypeError(f"bootstrap_servers must be a str or list, not {bootstrap_servers!r}")
        if default_key is not None and not (isinstance(default_key, str) or callable(default_key)):
            raise TypeError(f"default_key must be a str, a function or None, not {default_key!r}")
        if not isinstance(enable_idempotence, bool):
            raise TypeError(f"enable_idempotence must be a bool, not {enable_idempotence!r}")
        self._aiokafka = require("aiokafka", "kafka")
        self._errors = require("aiokafka.errors", "kafka")
        errors = self._errors
        records = require("aiokafka.record.default_records", "kafka")
        self._estimate = records.DefaultRecordBatchBuilder.estimate_size_in_bytes
        self._refused = tuple(getattr(errors, n) for n in _REFUSED if hasattr(errors, n))
        self.bootstrap_servers = bootstrap_servers
        self.default_key = default_key
        self.enable_idempotence = enable_idempotence
        if not isinstance(read_back, bool):
            raise TypeError(f"read_back must be a bool, not {read_back!r}")
        self.clock_skew = check_skew(clock_skew)
        self._options = dict(producer_options or {})
        self._producer: Any = None
        self._reader: KafkaReader | None = None
        if read_back:
            self._reader = KafkaReader(
                self._aiokafka, errors, bootstrap_servers, self._options, self.publish_timeout
            )
            self._lookup = Lookup(self._reader.read)

    def describe(self) -> str:
        servers = self.bootstrap_servers
        return servers if isinstance(servers, str) else ",".join(servers)

    async def _open(self) -> None:
        options: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "acks": "all",
            "enable_idempotence": self.enable_idempotence,
            "request_timeout_ms": int(self.publish_timeout * 1000),
            "retry_backoff_ms": 200,
            # a wave of a batch is handed to the producer at once: lingering only delays it
            # (measured over 1,000 keys: 13.7k/s at 0 against 10.5-12.7k at 1 ms)
            "linger_ms": 0,
        }
        options.update(self._options)
        self._producer = self._aiokafka.AIOKafkaProducer(**options)
        quiet = _QuietStart()
        loggers = [logging.getLogger(n) for n in ("aiokafka", "aiokafka.producer.sender")]
        for log in loggers:
            log.addFilter(quiet)
        try:
            await self._producer.start()
        except self._errors.KafkaError as exc:
            unreachable = (self._errors.KafkaConnectionError, self._errors.KafkaTimeoutError)
            if not options["enable_idempotence"] or isinstance(exc, unreachable):
                raise
            # connected, then the producer id for idempotence was refused (Tansu's
            # memory store answers UnknownError)
            raise BrokerUnavailable(
                f"kafka at {self.describe()} refused an idempotent producer "
                f"({type(exc).__name__}: {exc}): relay with --no-idempotence "
                "(KafkaSink(enable_idempotence=False)), or use a broker that supports "
                "idempotent producers"
            ) from None
        finally:
            for log in loggers:
                log.removeFilter(quiet)

    async def _close(self) -> None:
        try:
            if self._reader is not None:
                await self._reader.close()
        finally:
            if self._producer is not None:
                await self._producer.stop()

    async def _published(self, message: Message, asked: float) -> bool:
        assert self._lookup is not None
        topic = message.destination
        key = self._key(message)
        partitions = sorted(await self._producer.partitions_for(topic))
        places: list[Hashable]
        if key is None:
            places = [(topic, p) for p in partitions]
        else:  # the partition the producer sends this key to
            places = [(topic, self._producer._partition(topic, None, None, None, key, None))]
        created = message.event.created_at
        since = int(created.timestamp() * 1000 - self.clock_skew * 1000) if created else 0
        return await self._lookup.contains(places, message.message_id, max(since, 0), asked)

    def _key(self, message: Message) -> bytes | None:
        key = message.key
        if key is None:
            default = self.default_key
            key = default(message.event) if callable(default) else default
        return key.encode() if key is not None else None

    async def _send(self, message: Message) -> None:
        future = await self._producer.send(
            message.destination, value=message.body, key=self._key(message),
            headers=[(k, v.encode()) for k, v in message.headers.items()],
        )  # fmt: skip
        await asyncio.wait_for(future, self.publish_timeout)

    async def _send_many(self, messages: list[Message]) -> list[BaseException | None]:
        """Records put into record batches of their partition, the deliveries awaited
        together: the client packs them into one produce request per broker
        (`relay._kafka_send`)."""
        return await send_runs(self, messages, False)

    async def _send_runs(
        self, messages: list[Message], hold_after_dead: bool
    ) -> list[BaseException | None]:
        """As `_send_many`, several events of one ordering key allowed: a key's events
        of one partition go in one record batch, stored whole or not at all."""
        return await send_runs(self, messages, hold_after_dead)

    async def _metadata(self, topics: set[str]) -> dict[str, BaseException]:
        """Fetch the partitions of the ``topics`` the client does not know; the error of
        each it could not."""
        cluster = self._producer.client.cluster
        unknown = [t for t in topics if cluster.partitions_for_topic(t) is None]
        if not unknown:
            return {}
        found = await asyncio.gather(
            *(self._producer.partitions_for(t) for t in unknown), return_exceptions=True
        )
        return {t: r for t, r in zip(unknown, found, strict=True) if isinstance(r, Exception)}

    def _destination_problem(self, destination: str) -> str | None:
        return topic_problem(destination)

    def _refusal(self, exc: BaseException, message: Message) -> str | None:
        if isinstance(exc, self._refused) or getattr(exc, "errno", None) == _INVALID_RECORD:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _is_outage(self, exc: BaseException) -> bool:
        errors = self._errors
        if isinstance(exc, (errors.KafkaTimeoutError, errors.KafkaConnectionError)):
            return True
        if isinstance(exc, errors.KafkaError):
            return bool(exc.retriable)
        return isinstance(exc, (OSError, TimeoutError))
