"""The os family: AgentBench's OS interaction tasks behind the function-call API, in a sandbox.

Per session (AgentBench `start_sample`/`_judge`): a fresh sandbox from the task's image; for a
variant (`os_variants.py`: a tool removed, the shell started elsewhere) its perturbation, whose
failure is a `task_error`; the `init` scripts run as independent processes whose exit codes are not checked, as AgentBench
discards `exec_run`'s result (a script that fails part-way, e.g. data/4/Q09's redirection to fd
123321 above the open-file limit, leaves what it did; counted in `metrics["init_failures"]`, and
the golden/no-op check finds the tasks this breaks); a sandbox that cannot run a script or a
script that runs past its time limit is an infrastructure failure (`task_error`, as AgentBench's
exception gives UNKNOWN); the `start` script runs in the persistent shell; then up to 8 rounds
of `bash_action` (output cut at 800 characters as AgentBench cuts it), ended by `answer_action`
or `finish_action`, which are graded by `os_tasks.grade` inside the same sandbox.
Reward 1 when the judgement passes, else 0.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from env_workers.envs import os_oracle, os_tiers, os_variants
from env_workers.envs.base import (
    EnvSettings,
    Environment,
    Family,
    Opened,
    Outcome,
    Session,
    Status,
    TaskError,
    ToolCall,
    tool,
)
from env_workers.envs.os_tasks import Script, grade, load_tasks, script_argv
from env_workers.sandbox import Sandbox, SandboxBackend, SandboxSettings, make_backend
from env_workers.sandbox.base import ExecResult, truncate_output

log = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You are an assistant that acts like a person operating a Linux (Ubuntu) shell. I play the operating "
    "system. Your goal is to carry out the operations I ask for or to answer my question. In each turn, "
    "think about what to do, then call exactly one tool: bash_action to run bash code (the shell keeps its "
    "state between turns; the code must not read input), answer_action when you have the answer to the "
    "question, finish_action when you have finished an operation that has no answer. If an output is too "
    "long it is truncated, and you have to work around the truncation yourself."
)

TOOLS = [
    tool("bash_action", "Run bash code in the Linux shell and see its output.",
         {"script": {"type": "string", "description": "The bash code to run."}}),
    tool("answer_action", "Give the final answer to the question; this ends the task.",
         {"answer": {"type": "string", "description": "The answer, exactly as asked for."}}),
    tool("finish_action", "Declare the requested operation finished; this ends the task.",
         {"thought": {"type": "string", "description": "Why the task is finished."}}),
]

DATA = "agentbench/os_interaction"
TEST_FILES = (
    f"{DATA}/data/1/stock.json",
    f"{DATA}/data/2/environment.json",
    f"{DATA}/data/3/ac.json",
    *(f"{DATA}/data/4/{name}.json" for name in ("N11", "N225", "N37", "N4", "N41", "Q09", "Q19", "Q30", "Q47", "Q49")),
    f"{DATA}/data/5/new.json",
    f"{DATA}/data/6/new.json",
    f"{DATA}/data/7/bootstrap.json",
)


@dataclass
class OsState:
    task: Mapping[str, Any]
    sandbox: Sandbox


class OsEnvironment(Environment):
    family = "os"

    def __init__(self, max_rounds: int, sandbox_settings: SandboxSettings) -> None:
        super().__init__(max_rounds)
        self.sandbox_settings = sandbox_settings
        self._backend: SandboxBackend | None = None

    @property
    def backend(self) -> SandboxBackend:
        if self._backend is None:
            self._backend = make_backend(self.sandbox_settings)
        return self._backend

    async def open(self, sample: Mapping[str, Any]) -> Opened:
        variant = os_variants.from_sample(sample)
        sandbox = await self.backend.open(sample["image"])
        try:
            # AgentBench opens the agent's `bash --login` before the init scripts run, so what they
            # write to ~/.bashrc is not yet in the shell's environment.
            await sandbox.shell.ensure()
            if variant is not None:
                await self._perturb(sandbox, variant)
            init_failures = 0
            for script in sample["init"]:
                if script is None:
                    continue
                result = await self._run_script(sandbox, script, [])
                if result.timed_out:
                    raise TaskError(f"init script ran past {self.sandbox_settings.script_timeout_s:g} s")
                if result.exit_code != 0:
                    init_failures += 1
                    log.info("%s: init script exited %d: %s", sample["id"], result.exit_code, result.output[-300:])
            if sample["start"] is not None:
                await sandbox.shell.run(sample["start"][1], self.sandbox_settings.command_timeout_s)
        except BaseException:
            await sandbox.close()
            raise
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": sample["description"]}]
        return Opened(messages=messages, tools=list(TOOLS), state=OsState(sample, sandbox),
                      metrics={"init_failures": float(init_failures)})

    async def call_tool(self, session: Session, call: ToolCall) -> Outcome:
        state: OsState = session.state
        if call.name == "bash_action":
            result = await state.sandbox.shell.run(call.arguments["script"], self.sandbox_settings.command_timeout_s)
            return Outcome(self._format(result))
        answer = call.arguments["answer"] if call.name == "answer_action" else None
        passed = await grade(state.task, answer, lambda script, params: self._judge_run(state.sandbox, script, params))
        return Outcome("Submitted.", Status.COMPLETED, 1.0 if passed else 0.0, {"passed": float(passed)})

    async def close(self, session: Session) -> None:
        if session.state is not None:
            await session.state.sandbox.close()

    async def _perturb(self, sandbox: Sandbox, variant: os_variants.Variant) -> None:
        """The variant's perturbation, before the task's init. Unlike an init script's, its failure is checked:
        a variant that did not happen would be graded as if it had (a task_error instead)."""
        setup = os_variants.setup_script(variant)
        if setup is not None:
            result = await sandbox.run(["bash", "-c", setup], self.sandbox_settings.script_timeout_s)
            if result.timed_out or result.exit_code != 0:
                raise TaskError(f"variant {variant.name}: its setup exited {result.exit_code}: {result.output[-300:]}")
        command = os_variants.shell_command(variant)
        if command is not None:
            result = await sandbox.shell.run(command, self.sandbox_settings.command_timeout_s)
            if result.exit_code != 0:
                raise TaskError(f"variant {variant.name}: the shell could not start there: {result.output[-300:]}")

    async def _judge_run(self, sandbox: Sandbox, script: Script, params: Sequence[str]) -> tuple[int, str]:
        result = await self._run_script(sandbox, script, params)
        return result.exit_code, result.output

    async def _run_script(self, sandbox: Sandbox, script: Script, params: Sequence[str]) -> ExecResult:
        result = ExecResult(0, "")
        for argv in script_argv(script, params):
            result = await sandbox.run(argv, self.sandbox_settings.script_timeout_s)
        return result

    def _format(self, result: ExecResult) -> str:
        s = self.sandbox_settings
        text = truncate_output(result.output, s.output_limit, s.output_keep)
        if result.timed_out:
            text += f"\n[the command ran past {s.command_timeout_s:g} s and was killed]"
        if result.shell_restarted:
            text = "[the previous shell exited; this ran in a new shell]\n" + text
        return text if text else os_oracle.EMPTY_OUTPUT

    async def aclose(self) -> None:
        if self._backend is not None:
            await self._backend.aclose()


def make(settings: EnvSettings, sandbox: SandboxSettings | None = None) -> OsEnvironment:
    """The os family with `settings.os_sandbox`, or `sandbox` instead (benchmarks compare backends)."""
    return OsEnvironment(settings.os_rounds, sandbox or settings.os_sandbox)


FAMILY = Family(
    name="os",
    make=make,
    load=load_tasks,
    splits={"test": TEST_FILES, "train": (f"{DATA}/train_0317/training.json",),
            **{split: () for split in (*os_tiers.SPLITS, *os_tiers.VARIANT_SPLITS)}},
    golden=os_oracle.golden,
    noop=os_oracle.noop,
    generate=os_tiers.generate,
)

__all__ = ["FAMILY", "OsEnvironment", "make"]
