"""The run's own settings: the settings search, each system's consumer settings, the
measurements every scenario shares (steady producers, idle wake-ups, commit rates), and
which scenarios run. Each scenario's sizes live in its module; `benchmarks.scenarios`
composes them with these into the run's `Config`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..systems import aiooutbox_runner, pgqueuer_runner
from .scenario import Scenario

#: --quick values of the fields below
QUICK: dict[str, Any] = {
    "tune": False,
    "steady_seconds": 4.0,
    "wakeup_samples": 15,
    "producer_seconds": 1.5,
    "sample_interval": 0.2,
}


@dataclass
class HarnessConfig:
    """What every run has, whichever scenarios it runs."""

    tune: bool = True
    tune_size: int = 50_000
    aiooutbox_candidates: list[dict[str, Any]] = field(
        default_factory=lambda: [
            {"concurrency": 200, "pool_size": 4},
            {"concurrency": 500, "pool_size": 6},
            {"concurrency": 500, "pool_size": 6, "prefetch": 1500},
            {"concurrency": 1000, "pool_size": 8},
        ]
    )
    pgqueuer_candidates: list[dict[str, Any]] = field(
        default_factory=lambda: [
            {"workers": 1, "batch_size": 100},
            {"workers": 5, "batch_size": 100},
            {"workers": 10, "batch_size": 50},
        ]
    )
    aiooutbox_settings: dict[str, Any] = field(
        default_factory=lambda: dict(aiooutbox_runner.DEFAULT_SETTINGS)
    )
    pgqueuer_settings: dict[str, Any] = field(
        default_factory=lambda: dict(pgqueuer_runner.DEFAULT_SETTINGS)
    )
    # paced producers against a serving consumer (`load.steady_once`)
    steady_seconds: float = 15.0
    steady_producers: int = 4
    steady_tick: float = 0.01
    catch_up_timeout: float = 15.0
    # one event at a time into an idle consumer (`load.wakeup_once`)
    wakeup_samples: int = 60
    wakeup_gap: tuple[float, float] = (0.15, 0.35)
    poll_only_interval: float = 1.0
    # one-event transactions in a loop (`load.commit_rate`)
    producer_seconds: float = 2.0
    sample_interval: float = 0.5
    settle: float = 0.5  # pause after a consumer starts, before producers do
    patch: str | None = None  # Python file each aiooutbox consumer child runs first
    sql_patch: str | None = None  # SQL run on aiooutbox's databases after migrating
    scenarios: list[str] = field(default_factory=list)

    def registry(self) -> Mapping[str, Scenario[Any]]:
        """The scenarios this configuration can run, by name (`benchmarks.scenarios`)."""
        return {}


def settings_argument(parser: argparse.ArgumentParser, flag: str, text: str) -> dict[str, Any]:
    """A command-line JSON object of consumer settings, or a parser error that says why."""
    try:
        settings = json.loads(text)
    except json.JSONDecodeError as exc:
        parser.error(f"{flag} is not JSON: {exc}")
    if not isinstance(settings, dict):
        parser.error(f"{flag} must be a JSON object")
    return settings
