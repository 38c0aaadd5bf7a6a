"""Argument types of the command line, also applied to defaults taken from the environment.

A bad ``$AIOOUTBOX_...`` value is reported like a bad flag, naming the variable. A DSN
is checked before anything connects, and shown with its password redacted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .. import admin
from .._sql.statements import _MAX_TABLE, validate_identifier
from .._values.limits import check_topic_name
from ..errors import InvalidArgument
from . import logsetup
from .errors import UsageError


def env_value(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name) or default


def env_default(name: str, convert: Callable[[str], Any], fallback: str | None) -> Any:
    """``$name`` converted (a bad value is a usage error naming it), else ``fallback``."""
    value = env_value(name)
    if value is None:
        return fallback  # argparse converts a string default itself
    try:
        return convert(value)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        raise UsageError(f"${name}: {exc}") from None


def env_flag(name: str) -> bool:
    value = (env_value(name) or "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise UsageError(f"${name} must be 1/0, true/false, yes/no or on/off, not {value!r}")


def _argument_type(func: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return func(text)
        except (ValueError, TypeError) as exc:  # InvalidArgument is a ValueError
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name
    return convert


def _positive_int(text: str) -> int:
    if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < 1:
        raise InvalidArgument(f"expected a positive integer, got {text!r}")
    return int(text)


def _up_to(most: int, what: str = "a whole number") -> Callable[[str], int]:
    """Integers from 1 to ``most``: a bound the command would otherwise refuse later."""

    def check(text: str) -> int:
        if not re.fullmatch(r"\s*\d+\s*", text) or not 1 <= int(text) <= most:
            raise InvalidArgument(f"expected {what} from 1 to {most}, got {_clip(text)!r}")
        return int(text)

    return check


def _non_negative_int(text: str) -> int:
    if not re.fullmatch(r"\s*\d+\s*", text):
        raise InvalidArgument(f"expected a whole number (0 or more), got {text!r}")
    return int(text)


def _choice(*options: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text.lower() not in options:
            raise InvalidArgument(f"expected one of {', '.join(options)}, got {text!r}")
        return text.lower()

    return check


def _topic_list(text: str) -> list[str]:
    topics = [t.strip() for t in text.split(",") if t.strip()]
    if not topics:
        raise InvalidArgument("expected comma-separated topic names")
    return topics


def _json_value(text: str) -> Any:
    """JSON as `enqueue` takes it: no NaN or Infinity, no number beyond a float's range."""
    try:
        return json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"invalid JSON {_clip(text)!r}: {exc}") from None
    except RecursionError:
        raise InvalidArgument(f"invalid JSON {_clip(text)!r}: nested too deeply") from None


def _finite_float(text: str) -> float:
    if not math.isfinite(value := float(text)):
        raise InvalidArgument(
            f"the number {_clip(text, 20)} is beyond a float's range (it would be "
            "Infinity, which JSON cannot carry): send it as a string"
        )
    return value


def _no_constant(name: str) -> Any:
    raise InvalidArgument(f"{name} is not JSON (NaN and Infinity are not JSON numbers)")


def _json_object(text: str) -> dict[str, Any]:
    value = _json_value(text)
    if not isinstance(value, dict):
        raise InvalidArgument(f'expected a JSON object like \'{{"key": "value"}}\', got {text!r}')
    return value


def _dsn(text: str) -> str:
    """A PostgreSQL URL, checked before anything connects: a typo is a usage error."""
    dsn = text.strip()
    try:
        dsn.encode()
    except UnicodeEncodeError:  # asyncpg fails on it with an error of its own internals
        raise InvalidArgument(
            f"invalid DSN {_clip(redact(dsn))!r}: not UTF-8 text (a byte that is not UTF-8, "
            "read from the command line or the environment)"
        ) from None
    scheme, sep, _ = dsn.partition("://")
    if not sep or scheme not in ("postgresql", "postgres"):
        raise InvalidArgument(
            f"invalid DSN {_clip(redact(dsn))!r}: expected "
            "postgresql://user:password@host:port/database"
        )
    try:
        # several hosts (host1:port1,host2:port2, for failover): check every port
        for host in urlsplit(dsn).netloc.rpartition("@")[2].split(","):
            urlsplit(f"postgresql://{host}").port  # noqa: B018 - raises on a malformed port
    except ValueError as exc:
        raise InvalidArgument(f"invalid DSN {_clip(redact(dsn))!r}: {exc}") from None
    return dsn


def _clip(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InvalidArgument(f"expected a number such as 2 or 1.5, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise InvalidArgument(f"expected a finite number >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _number(text)
    if value > 1:
        raise InvalidArgument(f"expected a number from 0 to 1, got {text!r}")
    return value


def _optional_duration(text: str) -> float | None:
    if text.strip().lower() in ("none", "off", "never"):
        return None
    return admin.parse_duration(text)


def _port(text: str) -> int:
    if not re.fullmatch(r"\s*\d+\s*", text) or not 0 <= int(text) <= 65535:
        raise InvalidArgument(f"expected a TCP port between 0 and 65535, got {_clip(text)!r}")
    return int(text)


def _host(text: str) -> str:
    host = text.strip().removeprefix("[").removesuffix("]")
    if not host or any(c.isspace() or c in "/?#@" for c in host):
        raise InvalidArgument(f"expected a host name or IP address, got {_clip(text)!r}")
    return host


POSITIVE_INT = _argument_type(_positive_int, "positive_int")
EVENT_ID = _argument_type(_up_to(2**63 - 1, "an event id"), "event_id")
LIST_LIMIT = _argument_type(_up_to(admin.MAX_LIST), "limit")
TOPIC = _argument_type(check_topic_name, "topic")
NON_NEGATIVE_INT = _argument_type(_non_negative_int, "non_negative_int")
PORT = _argument_type(_port, "port")
HOST = _argument_type(_host, "host")
DURATION = _argument_type(admin.parse_duration, "duration")
OPTIONAL_DURATION = _argument_type(_optional_duration, "duration")
NUMBER = _argument_type(_number, "number")
FRACTION = _argument_type(_fraction, "fraction")
TOPICS = _argument_type(_topic_list, "topics")
DSN = _argument_type(_dsn, "dsn")
check_dsn = _dsn  # the same check, raising InvalidArgument
JSON = _argument_type(_json_value, "json")
JSON_OBJECT = _argument_type(_json_object, "json_object")
SCHEMA = _argument_type(lambda s: validate_identifier("schema", s), "schema")
TABLE = _argument_type(lambda s: validate_identifier("table", s, _MAX_TABLE), "table")


def choices(*options: str) -> Callable[[str], str]:
    """An argument type accepting one of ``options``, in any case."""
    return _argument_type(_choice(*options), "choice")


LEVEL = choices(*logsetup.LEVELS)
LOG_FORMAT = choices("text", "json")


def redact(dsn: str) -> str:
    """``dsn`` with any password replaced by ``***``."""
    dsn = re.sub(r"(password=)[^&\s]*", r"\1***", dsn)
    try:
        parts = urlsplit(dsn)
        password = parts.password
    except ValueError:
        return dsn
    if not password:
        return dsn
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=user.split(":", 1)[0] + ":***@" + host))
