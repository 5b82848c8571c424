"""Engine processes started at a lower scheduling priority (engines.nice), their children and their sessions too."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.engine.launch import popen_niced, set_session_niceness, stop_process_group

# The child waits a moment, so that the niceness is set before it starts a grandchild, as the engine
# supervisor imports for seconds before it starts vLLM; the grandchild prints its own niceness.
SCRIPT = ("import os, subprocess, sys, time; time.sleep(1); "
          "print(os.getpriority(os.PRIO_PROCESS, 0), subprocess.run([sys.executable, '-c', "
          "'import os; print(os.getpriority(os.PRIO_PROCESS, 0))'], capture_output=True, text=True).stdout.strip())")


def test_a_niced_process_and_the_processes_it_starts_run_at_the_lower_priority() -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    process = popen_niced([sys.executable, "-c", SCRIPT], 5, stdout=subprocess.PIPE, text=True,
                          start_new_session=True)
    out, _ = process.communicate(timeout=30)
    assert out.split() == [str(min(19, own + 5))] * 2


def test_nice_zero_leaves_the_priority_alone() -> None:
    process = popen_niced([sys.executable, "-c", "import time; time.sleep(30)"], 0, start_new_session=True)
    try:
        time.sleep(0.2)
        assert os.getpriority(os.PRIO_PROCESS, process.pid) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        stop_process_group(process, 5)


def _autogroup_line(pid: int | str) -> str | None:
    # Empty where the kernel has the file but does not schedule the process by autogroup (a process in a
    # cgroup of its own, as in many containers, CI machines among them): the same as no file.
    path = Path(f"/proc/{pid}/autogroup")
    return (path.read_text().strip() or None) if path.exists() else None


def test_a_niced_process_in_a_session_of_its_own_gets_a_niced_session_where_the_kernel_schedules_by_session() -> None:
    # Under autogroup scheduling a session's niceness, not the process's, weighs against other sessions.
    own = _autogroup_line("self")
    process = popen_niced([sys.executable, "-c", "import time; time.sleep(30)"], 7, start_new_session=True)
    try:
        line = _autogroup_line(process.pid)
        if line is not None:  # None: no autogroup for it, the process niceness is all there is
            # Our own file may read empty (a container's cgroup) while the new session still gets an autogroup.
            assert own is None or line.split()[0] != own.split()[0]
            assert line.endswith(f" nice {min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)}")
        assert _autogroup_line("self") == own
    finally:
        stop_process_group(process, 5)


def test_the_session_niceness_is_left_alone_for_a_process_that_shares_our_session() -> None:
    own = _autogroup_line("self")
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert set_session_niceness(process.pid, 9) is False  # it would have niced this test's session too
        assert _autogroup_line("self") == own
    finally:
        process.kill()
        process.wait()


def test_a_kernel_that_refuses_the_session_niceness_leaves_the_process_running_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A read-only /proc (some containers) must not stop an engine from starting.
    def refuse(self: Path, *_: object, **__: object) -> int:
        raise PermissionError(13, "Permission denied", str(self))

    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        monkeypatch.setattr(Path, "write_text", refuse)
        assert set_session_niceness(process.pid, 5) is False
        assert process.poll() is None
        if _autogroup_line(process.pid) is not None:
            assert "left at its niceness" in caplog.text
        else:
            assert "left at its niceness" not in caplog.text
    finally:
        stop_process_group(process, 5)
