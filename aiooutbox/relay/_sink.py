"""`Sink`: the handler every relay is, and the one message format all brokers get.

A sink is a batch handler (`Sink.handler`, over `Sink.publish_batch`), so it runs under
a consumer like any handler (leases, retries, dead, per-key order, observers), and an
async callable taking one `Event` too. Its whole job is "publish, await the broker's
confirms, return": a batch goes out with the client's pipelined calls (`relay._batch`),
each event with its own outcome, and the consumer settles each row ``done`` only after
the broker holds its message.

A broker that goes away is the sink's problem, not the event's: while the connection
is down a call waits for it to come back (up to ``reconnect_wait``) and publishes again
with the same message id, so a short outage costs no attempt and sends nothing to
``dead``. An event the broker refuses for good (a destination it cannot take or would
read as a wildcard, a message over its size limit, no stream or queue for it, a webhook
answering 4xx) is `Dead` at once with the broker's reason: retrying it could only
block its key. Anything else, and an outage longer than ``reconnect_wait``, reaches the
consumer's retry policy.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import time
from collections.abc import Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any, ClassVar, Literal

from .._values.extras import install_hint
from .._values.limits import check_seconds
from .._values.text import describe_exception, exception_message
from ..errors import Dead, InvalidArgument, OutboxError
from ..events import Event
from ..handlers import Handler
from ..retry import RetryPolicy
from ._batch import HeldBack, Window, publish
from ._cloudevents import CloudEvents, check_format, check_source
from ._lookup import Lookup
from ._message import (
    Message,
    ReservedHeaders,
    check_template,
    render_destination,
    shown,
)

__all__ = [
    "BrokerUnavailable",
    "HeldBack",
    "Message",
    "Sink",
    "SinkClosed",
    "render_destination",
]

logger = logging.getLogger("aiooutbox.relay")

#: how many destinations a sink remembers the check of
_REMEMBERED = 4096
#: the event a destination template is checked with when a sink is made
_SAMPLE = Event(0, "t", None, None, ordering_key="k")


class BrokerUnavailable(OutboxError):
    """The broker could not be reached when the sink started (nothing was published)."""


class SinkClosed(OutboxError):
    """The sink is not started, or was closed: events are retried by the consumer."""


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class Sink:
    """Base of every relay sink: lifecycle, the outage wait, the message format.

    ``async with NatsSink(...) as sink: await consumer.run({"*": sink.handler()})``
    (batches), or ``{"*": sink}`` (one event a call); or call `start` and `close`
    yourself. A sink can be started once; closing it twice is fine.

    ``max_in_flight`` bounds the messages awaiting the broker's confirm at once,
    batches included (``None``: only the consumer's ``concurrency`` does).
    ``format="cloudevents"`` publishes each event as a CloudEvent in the broker's binding
    (``"cloudevents-structured"``: the whole event as JSON in the body), with
    ``cloudevents_source`` as its ``source`` (see `relay._cloudevents`).
    Subclasses implement ``_open``, ``_close``, ``_send`` (and ``_send_many`` when the
    client pipelines: by default concurrent ``_send`` calls) and ``_is_outage``, and tell
    the broker's permanent refusals with ``_destination_problem``, ``_message_problem``
    (checked before publishing) and ``_refusal`` (the broker's answer).
    """

    name: ClassVar[str] = "sink"
    #: the CloudEvents protocol binding of the broker (None: structured, no binding)
    cloudevents_binding: ClassVar[str | None] = None
    #: header names (exact, and prefixes) the broker or its clients read as their own,
    #: beyond the ones every broker reserves (`_message.RESERVED_PREFIXES`)
    reserved_names: ClassVar[tuple[str, ...]] = ()
    reserved_prefixes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        *,
        destination: str = "{topic}",
        connect_timeout: float | timedelta = 10.0,
        publish_timeout: float | timedelta = 10.0,
        reconnect_wait: float | timedelta = 60.0,
        max_in_flight: int | None = None,
        format: str = "outbox",
        cloudevents_source: str | None = None,
    ) -> None:
        self.destination = check_template(destination)
        sample = render_destination(self.destination, _SAMPLE)
        problem = self._destination_problem(sample)
        if problem is not None:
            raise InvalidArgument(
                f"destination {shown(self.destination)} cannot work with {self.name}: {problem}"
            )
        #: destination -> why the broker cannot take it (None: it can), for the last few
        self._destinations: dict[str, str | None] = {}
        self._cloudevents = _cloudevents_for(self, format, cloudevents_source)
        #: the event's own headers this sink drops
        self._reserved = ReservedHeaders(self.reserved_names, self.reserved_prefixes)
        self.connect_timeout = check_seconds("connect_timeout", connect_timeout, minimum=0.01)
        self.publish_timeout = check_seconds("publish_timeout", publish_timeout, minimum=0.01)
        self.reconnect_wait = check_seconds("reconnect_wait", reconnect_wait, minimum=0.0)
        if max_in_flight is not None and (
            not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool)
        ):
            raise TypeError(f"max_in_flight must be an int or None, not {max_in_flight!r}")
        if max_in_flight is not None and max_in_flight < 1:
            raise InvalidArgument(f"max_in_flight must be at least 1, not {max_in_flight}")
        self.max_in_flight = max_in_flight
        self._window = Window(max_in_flight) if max_in_flight else None
        self._state = _State.NEW
        self._outage_since: float | None = None
        #: publishes repeated after a lost connection (each may have reached the broker)
        self.republished = 0
        #: the broker read back before a repeat (sinks that can: Kafka, Redis Streams)
        self._lookup: Lookup | None = None
        #: repeats not published again: the broker already held them (`_lookup`)
        self.found_published = 0

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        """Connect; raise `BrokerUnavailable` (one line saying why) if the broker is not there."""
        if self._state is not _State.NEW:
            raise SinkClosed(f"{self.name} sink is {self._state.value}; a sink starts once")
        try:
            await asyncio.wait_for(self._open(), self.connect_timeout)
        except TimeoutError:
            await self._abort()
            raise BrokerUnavailable(
                f"{self.name}: no answer from {self.describe()} within {self.connect_timeout:g}s"
            ) from None
        except (OSError, ConnectionError) as exc:
            await self._abort()
            raise BrokerUnavailable(
                f"{self.name} at {self.describe()}: {exception_message(exc)}"
            ) from None
        except Exception as exc:
            await self._abort()
            if isinstance(exc, OutboxError):
                raise
            raise BrokerUnavailable(
                f"{self.name} at {self.describe()}: {describe_exception(exc)}"
            ) from None
        self._state = _State.OPEN
        logger.info("%s sink connected to %s", self.name, self.describe())

    async def close(self) -> None:
        """Close the broker connection; events still being published fail and are retried."""
        if self._state is _State.CLOSED:
            return
        opened = self._state is _State.OPEN
        self._state = _State.CLOSED
        if opened:
            await self._close()

    async def _abort(self) -> None:
        try:
            await self._close()
        except Exception as exc:  # a half-open client; the start error is what matters
            logger.debug(
                "closing a %s sink that failed to start: %s", self.name, describe_exception(exc)
            )

    async def __aenter__(self) -> Sink:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.shield(self.close())

    @property
    def started(self) -> bool:
        return self._state is _State.OPEN

    # -- the handlers -----------------------------------------------------------------
    async def __call__(self, event: Event) -> None:
        """Publish ``event`` and return once the broker confirmed it; raise `Dead` with the
        broker's reason when it refuses the event for good."""
        failures = await publish(self, (event,))
        if failures:
            raise failures[event.id]

    async def publish_batch(
        self, events: Sequence[Event], *, hold_after_dead: bool = False
    ) -> dict[int, BaseException] | None:
        """Publish ``events`` with the client's pipelined calls (a batch handler: ``None``
        once the broker confirmed every one, else the failed ones' exceptions by event
        id: `Dead` for a refusal, `HeldBack` for an event held behind an earlier one of
        its key). A key's events are published one after another, each once the broker
        confirmed the one before (see `relay._batch`); ``hold_after_dead`` holds a key
        behind a refused event too (handlers with ``on_dead="block"``)."""
        return await publish(self, events, hold_after_dead=hold_after_dead)

    def handler(
        self,
        batch: int = 256,
        *,
        on_dead: Literal["skip", "block"] = "skip",
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        linger: float = 0.0,
    ) -> Handler:
        """The sink's batch handler for ``consumer.run({"*": sink.handler()})``: up to
        ``batch`` events a call, published with the client's pipelined calls
        (`publish_batch`); ``on_dead="block"`` holds a key's later events behind a
        refused one, in the broker as in the outbox. The options are `Handler`'s."""
        publish = self.publish_batch
        if on_dead == "block":
            publish = functools.partial(self.publish_batch, hold_after_dead=True)
        return Handler(
            publish, retry=retry, timeout=timeout, on_dead=on_dead, batch=batch, linger=linger
        )

    def _prepare(self, event: Event) -> Message:
        """The message of ``event`` in the sink's format; `Dead` if the broker would
        refuse it whatever the retries."""
        message = self._message(event)
        if self._cloudevents is not None:
            message = self._cloudevents.message(message)
        self._check(message)
        return message

    def _closed_error(self) -> BaseException:
        return SinkClosed(f"{self.name} sink is {self._state.value}; start it first")

    def _note_back(self) -> None:
        if self._outage_since is not None:
            logger.info(
                "%s sink: publishing again after %.1fs",
                self.name,
                time.monotonic() - self._outage_since,
            )
            self._outage_since = None

    def _message(self, event: Event) -> Message:
        return Message.of(event, self.destination, reserved=self._reserved)

    def _check(self, message: Message) -> None:
        """`Dead` when the broker would refuse ``message`` whatever the retries."""
        destination = message.destination
        try:
            problem = self._destinations[destination]
        except KeyError:
            problem = self._destination_problem(destination)
            if len(self._destinations) >= _REMEMBERED:
                self._destinations.clear()
            self._destinations[destination] = problem
        if problem is None:
            problem = self._message_problem(message)
            if problem is None:
                return
        raise Dead(f"{self.name} cannot publish to {shown(destination)}: {problem}")

    def _note_outage(self, exc: BaseException, now: float) -> None:
        if self._outage_since is None:
            self._outage_since = now
            logger.warning(
                "%s sink: %s unavailable (%s); holding events until it is back (up to %gs each)",
                self.name,
                self.describe(),
                describe_exception(exc),
                self.reconnect_wait,
            )

    # -- for subclasses ----------------------------------------------------------------
    def describe(self) -> str:
        """Where the sink publishes, without credentials."""
        return self.name

    async def _open(self) -> None:
        raise NotImplementedError

    async def _close(self) -> None:
        raise NotImplementedError

    async def _send(self, message: Message) -> None:
        """Publish one message and await the broker's confirm."""
        raise NotImplementedError

    async def _send_many(self, messages: list[Message]) -> list[BaseException | None]:
        """Publish ``messages`` (no two of one ordering key) and await the broker's
        confirms: each one's error, or None. By default concurrent `_send` calls;
        sinks whose client pipelines override it."""
        results = await asyncio.gather(*map(self._send, messages), return_exceptions=True)
        return [_failure(r) for r in results]

    def _may_have_landed(self, exc: BaseException) -> bool:
        """False when the outage ``exc`` stopped the publish before it was sent."""
        return True

    async def _published(self, message: Message, asked: float) -> bool:
        """True when the broker already holds ``message`` (sinks with a `_lookup`); what
        was read after ``asked`` (monotonic) is read again only if it does not say."""
        raise NotImplementedError

    def _is_outage(self, exc: BaseException) -> bool:
        """True when ``exc`` means the broker is out of reach, not that the event failed."""
        return isinstance(exc, (OSError, asyncio.TimeoutError, ConnectionError))

    def _destination_problem(self, destination: str) -> str | None:
        """Why the broker can never take ``destination`` (None: it can). Called once per
        destination (remembered), and on the template at construction."""
        return None

    def _message_problem(self, message: Message) -> str | None:
        """Why the broker would refuse ``message`` whatever the retries (None: it would not)."""
        return None

    def _refusal(self, exc: BaseException, message: Message) -> str | None:
        """The broker's reason when ``exc`` refuses ``message`` for good (None: ``exc`` is an
        outage or a failure worth retrying)."""
        return None


def _failure(result: object) -> BaseException | None:
    """A gathered result as `_send_many` returns it: the error, or None; a cancelled
    publish (its task cancelled, not the caller) is an error too."""
    if isinstance(result, Exception):
        return result
    if isinstance(result, BaseException):  # CancelledError of that one publish
        return TimeoutError(f"the publish was cancelled: {result!r}")
    return None


def _cloudevents_for(sink: Sink, format: str, source: str | None) -> Any:
    """The CloudEvents encoder of a sink's ``format`` (None: the default format)."""

    if check_format(format) == "outbox":
        if source is not None:
            raise InvalidArgument("cloudevents_source applies only to the cloudevents formats")
        return None
    return CloudEvents(
        sink.cloudevents_binding,
        structured=format == "cloudevents-structured",
        source=check_source(source) if source is not None else "/aiooutbox",
    )


def require(module: str, extra: str) -> Any:
    """Import an optional client library, or say which extra installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"this sink needs {module!r}: {install_hint(extra)} ({exception_message(exc)})"
        ) from exc
