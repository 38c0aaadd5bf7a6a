"""Publishing a batch of events: one result per event, each message sorted on its own.

A sink's batch handler (`Sink.publish_batch`) turns every event into its message, then
publishes them in **waves**: wave 0 holds every unordered event and the first event of
each ordering key in the batch, wave 1 the second event of each key, and so on. A wave
goes to the broker as one pipelined call of the sink (`Sink._send_many`: Kafka's
``send`` futures gathered, one Redis pipeline, JetStream publishes with their PubAcks
awaited together, RabbitMQ publishes with their confirms awaited together, webhook
requests side by side); the next wave starts once every message of this one has its
outcome. So a key's events reach the broker one after another, each only after the
broker confirmed the one before it, whatever the client or the broker do with
pipelined messages that fail: a failed one never has a later event of its key stored
before it. A key whose event failed (retried) holds its later events of the batch
back unpublished (`HeldBack`), as a consumer holds a key behind a failed head; a
refused (dead) event does not, unless the handler blocks its key (``on_dead="block"``).

A sink that can keep a key's order within one call (``_send_runs``: Kafka, whose record
batch is stored whole or not at all) gets the whole batch in one call instead of waves,
the events that failed before publishing and their keys' later events taken out; it
holds a key's later events back itself.

Within a wave every message is sorted on its own, as a single publish is: refused for
good (`Dead`), failed (the exception, retried by the consumer), or an outage: then the
messages the outage hit are published again, no attempt spent, after a pause that
doubles up to a second, until ``reconnect_wait`` has passed since the wave's first
outage. A message that may have reached the broker (the sink can read it back: Kafka,
Redis Streams) is looked up before it is published again, as is every event whose
attempt is not its first; the look-ups of a wave share one read of each place.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Protocol

from ..errors import Dead
from ..events import Event
from ._lookup import Lookup
from ._message import Message, ordering_key, shown

__all__ = ["HeldBack", "Publisher", "Window", "held_back", "publish"]

logger = logging.getLogger("aiooutbox.relay")

#: the first pause after an outage, and the longest
_PAUSE, _MAX_PAUSE = 0.05, 1.0


class HeldBack(Exception):
    """Not published: an earlier event of its ordering key in the same batch was not
    published, and is retried first (the key's order in the broker is kept)."""


class Window:
    """``max_in_flight``: publishes awaiting the broker's confirm at once, taken and
    given back by the message, first come first served."""

    __slots__ = ("_free", "_waiters", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = size
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    async def acquire(self, n: int) -> None:
        """Take ``n`` slots (at most ``size``), waiting for them in turn."""
        if not self._waiters and self._free >= n:
            self._free -= n
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, future)
        self._waiters.append(entry)
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():
                self.release(n)  # granted as the wait was cancelled: give them back
            else:
                with contextlib.suppress(ValueError):  # woken as it was cancelled
                    self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, n: int) -> None:
        self._free += n
        self._wake()

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters:
            n, future = waiters[0]
            if future.done():  # cancelled: never counted
                waiters.popleft()
            elif n <= self._free:
                waiters.popleft()
                self._free -= n
                future.set_result(None)
            else:
                return


class Publisher(Protocol):
    """What `publish` needs of a sink (`Sink` is one)."""

    @property
    def name(self) -> str: ...

    reconnect_wait: float
    republished: int
    found_published: int
    _lookup: Lookup | None
    _window: Window | None

    @property
    def started(self) -> bool: ...

    def _prepare(self, event: Event) -> Message: ...

    def _closed_error(self) -> BaseException: ...

    async def _send_many(self, messages: list[Message]) -> list[BaseException | None]: ...

    async def _published(self, message: Message, asked: float) -> bool: ...

    def _refusal(self, exc: BaseException, message: Message) -> str | None: ...

    def _is_outage(self, exc: BaseException) -> bool: ...

    def _may_have_landed(self, exc: BaseException) -> bool: ...

    def _note_outage(self, exc: BaseException, now: float) -> None: ...

    def _note_back(self) -> None: ...


class _Item:
    """One event of the batch on its way: its message, or why it has none."""

    __slots__ = ("error", "event", "key", "look", "message")

    def __init__(self, event: Event, message: Message | None, error: BaseException | None):
        self.event = event
        self.message = message
        self.error = error
        self.key = ordering_key(event)
        self.look = False


async def publish(
    sink: Publisher, events: Sequence[Event], *, hold_after_dead: bool = False
) -> dict[int, BaseException] | None:
    """Publish ``events``; None when every one is in the broker, else the failed ones'
    exceptions by event id (`Dead` for a refusal, `HeldBack` for those held behind an
    earlier event of their key). Raises only when the sink is not started."""
    if not sink.started:
        raise sink._closed_error()
    failures: dict[int, BaseException] = {}
    readable = sink._lookup is not None
    if len(events) <= 1:  # the per-event handler's call: no waves to make
        for event in events:
            try:
                item = _Item(event, sink._prepare(event), None)
            except Exception as exc:
                failures[event.id] = exc
            else:
                item.look = readable and (event.attempts > 1 or event.redelivered)
                await _wave(sink, [item], failures)
        return failures or None
    items = []
    for event in events:
        try:
            item = _Item(event, sink._prepare(event), None)
        except Exception as exc:  # refused before publishing (Dead), or a bad event
            item = _Item(event, None, exc)
        else:
            item.look = readable and (event.attempts > 1 or event.redelivered)
        items.append(item)
    if getattr(sink, "_send_runs", None) is not None:  # a key's events in one call
        await _wave(sink, _runs(items, failures, hold_after_dead), failures, hold_after_dead)
        return failures or None
    waves: list[list[_Item]] = [[]]
    depth: dict[str, int] = {}
    for item in items:
        level = 0
        if item.key is not None:
            level = depth.get(item.key, 0)
            depth[item.key] = level + 1
            if level == len(waves):
                waves.append([])
        waves[level].append(item)
    if len(waves) == 1 and not any(item.error for item in waves[0]):  # nothing to hold back
        await _wave(sink, waves[0], failures)
        return failures or None
    blocked: set[str] = set()
    for wave in waves:
        ready = []
        for item in wave:
            if item.key is not None and item.key in blocked:
                failures[item.event.id] = held_back(item.key)
            elif item.error is not None:
                failures[item.event.id] = item.error
            else:
                ready.append(item)
        if ready:
            await _wave(sink, ready, failures)
        for item in wave:
            error = failures.get(item.event.id)
            held = error is not None and (hold_after_dead or not isinstance(error, Dead))
            if held and item.key is not None:
                blocked.add(item.key)
    return failures or None


def _runs(
    items: list[_Item], failures: dict[int, BaseException], hold_after_dead: bool
) -> list[_Item]:
    """The items to publish in one call, in order: all but those that failed before
    publishing and the later events of their keys (`HeldBack`)."""
    blocked: set[str] = set()
    ready = []
    for item in items:
        key = item.key
        if key is not None and key in blocked:
            failures[item.event.id] = held_back(key)
        elif item.error is not None:
            failures[item.event.id] = item.error
            if key is not None and (hold_after_dead or not isinstance(item.error, Dead)):
                blocked.add(key)
        else:
            ready.append(item)
    return ready


def held_back(key: str) -> HeldBack:
    """The outcome of a key's event left unpublished behind an earlier one that failed."""
    return HeldBack(
        f"not published: an earlier event of ordering key {key!r} in the same batch was "
        "not published"
    )


async def _wave(
    sink: Publisher,
    items: list[_Item],
    failures: dict[int, BaseException],
    hold_after_dead: bool = False,
) -> None:
    """Publish ``items`` (no two of one key, unless the sink takes a key's events in
    one call: `_send_runs`) until each has its outcome."""
    deadline: float | None = None
    pause = _PAUSE
    todo = items
    while True:
        if not sink.started:
            closed = sink._closed_error()
            for item in todo:
                failures[item.event.id] = closed
            return
        outcomes: list[tuple[_Item, BaseException | None]] = []
        fresh = todo
        if any(item.look for item in todo):
            fresh = await _look_up(sink, todo, outcomes)
        if fresh:
            sent = await _send(sink, fresh, hold_after_dead)
            outcomes += zip(fresh, sent, strict=True)
        again: list[tuple[_Item, BaseException]] = []
        landed = False
        for item, result in outcomes:
            if result is None:
                landed = True
                continue
            message = item.message
            assert message is not None
            reason = sink._refusal(result, message)
            if reason is not None:
                dead = Dead(
                    f"{sink.name} refused the message for {shown(message.destination)}: {reason}"
                )
                dead.__cause__ = result
                failures[item.event.id] = dead
            elif not sink._is_outage(result):
                failures[item.event.id] = result
            else:
                again.append((item, result))
        if landed:
            sink._note_back()
        if not again:
            return
        now = time.monotonic()
        if deadline is None:
            deadline = now + sink.reconnect_wait
        if now >= deadline:
            for item, error in again:
                failures[item.event.id] = error
            return
        sink._note_outage(again[0][1], now)
        await asyncio.sleep(min(pause, deadline - now))
        pause = min(pause * 2, _MAX_PAUSE)
        sink.republished += len(again)
        for item, error in again:
            # a lost publish may have landed: look before publishing it again
            item.look = item.look or (sink._lookup is not None and sink._may_have_landed(error))
        todo = [item for item, _ in again]


async def _look_up(
    sink: Publisher, todo: list[_Item], outcomes: list[tuple[_Item, BaseException | None]]
) -> list[_Item]:
    """Look the items that may be in the broker already up; those found are done (no
    outcome), a failed look-up is an outcome (made again after an outage), for the
    later items of its key too; the rest, to publish, are returned."""
    fresh: list[_Item] = []
    stalled: dict[str, BaseException] = {}  # keys whose look-up failed: not published now
    asked = time.monotonic()  # every look-up of this pass is served by one read
    for item in todo:
        message = item.message
        assert message is not None
        if item.key is not None and item.key in stalled:
            outcomes.append((item, stalled[item.key]))
            continue
        if item.look:
            try:
                found = await sink._published(message, asked)
            except Exception as exc:
                outcomes.append((item, exc))
                if item.key is not None:
                    stalled[item.key] = exc
                continue
            if found:
                sink.found_published += 1
                logger.debug(
                    "%s sink: message %s is already in %s; not publishing it again",
                    sink.name,
                    message.message_id,
                    shown(message.destination),
                )
                continue
            item.look = False
        fresh.append(item)
    return fresh


async def _send(
    sink: Publisher, items: list[_Item], hold_after_dead: bool
) -> list[BaseException | None]:
    """The items' messages through the sink's pipelined call, within its
    ``max_in_flight``; a call that fails as a whole fails every message with it. A
    sink that takes a key's events in one call (`_send_runs`) gets them in calls of at
    most ``max_in_flight``, one after another: a key's events after one that failed in
    an earlier call are held back."""
    messages: list[Message] = [item.message for item in items]  # type: ignore[misc]
    runs = getattr(sink, "_send_runs", None)
    window = sink._window
    if window is None:
        try:
            if runs is not None:
                return await runs(messages, hold_after_dead)  # type: ignore[no-any-return]
            return await sink._send_many(messages)
        except Exception as exc:
            return [exc] * len(messages)
    results: list[BaseException | None] = []
    failed: set[str] = set()
    for start in range(0, len(messages), window.size):
        chunk = messages[start : start + window.size]
        held: dict[int, BaseException] = {}
        if failed:  # a key failed in an earlier call: its later events are held back
            for i, message in enumerate(chunk):
                if message.key is not None and message.key in failed:
                    held[i] = held_back(message.key)
            chunk = [m for i, m in enumerate(chunk) if i not in held]
        await window.acquire(len(chunk))
        try:
            if runs is not None:
                sent = await runs(chunk, hold_after_dead)
            else:
                sent = await sink._send_many(chunk)
        except Exception as exc:
            sent = [exc] * len(chunk)
        finally:
            window.release(len(chunk))
        got = iter(sent)
        for i in range(len(chunk) + len(held)):
            results.append(held[i] if i in held else next(got))
        if runs is not None:
            for message, error in zip(chunk, sent, strict=True):
                if (
                    error is not None
                    and message.key is not None
                    and (hold_after_dead or sink._refusal(error, message) is None)
                ):
                    failed.add(message.key)
    return results
