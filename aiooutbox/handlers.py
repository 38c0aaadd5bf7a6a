"""Handler registration: a plain mapping, or a `Router` with per-topic options.

A handler takes one event (``async def handler(event)``), or, registered with
``batch=N`` (`Handler(fn, batch=N)`, `Router.batch`), a list of up to N events of its
topic (``async def handler(events)``) and says which of them failed (docs/batches.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from ._values.callables import is_async_callable
from ._values.limits import check_count, check_seconds, check_topic_name
from .errors import InvalidArgument
from .events import Event
from .retry import RetryPolicy

__all__ = [
    "ALL_TOPICS",
    "MAX_BATCH",
    "MAX_LINGER",
    "BatchHandlerFunc",
    "Handler",
    "HandlerFunc",
    "Router",
    "resolve_handlers",
]

#: register a handler under this topic to handle every topic that has no handler of
#: its own; the consumer then claims every topic in the outbox (what relays do)
ALL_TOPICS = "*"

#: the most events one call of a batch handler may be given, and its longest linger
MAX_BATCH = 100_000
MAX_LINGER = 60.0

HandlerFunc = Callable[[Event], Awaitable[Any]]
#: ``async def handler(events: list[Event]) -> None | Mapping[int, BaseException]``:
#: None when every event is done, else the failed events' ids mapped to why they failed
BatchHandlerFunc = Callable[[list[Event]], Awaitable[Any]]
F = TypeVar("F", bound=HandlerFunc)
B = TypeVar("B", bound=BatchHandlerFunc)


@dataclass(frozen=True)
class Handler:
    """A handler with per-topic options; `None` means "use the consumer's default".

    ``batch=N`` makes ``func`` a batch handler: it is called with a list of up to N
    claimed events of its topic and returns None (every event done) or a mapping of
    the failed events' ids to exceptions (docs/batches.md). ``linger`` (seconds, batch
    handlers only) lets a call wait up to that long for a batch to fill; 0 calls it at
    once with what is there.

    Checked when it is made: a function that is not async or an option out of range
    raises there (`TypeError`, `InvalidArgument`), and a ``timedelta`` becomes seconds.
    """

    #: a `HandlerFunc`, or with ``batch`` a `BatchHandlerFunc`
    func: Callable[[Any], Awaitable[Any]]
    retry: RetryPolicy | None = None
    #: for a batch handler: the whole call's limit
    timeout: float | None = None
    #: what a dead ordered event does to its key: "skip" (the key moves on to its next
    #: event, as SQS FIFO does) or "block" (the key waits until an operator retries or
    #: purges the dead event); unordered events are unaffected
    on_dead: Literal["skip", "block"] = "skip"
    #: None: ``func`` takes one event; N: it takes a list of up to N events
    batch: int | None = None
    linger: float = 0.0

    def __post_init__(self) -> None:
        _check_func(self.func, self.batch, "the handler")
        options = (self.retry, self.timeout, self.on_dead, self.batch, self.linger)
        for name, value in _checked_options(*options, "").items():
            object.__setattr__(self, name, value)  # frozen: a timedelta made seconds


class Router(Mapping[str, Handler]):
    """Collects handlers with a decorator:

    ```python
    router = aiooutbox.Router()

    @router.handler("orders.created", timeout=10)
    async def send_confirmation(event: aiooutbox.Event) -> None: ...
    ```
    """

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}

    def handler(
        self,
        topic: str,
        *,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        on_dead: Literal["skip", "block"] = "skip",
    ) -> Callable[[F], F]:
        def register(func: F) -> F:
            self.add(topic, func, retry=retry, timeout=timeout, on_dead=on_dead)
            return func

        return register

    def batch(
        self,
        topic: str,
        *,
        size: int,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        on_dead: Literal["skip", "block"] = "skip",
        linger: float = 0.0,
    ) -> Callable[[B], B]:
        """Register a batch handler, called with a list of up to ``size`` events:

        ```python
        @router.batch("orders.created", size=500)
        async def publish(events: list[aiooutbox.Event]) -> None: ...
        ```
        """

        def register(func: B) -> B:
            self._add(topic, _made(topic, func, retry, timeout, on_dead, size, linger))
            return func

        return register

    def add(
        self,
        topic: str,
        func: HandlerFunc,
        *,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        on_dead: Literal["skip", "block"] = "skip",
    ) -> None:
        self._add(topic, _made(topic, func, retry, timeout, on_dead))

    def _add(self, topic: str, handler: Handler) -> None:
        if topic in self._handlers:
            raise InvalidArgument(f"topic {topic!r} already has a handler")
        self._handlers[topic] = handler

    def __getitem__(self, topic: str) -> Handler:
        return self._handlers[topic]

    def __iter__(self) -> Iterator[str]:
        return iter(self._handlers)

    def __len__(self) -> int:
        return len(self._handlers)


def _check_topic(topic: object) -> None:
    if not isinstance(topic, str):
        raise TypeError(f"handler topics must be str, got {topic!r}")
    check_topic_name(topic, "handler topic")


def _check_func(func: object, batch: object, what: str) -> None:
    if not callable(func) or not is_async_callable(func):
        shape = "handler(event) -> None" if batch is None else "handler(events) -> None"
        raise TypeError(f"{what} must be an async function (async def {shape}), got {func!r}")


def _checked_options(
    retry: object, timeout: object, on_dead: object, batch: object, linger: object, where: str
) -> dict[str, float]:
    """Refuse a handler's options out of range; return those made seconds (a
    ``timedelta``, an int). ``where`` names its topic in the messages, if known."""
    made: dict[str, float] = {}
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise TypeError(f"retry{where} must be a RetryPolicy, got {retry!r}")
    if timeout is not None:
        # the same bounds as the consumer's handler_timeout
        seconds = check_seconds(f"timeout{where}", timeout, minimum=0.001)
        if type(timeout) is not float:
            made["timeout"] = seconds
    if on_dead not in ("skip", "block"):
        raise InvalidArgument(f"on_dead{where} must be 'skip' or 'block', got {on_dead!r}")
    if batch is not None:
        check_count(f"batch{where}", batch, 1, MAX_BATCH)
    if type(linger) is not float or linger != 0.0:
        seconds = check_seconds(f"linger{where}", linger, maximum=MAX_LINGER)
        if batch is None and seconds:
            raise InvalidArgument(
                f"linger{where} applies to batch handlers only (Handler(fn, batch=N, linger=...))"
            )
        if type(linger) is not float:
            made["linger"] = seconds
    return made


def _made(
    topic: object,
    func: Any,
    retry: RetryPolicy | None = None,
    timeout: float | None = None,
    on_dead: Literal["skip", "block"] = "skip",
    batch: int | None = None,
    linger: float = 0.0,
) -> Handler:
    """``Handler(func, ...)`` registered for ``topic``: its errors name the topic."""
    _check_topic(topic)
    where = f" for {topic!r}"
    _check_func(func, batch, f"the handler{where}")
    _checked_options(retry, timeout, on_dead, batch, linger, where)
    return Handler(func, retry, timeout, on_dead, batch, linger)


class _Resolved(dict[str, Handler]):
    """What `resolve_handlers` returns; given one again, it returns it unchecked."""


def resolve_handlers(handlers: object) -> dict[str, Handler]:
    """Validate a mapping of topic to async function or `Handler`; raise on misuse.

    The web integrations, `run_consumer` and `OutboxConsumer.run` each accept raw
    handlers, so each calls this; the first call does the work, the others see its
    result and return it as it is.
    """
    if isinstance(handlers, _Resolved):
        return handlers
    if not isinstance(handlers, Mapping):
        raise TypeError(
            "handlers must be a mapping of topic to async handler (or an aiooutbox.Router), "
            f"not {type(handlers).__name__}"
        )
    if not handlers:
        raise InvalidArgument("handlers is empty: register at least one topic")
    resolved = _Resolved()
    for topic, value in handlers.items():
        _check_topic(topic)
        # a `Handler` was checked when it was made; a function is made one here
        resolved[topic] = value if isinstance(value, Handler) else _made(topic, value)
    return resolved
