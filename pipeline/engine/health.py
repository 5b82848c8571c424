"""Waiting for a freshly started server to serve: the one health poll of engines and their vLLM servers.

The engine supervisor (`rollstream engine`) waits this way for its vLLM server's `/health`; whoever
launches an engine (`rollstream up`, benchmarks, tests) waits for the supervisor's
`/rollstream/state` (pipeline/engine/launch.py `EngineProcess.wait_until_serving`).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

POLL_S = 0.5
PROBE_TIMEOUT_S = 2.0
LOG_TAIL_CHARS = 3000


class NotServing(RuntimeError):
    """The server exited, or did not answer within its timeout."""


def log_tail(log_path: Path | None, chars: int = LOG_TAIL_CHARS) -> str:
    """The end of a log file ('' when there is none): what a failed start is reported with."""
    return log_path.read_text(errors="replace")[-chars:] if log_path is not None and log_path.exists() else ""


def wait_until_serving(url: str, process: subprocess.Popen, timeout_s: float, *, probe: str = "/health",
                       name: str = "vLLM", log_path: Path | None = None,
                       headers: Mapping[str, str] | None = None) -> float:
    """Blocks until GET `url + probe` (with `headers`: the engine's key, env_workers/engine_client.auth_headers)
    answers 200; returns the seconds it took.

    Raises NotServing as soon as `process` exits (nothing would ever answer) or after `timeout_s`,
    with the end of `log_path` when given, since that is where the reason is."""
    started = time.monotonic()
    while True:
        if process.poll() is not None:
            raise NotServing(_with_log(f"{name} exited with {process.returncode} before serving", log_path))
        if time.monotonic() - started > timeout_s:
            raise NotServing(_with_log(f"{name} not serving after {timeout_s:.0f} s", log_path))
        try:
            if httpx.get(f"{url}{probe}", headers=dict(headers or {}), timeout=PROBE_TIMEOUT_S).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass  # not listening yet, or busy loading the model
        time.sleep(POLL_S)


def _with_log(message: str, log_path: Path | None) -> str:
    tail = log_tail(log_path)
    return f"{message}:\n{tail}" if tail else message
