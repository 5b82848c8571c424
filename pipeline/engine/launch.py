"""Start and stop `rollstream engine` processes (for `rollstream up`, benchmarks and tests)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.engine import health
from schemas.prometheus import metrics_url

log = logging.getLogger(__name__)


def stop_process_group(process: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM to the process group a process leads (it was started with start_new_session), SIGKILL
    after timeout_s; its exit status."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode


def stop_process_groups(processes: list[tuple[subprocess.Popen, float]]) -> list[int]:
    """`stop_process_group` of several processes at once: SIGTERM to every group first, then each waited
    for up to its own timeout (from the moment of the signal) and SIGKILLed past it; their exit statuses,
    in order. Stopping them together costs the slowest one's shutdown, not the sum of all."""
    started = time.monotonic()
    for process, _ in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for process, timeout_s in processes:
        try:
            process.wait(timeout=max(0.0, started + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
    return [process.returncode for process, _ in processes]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on at `host` now (the OS's choice); the caller binds it soon after."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` different ports nobody listens on at `host` now: every socket stays bound until all are
    picked, so the OS cannot hand out one of them twice."""
    with ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]


@dataclass
class EngineProcess:
    """One running engine: its supervisor process (which owns vLLM's server) and where it serves."""

    pool: str
    engine_id: str
    url: str
    process: subprocess.Popen
    log_path: Path
    metrics_port: int | None = None
    """Where its supervisor serves Prometheus metrics (vLLM's own are at the engine's url + /metrics)."""
    cpus: str = "auto"
    """The cores its vLLM worker binds to (`rollstream engine --cpus`), kept when it is started again."""

    @property
    def metrics_url(self) -> str | None:
        return metrics_url(self.metrics_port) if self.metrics_port is not None else None

    def log_tail(self, chars: int = health.LOG_TAIL_CHARS) -> str:
        return health.log_tail(self.log_path, chars)

    def wait_until_serving(self, timeout_s: float = 300.0) -> float:
        """Blocks until the control surface answers; returns the seconds it took. An engine that
        exits or does not come up raises NotServing (a RuntimeError) with the end of its log."""
        return health.wait_until_serving(self.url, self.process, timeout_s, probe="/rollstream/state",
                                         name=f"engine {self.engine_id}", log_path=self.log_path)

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to the whole process group (supervisor and vLLM), SIGKILL if it lingers."""
        stop_process_group(self.process, timeout_s)


def _autogroup(pid: int | str) -> str | None:
    """The autogroup (session) a process is scheduled in, from /proc/PID/autogroup; None where the kernel has none."""
    try:
        return Path(f"/proc/{pid}/autogroup").read_text().split()[0]
    except (OSError, IndexError):
        return None


def set_session_niceness(pid: int, nice: int, attempts: int = 20) -> bool:
    """Gives the session a process leads the niceness `nice`, where the kernel schedules by session.

    Linux with autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled, on by default on many
    distributions) first shares the CPUs fairly between sessions and only then by niceness within one. A
    process started with start_new_session leads a session of its own, so its niceness alone weighs nothing
    against the learner's session (measured here: two CPU-bound sessions, one at nice 19, still split two
    cores 50/50; with the session niced 19, 97/3). Returns False, changing nothing, where the kernel has
    autogroup for the process or it shares our session (niceing it would nice us too), and with a warning
    where the kernel refuses (a read-only /proc in some containers): the process then runs, at its own niceness
    only. We need no autogroup of our own: in a container's cgroup our file reads empty while a session we
    start can still get an autogroup (seen on a CI machine), and niceing that one leaves us alone."""
    try:
        if _autogroup(pid) is None or os.getsid(pid) == os.getsid(0):
            return False
    except ProcessLookupError:
        return False
    for _ in range(attempts):
        try:
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))
            return True
        except BlockingIOError:  # the kernel allows one change every 100 ms to unprivileged users
            time.sleep(0.1)
        except OSError as error:
            log.warning("session of process %d left at its niceness (%s): engines.nice weighs little against "
                        "other sessions", pid, error)
            return False
    log.warning("session of process %d left at its niceness: the kernel kept answering EAGAIN", pid)
    return False


def popen_niced(command: Sequence[str], nice: int, **popen: Any) -> subprocess.Popen:
    """subprocess.Popen, then the process's niceness raised by `nice` (0: left alone). A process it starts
    afterwards inherits it: the engine supervisor takes seconds of imports before it starts vLLM. Started
    with start_new_session, its session gets the same niceness (see set_session_niceness)."""
    process = subprocess.Popen(command, **popen)
    if nice:
        niceness = min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice)
        os.setpriority(os.PRIO_PROCESS, process.pid, niceness)
        if popen.get("start_new_session"):
            set_session_niceness(process.pid, niceness)
    return process


# Run by `popen_tied` in the child, before the real command replaces it (same pid): arms the parent-death
# signal, then checks the parent is still the one that started it (it may have died before the signal was
# armed, and would never send it), then execs. Not Linux: nothing to arm, the child is not tied.
_TIED_CHILD = """
import ctypes, os, sys
parent, signum, command = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
if prctl is not None:
    if prctl(1, signum, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        sys.exit(128 + signum)
os.execvp(command[0], command)
"""


def popen_tied(command: list[str], *, death_signal: int = signal.SIGTERM, **popen: Any) -> subprocess.Popen:
    """subprocess.Popen of `command` that receives `death_signal` when this process dies, however it
    dies (SIGKILL included, where no cleanup of ours runs): Linux's PR_SET_PDEATHSIG.

    The signal is armed by a short Python prelude that then execs `command` (the pid stays the
    same), not by a preexec_fn: preexec_fn runs Python between fork and exec, which can deadlock
    when the parent has threads (our imports start some), and Python documents it as unsafe then.
    The kernel sends the signal when the *thread* that started the child exits, so call this from
    the thread that lives as long as the process (the supervisor's main thread). SIGTERM by
    default: vLLM's server then shuts down its own engine-core processes, which a SIGKILL would
    leave behind; a server that hangs on SIGTERM is not killed."""
    prelude = [sys.executable, "-c", _TIED_CHILD, str(os.getpid()), str(int(death_signal))]
    return subprocess.Popen([*prelude, *command], **popen)


def engine_command(*, pool: str, model_dir: Path, run: str, port: int, engine_id: str, work_dir: Path,
                   bind_host: str, advertise_host: str | None, extra_args: tuple[str, ...] = ()) -> list[str]:
    """The command line of one engine (`rollstream engine` as its module): what `launch_engine` starts here
    and `rollstream process engine` execs in a container of its own."""
    command = [sys.executable, "-m", "pipeline.cli.engine", "--pool", pool, "--model", str(model_dir),
               "--port", str(port), "--engine-id", engine_id, "--run", run,
               "--work-dir", str(work_dir), "--host", bind_host, *extra_args]
    if advertise_host:
        command += ["--advertise-url", f"http://{advertise_host}:{port}"]
    return command


def launch_engine(*, pool: str, model_dir: Path, run: str, work_dir: Path, port: int | None = None,
                  engine_id: str | None = None, extra_args: tuple[str, ...] = (),
                  cwd: Path | None = None, bind_host: str = "127.0.0.1",
                  advertise_host: str | None = None, nice: int = 0,
                  env: dict[str, str] | None = None, metrics_port: int | None = None,
                  cpus: str = "auto") -> EngineProcess:
    """Starts `rollstream engine` in its own process group; call `wait_until_serving` next.
    bind_host 0.0.0.0 with an advertise_host lets other machines (containers) reach it; `nice` lowers the
    scheduling priority of the engine and of every process it starts (vLLM's inherit it); `env`, when
    given, replaces the environment it inherits; `metrics_port`, when given, is where the supervisor serves
    its Prometheus metrics; `cpus` binds its vLLM worker's threads (pipeline/engine/cpus.py)."""
    port = port or free_port()
    engine_id = engine_id or f"{pool}-{port}"
    work_dir.mkdir(parents=True, exist_ok=True)
    log_path = work_dir / f"{engine_id}.log"
    command = engine_command(pool=pool, model_dir=model_dir, run=run, port=port, engine_id=engine_id,
                             work_dir=work_dir / engine_id, bind_host=bind_host, advertise_host=advertise_host,
                             extra_args=extra_args)
    if metrics_port is not None:
        command += ["--metrics-port", str(metrics_port)]
    if cpus != "auto":
        command += ["--cpus", cpus]
    with open(log_path, "ab") as log:  # an engine started again keeps the log of its previous life
        process = popen_niced(command, nice, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                              start_new_session=True)
    return EngineProcess(pool, engine_id, f"http://127.0.0.1:{port}", process, log_path, metrics_port, cpus)
