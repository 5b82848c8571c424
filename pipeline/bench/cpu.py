"""Where a benchmark's CPU went: seconds of given processes, of a process and its descendants, of the
local Kafka broker, of the whole machine, and how long a thread waited for a core.

On a machine whose cores the engines share with everything else, a stage's wall time says little
without them: a process can be slow because it works, or because it is runnable and waits for a core
(Linux's schedstat counts that wait per thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from pathlib import Path

import psutil


def cpu_seconds(processes: Iterable[psutil.Process]) -> float:
    """User + system CPU seconds of the processes themselves (0 for one that is gone), not of their children."""
    total = 0.0
    for p in processes:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def tree(pid: int) -> list[psutil.Process]:
    """The process `pid` and its descendants now (an empty list when it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def local_broker() -> psutil.Process | None:
    """The Kafka broker's process when it runs on this machine (infra/up.sh), else None."""
    for p in psutil.process_iter(["cmdline"]):
        if "kafka.Kafka" in (p.info["cmdline"] or []):
            return p
    return None


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine spent on anything but idling, since boot."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def thread_wait_seconds(native_id: int | None = None) -> float | None:
    """Seconds the thread (default: the calling one) has spent runnable but waiting for a core, from
    /proc's schedstat; None where the kernel does not report it."""
    tid = native_id if native_id is not None else threading.get_native_id()
    try:
        fields = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class CpuMeter:
    """Samples, from the thread that runs the loop under test, the CPU seconds of this process with its
    descendants (the engine's process tree apart), of the engine's tree, of the local broker and of the
    machine, and the calling thread's wait for a core."""

    def __init__(self, engine_pid: int) -> None:
        self.engine_pid = engine_pid
        self.me = psutil.Process()
        self.broker = local_broker()
        self.cores = psutil.cpu_count() or 1

    def sample(self) -> dict[str, float | None]:
        engine = tree(self.engine_pid)
        engine_pids = {p.pid for p in engine}
        return {"loop": cpu_seconds(p for p in tree(self.me.pid) if p.pid not in engine_pids),
                "loop_thread_wait": thread_wait_seconds(), "engine": cpu_seconds(engine),
                "broker": cpu_seconds([self.broker]) if self.broker is not None else None,
                "machine": machine_busy_seconds()}


class MachineCpuSampler:
    """Samples the machine's busy CPU seconds (machine_busy_seconds) with their wall time, every `interval_s`,
    in a thread of its own while it is entered: what a benchmark reads the CPU of any window of its runs from
    afterwards (pipeline/bench/pipeline_logic.cpu_between), however the window is found."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[int, float]] = []  # (wall time ms, busy CPU seconds since boot)
        self.cores = psutil.cpu_count() or 1
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="machine-cpu", daemon=True)

    def _take(self) -> None:
        self.samples.append((int(time.time() * 1000), machine_busy_seconds()))

    def _sample(self) -> None:
        while not self._halt.wait(self.interval_s):
            self._take()

    def __enter__(self) -> MachineCpuSampler:
        self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self._thread.join()
        self._take()
