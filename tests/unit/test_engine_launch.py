"""Engine processes: started at a lower scheduling priority (engines.nice), their children and their sessions
too; and the wait until a started server serves."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.engine.health import NotServing, wait_until_serving
from pipeline.engine.launch import (
    free_port,
    free_ports,
    popen_niced,
    set_session_niceness,
    stop_process_group,
)

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


def test_waiting_for_a_server_returns_once_its_probe_answers(tmp_path: Path) -> None:
    port = free_port()
    # Listens only after a moment, as vLLM does while it loads the model.
    server = subprocess.Popen(["sh", "-c", f"sleep 1; exec {sys.executable} -m http.server --bind 127.0.0.1 {port}"],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        seconds = wait_until_serving(f"http://127.0.0.1:{port}", server, 30, probe="/")
        assert 0.9 < seconds < 30
    finally:
        stop_process_group(server, 5)


def test_a_server_that_exits_before_serving_fails_the_wait_with_the_end_of_its_log(tmp_path: Path) -> None:
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen([sys.executable, "-c", "print('no model here'); raise SystemExit(3)"], stdout=log)
    with pytest.raises(NotServing, match="^engine e1 exited with 3 before serving:\nno model here"):
        wait_until_serving(f"http://127.0.0.1:{free_port()}", server, 30, name="engine e1", log_path=log_path)


def test_a_server_that_never_answers_fails_the_wait_after_its_timeout() -> None:
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        started = time.monotonic()
        with pytest.raises(NotServing, match="^vLLM not serving after 1 s$"):
            wait_until_serving(f"http://127.0.0.1:{free_port()}", server, 1)
        assert time.monotonic() - started < 5
    finally:
        stop_process_group(server, 5)


def test_ports_picked_together_are_all_different() -> None:
    # `rollstream up` gives every process of a run a metrics port from one call
    ports = free_ports(50)
    assert len(set(ports)) == 50 and all(p > 0 for p in ports)
