"""Ctrl-C and SIGTERM during a run: the first one stops the run in order, the ones after it are ignored."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

from pipeline.run.follower import RunFollower
from pipeline.run.supervision import Stack


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: stop the run cleanly."""


def raise_interrupted(*_: object) -> None:
    # The first signal starts the shutdown; from then on they are ignored (shut_down restores the old
    # handlers), else a second one, e.g. Ctrl-C pressed twice or `timeout` forwarding its own, raised
    # again in the shutdown's first lines and the run ended in a traceback.
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted


def catch_interrupts() -> dict[int, Any]:
    """From here on Ctrl-C and SIGTERM raise Interrupted; returns the handlers they replace."""
    return {s: signal.signal(s, raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}


def shut_down(stack: Stack, follower: RunFollower | None, previous: dict[int, Any],
              say: Callable[[str], None]) -> dict[str, int | None]:
    """Stops the run's processes and its follower, then puts the previous signal handlers back.
    Meanwhile the signals are ignored: a second Ctrl-C, or a supervisor repeating SIGTERM, must not
    cut the shutdown short and leave engines running."""
    for s in previous:
        signal.signal(s, signal.SIG_IGN)
    codes = stack.stop(say)
    if follower is not None:
        follower.stop()
    for s, handler in previous.items():
        signal.signal(s, handler)
    return codes
