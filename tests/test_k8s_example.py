"""examples/k8s/worker.yaml: its probes reach the runner as a kubelet's would.

A kubelet probes ``httpGet`` at the pod's IP (no ``host`` given), from the node, never
over the pod's loopback. Here the runner is started with the worker container's exact
arguments, parsed from the YAML (only the metrics port number is swapped for a free
one, in the arguments and the container port alike: 9100 may be taken on a shared
machine), and each probe is sent to this machine's own non-loopback interface address,
from that address, with the kubelet's request. A runner bound to 127.0.0.1 refuses it.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import time
from pathlib import Path
from typing import Any

import asyncpg
import yaml

import aiooutbox
from tests.clirunner import Runner, clean_env
from tests.helpers import status_counts, wait_until

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "examples" / "k8s" / "worker.yaml"
_SIOCGIFADDR = 0x8915

HANDLERS = """
import aiooutbox

router = aiooutbox.Router()


@router.handler("orders.created")
async def created(event: aiooutbox.Event) -> None:
    pass
"""


def interface_address() -> str:
    """An IPv4 address of one of this machine's non-loopback interfaces: what a pod IP
    is to the kubelet (not 127.0.0.x, which every process here reaches over ``lo``)."""
    for _, name in socket.if_nameindex():
        if name == "lo":
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                packed = fcntl.ioctl(
                    sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode())
                )
            except OSError:  # an interface without an IPv4 address
                continue
        address = socket.inet_ntoa(packed[20:24])
        if not address.startswith("127."):
            return address
    raise AssertionError(
        "this machine has no non-loopback IPv4 interface address to probe the runner at "
        f"(interfaces: {[n for _, n in socket.if_nameindex()]})"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        port: int = sock.getsockname()[1]
        return port


def worker_container() -> dict[str, Any]:
    documents = list(yaml.safe_load_all(MANIFEST.read_text()))
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    container_: dict[str, Any] = container
    return container_


async def kubelet_get(address: str, port: int, path: str) -> int:
    """The kubelet's HTTP probe: a GET from the node's address; the status code."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(address, port, local_addr=(address, 0)), 1
    )
    try:
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {address}:{port}\r\nUser-Agent: kube-probe/1.31\r\n"
            "Accept: */*\r\nConnection: close\r\n\r\n".encode()
        )
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 1)  # timeoutSeconds: 1
        return int(status_line.split()[1])
    finally:
        writer.close()


async def test_the_manifests_probes_reach_the_runner_from_the_pod_address(
    dsn: str, tmp_path: Path
) -> None:
    container = worker_container()
    command = container["command"]
    assert command[:4] == ["python", "-m", "aiooutbox", "run"], command
    args = command[4:]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probes = {kind: container[kind]["httpGet"] for kind in ("readinessProbe", "livenessProbe")}
    assert all("host" not in probe for probe in probes.values())  # the pod IP, as usual

    # the port the runner serves is the one the probes name
    (flag,) = [a for a in args if a.startswith("--metrics-port")]
    served = int(flag.split("=", 1)[1])
    for probe in probes.values():
        named = probe["port"]
        assert ports.get(named, named) == served, (probe, ports, flag)
    port = free_port()
    args = [f"--metrics-port={port}" if a == flag else a for a in args]

    package = tmp_path / "orders"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "jobs.py").write_text(HANDLERS)
    env = clean_env(AIOOUTBOX_DSN=dsn, PYTHONPATH=f"{tmp_path}:{ROOT}")
    address = interface_address()
    conn = await asyncpg.connect(dsn)
    try:
        await aiooutbox.enqueue(conn, "orders.created", {"order_id": 42})
        async with Runner(*args, env=env) as runner:
            await runner.wait_for_line("serving /metrics and /healthz")
            started = time.monotonic()
            for kind, probe in probes.items():
                last: object = None
                while True:
                    try:
                        last = await kubelet_get(address, port, probe["path"])
                    except (OSError, TimeoutError) as exc:
                        last = exc
                    if last == 200:
                        break
                    if time.monotonic() - started > 30:
                        raise AssertionError(
                            f"{kind} GET http://{address}:{port}{probe['path']}: {last!r} "
                            f"after {time.monotonic() - started:.1f}s\n{runner.stderr}"
                        )
                    await asyncio.sleep(0.2)
            await wait_until(lambda: _done(conn, 1), timeout=30)
            runner.signal()
            assert await runner.wait() == 0, runner.stderr
    finally:
        await conn.close()


async def _done(conn: asyncpg.Connection, n: int) -> bool:
    return await status_counts(conn) == {"done": n}
