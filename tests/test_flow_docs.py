"""docs/flow-control.md's Python snippet runs as written, on a real database."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import asyncpg

from aiooutbox import admin

DOC = Path(__file__).resolve().parent.parent / "docs" / "flow-control.md"


async def test_the_flow_control_snippet_runs(pool: asyncpg.Pool, capsys: Any) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, "a new snippet needs running here"
    # the snippet awaits at the top level, as in a REPL or a handler: run it as a body
    source = "async def snippet(pool):\n" + textwrap.indent(blocks[0], "    ")
    namespace: dict[str, Any] = {}
    exec(compile(source, str(DOC), "exec"), namespace)
    await namespace["snippet"](pool)
    controls = {c.topic: c for c in await admin.topic_controls(pool)}
    control = controls["payments.charge"]
    assert control.max_running == 5 and control.rate_text is None and not control.paused
    assert "payments.charge" in capsys.readouterr().out
    assert len(await admin.flow_history(pool, "payments.charge")) >= 4
