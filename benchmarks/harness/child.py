"""A consumer in its own process: ``python -m benchmarks.harness.child '<json spec>'``.

spec: ``system`` (aiooutbox | pgqueuer | bare | awa | procrastinate; see RUNNERS),
``mode`` (drain | serve), ``dsn``, ``settings``
(passed to the system's ``consume``), ``n`` (drain: stop after this many events),
``latency`` (payloads carry the producer's wall-clock send time), ``sample_interval``,
``patch`` (a Python file run first, to measure an experimental engine change),
``hold`` (drain: after the last handler print ``{"type": "reached"}`` and wait for a
line on stdin before stopping), ``raw`` (also report every (sent, handler start)
pair), ``times`` (record the first and last handler start even without latencies).
The stop command may carry ``committing``: [[send time, COMMIT-sent time], ...] per
producer transaction, for latencies from the COMMIT.

Protocol on stdout, one JSON object per line: ``{"type": "ready"}`` once the consumer
runs, then ``{"type": "result", ...}``. In serve mode the parent writes
``{"stop_after": N, "timeout": s}`` to stdin: stop once N events were handled (or after
``timeout`` seconds) and report.
"""

from __future__ import annotations

import asyncio
import json
import runpy
import sys
import time
from array import array
from typing import Any

import psutil

from .stats import summarize_ms

# the module whose ``consume`` drives each system (benchmarks/systems/peers.py: the
# references)
RUNNERS = {
    "aiooutbox": ("..systems.aiooutbox_runner", "consume"),
    "pgqueuer": ("..systems.pgqueuer_runner", "consume"),
    "bare": ("..systems.peers", "consume_bare"),
    "awa": ("..systems.peers", "consume_awa"),
    "procrastinate": ("..systems.peers", "consume_procrastinate"),
}


class Recorder:
    """What the handlers report: counts, end-to-end latencies, first/last handler time."""

    def __init__(self, target: int | None, latency: bool) -> None:
        self.target = target
        self.latency = latency
        self.raw = False
        self.times = False  # first/last handler time without latencies (several processes)
        self.ids = array("q")  # handled event ids, when the spec asks (double claims)
        self.committing: dict[float, float] = {}
        self.handled = 0
        self.t_start = 0.0
        self.cpu_start = 0.0  # process CPU (all threads) at start and at the target
        self.cpu_last = 0.0
        self.t_first = 0.0
        self.t_last = 0.0
        self.sent = array("d")
        self.began = array("d")
        self.reached = asyncio.Event()
        self.ready = asyncio.Event()
        self.extra: dict[str, Any] = {}

    def started(self) -> None:
        self.t_start = time.time()
        self.cpu_start = time.process_time()

    def count(self, event_id: int | None = None) -> None:
        if self.times:
            now = time.time()
            if not self.handled:
                self.t_first = now
            self.t_last = now
        self.handled += 1
        if event_id is not None:
            self.ids.append(event_id)
        if self.target is not None and self.handled >= self.target:
            self.t_last = time.time()
            self.cpu_last = time.process_time()
            self.reached.set()

    def hit(self, sent: float) -> None:
        now = time.time()
        if not self.handled:
            self.t_first = now
        self.handled += 1
        self.t_last = now
        self.sent.append(sent)
        self.began.append(now)
        if self.target is not None and self.handled >= self.target:
            self.reached.set()

    def latency_report(self) -> dict[str, Any]:
        if not self.sent:
            return {}
        lat = [b - s for s, b in zip(self.sent, self.began, strict=True)]
        t0 = self.sent[0]
        bins: dict[int, list[float]] = {}
        for s, value in zip(self.sent, lat, strict=True):
            bins.setdefault(int((s - t0) * 2), []).append(value)
        series = []
        for key in sorted(bins):
            summary = summarize_ms(bins[key])
            series.append([key / 2, summary["p50"], summary["p99"], summary["n"]])
        report: dict[str, Any] = {"latency": summarize_ms(lat), "latency_series": series}
        if self.committing:
            # from when the producer sent COMMIT, for batches whose time the parent sent
            known = self.committing
            report["latency_from_commit"] = summarize_ms(
                [b - known[s] for s, b in zip(self.sent, self.began, strict=True) if s in known]
            )
        if self.raw:
            report["raw"] = [[s, b] for s, b in zip(self.sent, self.began, strict=True)]
        return report


async def _sample(recorder: Recorder, interval: float, out: list[list[float]]) -> None:
    me = psutil.Process()
    t0 = time.time()
    while True:
        rss = me.memory_info().rss / 2**20
        cpu = sum(me.cpu_times()[:2])
        out.append([round(time.time() - t0, 3), recorder.handled, round(rss, 2), round(cpu, 3)])
        await asyncio.sleep(interval)


async def _control(recorder: Recorder, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=256 * 2**20)  # the stop command can be large
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    line = await reader.readline()
    if not line:
        stop.set()
        return
    command = json.loads(line)
    recorder.committing = dict(command.get("committing") or [])
    recorder.target = int(command["stop_after"])
    if recorder.handled >= recorder.target:
        recorder.reached.set()
    try:
        await asyncio.wait_for(recorder.reached.wait(), float(command.get("timeout", 60)))
    except TimeoutError:
        recorder.extra["timed_out"] = True
    stop.set()


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def main(spec: dict[str, Any]) -> None:
    if spec.get("patch"):
        # an experimental engine change to measure (see --patch): a Python file that
        # monkeypatches the library before the consumer starts
        runpy.run_path(spec["patch"], run_name="benchmark_patch")
    import importlib

    module, function = RUNNERS[spec["system"]]
    consumer = getattr(importlib.import_module(module, __package__), function)
    mode = spec["mode"]
    recorder = Recorder(spec.get("n") if mode == "drain" else None, bool(spec.get("latency")))
    recorder.raw = bool(spec.get("raw"))
    recorder.times = bool(spec.get("times"))
    stop = asyncio.Event()
    samples: list[list[float]] = []
    sampler = asyncio.ensure_future(_sample(recorder, spec.get("sample_interval", 0.5), samples))
    consume = asyncio.ensure_future(consumer(spec["dsn"], spec["settings"], recorder, stop))
    ready = asyncio.ensure_future(recorder.ready.wait())
    await asyncio.wait([consume, ready], return_when=asyncio.FIRST_COMPLETED)
    if consume.done():
        consume.result()  # raises the consumer's error
    _emit({"type": "ready", "pid": psutil.Process().pid})
    if mode == "drain":
        waiter = asyncio.ensure_future(recorder.reached.wait())
        await asyncio.wait([consume, waiter], return_when=asyncio.FIRST_COMPLETED)
        if spec.get("hold") and waiter.done():
            # keep every connection open until the parent has read the server backends'
            # CPU: their time up to the last handler, none of it lost with the backend
            _emit({"type": "reached"})
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        stop.set()
    else:
        control = asyncio.ensure_future(_control(recorder, stop))
        await asyncio.wait([consume, control], return_when=asyncio.FIRST_COMPLETED)
        stop.set()
        if control.done():
            control.result()  # a broken command is an error, not a stop
    await consume
    t_end = time.time()
    sampler.cancel()
    me = psutil.Process()
    samples.append(
        [
            samples[-1][0] if samples else 0.0,
            recorder.handled,
            me.memory_info().rss / 2**20,
            sum(me.cpu_times()[:2]),
        ]
    )
    elapsed = t_end - recorder.t_start
    result: dict[str, Any] = {
        "type": "result",
        "handled": recorder.handled,
        "t_start": recorder.t_start,
        "t_end": t_end,
        "t_last": recorder.t_last,
        "t_first": recorder.t_first,
        "elapsed": elapsed,
        "rate": recorder.handled / elapsed if elapsed > 0 else 0.0,
        "cpu_s": round(sum(me.cpu_times()[:2]), 3),
        # the drain's own CPU, startup and shutdown left out (drain mode, counting handlers)
        "drain_cpu_s": round(recorder.cpu_last - recorder.cpu_start, 4),
        "rss": samples,
        **recorder.latency_report(),
        **recorder.extra,
    }
    _emit(result)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
