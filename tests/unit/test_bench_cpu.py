"""pipeline/bench/cpu.py: CPU seconds of processes and the wait of a thread for a core, read from this
machine's kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from pipeline.bench.cpu import CpuMeter, MachineCpuSampler, cpu_seconds, thread_wait_seconds, tree


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_cpu_seconds_count_the_work_a_process_did_and_zero_for_one_that_is_gone():
    me = psutil.Process()
    before = cpu_seconds([me])
    _spin(0.2)
    assert cpu_seconds([me]) - before >= 0.15  # counted in clock ticks
    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    process = psutil.Process(gone.pid)
    gone.kill()
    gone.wait()
    assert cpu_seconds([process]) == 0.0


def test_tree_holds_a_process_and_its_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert {os.getpid(), child.pid} <= {p.pid for p in tree(os.getpid())}
    finally:
        child.kill()
        child.wait()
    assert tree(child.pid) == []


def test_the_meter_counts_the_engines_tree_apart_from_the_loop():
    engine = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                               "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        meter = CpuMeter(engine.pid)
        before = after = meter.sample()
        deadline = time.monotonic() + 20
        while after["engine"] - before["engine"] < 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)  # the child spins for 0.5 s of CPU; this thread mostly sleeps
            after = meter.sample()
        assert after["engine"] - before["engine"] >= 0.3
        assert after["loop"] - before["loop"] < 0.2
        assert after["machine"] >= before["machine"]
    finally:
        engine.kill()
        engine.wait()


def test_thread_wait_is_read_from_the_kernel_and_never_decreases():
    first = thread_wait_seconds()
    assert first is not None and first >= 0.0  # Linux reports schedstat for every thread
    _spin(0.05)
    assert thread_wait_seconds() >= first
    assert thread_wait_seconds(native_id=2**22 + 12345) is None  # no such thread


def test_the_machine_sampler_records_busy_cpu_over_wall_time_until_it_is_left():
    with MachineCpuSampler(interval_s=0.05) as sampler:
        _spin(0.3)
    times = [t for t, _ in sampler.samples]
    busy = [b for _, b in sampler.samples]
    assert len(times) >= 4 and times == sorted(times) and busy == sorted(busy)
    assert busy[-1] - busy[0] >= 0.2  # the spin, at least, was busy
    assert not sampler._thread.is_alive()
