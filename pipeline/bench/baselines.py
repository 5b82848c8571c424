"""The machine's own speed at moving bytes, the baselines the weight benchmarks divide by.

A baseline is what the hardware does, not what a Python path through it does: one contiguous
buffer, warmed (every page touched before the timing), best of several, because the machine is
shared and a single timing measures the neighbours too.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.bench.weights_logic import baseline


def copy_baseline(nbytes: int, repeats: int = 5) -> dict[str, Any]:
    """The machine's copy speed for `nbytes`: one contiguous buffer, warmed (every page touched first),
    copied in memory, written to a file with fsync and read back with the page cache dropped; best of
    `repeats` for each."""
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)  # warm: the pages exist before the timing
    copy_s = write_s = read_s = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        copy_s = min(copy_s, time.perf_counter() - started)
    data = source.numpy()
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-weights-") as tmp:
        path = Path(tmp) / "version.bin"
        for _ in range(max(2, repeats // 2)):
            started = time.perf_counter()
            with open(path, "wb") as f:
                f.write(memoryview(data))
                f.flush()
                os.fsync(f.fileno())
            write_s = min(write_s, time.perf_counter() - started)
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            started = time.perf_counter()
            with open(path, "rb") as f:
                f.readinto(memoryview(target.numpy()))
            read_s = min(read_s, time.perf_counter() - started)
    return baseline(nbytes, copy_s, write_s, read_s)
