"""Several databases on one command line: ``--dsn`` repeated, or ``--dsn-file FILE``.

Each database is ``[NAME=]postgresql://...``; a file holds one per line (blank lines and
``#`` comments skipped). The name labels the database in logs, metrics and ``stats``;
without one it is derived from the DSN (``host:port/dbname``). Everything is checked
before anything connects: a malformed line, a name used twice, or two DSNs that reach
the same database (same hosts, ports and database name, whatever the user, password or
options) is a usage error, one line, naming the culprit.
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from ..errors import InvalidArgument
from .args import _argument_type, check_dsn, env_value, redact
from .errors import UsageError

__all__ = ["NAME_PATTERN", "TARGET", "Target", "parse_target", "read_dsn_file", "targets"]

#: a database's name: what the ``database`` label, the logs and ``stats`` show
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,62}")
_NAMED = re.compile(r"([^=:/]+)=(.*)", re.DOTALL)  # a DSN never starts with NAME=
_MAX_FILE = 1 << 20  # bytes: a DSN file is a short list, not a data file


@dataclass(frozen=True)
class Target:
    """One database to serve: its name and DSN; ``named``: the user chose the name."""

    name: str
    dsn: str
    named: bool = False

    @property
    def shown(self) -> str:
        """How an error message names it: the name and the redacted DSN."""
        return f"{self.name} ({redact(self.dsn)})"


def parse_target(text: str) -> Target:
    """``NAME=DSN`` or ``DSN``; `InvalidArgument` (a ValueError) when malformed."""
    text = text.strip()
    match = _NAMED.fullmatch(text)
    if match is None:
        dsn = check_dsn(text)
        return Target(default_name(dsn), dsn)
    name, dsn = match.group(1), match.group(2).strip()
    if not NAME_PATTERN.fullmatch(name):
        raise InvalidArgument(
            f"database name {name[:40]!r}: use 1-63 letters, digits and _ . @ -, "
            "starting with a letter or digit"
        )
    return Target(name, check_dsn(dsn), named=True)


def _query(dsn: str) -> dict[str, str]:
    parts = urlsplit(dsn)
    return {k: v[-1] for k, v in parse_qs(parts.query).items()}


def _user(dsn: str) -> str:
    parts = urlsplit(dsn)
    netloc = parts.netloc.rpartition("@")
    user = unquote(netloc[0].partition(":")[0]) if netloc[1] else ""
    return _query(dsn).get("user") or user or env_value("PGUSER") or getpass.getuser() or "postgres"


def _hosts(dsn: str) -> list[tuple[str, int]]:
    """Each ``(host, port)`` the DSN may connect to, as PostgreSQL's defaults fill them."""
    query = _query(dsn)
    netloc = urlsplit(dsn).netloc.rpartition("@")[2]
    default_port = int(query.get("port") or env_value("PGPORT") or 5432)
    found: list[tuple[str, int]] = []
    for spec in netloc.split(",") if netloc else []:
        parsed = urlsplit(f"//{spec}")
        found.append(((parsed.hostname or "").lower(), parsed.port or default_port))
    if not found or not any(h for h, _ in found):
        hosts = query.get("host") or env_value("PGHOST") or "localhost"
        found = [(h.strip().lower(), default_port) for h in hosts.split(",")]
    return found


def _dbname(dsn: str) -> str:
    path = unquote(urlsplit(dsn).path.lstrip("/"))
    return _query(dsn).get("dbname") or path or env_value("PGDATABASE") or _user(dsn)


def database_key(dsn: str) -> tuple[tuple[tuple[str, int], ...], str]:
    """What makes two DSNs the same database: their hosts and ports, and the database
    name (the user, password and connection options do not change which one it is).
    Host names are compared as written: ``localhost`` and ``127.0.0.1`` differ."""
    return tuple(_hosts(dsn)), _dbname(dsn)


def default_name(dsn: str) -> str:
    """``host:port/dbname`` (the first host when there are several)."""
    (host, port), *_ = _hosts(dsn)
    return f"{host}:{port}/{_dbname(dsn)}"


TARGET = _argument_type(parse_target, "dsn")


def read_dsn_file(path: Path, flag: str = "--dsn-file") -> list[Target]:
    """The databases listed in ``path``, one ``[NAME=]DSN`` per line."""
    try:
        with path.open("rb") as f:
            raw = f.read(_MAX_FILE + 1)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    if len(raw) > _MAX_FILE:
        raise UsageError(f"{flag} {path}: larger than {_MAX_FILE >> 20} MiB; is it the right file?")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{flag} {path}: not UTF-8 text (byte {exc.start})") from None
    found: list[Target] = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            found.append(parse_target(line))
        except InvalidArgument as exc:
            raise UsageError(f"{flag} {path} line {number}: {exc}") from None
    if not found:
        raise UsageError(f"{flag} {path}: no DSN in it (one [NAME=]postgresql://... per line)")
    return found


def _check_distinct(found: list[Target]) -> None:
    names: dict[str, Target] = {}
    keys: dict[object, Target] = {}
    for target in found:
        key = database_key(target.dsn)
        if key in keys:
            raise UsageError(
                f"{target.shown} is the same database as {keys[key].shown}: list each database once"
            )
        if target.name in names:
            raise UsageError(
                f"two databases are named {target.name!r}: {names[target.name].shown} and "
                f"{target.shown}; name them apart with NAME=DSN"
            )
        keys[key] = target
        names[target.name] = target


def targets(args: argparse.Namespace) -> list[Target]:
    """The databases of ``--dsn`` (repeatable) and ``--dsn-file``; else of
    ``$AIOOUTBOX_DSN_FILE``, else ``$AIOOUTBOX_DSN`` or ``$DATABASE_URL``; else none
    (the embedded server). Checked as the module docstring says."""
    found: list[Target] = list(args.dsn or [])
    if args.dsn_file is not None:
        found += read_dsn_file(args.dsn_file)
    if not found:
        file = env_value("AIOOUTBOX_DSN_FILE")
        if file:
            found = read_dsn_file(Path(file), "$AIOOUTBOX_DSN_FILE")
        else:
            env = "AIOOUTBOX_DSN" if env_value("AIOOUTBOX_DSN") else "DATABASE_URL"
            value = os.environ.get(env)
            if value:
                try:
                    found = [parse_target(value)]
                except InvalidArgument as exc:
                    raise UsageError(f"${env}: {exc}") from None
    _check_distinct(found)
    return found
