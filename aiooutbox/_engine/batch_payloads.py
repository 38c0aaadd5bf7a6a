"""A batch's payloads decoded: all in one call when the default decoder can, else each
on its own, a refused one marked `Undecodable` for the batch to fail in its order."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread

from .._values.codec import Decoder, decode_json
from .executor import _THREAD_DECODE_CHARS
from .rows import ClaimedRow, getter

__all__ = ["Undecodable", "decode_all", "decode_each"]

_PAYLOAD = getter("payload")


class Undecodable:
    """A payload the decoder refused, with why: the batch records the row's failure
    (or gives the row back) in the batch's order (`BatchExecutor._events`)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def decode_all(rows: list[ClaimedRow]) -> list[Any] | None:
    """Every row's payload decoded by the default decoder in one call (stored jsonb
    text is always valid JSON; one call costs a fraction of one per row); None when a
    payload is large enough for a thread, or the decoder refused the whole."""
    texts = list(map(_PAYLOAD, rows))
    if max(map(len, texts), default=0) > _THREAD_DECODE_CHARS:
        return None
    try:
        payloads: list[Any] = decode_json("[" + ",".join(texts) + "]")
    except Exception:
        return None
    return payloads if len(payloads) == len(rows) else None


async def decode_each(rows: list[ClaimedRow], decode: Decoder) -> list[Any]:
    """Each row's payload decoded on its own (a decoder of the user's, a large payload
    in a thread); `Undecodable` for one the decoder refused. Nothing is recorded here."""
    payloads: list[Any] = []
    for row in rows:
        try:
            if len(row.payload) > _THREAD_DECODE_CHARS:
                payloads.append(await anyio.to_thread.run_sync(decode, row.payload))
            else:
                payloads.append(decode(row.payload))
        except anyio.get_cancelled_exc_class():
            raise  # the caller releases the rows
        except BaseException as exc:  # SystemExit and friends too: the batch stops the consumer
            payloads.append(Undecodable(exc))
    return payloads
