"""What a results document says about its run: when, the command, the machine, the
server and its settings, the packages, and where the aiooutbox under test came from."""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg

from .config import HarnessConfig


def git_state() -> str:
    """Where the aiooutbox under test came from: its git commit, and local edits."""
    import subprocess

    import aiooutbox

    package = Path(aiooutbox.__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=package, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "."], cwd=package, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit, dirty = "", ""
    if not commit:
        return f"aiooutbox from {package} (not a git checkout)"
    return f"{commit}{' + uncommitted changes in aiooutbox/' if dirty else ''}"


async def describe(admin_dsn: str, config: HarnessConfig) -> dict[str, Any]:
    """The results document's ``meta`` as the run starts (`Bench.run` adds its end)."""
    import importlib.metadata as md

    import psutil

    conn = await asyncpg.connect(admin_dsn)
    try:
        version = await conn.fetchval("SELECT version()")
        names = [
            "shared_buffers", "synchronous_commit", "fsync", "wal_level", "max_wal_size",
            "checkpoint_timeout", "work_mem", "autovacuum", "max_connections", "jit",
            "random_page_cost", "effective_io_concurrency",
        ]  # fmt: skip
        rows = await conn.fetch(
            "SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY($1)",
            names,
        )
    finally:
        await conn.close()

    def version_of(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "?"

    return {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(["python", "-m", "benchmarks", *sys.argv[1:]]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(),
            "loadavg_start": list(os.getloadavg()),
        },
        "postgresql": {"version": version, "settings": {r[0]: r[1] for r in rows}},
        "packages": {
            name: version_of(name) for name in ("aiooutbox", "pgqueuer", "asyncpg", "orjson")
        },
        "source": git_state(),
        "patch": config.patch,
        "sql_patch": config.sql_patch,
    }
