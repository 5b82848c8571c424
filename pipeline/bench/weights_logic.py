"""The pure part of `rollstream bench weights`: rows per version, per setting, and the headline.

A setting is one (dtype, learning rate) pair: the staged weights' dtype and the step between
versions. Its `delta_fraction` is the mean over its delta versions of delta bytes / the full
version's bytes. The headline `ratio` compares the staged delta update with the honest baseline of
moving the same (full) bytes on this machine: a memory copy plus a file write and read,
bandwidth / bandwidth, so 1.0 means the update costs what copying the version costs, and >= 0.5 is
"within 2x" (the issue's goal).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

MB = 1024 * 1024


def mb_per_s(nbytes: int, seconds: float) -> float:
    """MB/s (MB = 2^20 bytes); 0 for a non-positive time."""
    return nbytes / MB / seconds if seconds > 0 else 0.0


def version_row(version: int, kind: str, staged_bytes: int, full_bytes: int, stage_s: float) -> dict[str, Any]:
    """One staged version: its kind, its bytes beside the full version's, and the staging time."""
    return {"version": version, "kind": kind, "staged_bytes": staged_bytes, "full_bytes": full_bytes,
            "fraction": staged_bytes / full_bytes if full_bytes else 0.0, "stage_s": round(stage_s, 4)}


def setting_summary(dtype: str, lr: float, rows: Sequence[Mapping[str, Any]], late_join: Mapping[str, Any]) -> dict[str, Any]:
    """A setting's rows and `delta_fraction` (mean over its delta versions), and the late joiner's check."""
    deltas = [r["fraction"] for r in rows if r["kind"] == "delta"]
    return {"dtype": dtype, "lr": lr, "delta_fraction": statistics.fmean(deltas) if deltas else None,
            "delta_fraction_max": max(deltas) if deltas else None, "versions": list(rows), "late_join": dict(late_join)}


def baseline(nbytes: int, copy_s: float, write_s: float, read_s: float) -> dict[str, Any]:
    """The machine's own cost of moving `nbytes`: memory copy, file write (fsync) and read, and their sum."""
    total = copy_s + write_s + read_s
    return {"bytes": nbytes, "memory_copy_s": copy_s, "file_write_s": write_s, "file_read_s": read_s,
            "seconds": total, "memory_copy_mb_per_s": mb_per_s(nbytes, copy_s),
            "file_write_mb_per_s": mb_per_s(nbytes, write_s), "file_read_mb_per_s": mb_per_s(nbytes, read_s),
            "mb_per_s": mb_per_s(nbytes, total)}


def update_summary(full_bytes: int, served_s: Sequence[float], base: Mapping[str, Any]) -> dict[str, Any]:
    """Event -> served times of the delta versions an engine followed: the median, its bandwidth in
    full-version bytes per second, and `ratio` = that bandwidth / the baseline's (= baseline s / update s)."""
    median = statistics.median(served_s)
    return {"versions": len(served_s), "served_s": [round(s, 3) for s in served_s], "median_s": median,
            "mb_per_s": mb_per_s(full_bytes, median), "ratio": base["seconds"] / median if median > 0 else 0.0}


IN_MEMORY_LINE = re.compile(r"loaded version (\d+) from MinIO in memory .*?: download ([\d.]+) s, drain ([\d.]+) s, "
                            r"apply ([\d.]+) s, load ([\d.]+) s")
"""The line the engine supervisor logs for each version it applies in memory (pipeline/engine/supervisor.py)."""


def engine_split(log_text: str) -> list[dict[str, Any]]:
    """Per version the engine applied in memory, where its time went (download, drain, apply with the
    sha256 checks, vLLM's load), read from the engine's log; versions rebuilt on disk have no line."""
    return [{"version": int(m[1]), "download_s": float(m[2]), "drain_s": float(m[3]), "apply_s": float(m[4]),
             "load_s": float(m[5])} for m in IN_MEMORY_LINE.finditer(log_text)]

