"""What a batch handler's result means, and the one log line of a batch's failures.

`check_result` reads the handler's return value: None, every event done; a mapping of
event ids (of this batch) to exception instances, those failed; anything else is
refused, logged with the topic and the handler, and every event of the batch fails with
a `TypeError` that says why (never a silent success).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import anyio

from .._values.text import describe_exception, safe_text
from ..errors import Retry
from .batches import Pool
from .rows import ClaimedRow

__all__ = ["check_result", "log_failures", "name_of", "repr_of"]

logger = logging.getLogger("aiooutbox.consumer")

_SHOWN_IDS = 20  # event ids named in a log line about a batch


def name_of(func: object) -> str:
    """A handler's name for a log line."""
    name = getattr(func, "__qualname__", None)
    return name if isinstance(name, str) else repr(func)


def repr_of(value: object) -> str:
    """``repr(value)`` cut short, never raising (user values)."""
    try:
        text = repr(value)
    except Exception:
        return f"<{type(value).__name__} object>"
    return safe_text(str.__str__(text), 120)


def check_result(
    pool: Pool, result: object, started: list[ClaimedRow]
) -> tuple[dict[int, BaseException] | None, BaseException | None, BaseException | None]:
    """The handler's mapping as (failures, None, a fatal one among them); or, when
    it is not a valid result, (None, the error every event fails with, None)."""
    failures: dict[int, BaseException] = {}
    fatal: BaseException | None = None
    try:
        what = _read(result, {row.id for row in started}, failures)
        if what is None:
            cancelled = anyio.get_cancelled_exc_class()
            fatal = next(
                (v for v in failures.values() if not isinstance(v, (Exception, cancelled))),
                None,
            )
    except Exception as exc:  # the user's objects raised while they were read
        what = f"returned a value that could not be read ({describe_exception(exc)})"
    if what is None:
        return failures, None, fatal
    message = (
        f"the batch handler {name_of(pool.handler.func)} for {pool.topic!r} {what}; it must "
        "return None (every event done) or a mapping of the failed events' ids (event.id) "
        "to exception instances, so every event of this batch is failed"
    )
    logger.error("%s", message, extra={"topic": pool.topic, "handler": name_of(pool.handler.func)})
    return None, TypeError(message), None


def _read(result: object, ids: set[int], failures: dict[int, BaseException]) -> str | None:
    """Fill ``failures`` from the handler's result, keyed by plain ints; None if the
    result is valid, else what is wrong with it. May raise (the user's objects)."""
    if not isinstance(result, Mapping):
        return f"returned {type(result).__name__} {repr_of(result)}"
    try:
        items = list(dict(result).items())
    except Exception as exc:
        return f"returned a mapping that could not be read ({describe_exception(exc)})"
    # an id is an int (`event.id`): not True, not 1.0, which would name event 1 too
    foreign = [k for k, _ in items if not isinstance(k, int) or isinstance(k, bool)]
    foreign += [k for k, _ in items if k not in foreign and int(k) not in ids]
    if foreign:
        shown = ", ".join(repr_of(k) for k in foreign[:_SHOWN_IDS])
        return f"named {len(foreign)} id(s) not in the batch: {shown}"
    odd = [(k, v) for k, v in items if not isinstance(v, BaseException)]
    if odd:
        k, v = odd[0]
        return (
            f"mapped {len(odd)} event(s) to values that are not exception instances "
            f"(event {k}: {repr_of(v)})"
        )
    failures.update((int(k), v) for k, v in items)
    return None


def log_failures(
    pool: Pool,
    started: list[ClaimedRow],
    counts: dict[str, int],
    failed: list[int],
    first: tuple[ClaimedRow, BaseException],
    *,
    whole: bool,
) -> None:
    row, exc = first
    summary = safe_text(describe_exception(exc), 500)
    what = "failed" if whole else f"had {len(failed)} failure(s), the first event {row.id}"
    then = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    unrun = (
        "; unrun: the later events of a failed event's key, back to waiting behind it"
        if counts["unrun"]
        else ""
    )
    extra = {
        "topic": pool.topic,
        "handler": name_of(pool.handler.func),
        "events": len(started),
        "event_ids": failed[:1000],
        "outcomes": {k: n for k, n in counts.items() if n},
    }
    level = logging.INFO if isinstance(exc, Retry) and not counts["dead"] else logging.WARNING
    logger.log(
        level,
        "batch of %d event(s) of %r %s: %s; %s%s (failed ids %s)",
        len(started),
        pool.topic,
        what,
        summary,
        then,
        unrun,
        ", ".join(map(str, failed[:_SHOWN_IDS])) + (" ..." if len(failed) > _SHOWN_IDS else ""),
        extra=extra,
    )
