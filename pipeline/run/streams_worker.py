"""A streams worker (`rollstream streams worker`) as a subprocess of the caller.

Benchmarks and tests run the stream processor as deployed, in a process of its own that they can
stop cleanly or kill: the worker runs in its own session, so SIGKILL takes it and its children
whole, as a crash would, and its output goes to a log file the caller can show on failure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pipeline.run.config import REPO_ROOT


@dataclass
class WorkerProcess:
    """`rollstream streams worker` as a subprocess (its own session, so SIGKILL takes it whole)."""

    app_id: str
    datadir: Path
    log_path: Path
    options: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    _log: IO[bytes] | None = None

    def start(self) -> WorkerProcess:
        self._log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "pipeline.cli.streams", "worker", "--app-id", self.app_id,
               "--datadir", str(self.datadir), *self.options]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final commit (what a crash looks like)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM and up to 30 s for a clean shutdown, then SIGKILL; closes the log."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log is not None:
            self._log.close()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""
