"""The statements that start where a consumer's previous call left off (migration 0019).

A part of `Queries` (its base class) kept apart: the claim from each topic's low mark,
the idle probe from them, lease recovery from its lease mark. See docs/internals.md, "The
hot path", and `_engine.claim_window.Marks`.
"""

from __future__ import annotations

from .groups import first_due

__all__ = ["CLAIMED", "MarkStatements", "redelivered"]

# the mark of topic ``t`` (`next_available_marked`) as a position
_MARK = (
    "(CASE WHEN t.us IS NULL THEN '-infinity'"
    " ELSE 'epoch'::timestamptz + t.us * interval '1 microsecond' END, coalesce(t.id, 0))"
)


# The claim's columns as `ClaimedRow` reads them. ``created_at`` and ``available_at``
# come as epoch seconds: asyncpg decodes a float8 at a tenth of a timestamptz's cost
# (measured: 1.3 µs a row for the timestamptz, most of a claimed row's decoding), and
# ±infinity stays ±inf; the datetime of ``Event.created_at`` is made from it, exact to
# the microsecond for the years 1698 to 2242 (a float8's precision)
def _claimed(dedupe_key: str) -> str:
    return (
        f"c.id, c.topic, c.payload, {dedupe_key}, c.headers, c.attempts, c.max_attempts,"
        " date_part('epoch', c.created_at) AS created_at,"
        " date_part('epoch', c.available_at) AS available_at, c.message_id,"
        ' c.ordering_key, c.is_head, c.grp AS "group"'
    )


CLAIMED = _claimed("c.dedupe_key")
# the claim from marks: its marks row (a NULL id) carries the server's start time in the
# column it leaves empty (`Marks.update`)
_CLAIMED_WITH_SERVER = _claimed(
    "CASE WHEN c.id IS NULL THEN pg_postmaster_start_time()::text"
    " ELSE c.dedupe_key END AS dedupe_key"
)


def redelivered(schema: str, table: str) -> str:
    """Whether the claimed row ``c`` was claimed before: attempts > 1, or an ordered
    event whose attempt a requeue gave back, which left its error (since migration 0019
    an event's ``available_at`` moves when it is written, so it no longer tells); the
    function is called only for ordered rows on their first attempt."""
    return (
        "(CASE WHEN c.attempts > 1 THEN true WHEN c.ordering_key IS NULL THEN false"
        f' ELSE "{schema}"."{table}_requeued"(c.id) END)'
    )


class MarkStatements:
    """`Queries` supplies ``qualified``, ``open_writers`` and ``_function``."""

    @property
    def qualified(self) -> str:
        raise NotImplementedError

    @property
    def open_writers(self) -> str:
        raise NotImplementedError

    def _function(self, name: str) -> str:
        raise NotImplementedError

    @property
    def claim_marked(self) -> str:
        # the claim from each topic's low mark (migrations 0019, 0020, 0021): $1-$7 as `claim`,
        # with $3 never NULL, $8 each topic's mark as epoch microseconds (NULL: from the
        # start), $9 its id, $10 the position keys awaited, $11 the grace (s) before a
        # held key is awaited, $12 the group cursor and $13 the groups per claim (as
        # `claim_in_turn`), $14-$16 each topic's sweep of its groups (the group probed
        # last, NULL: a sweep starts; its lowest candidate's microseconds and id) and $17
        # the most groups probed per topic. The claimed rows, each with ``redelivered``,
        # then a row with a NULL id whose payload holds the new marks and sweeps and
        # whose dedupe_key the server's start time (`Marks.update`)
        return (
            f"SELECT {_CLAIMED_WITH_SERVER}, c.redelivered FROM {self._function('claim_v11')}"
            "($1, $2::float8, $3::text[], $4::int, $5::bigint, $6::int, $7::int,"
            " $8::bigint[], $9::bigint[], $10::bigint[], $11::float8, $12::text, $13::int,"
            " $14::text[], $15::bigint[], $16::bigint[], $17::int) AS c"
        )

    @property
    def recover_after(self) -> str:
        # `recover_expired` from the lease mark $2 (migration 0019)
        return (
            f"SELECT * FROM {self._function('requeue_v6')}(NULL, '{{}}', $1::int,"
            " 'lease expired: the worker stopped renewing it', $2::timestamptz)"
        )

    @property
    def lease_mark(self) -> str:
        # $1 the last lease mark, $2 margin (s), $3 the server start time $1 was read
        # on: the lease of the first row being processed from $1 (not locking), but
        # never later than now() - $2: a claim or heartbeat still running writes leases
        # later than that (now() + lease_timeout). On a server that started at another
        # time (a promoted standby, a restore, a restart) the rows may be older than
        # $1: the look starts from the start. Returns (mark, started).
        return (
            "SELECT least(now() - make_interval(secs => $2::float8), ("
            f" SELECT c.lease_expires_at FROM {self.qualified} AS c"
            "  WHERE c.lease_expires_at >= CASE WHEN pg_postmaster_start_time() ="
            "    $3::timestamptz THEN $1::timestamptz ELSE '-infinity' END"
            "   AND c.lease_expires_at < now() - make_interval(secs => $2::float8)"
            "   AND c.status = 'processing'"
            "  ORDER BY c.lease_expires_at LIMIT 1)), pg_postmaster_start_time()"
        )

    @property
    def next_available_marked(self) -> str:
        # `next_available` from each topic's low mark: $1 topics, $2 marks as epoch
        # microseconds (NULL: from the start), $3 ids, $4 the position keys the consumer
        # awaits. A key that has left pg_locks takes the marks back to 10 ms before it,
        # as the claim from marks does: its transaction may have committed after the
        # last claim read pg_locks, leaving rows behind the marks that no notification
        # announced (the insert found nobody idle)
        return (
            "SELECT extract(epoch FROM (min(greatest(n.at, now())) - now()))::float8 FROM ("
            " SELECT u.topic,"
            "  CASE WHEN u.us IS NOT NULL AND b.us <= u.us THEN b.us ELSE u.us END AS us,"
            "  CASE WHEN u.us IS NOT NULL AND b.us <= u.us THEN 0 ELSE u.id END AS id"
            " FROM unnest($1::text[], $2::bigint[], $3::bigint[]) AS u(topic, us, id)"
            " CROSS JOIN (SELECT (min(a.k) - 10) * 1000 AS us FROM unnest($4::bigint[]) AS a(k)"
            f"  WHERE NOT (a.k = ANY ({self._function('open_positions')}()))) AS b) AS t"
            f" CROSS JOIN LATERAL ({first_due(self.qualified, _MARK)}) AS n"
        )

    @property
    def idle_probe_marked(self) -> str:
        # `idle_probe` from the topics' low marks ($1-$4 as `next_available_marked`)
        return f"SELECT ({self.next_available_marked}) AS due, ({self.open_writers}) > 0 AS writers"
