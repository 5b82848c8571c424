"""The python family (ToRL's tool-integrated reasoning): math word problems solved with a code interpreter.

ToRL (Li et al. 2025, arXiv 2503.23383) lets the policy write Python, runs it in a sandbox and shows it the
output; here that is the tool `run_python(code)`, and the answer is `submit(answer)`, graded against the
generator's exact answer (`python_tasks.grade`: whole numbers exactly, two-place answers within 0.005).
Reward 1 for a right answer, else 0; with `EnvSettings.python_unexecuted_code_penalty`, -0.5 is added when
no code run of the episode succeeded (ToRL's executability penalty, off by default).

Each run is a new program (variables are not kept; files are, in the episode's sandbox), run by
`python_runner.RUNNER` in a sandbox of the os family's backend and limits (`EnvSettings.os_sandbox`: no
network, memory, processes, disk, CPU; bubblewrap or Docker) within `python_timeout_s`. The policy sees
the program's stdout and, when it fails, the last line of its error, cut as os output is cut. At most
`python_max_code_runs` runs per trajectory (ToRL's C); past it a call is refused and not run.

The sandbox is opened at the first run (a policy that answers at once costs none) and kept for the
episode. Who is to blame decides the outcome, as in base.py: what the code does to itself or to its
sandbox (an endless loop, a fork bomb, a huge allocation or output, killing its interpreter, killing the
whole sandbox) is a tool message the policy sees, and a sandbox the code broke is replaced by a fresh one
at the next run; a sandbox that cannot be opened, or that fails its first run, is an infrastructure
failure (`task_error`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from env_workers.envs import python_runner, python_tasks
from env_workers.envs.base import (
    ActionError,
    EnvSettings,
    Environment,
    Family,
    Opened,
    Outcome,
    Policy,
    Session,
    Status,
    ToolCall,
    assistant_call,
    scripted,
    tool,
)
from env_workers.sandbox import Sandbox, SandboxBackend, SandboxSettings, make_backend

log = logging.getLogger(__name__)

# ToRL's executability penalty (its reward table: non-executable code -0.5).
UNEXECUTED_CODE_PENALTY = -0.5
# The runner enforces the time limit itself; the sandbox's own limit is a backstop a little later.
RUNNER_GRACE_S = 5.0

SYSTEM_PROMPT = (
    "You solve math word problems with the help of a Python 3 interpreter. Call run_python with a complete "
    "program; you see what it prints to standard output and, if it fails, the last line of the error. Each run "
    "is a new program: variables are not kept between runs, so print every value you need. You may run code at "
    "most {runs} times. When you know the answer, call submit with the number; this ends the task."
)

TOOLS = [
    tool("run_python", "Run a Python 3 program and see its standard output and, if it fails, its last error line.",
         {"code": {"type": "string", "description": "The complete program; print the values you need."}}),
    tool("submit", "Submit the final answer; this ends the task.",
         {"answer": {"type": "number", "description": "The answer, as a number."}}),
]


def reward(correct: bool, code_successes: int, penalize_unexecuted: bool) -> float:
    """1 for a right answer, else 0; with the penalty on, -0.5 more when no code run succeeded."""
    value = 1.0 if correct else 0.0
    if penalize_unexecuted and code_successes == 0:
        value += UNEXECUTED_CODE_PENALTY
    return value


@dataclass
class PythonState:
    sandbox: Sandbox | None = None
    code_runs: int = 0
    code_successes: int = 0


class PythonEnvironment(Environment):
    family = "python"

    def __init__(self, settings: EnvSettings, backend: SandboxBackend | None = None) -> None:
        super().__init__(settings.python_rounds)
        self.sandbox_settings: SandboxSettings = settings.os_sandbox
        self.timeout_s = settings.python_timeout_s
        self.max_code_runs = settings.python_max_code_runs
        self.penalize_unexecuted = settings.python_unexecuted_code_penalty
        self._backend = backend

    @property
    def backend(self) -> SandboxBackend:
        if self._backend is None:
            self._backend = make_backend(self.sandbox_settings)
        return self._backend

    async def open(self, sample: Mapping[str, Any]) -> Opened:
        messages = [{"role": "system", "content": SYSTEM_PROMPT.format(runs=self.max_code_runs)},
                    {"role": "user", "content": sample["question"]}]
        return Opened(messages=messages, tools=list(TOOLS), state=PythonState(),
                      metrics={"code_runs": 0.0, "code_successes": 0.0, "sandbox_resets": 0.0})

    async def call_tool(self, session: Session, call: ToolCall) -> Outcome:
        state: PythonState = session.state
        if call.name == "submit":
            correct = python_tasks.grade(call.arguments["answer"], session.sample["exact"], session.sample["places"])
            value = reward(correct, state.code_successes, self.penalize_unexecuted)
            return Outcome("Submitted.", Status.COMPLETED, value, {"score": float(correct)})
        if state.code_runs >= self.max_code_runs:
            raise ActionError(f"the interpreter runs at most {self.max_code_runs} programs per task; "
                              f"this one was not run. Submit your answer.")
        code = call.arguments["code"]
        if python_runner.code_too_long(code):
            raise ActionError(f"the code is longer than {python_runner.MAX_CODE_BYTES} bytes; it was not run.")
        state.code_runs += 1
        session.metrics["code_runs"] = float(state.code_runs)
        text, succeeded = await self._run(session, state, code)
        state.code_successes += succeeded
        session.metrics["code_successes"] = float(state.code_successes)
        return Outcome(text)

    async def _run(self, session: Session, state: PythonState, code: str) -> tuple[str, bool]:
        """Runs one program: (the tool message, whether it succeeded)."""
        fresh = state.sandbox is None
        if state.sandbox is None:
            state.sandbox = await self.backend.open("default")  # cannot be opened: infrastructure, task_error
        s = self.sandbox_settings
        argv = python_runner.runner_argv(code, s.output_limit, self.timeout_s)
        try:
            result = await state.sandbox.run(argv, self.timeout_s + RUNNER_GRACE_S)
        except Exception:
            if fresh:  # a new sandbox that cannot run one program is broken, not broken by the code
                raise
            log.warning("python: session %s's sandbox failed under its code; resetting it", session.id, exc_info=True)
            report, timed_out = None, False
        else:
            report, timed_out = python_runner.parse_report(result.output), result.timed_out
        if report is None:
            await self._reset(session, state)
            return python_runner.lost_text(timed_out, self.timeout_s), False
        return python_runner.tool_text(report, self.timeout_s, s.output_limit, s.output_keep), report.succeeded

    async def _reset(self, session: Session, state: PythonState) -> None:
        """Drops a sandbox the code broke (or may have: its runner left no report); the next run gets a new one."""
        sandbox, state.sandbox = state.sandbox, None
        session.metrics["sandbox_resets"] = session.metrics.get("sandbox_resets", 0.0) + 1
        if sandbox is not None:
            try:
                await sandbox.close()
            except Exception:
                log.exception("python: closing session %s's broken sandbox failed", session.id)

    async def close(self, session: Session) -> None:
        state: PythonState | None = session.state
        if state is not None and state.sandbox is not None:
            await state.sandbox.close()

    async def aclose(self) -> None:
        if self._backend is not None:
            await self._backend.aclose()


def make(settings: EnvSettings, backend: SandboxBackend | None = None) -> PythonEnvironment:
    """The python family with `settings.os_sandbox`'s backend, or `backend` instead (tests pass their own)."""
    return PythonEnvironment(settings, backend)


def generate(split: str, settings: EnvSettings) -> list[dict[str, Any]]:
    return python_tasks.generate(split, settings.python_seed, settings.python_train_tasks, settings.python_dev_tasks)


def load(path: Path) -> list[dict[str, Any]]:
    """A JSONL file of python tasks in the generated form (id, question, level, kind, answer, exact, places, code)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")


def printed_number(text: str) -> int | float | None:
    """The number a program printed as its only output (an int when it is written as one), else None."""
    text = text.strip()
    if not _NUMBER.fullmatch(text):
        return None
    return int(text) if re.fullmatch(r"-?\d+", text) else float(text)


def golden(task: Mapping[str, Any]) -> Policy:
    """Runs the task's golden code, then submits the number it printed (0 when it printed none)."""
    def policy(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        outputs = [m.get("content") or "" for m in history if m.get("role") == "tool"]
        if not outputs:
            return assistant_call("run_python", {"code": task["code"]})
        answer = printed_number(outputs[-1])
        return assistant_call("submit", {"answer": 0 if answer is None else answer}, call_id="call_1")

    return policy


def noop(task: Mapping[str, Any]) -> Policy:
    """Submits 0 straight away (no answer is 0) and never runs code."""
    return scripted([assistant_call("submit", {"answer": 0})])


FAMILY = Family(name="python", make=make, load=load, splits={split: () for split in python_tasks.SPLITS},
                golden=golden, noop=noop, generate=generate)

__all__ = ["FAMILY", "PythonEnvironment", "make"]
