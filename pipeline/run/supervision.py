"""The processes of one run: started in their own sessions with their logs, restarted within a
budget when they die on their own, and stopped in waves in the reverse of their start order."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pipeline.engine.launch import EngineProcess, popen_niced, stop_process_groups
from pipeline.run.config import REPO_ROOT, write_private
from pipeline.run.plan import Child


class RunFailed(RuntimeError):
    """A process of the run ended on its own, or the run could not start."""


def last_words(log_tail: str) -> str | None:
    """The last line of a log that says something: librdkafka's own `%3|...` lines and progress bars
    (a carriage return inside the line) are skipped, since they outlive the error that ended the process."""
    for line in reversed(log_tail.splitlines()):
        line = line.strip()
        if line and not line.startswith("%") and "\r" not in line and not line.endswith("it/s]"):
            return line[:300]
    return None


@dataclass
class RestartBudget:
    """How many times each process of a run (child or engine, by name) may be started again after
    it died on its own: `limit` times each. One budget for both, so that `used` is the run's record
    of every restart."""

    limit: int
    used: dict[str, int] = field(default_factory=dict)

    def take(self, name: str, code: int | None, log_tail: Callable[[], str], label: str | None = None) -> int:
        """Counts one restart of `name`, which exited with `code`, and returns its number (1 for the
        first). Past the limit raises RunFailed with the end of its log; `label` names it there
        (default: `name`)."""
        used = self.used.get(name, 0)
        if used >= self.limit:
            raise RunFailed(f"{label or name} exited with {code}"
                            f"{f' after {used} restarts' if used else ''}:\n{log_tail()}")
        self.used[name] = used + 1
        return used + 1


@dataclass
class RunningChild:
    """A started process of the run."""

    child: Child
    process: subprocess.Popen
    log_path: Path
    log: IO[bytes]

    @classmethod
    def start(cls, child: Child, log_dir: Path) -> RunningChild:
        for path, content in child.files.items():
            write_private(Path(path), content)
        log_path = log_dir / f"{child.name}.log"
        log = open(log_path, "ab")
        # Its own session: Ctrl-C reaches only `up`, which stops every child in order.
        process = popen_niced(child.argv, child.nice, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                              env={**child.env, **os.environ}, start_new_session=True)
        return cls(child, process, log_path, log)

    def log_tail(self, chars: int = 2500) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    @property
    def stop_timeout_s(self) -> float:
        """How long it may take to stop before it is killed: env workers drain their in-flight rollouts,
        the rest stop within seconds."""
        return 150.0 if self.child.name.startswith("env-worker") else 60.0


def stop_waves(names: list[str]) -> list[list[str]]:
    """The order a run's children stop in, from their start order: the dispatcher first (nothing new goes
    out), then together whatever consumes what it sent (env workers draining their rollouts, the learner),
    then the streams worker that fed them; each wave in the reverse of the start order, empty waves left out."""
    newest_first = list(reversed(names))
    first = [n for n in newest_first if n == "dispatcher"]
    last = [n for n in newest_first if n == "streams"]
    middle = [n for n in newest_first if n not in first and n not in last]
    return [wave for wave in (first, middle, last) if wave]


class Stack:
    """The processes of one run (engines apart), stopped in the reverse of their start order; the
    engines, started first, are stopped last."""

    def __init__(self, log_dir: Path, max_restarts: int = 0) -> None:
        self.log_dir = log_dir
        self.budget = RestartBudget(max_restarts)
        self.children: list[RunningChild] = []
        self.engines: list[EngineProcess] = []

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts so far, by child name and engine id."""
        return self.budget.used

    def metrics_urls(self) -> dict[str, str]:
        """Where each process serves its Prometheus metrics: children by name, then engines by id."""
        named = [(c.child.name, c.child.metrics_url) for c in self.children]
        named += [(e.engine_id, e.metrics_url) for e in self.engines]
        return {name: url for name, url in named if url is not None}

    def start(self, child: Child) -> RunningChild:
        running = RunningChild.start(child, self.log_dir)
        self.children.append(running)
        return running

    def supervise(self, say: Callable[[str], None], finished: Iterable[str] = ()) -> None:
        """Restarts a child that ended on its own (its restart command: the learner resumes from its
        checkpoint, the others from their committed offsets), within the restart budget; beyond it
        raises RunFailed. Children named in `finished` that exited 0 are done, not dead."""
        done = set(finished)
        for i, c in enumerate(self.children):
            code = c.process.poll()
            if code is None or (c.child.name in done and code == 0):
                continue
            n = self.budget.take(c.child.name, code, c.log_tail)
            c.log.close()
            words = last_words(c.log_tail())
            say(f"{c.child.name} exited with {code}: restarting it ({n} of {self.budget.limit})"
                + (f"; its last words: {words}" if words and code not in (-9, -15) else ""))
            self.children[i] = RunningChild.start(c.child.restarted(), self.log_dir)

    def failed(self) -> RunningChild | None:
        """The first child that has exited."""
        return next((c for c in self.children if c.process.poll() is not None), None)

    def stop(self, say: Callable[[str], None]) -> dict[str, int | None]:
        """Stops the children in their waves (`stop_waves`), then every engine at once; their exit codes by name."""
        codes: dict[str, int | None] = {}
        by_name = {c.child.name: c for c in self.children}
        for wave in stop_waves([c.child.name for c in self.children]):
            stopping = [by_name[name] for name in wave]
            for c, code in zip(stopping, stop_process_groups([(c.process, c.stop_timeout_s) for c in stopping])):
                c.log.close()
                codes[c.child.name] = code
        for e, code in zip(self.engines, stop_process_groups([(e.process, 60.0) for e in self.engines])):
            codes[e.engine_id] = code
        say("stopped: " + ", ".join(f"{n} ({'ok' if rc in (0, -15) else rc})" for n, rc in codes.items()))
        return codes
