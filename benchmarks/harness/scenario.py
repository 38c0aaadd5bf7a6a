"""What a scenario is to the run: a name for ``--only``, the coroutine that measures, its
sizes, and what it adds to results.md. Each scenario module ends with one ``SCENARIO``;
`benchmarks.scenarios` registers it (benchmarks/README.md: adding a scenario)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

B = TypeVar("B")
T = TypeVar("T")

#: the results document -> markdown lines ([] when the results hold nothing of it)
Render = Callable[[dict[str, Any]], list[str]]
#: the results document -> rows of results.md's Targets table (`markdown.target`)
TargetRows = Callable[[dict[str, Any]], list[dict[str, Any]]]


@dataclass(frozen=True)
class Scenario(Generic[B]):
    """One scenario of ``python -m benchmarks``.

    ``run(bench)`` measures and writes its part of ``bench.results``. ``sizes`` is the
    dataclass of its sizes and durations (a base of the run's `Config`; read them with
    `sizes_of`), ``quick``/``full`` their values under ``--quick``/``--full``.
    ``sections`` and ``targets`` render it, each placed by its rank among every
    scenario's (results.md's order: rank 10 drain ... 180 the relay's streams); a
    results document from another run renders the same way (``--render``).
    """

    name: str
    run: Callable[[B], Awaitable[None]]
    sizes: type | None = None
    quick: Mapping[str, Any] = field(default_factory=dict)
    full: Mapping[str, Any] = field(default_factory=dict)
    #: in a run without --only
    default: bool = True
    #: needs the machine's brokers: runs last in a default run, and `Config()`'s default
    #: list (the smoke tests' Benches) leaves it out
    brokers: bool = False
    sections: tuple[tuple[int, Render], ...] = ()
    targets: tuple[tuple[int, TargetRows], ...] = ()


def sizes_of(config: object, kind: type[T]) -> T:
    """``config`` as the scenario's sizes (`Config` inherits every scenario's)."""
    if not isinstance(config, kind):
        raise TypeError(
            f"{type(config).__name__} has no {kind.__module__}.{kind.__qualname__}: "
            "register the scenario in benchmarks/scenarios/__init__.py"
        )
    return config
