"""The insertion order of an `enqueue_many` batch, as docs/producers.md states it.

Ids follow the insertion order, so reading them back shows it: unordered rows with a
dedupe key (sorted by it), then rows with an ordering key (grouped by key, keys sorted,
input order within a key), then unordered keyless rows in input order.
"""

from __future__ import annotations

from pathlib import Path

import asyncpg

import aiooutbox
from aiooutbox import NewEvent

DOC = Path(__file__).resolve().parent.parent / "docs" / "producers.md"


async def test_a_batch_is_inserted_in_the_documented_groups(conn: asyncpg.Connection) -> None:
    batch = [
        NewEvent("t", {"i": 0}),  # keyless, unordered
        NewEvent("t", {"i": 1}, ordering_key="k-b"),
        NewEvent("t", {"i": 2}, dedupe_key="d-z"),
        NewEvent("t", {"i": 3}, ordering_key="k-a", dedupe_key="d-a"),
        NewEvent("t", {"i": 4}),
        NewEvent("t", {"i": 5}, ordering_key="k-b"),
        NewEvent("t", {"i": 6}, dedupe_key="d-m"),
        NewEvent("t", {"i": 7}, ordering_key="k-a"),
    ]
    ids = await aiooutbox.enqueue_many(conn, batch)
    assert None not in ids
    inserted = [i for _, i in sorted((id_, n) for n, id_ in enumerate(ids) if id_ is not None)]
    # dedupe-keyed unordered by key; ordering key k-a then k-b, input order within;
    # keyless unordered last, in input order
    assert inserted == [6, 2, 3, 7, 1, 5, 0, 4], inserted

    text = " ".join(DOC.read_text(encoding="utf-8").split())
    assert "sorted by dedupe key, keyless rows last" not in text
    assert "grouped by that key (keys in sorted order) and in input order within each key" in (text)
    assert "`unnest` of nine arrays" in text
