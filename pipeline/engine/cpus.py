"""Which CPU cores each engine of a run binds its vLLM worker's threads to (VLLM_CPU_OMP_THREADS_BIND).

vLLM's CPU worker binds its OpenMP threads by itself ("auto"): every core of its NUMA node but one, kept
for the rest of the host. It knows nothing of the other engines on the host, so every engine of a run
binds to the same cores: on two cores, the current and the stale engine (or two current ones) both ran
on core 0 while core 1 served everything else (seen with `taskset -cp` on their workers). Spread, the
engines of one host get disjoint sets of the cores this process may use instead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

AUTO = "auto"
"""vLLM binds by itself (the right choice for a single engine: it keeps a core for the rest)."""
NOBIND = "nobind"
"""No binding: the kernel schedules the worker's threads anywhere."""
CPU_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def valid_binding(value: str) -> str:
    """`value` if vLLM accepts it as one worker's VLLM_CPU_OMP_THREADS_BIND, else ValueError in one line."""
    if value in (AUTO, NOBIND) or CPU_LIST.match(value):
        return value
    raise ValueError(f"CPU binding {value!r} is none of auto, nobind or a list of CPU ids such as 0-3,6")


def engine_cpu_sets(allowed: Sequence[int], count: int) -> list[str]:
    """The binding of each of `count` engines on one host whose processes may use the cores `allowed`:
    vLLM's own for a single engine; otherwise the cores split into `count` contiguous, disjoint, equal
    (to within one) sets, or one core each, round robin, when there are more engines than cores."""
    if count <= 1:
        return [AUTO] * count
    cores = sorted(set(allowed))
    if not cores:
        raise ValueError("no CPU cores to bind engines to")
    if count >= len(cores):
        return [str(cores[i % len(cores)]) for i in range(count)]
    bounds = [i * len(cores) // count for i in range(count + 1)]
    return [",".join(str(c) for c in cores[bounds[i]:bounds[i + 1]]) for i in range(count)]


__all__ = ["AUTO", "NOBIND", "engine_cpu_sets", "valid_binding"]
