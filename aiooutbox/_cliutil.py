"""Building blocks of the command line, in one import for the commands that use them.

The parts live in modules of their own: the two errors (`_clierrors`), argument types
and environment defaults (`_cliargs`), shared option groups and the parser class
(`_clioptions`), and connecting (`_cliconnect`). ``run``, ``relay`` and the consumer
options import them from here.
"""

from __future__ import annotations

from ._cliargs import (
    DSN,
    DURATION,
    FRACTION,
    HOST,
    JSON,
    JSON_OBJECT,
    LEVEL,
    LOG_FORMAT,
    NUMBER,
    OPTIONAL_DURATION,
    PORT,
    POSITIVE_INT,
    SCHEMA,
    TABLE,
    TOPICS,
    choices,
    env_default,
    env_flag,
    redact,
)
from ._cliconnect import (
    CONNECT_TIMEOUT,
    apply_migrations,
    connect,
    database,
    ensure_embedded,
    open_pool,
    resolve_data_dir,
    resolve_dsn,
)
from ._clierrors import CommandError, UsageError
from ._clioptions import (
    Formatter,
    Parser,
    add_command,
    add_database_options,
    add_listen_options,
    add_logging_options,
    add_metrics_options,
    check_listen_options,
    check_metrics_options,
)

__all__ = [
    "CONNECT_TIMEOUT",
    "DSN",
    "DURATION",
    "FRACTION",
    "HOST",
    "JSON",
    "JSON_OBJECT",
    "LEVEL",
    "LOG_FORMAT",
    "NUMBER",
    "OPTIONAL_DURATION",
    "PORT",
    "POSITIVE_INT",
    "SCHEMA",
    "TABLE",
    "TOPICS",
    "CommandError",
    "Formatter",
    "Parser",
    "UsageError",
    "add_command",
    "add_database_options",
    "add_listen_options",
    "add_logging_options",
    "add_metrics_options",
    "apply_migrations",
    "check_listen_options",
    "check_metrics_options",
    "choices",
    "connect",
    "database",
    "ensure_embedded",
    "env_default",
    "env_flag",
    "open_pool",
    "redact",
    "resolve_data_dir",
    "resolve_dsn",
]
