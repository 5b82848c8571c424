"""How an engine's vLLM processes wait for each other: a vLLM general plugin (the `vllm.general_plugins` entry
point in pyproject.toml), which vLLM loads in each of its processes, the engine core and the worker included.

vLLM's engine core hands every step to its worker process through a shared-memory queue and reads the result
from another (vllm.distributed.device_communicators.shm_broadcast). A reader waiting on one polls it in a loop
that calls `sched_yield()` for up to a second after each message: the engine core polls while the worker
computes the step, the worker while the engine core schedules the next. On a GPU host each has a core to
spare. On a CPU host the worker's threads compute on the same cores, and beside the learner and a second
engine every core is taken: a yielding poller is runnable at once again and keeps its share of a core.

With `ROLLSTREAM_ENGINE_POLL_SLEEP_S` set to a positive number, each poll sleeps that long instead, so a waiting
process stops taking a share of a core (alone, an engine used 49 CPU s instead of 79 in 40 s); a message is seen
at most that much later (0.2 ms beside a CPU step of 10-30 ms).
Unset or 0, vLLM's own loop is left as it is. The supervisor sets it from `EngineSettings.poll_sleep_s`.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Mapping

POLL_SLEEP_ENV = "ROLLSTREAM_ENGINE_POLL_SLEEP_S"


def poll_sleep_s(environ: Mapping[str, str]) -> float:
    """The sleep between two polls that the environment asks for; 0 leaves vLLM's loop as it is."""
    raw = environ.get(POLL_SLEEP_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{POLL_SLEEP_ENV}={raw!r} is not a number of seconds") from None
    if not 0 <= value < 1:
        raise ValueError(f"{POLL_SLEEP_ENV}={raw!r} must be at least 0 and below 1 second")
    return value


def register() -> None:
    """vLLM's entry point: replaces the yield in the shared-memory queue's polling loops with a short sleep."""
    sleep_s = poll_sleep_s(os.environ)
    if not sleep_s:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    # A vLLM that no longer polls through this name would silently keep spinning; fail loudly instead.
    if not callable(getattr(shm_broadcast, "sched_yield", None)):
        raise RuntimeError(f"{POLL_SLEEP_ENV} is set, but vLLM's shm_broadcast no longer calls sched_yield "
                           "(pipeline/engine/poll.py was written for vLLM 0.32)")
    shm_broadcast.sched_yield = functools.partial(time.sleep, sleep_s)
