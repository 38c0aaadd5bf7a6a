"""``demo`` refuses what it cannot do before it writes anything."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import asyncpg
import pytest

from aiooutbox import embedded
from tests.clirunner import clean_env, cli

BAD_OPTIONS = [("--concurrency", "200000"), ("--events", "900000000")]


@pytest.mark.parametrize(("flag", "value"), BAD_OPTIONS)
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


@pytest.mark.parametrize(("flag", "value"), BAD_OPTIONS)
async def test_a_bad_demo_option_is_refused_before_connecting(flag: str, value: str) -> None:
    """The usage error, not the connection error it would otherwise hide: the options
    are checked before the pool connects."""
    started = time.monotonic()
    result = await cli("demo", "--dsn", "postgresql://postgres@127.0.0.1:1/x", flag, value)
    assert result.rc == 2, result
    assert len(result.err_lines) == 1, result.err
    assert result.err_lines[0].startswith(f"python -m aiooutbox: error: {flag} {value}: "), result
    assert "cannot connect" not in result.err and result.out == "", result
    assert time.monotonic() - started < 20


@pytest.mark.parametrize(("flag", "value"), BAD_OPTIONS)
async def test_a_bad_demo_option_starts_no_embedded_server(
    tmp_path: Path, flag: str, value: str
) -> None:
    """Without a DSN the demo would start the embedded server: not for a usage error."""
    data_dir = tmp_path / "pgdata"
    try:
        result = await cli("demo", flag, value, env=clean_env(AIOOUTBOX_DATA_DIR=str(data_dir)))
    finally:
        with contextlib.suppress(Exception):
            embedded.stop(data_dir)
    assert result.rc == 2, result
    assert len(result.err_lines) == 1 and f"{flag} {value}: " in result.err, result.err
    assert not data_dir.exists() and result.out == "", result
