"""Rounds that alternate variants in one run, so that a shared machine's drift falls on
every variant alike: the orders, drains of each variant once a round, their medians,
and the fixture databases a scenario keeps across its rounds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from ..systems import aiooutbox_runner
from .bench import Bench
from .stats import median

T = TypeVar("T")


def alternated(items: Sequence[T], r: int) -> list[T]:
    """``items`` in order in even rounds, reversed in odd ones."""
    return list(items) if r % 2 == 0 else list(items)[::-1]


def rotated(items: Sequence[T], r: int, *, reverse_odd: bool = False) -> list[T]:
    """``items`` rotated by the round ``r`` (round r starts at item r); ``reverse_odd``:
    reversed in odd rounds too, as a rotation alone keeps every item after the same one."""
    shift = r % len(items)
    order = [*items[shift:], *items[:shift]]
    if reverse_odd and r % 2:
        order.reverse()
    return order


def median_rate(runs: list[dict[str, Any]], variant: str) -> float:
    """The median drain rate of ``variant``'s runs that had no error."""
    return median([r["rate"] for r in runs if r["variant"] == variant and "error" not in r])


async def drain_rounds(
    bench: Bench, rounds: int, variants: list[tuple[str, Any]], **drain: Any
) -> list[dict[str, Any]]:
    """Drain each variant once per round, the order rotating by round. A variant is
    (label, (system, n, loader, settings))."""
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        for label, (system, n, loader, settings) in rotated(variants, r):
            run = await bench.drain_once(
                system, n, settings, label=f"{label:14} ", loader=loader, **drain
            )
            run["variant"] = label
            runs.append({k: v for k, v in run.items() if k != "rss"})
    return runs


async def make_fixture(bench: Bench, name: str, *, patched: bool = True) -> aiooutbox_runner.System:
    """An aiooutbox database of the scenario's own (``<prefix><name>``), set up (with
    ``--sql-patch`` applied unless not ``patched``), and dropped with the run's."""
    sql_patch = bench.config.sql_patch if patched else None
    system = aiooutbox_runner.System(bench.admin_dsn, bench.prefix + name, sql_patch=sql_patch)
    bench.extra_systems.append(system)
    await system.setup()
    return system
