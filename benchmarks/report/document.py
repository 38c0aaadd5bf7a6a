"""results.md: the Targets table, then every scenario's sections in the order of their
ranks (`Scenario.sections`), the settings each system ran with, and the run."""

from __future__ import annotations

import json
from typing import Any

from ..harness.markdown import fmt, loads, mark
from ..harness.scenario import Render, TargetRows
from ..scenarios import SCENARIOS


def _ranked(parts: list[tuple[int, Any]]) -> list[Any]:
    """Each part once (two scenarios may share one), by rank, the registry's order
    breaking ties."""
    seen: list[Any] = []
    for _, part in sorted(parts, key=lambda p: p[0]):
        if part not in seen:
            seen.append(part)
    return seen


SECTIONS: list[Render] = _ranked([s for scenario in SCENARIOS for s in scenario.sections])
TARGETS: list[TargetRows] = _ranked([t for scenario in SCENARIOS for t in scenario.targets])


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets, each with what this run measured and whether it holds."""
    return [row for rows in TARGETS for row in rows(results)]


def markdown(results: dict[str, Any]) -> str:
    lines = ["## Targets", "", "| what | target | measured | ok |", "|---|---|---|---|"]
    for t in results.get("targets") or targets(results):
        lines.append(f"| {t['what']} | {t['target']} | {fmt(t['measured'], 2)} | {mark(t['ok'])} |")
    for section in SECTIONS:
        lines += section(results)
    settings = results.get("settings", {})
    if settings:
        lines += ["", "## Settings", ""]
        for name, value in settings.items():
            lines.append(f"- {name}: `{json.dumps(value)}`")
    lines += _run(results.get("meta", {}))
    return "\n".join(lines) + "\n"


def _run(meta: dict[str, Any]) -> list[str]:
    if not meta:
        return []
    pg = meta.get("postgresql", {})
    machine = meta.get("machine", {})
    return [
        "",
        "## Run",
        "",
        f"- command: `{meta.get('command')}`; started {meta.get('started')}, "
        f"took {meta.get('duration_s')} s",
        f"- aiooutbox: {meta.get('source')}"
        + (f"; with `--patch {meta['patch']}`" if meta.get("patch") else "")
        + (f" `--sql-patch {meta['sql_patch']}`" if meta.get("sql_patch") else ""),
        f"- machine: {machine.get('platform')}, {machine.get('cpus')} CPUs, "
        f"{machine.get('memory_gb')} GB, Python {machine.get('python')}; "
        f"load average at start {loads(machine.get('loadavg_start'))}, "
        f"at end {loads(meta.get('loadavg_end'))} (a shared machine)",
        f"- {pg.get('version')}",
        f"- server settings: `{json.dumps(pg.get('settings', {}))}`",
        f"- packages: `{json.dumps(meta.get('packages', {}))}`",
    ]
