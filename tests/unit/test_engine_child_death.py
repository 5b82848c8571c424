"""The engine supervisor's vLLM child dies with it: a parent started like `rollstream engine` starts a
child through the same helper (`popen_tied`, what supervisor.start_server uses), is SIGKILLed, and the
child must be gone within seconds instead of serving on with parent 1. Real processes; `sleep` stands
in for vLLM. Linux only, as PR_SET_PDEATHSIG is."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pipeline.engine.launch import _TIED_CHILD
from pipeline.run.config import REPO_ROOT

# A supervisor-like parent: starts the child in a session of its own (as start_server does), says its
# pid, then lives until killed.
PARENT = """
import subprocess, sys, time
from pipeline.engine.launch import popen_tied
tied = sys.argv[1] == "tied"
command = ["sleep", "60"]
child = popen_tied(command, start_new_session=True) if tied else subprocess.Popen(command, start_new_session=True)
print(child.pid, flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def runs_sleep(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == b"sleep"
    except FileNotFoundError:
        return False


def wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def parent_with_child(mode: str) -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    # The prelude has exec'd the real command (same pid) before the parent is killed.
    assert wait_for(lambda: runs_sleep(child), 10.0)
    return parent, child


def test_child_started_by_a_supervisor_dies_when_the_supervisor_is_sigkilled():
    parent, child = parent_with_child("tied")
    try:
        parent.kill()
        parent.wait(timeout=10)
        assert wait_for(lambda: not alive(child), 5.0), f"child {child} outlived its SIGKILLed parent"
    finally:
        if alive(child):
            os.kill(child, 9)


def test_an_untied_child_outlives_its_sigkilled_parent():
    """The failure the tie prevents (and a check that the test above can fail)."""
    parent, child = parent_with_child("untied")
    try:
        parent.kill()
        parent.wait(timeout=10)
        time.sleep(0.5)
        assert alive(child)
    finally:
        os.kill(child, 9)


def test_child_whose_parent_died_before_the_signal_was_armed_exits_at_once():
    # Told its parent is pid 1 (not ours): as if the parent had died between fork and prctl.
    done = subprocess.run([sys.executable, "-c", _TIED_CHILD, "1", "15", "sleep", "60"], timeout=10)
    assert done.returncode == 128 + 15
