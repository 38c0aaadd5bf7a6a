"""The names an outbox owns in its schema, checked before `migrate` creates one.

An outbox named ``events`` owns ``events`` and every name its migrations derive from
it (``events_done``, ``events_idle``, ``events_all``, ``events_migrations``, its
indexes). A second outbox in the same schema that takes one of them (``events_done``)
fails midway (its table clashes with the first's ring, or the first's next migration
clashes with it), leaving stray tables or an outbox stuck at an old version; so a new
outbox is refused before anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import asyncpg

from ..errors import InvalidArgument
from .statements import Queries

__all__ = ["refuse_taken_names", "suffixes"]

_DERIVED = re.compile(r"\{\{table\}\}(_[a-z0-9_]+)")
# relations of the schema with any of the names, and outboxes (their version tables)
_TAKEN = (
    "SELECT c.relname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n"
    " ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = ANY ($2::text[])"
    " ORDER BY 1"
)


def suffixes(templates: Iterable[str]) -> frozenset[str]:
    """The suffixes the migrations append to the table's name (``_done``, ...)."""
    return frozenset(m for text in templates for m in _DERIVED.findall(text))


async def refuse_taken_names(conn: asyncpg.Connection, q: Queries, derived: frozenset[str]) -> None:
    """Raise `InvalidArgument` if the new outbox ``q`` would take a name another object
    of its schema has, or is itself a name an existing outbox derives."""
    mine = sorted(q.table + s for s in derived)
    taken = [r[0] for r in await conn.fetch(_TAKEN, q.schema, mine)]
    if taken:
        raise InvalidArgument(
            f"cannot create the outbox {q.qualified}: schema {q.schema!r} already has "
            f"{', '.join(taken[:5])}, a name this outbox would use; choose another table name"
        )
    # is ``table`` one of an existing outbox's names? (that outbox has ``<base>_migrations``)
    bases = {q.table[: -len(s)] + "_migrations" for s in derived if q.table.endswith(s)}
    owners = [r[0] for r in await conn.fetch(_TAKEN, q.schema, sorted(bases))]
    if owners:
        owner = owners[0].removesuffix("_migrations")
        raise InvalidArgument(
            f"cannot create the outbox {q.qualified}: the outbox {q.schema}.{owner} uses the "
            f"name {q.table!r}; choose another table name"
        )
