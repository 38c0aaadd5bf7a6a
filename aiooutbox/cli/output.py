"""Plain-text rendering for the command line: tables, ages, the stats and dead-letter views.

Text read from the database (topics, errors, worker names) is shown with control
characters escaped (`safe`): a stored escape sequence never reaches the terminal.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .._engine.options import ConsumerOptions
from .._engine.watchdog import MvccReport
from ..admin import STATUSES, DeadEvent, OutboxStats

__all__ = ["age", "databases_view", "dead_table", "duration", "safe", "stats_view", "table"]

# C0 and C1 controls, DEL, line and paragraph separators, and the bidirectional marks,
# embeddings, overrides and isolates (which reorder the text around them)
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe(text: str, *, lines: bool = False) -> str:
    """``text`` with every terminal-affecting character escaped (``\\x1b``,
    ``\\u202e``); with ``lines``, newlines are kept."""
    if lines:
        return "\n".join(_UNSAFE.sub(_escape, line) for line in text.split("\n"))
    return _UNSAFE.sub(_escape, text)


def age(seconds: float | None) -> str:
    """``0.42s``, ``12s``, ``3m12s``, ``2h05m``, ``3d04h``; ``-`` for ``None``."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{max(seconds, 0.0):.2g}s" if seconds < 1 else f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def duration(seconds: float) -> str:
    """A duration as the largest unit that divides it: ``7d``, ``12h``, ``90s``, ``0.5s``."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to fit; numbers (estimates ``≈N`` too) right-aligned, text
    left-aligned."""
    cells = [[safe(str(c)) for c in row] for row in rows]
    numeric = [all(_number(row[i]) for row in rows) if rows else False for i in range(len(headers))]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        padded = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(padded).rstrip()

    return "\n".join([line(list(headers)), *(line(r) for r in cells)])


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, str) and value[:1] == "≈")


def _first_line(text: str | None, width: int) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else "-"
    return line if len(line) <= width else line[: width - 3] + "..."


def _counts(report: OutboxStats, counts: dict[str, int]) -> list[object]:
    """A row's counts by status; estimated ones marked ``≈``."""
    return [
        f"≈{counts[s]}" if s == "done" and report.done_estimated else counts[s] for s in STATUSES
    ]


def stats_view(report: OutboxStats, *, hint: str = "") -> str:
    """The ``stats`` command's text output."""
    parts = [f"outbox {report.outbox}", ""]
    if not report.topics:
        parts.append("no events")
    else:
        rows: list[list[object]] = [
            [t.topic, *_counts(report, t.counts), age(t.lag)] for t in report.topics
        ]
        rows.append(["(all topics)", *_counts(report, report.totals), age(report.lag)])
        parts.append(table(["TOPIC", *(s.upper() for s in STATUSES), "LAG"], rows))
        if report.done_estimated:
            parts.append(
                "≈: estimated (past 50,000 done rows: the planner's row count less the"
                " exact others, shared by a sample); every other count is exact"
            )
    parts.append("")
    if report.in_flight:
        parts.append(
            table(
                ["IN FLIGHT BY WORKER", "ROWS", "OLDEST CLAIM"],
                [[w.worker, w.rows, age(w.oldest_claim_age) + " ago"] for w in report.in_flight],
            )
        )
    else:
        parts.append("in flight: none")
    lag = (
        "nothing waiting"
        if report.lag is None
        else f"oldest claimable event waited {age(report.lag)}"
    )
    dead = f"dead: {report.dead}"
    if report.dead:
        dead += f" (python -m aiooutbox dead list{hint})"
    parts += [f"lag: {lag}", dead]
    if report.paused:
        shown = "every topic" if report.paused == ["*"] else ", ".join(map(safe, report.paused))
        parts.append(f"paused: {shown} (python -m aiooutbox topics{hint})")
    for c in report.controls:
        if c.limited:
            limits = [f"max running {c.max_running}"] if c.max_running is not None else []
            if c.rate_text is not None:
                limits.append(f"rate {c.rate_text} (burst {c.burst:g})")
            parts.append(f"limited: {safe(c.topic)}: {', '.join(limits)}")
    for u in report.unconsumed:
        parts.append(
            f"warning: {safe(u.topic)}: {u.waiting} event(s) waiting up to {age(u.lag)} and "
            "no consumer seen handling the topic (none holds its events, none idle advertises "
            "it): run one with a handler for it"
        )
    for b in report.blocked_keys:
        why = (
            f"dead, blocking its key (retry or purge event {b.head_id} to move on)"
            if b.status == "dead"
            else f"failing, attempt {b.attempts}, next try {b.available_at:%H:%M:%S}"
        )
        parts.append(
            f"blocked key {b.ordering_key!r}: head event {b.head_id} ({safe(b.topic)}) {why}; "
            f"{b.waiting} event(s) waiting behind it"
        )
    if report.mvcc is not None:
        parts += _mvcc_lines(report.mvcc)
    return safe("\n".join(parts), lines=True)  # the session names of the mvcc lines too


def databases_view(reports: Sequence[tuple[str, OutboxStats | str]], *, hint: str = "") -> str:
    """``stats`` over several databases: one row per database (counts by status, its
    lag), then the warnings of each; a database that could not be read shows dashes."""
    rows: list[list[object]] = []
    notes: list[str] = []
    for name, report in reports:
        if isinstance(report, str):
            rows.append([name, *("-" for _ in STATUSES), "-"])  # why: on stderr
            continue
        rows.append([name, *_counts(report, report.totals), age(report.lag)])
        if report.dead:
            notes.append(f"{name}: {report.dead} dead (python -m aiooutbox dead list{hint})")
        notes += [f"{name}: warning: {safe(u.topic)}: {u.waiting} event(s) waiting up to "
                  f"{age(u.lag)} and no consumer seen handling the topic"
                  for u in report.unconsumed]  # fmt: skip
        notes += [f"{name}: blocked key {b.ordering_key!r}: head event {b.head_id} "
                  f"({safe(b.topic)}) {b.status}; {b.waiting} event(s) waiting behind it"
                  for b in report.blocked_keys]  # fmt: skip
    found = [r for _, r in reports if not isinstance(r, str)]
    if found:
        lags = [r.lag for r in found if r.lag is not None]
        rows.append(
            [
                "(all databases)",
                *(sum(r.totals[s] for r in found) for s in STATUSES),
                age(max(lags) if lags else None),
            ]
        )
    text = table(["DATABASE", *(s.upper() for s in STATUSES), "LAG"], rows)
    return safe("\n".join([text, *(["", *notes] if notes else [])]), lines=True)


def _mvcc_lines(mvcc: MvccReport) -> list[str]:
    """The watchdog's view: dead tuples, the horizon's oldest holder, warnings past the
    consumers' default thresholds."""
    lines = []
    if mvcc.dead_tuples is not None:
        vacuumed = (
            mvcc.last_vacuum.astimezone().strftime("%Y-%m-%d %H:%M:%S")
            if (mvcc.last_vacuum)
            else "never"
        )
        lines.append(
            f"dead tuples: {mvcc.dead_tuples} (live {mvcc.live_tuples}, last vacuum {vacuumed})"
        )
    if not mvcc.holders:
        lines.append("xmin horizon: held by no other session")
        return lines
    lines.append(f"xmin horizon: oldest holder {mvcc.holders[0].describe()}")
    defaults = ConsumerOptions()
    for holder in mvcc.holders:
        if holder.pins(defaults.horizon_warning):
            lines.append(
                f"warning: the xmin horizon is held by {holder.describe()}: vacuum cannot "
                "remove the outbox's dead rows while it lasts (docs/deployment.md)"
            )
    if mvcc.dead_tuples is not None and mvcc.dead_tuples >= defaults.dead_tuples_warning:
        lines.append(
            f"warning: {mvcc.dead_tuples} dead tuples in the outbox table: check the "
            "horizon and autovacuum (docs/deployment.md)"
        )
    return lines


def dead_table(events: Sequence[DeadEvent], *, error_width: int = 70) -> str:
    """The ``dead list`` command's text output."""
    if not events:
        return "no dead events"
    return table(
        ["ID", "TOPIC", "ATTEMPTS", "DIED", "LAST ERROR"],
        [
            [
                e.id,
                e.topic,
                f"{e.attempts}/{e.max_attempts}",
                e.finished_at.astimezone().strftime("%Y-%m-%d %H:%M:%S") if e.finished_at else "-",
                _first_line(e.last_error, error_width),
            ]
            for e in events
        ],
    )
