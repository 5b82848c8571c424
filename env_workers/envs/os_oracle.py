"""Golden and no-op policies for OS tasks (ROLL's two rules for training data).

Golden: a `match` task is answered with its expected string; a `check` task runs its `example`
script through bash_action (what an agent that knew the solution would type) and answers with the
output, which is what AgentBench's checks compare against the example's own output.
No-op: finish without an answer.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from env_workers.envs.base import Policy, assistant_call
from env_workers.envs.os_tasks import Script

EMPTY_OUTPUT = "The output of the OS is empty."


def script_as_command(script: Script) -> str:
    """A task script as one bash_action: bash inline, other languages through their interpreter."""
    language, code = script
    if language == "bash":
        return code
    if language == "python":
        return f"python3 -c {shlex.quote(code)}"
    compiler = "gcc" if language == "c" else "g++"
    return f"printf %s {shlex.quote(code)} > /tmp/main.cpp && {compiler} -o /tmp/a.out /tmp/main.cpp && /tmp/a.out"


def _last_tool_output(history: Sequence[Mapping[str, Any]]) -> str:
    for message in reversed(history):
        if message.get("role") == "tool":
            content = message.get("content") or ""
            return "" if content == EMPTY_OUTPUT else content.strip()
    return ""


def golden(task: Mapping[str, Any]) -> Policy:
    match = task["match"]
    if match is not None and "answer" in match:
        expected = match["answer"]
        return lambda history: assistant_call("answer_action", {"answer": expected})
    example = task["example"]

    def policy(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not any(m.get("role") == "tool" for m in history):
            return assistant_call("bash_action", {"script": script_as_command(example)})
        return assistant_call("answer_action", {"answer": _last_tool_output(history)})

    return policy


def noop(task: Mapping[str, Any]) -> Policy:
    return lambda history: assistant_call("finish_action", {"thought": "I am done."})
