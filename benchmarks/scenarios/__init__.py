"""The scenarios of ``python -m benchmarks``, one module each, and the one place they are
registered: `SCENARIOS` (the ``--only`` names, in the order ``--help`` lists them) and
`Config` (every scenario's sizes beside the run's own). benchmarks/README.md says how to
add one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..harness import config as harness
from ..harness.bench import Bench
from ..harness.scenario import Scenario
from . import (
    dashboard,
    drain,
    drivers,
    fairness,
    flow,
    history,
    horizon,
    isolation,
    observe,
    ordering,
    producers,
    references,
    relay,
    retention,
    steady,
    tax,
    upgrade,
    wakeup,
)
from .steady import latency_grew

__all__ = ["SCENARIOS", "Bench", "Config", "latency_grew"]

SCENARIOS: tuple[Scenario[Bench], ...] = (
    drain.SCENARIO,
    history.SCENARIO,
    steady.SCENARIO,
    wakeup.SCENARIO,
    producers.SCENARIO,
    drivers.SCENARIO,
    observe.SCENARIO,
    ordering.SCENARIO,
    isolation.SCENARIO,
    flow.SCENARIO,
    fairness.SCENARIO,
    relay.SCENARIO,
    references.SCENARIO,  # the bare loop, PgQueuer, awa-pg and procrastinate side by side
    tax.SCENARIO,  # the producer's tax beside three baseline consumers, the trigger taken apart
    retention.SCENARIO,  # only with --only: 10M done rows by default (--retention-rows)
    upgrade.SCENARIO,  # only with --only: migrate 10M pending rows from 17 (--upgrade-rows)
    dashboard.SCENARIO,  # only with --only: it builds a 10M-row database (minutes)
    dashboard.DRAIN_ONLY,  # only with --only: the drain with a dashboard open, alone
    horizon.SCENARIO,  # only with --only: free vs pinned soaks on a private cluster (an hour)
    horizon.RETENTION,  # only with --only: sizes under retention, free vs pinned (an hour)
)
BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}


def default_run() -> list[str]:
    """What a run without --only runs, less the scenarios that need the machine's
    brokers (`__main__.config_from` adds them, last)."""
    return [s.name for s in SCENARIOS if s.default and not s.brokers]


@dataclass
class Config(
    harness.HarnessConfig,
    drain.Sizes,
    history.Sizes,
    steady.Sizes,
    producers.Sizes,
    drivers.Sizes,
    observe.Sizes,
    ordering.Sizes,
    isolation.Sizes,
    flow.Sizes,
    fairness.Sizes,
    relay.Sizes,
    references.Sizes,
    tax.Sizes,
    retention.Sizes,
    upgrade.Sizes,
    dashboard.Sizes,
    horizon.Sizes,
):
    """Every size and duration of a run; `default`, `quick` and the smoke test differ."""

    scenarios: list[str] = field(default_factory=default_run)

    @classmethod
    def quick(cls) -> Config:
        return cls(**_merged("quick", harness.QUICK))

    @classmethod
    def full(cls) -> Config:
        return cls(**_merged("full", {}))

    def registry(self) -> Mapping[str, Scenario[Any]]:
        return BY_NAME


def _merged(kind: str, base: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` and every scenario's ``quick`` or ``full`` sizes."""
    values = dict(base)
    for scenario in SCENARIOS:
        values.update(getattr(scenario, kind))
    return values


def _check() -> None:
    """Every scenario's sizes are among Config's bases, and no two define one name."""
    owners: dict[str, str] = {f.name: "the harness" for f in fields(harness.HarnessConfig)}
    for scenario in SCENARIOS:
        if scenario.sizes is None:
            continue
        if not issubclass(Config, scenario.sizes):
            raise TypeError(f"Config lacks {scenario.name}'s Sizes: add it to its bases")
        for f in fields(scenario.sizes):
            owner = owners.setdefault(f.name, scenario.sizes.__module__)
            if owner != scenario.sizes.__module__:
                raise TypeError(f"{scenario.name}'s size {f.name} is {owner}'s already")


_check()
