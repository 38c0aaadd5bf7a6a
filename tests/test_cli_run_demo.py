"""``demo`` refuses what it cannot do before it writes anything."""

from __future__ import annotations

import time

import asyncpg
import pytest

from tests.clirunner import cli


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--concurrency", "200000"), ("--events", "900000000")],
)
async def test_a_bad_demo_option_is_one_line_and_exit_2_before_any_write(
    empty_dsn: str, flag: str, value: str
) -> None:
    started = time.monotonic()
    result = await cli("demo", "--dsn", empty_dsn, flag, value, timeout=60)
    took = time.monotonic() - started
    assert result.rc == 2, result
    assert len(result.err_lines) == 1 and f"{flag} {value}" in result.err, result.err
    assert result.out == "", result.out
    assert took < 20, took  # no events were built
    conn = await asyncpg.connect(empty_dsn)
    try:
        assert await conn.fetchval("SELECT to_regclass('aiooutbox_demo')") is None
    finally:
        await conn.close()
