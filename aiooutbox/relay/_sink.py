"""`Sink`: the handler every relay is, and the one message format all brokers get.

A sink is an async callable taking an `Event`, so it runs under a consumer like any
handler (leases, retries, dead, per-key order, observers). Its whole job per event is
"publish, await the broker's confirm, return": the consumer then settles the row
``done`` only after the broker holds the message, and runs many sinks' calls at once
(its ``concurrency``) for throughput.

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
import logging
import time
from datetime import timedelta
from types import TracebackType
from typing import Any, ClassVar

from .._values.limits import check_seconds
from .._values.text import describe_exception, exception_message
from ..errors import Dead, InvalidArgument, OutboxError
from ..events import Event
from ._cloudevents import CloudEvents, check_format, check_source
from ._lookup import Lookup
from ._message import (
    Message,
    check_template,
    render_destination,
    shown,
)

__all__ = ["BrokerUnavailable", "Message", "Sink", "SinkClosed", "render_destination"]

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

    ``async with NatsSink(...) as sink: await consumer.run({"*": sink})``, or call
    `start` and `close` yourself. A sink can be started once; closing it twice is fine.

    ``max_in_flight`` bounds the publishes awaiting the broker's confirm at once
    (``None``: only the consumer's ``concurrency`` does). With a consumer
    ``concurrency`` above it, claimed events queue for a publish slot, so a claim in
    progress never leaves the broker's window empty (measured: the relay kept ~100 of
    256 publishes in flight while it waited for claims, docs/benchmarks.md).
    ``format="cloudevents"`` publishes each event as a CloudEvent in the broker's binding
    (``"cloudevents-structured"``: the whole event as JSON in the body), with
    ``cloudevents_source`` as its ``source`` (see `relay._cloudevents`).
    Subclasses implement ``_open``, ``_close``, ``_send`` and ``_is_outage``, and tell
    the broker's permanent refusals with ``_destination_problem``, ``_message_problem``
    (checked before publishing) and ``_refusal`` (the broker's answer).
    """

    name: ClassVar[str] = "sink"
    #: the CloudEvents protocol binding of the broker (None: structured, no binding)
    cloudevents_binding: ClassVar[str | None] = None

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
        self._window = asyncio.Semaphore(max_in_flight) if max_in_flight else None
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

    # -- the handler ------------------------------------------------------------------
    async def __call__(self, event: Event) -> None:
        """Publish ``event`` and return once the broker confirmed it; raise `Dead` with the
        broker's reason when it refuses the event for good."""
        message = self._message(event)
        if self._cloudevents is not None:
            message = self._cloudevents.message(message)
        self._check(message)
        deadline: float | None = None
        pause = 0.05
        # not the event's first attempt: an earlier one may have reached the broker
        look = (event.attempts > 1 or event.redelivered) and self._lookup is not None
        while True:
            if self._state is not _State.OPEN:
                raise SinkClosed(f"{self.name} sink is {self._state.value}; start it first")
            try:
                if look:
                    if await self._published(message):
                        self.found_published += 1
                        logger.debug(
                            "%s sink: message %s is already in %s; not publishing it again",
                            self.name,
                            message.message_id,
                            shown(message.destination),
                        )
                        return
                    look = False
                if self._window is None:
                    await self._send(message)
                else:
                    async with self._window:
                        await self._send(message)
            except Exception as exc:
                reason = self._refusal(exc, message)
                if reason is not None:
                    raise Dead(
                        f"{self.name} refused the message for {shown(message.destination)}: "
                        f"{reason}"
                    ) from exc
                if not self._is_outage(exc):
                    raise
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.reconnect_wait
                if now >= deadline:
                    raise
                self._note_outage(exc, now)
                await asyncio.sleep(min(pause, deadline - now))
                pause = min(pause * 2, 1.0)
                self.republished += 1
                # a look-up that failed is made again; a lost publish may have landed:
                # look before publishing it again
                look = look or (self._lookup is not None and self._may_have_landed(exc))
                continue
            if self._outage_since is not None:
                logger.info(
                    "%s sink: publishing again after %.1fs",
                    self.name,
                    time.monotonic() - self._outage_since,
                )
                self._outage_since = None
            return

    def _message(self, event: Event) -> Message:
        return Message.of(event, self.destination)

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
        raise NotImplementedError

    def _may_have_landed(self, exc: BaseException) -> bool:
        """False when the outage ``exc`` stopped the publish before it was sent."""
        return True

    async def _published(self, message: Message) -> bool:
        """True when the broker already holds ``message`` (sinks with a `_lookup`)."""
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
            f"this sink needs {module!r}: pip install 'aiooutbox[{extra}]' "
            f"({exception_message(exc)})"
        ) from exc
