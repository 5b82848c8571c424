"""Engine processes started at a lower scheduling priority (engines.nice), their children too."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pipeline.engine.launch import popen_niced, stop_process_group

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
