"""The python family through the environment API, with its code run by the real runner as a plain local process
(a stand-in backend: no isolation, so only benign code here; hostile code in real sandboxes is in
tests/integration/test_python_env.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from env_workers.envs import python_env, registry
from env_workers.envs.base import EnvSettings, Observation, Session, Status, assistant_call
from env_workers.envs.check import check_family
from env_workers.sandbox import SandboxCrashed
from env_workers.sandbox.base import ExecResult, Sandbox, SandboxBackend, ShellChannel
from pipeline.run.config import load_config

SETTINGS = EnvSettings(python_timeout_s=5.0)
SAMPLE = registry.sample("python", "dev", 0, SETTINGS)


class LocalSandbox(Sandbox):
    """Runs each argv as a local process, stdout and stderr merged, as the backends' `run` does."""

    backend = "local"

    def __init__(self, fail_runs: bool = False, output: str | None = None) -> None:
        super().__init__()
        self.fail_runs, self.output, self.runs, self.closed = fail_runs, output, 0, False

    async def _open_shell(self) -> ShellChannel:
        raise NotImplementedError("the python family runs no shell")

    async def run(self, argv: Sequence[str], timeout_s: float) -> ExecResult:
        self.runs += 1
        if self.fail_runs:
            raise SandboxCrashed("the container is gone")
        if self.output is not None:
            return ExecResult(-9, self.output)
        process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                       stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(process.communicate(), timeout_s)
        return ExecResult(process.returncode or 0, out.decode("utf-8", errors="replace"))

    async def _release(self) -> None:
        self.closed = True


class LocalBackend(SandboxBackend):
    name = "local"

    def __init__(self, *sandboxes: LocalSandbox, fail_open: bool = False) -> None:
        self.waiting, self.opened, self.fail_open = list(sandboxes), [], fail_open

    async def open(self, image: str) -> Sandbox:
        if self.fail_open:
            raise SandboxCrashed("no engine")
        sandbox = self.waiting.pop(0) if self.waiting else LocalSandbox()
        self.opened.append(sandbox)
        return sandbox


def _env(backend: SandboxBackend | None = None, **settings: object) -> python_env.PythonEnvironment:
    return python_env.make(SETTINGS.model_copy(update=settings), backend or LocalBackend())


async def _play(env: python_env.PythonEnvironment, messages: list[dict]) -> tuple[list[Observation], Session]:
    session = await env.start(SAMPLE)
    observations = []
    try:
        for message in messages:
            observations.append(await env.observation(session, message))
            if observations[-1].finish:
                break
    finally:
        await env.end(session)
    return observations, session


def _run(code: str) -> dict:
    return assistant_call("run_python", {"code": code})


def _submit(answer: object) -> dict:
    return assistant_call("submit", {"answer": answer})


def test_tools_are_openai_function_schemas_and_the_prompt_names_the_run_budget() -> None:
    session = asyncio.run(_env(python_max_code_runs=3).start(SAMPLE))
    assert [t["function"]["name"] for t in session.tools] == ["run_python", "submit"]
    assert all(t["type"] == "function" and t["function"]["parameters"]["type"] == "object" for t in session.tools)
    assert session.tools[1]["function"]["parameters"]["properties"]["answer"] == {
        "type": "number", "description": "The answer, as a number."}
    assert [m["role"] for m in session.messages] == ["system", "user"]
    assert session.messages[1]["content"] == SAMPLE["question"] and "at most 3 times" in session.messages[0]["content"]


def test_a_run_shows_stdout_or_the_last_error_line_and_the_session_goes_on() -> None:
    observations, session = asyncio.run(_play(_env(), [_run("print(6 * 7)"), _run("x = 1\nprint(x / 0)"),
                                                        _run("pass"), _submit(0)]))
    assert [o.messages[0]["content"] for o in observations[:3]] == [
        "42\n", "ZeroDivisionError: division by zero", "The code ran and printed nothing."]
    assert [o.messages[0]["role"] for o in observations[:3]] == ["tool"] * 3
    assert [o.status for o in observations] == [Status.RUNNING] * 3 + [Status.COMPLETED]
    assert session.metrics["code_runs"] == 3 and session.metrics["code_successes"] == 2


def test_golden_passes_and_noop_fails_through_the_check() -> None:
    family = registry.family("python")
    samples = registry.samples("python", "dev", SETTINGS)[:6]  # two of each level
    result = asyncio.run(check_family(family, _env(), samples))
    assert (result["golden_pass"], result["noop_pass"], result["errors"], result["failing_ids"]) == (6, 0, 0, [])


def test_a_right_answer_gets_1_and_a_wrong_one_0() -> None:
    right, _ = asyncio.run(_play(_env(), [_submit(json.loads(SAMPLE["answer"]))]))
    wrong, _ = asyncio.run(_play(_env(), [_submit(json.loads(SAMPLE["answer"]) + 1)]))
    assert (right[-1].reward, right[-1].metrics["score"]) == (1.0, 1.0)
    assert (wrong[-1].reward, wrong[-1].metrics["score"]) == (0.0, 0.0)


def test_runs_past_the_cap_are_refused_without_running_and_the_answer_still_counts() -> None:
    backend = LocalBackend()
    messages = [_run("print(1)"), _run("print(2)"), _run("print(3)"), _submit(json.loads(SAMPLE["answer"]))]
    observations, session = asyncio.run(_play(_env(backend, python_max_code_runs=2), messages))
    assert observations[2].messages[0]["content"].startswith("Error: the interpreter runs at most 2 programs")
    assert backend.opened[0].runs == 2 and session.metrics["code_runs"] == 2 and session.metrics["tool_errors"] == 1
    assert observations[-1].status == Status.COMPLETED and observations[-1].reward == 1.0


@pytest.mark.parametrize(("penalty", "messages", "reward"), [
    (False, [_run("1/0"), _submit("wrong")], 0.0),   # off: a wrong answer is 0 whatever the code did
    (False, [_submit("answer")], 1.0),
    (True, [_run("1/0"), _submit("wrong")], -0.5),   # code never ran to its end, wrong answer
    (True, [_submit("wrong")], -0.5),                # no code at all counts as none that ran
    (True, [_run("1/0"), _submit("answer")], 0.5),   # right, but no code ran
    (True, [_run("1/0"), _run("print(1)"), _submit("wrong")], 0.0),  # one run succeeded: no penalty
    (True, [_run("print(1)"), _submit("answer")], 1.0),
    (True, [_run("import time\ntime.sleep(9)"), _submit("wrong")], -0.5),  # a run stopped at the time limit failed
])
def test_the_unexecuted_code_penalty_is_an_option_off_by_default(penalty: bool, messages: list, reward: float) -> None:
    answer = json.loads(SAMPLE["answer"])
    for message in messages:
        call = message["tool_calls"][0]["function"]
        if call["name"] == "submit":
            given = json.loads(call["arguments"])["answer"]
            call["arguments"] = json.dumps({"answer": answer if given == "answer" else answer + 1})
    observations, _ = asyncio.run(_play(_env(python_unexecuted_code_penalty=penalty, python_timeout_s=0.5), messages))
    assert observations[-1].status == Status.COMPLETED and observations[-1].reward == reward
    assert EnvSettings().python_unexecuted_code_penalty is False


def test_the_reward_rule_adds_the_penalty_only_without_a_successful_run() -> None:
    assert python_env.reward(True, 0, False) == 1.0 and python_env.reward(False, 0, False) == 0.0
    assert python_env.reward(True, 0, True) == 0.5 and python_env.reward(False, 0, True) == -0.5
    assert python_env.reward(True, 1, True) == 1.0 and python_env.reward(False, 2, True) == 0.0


def test_code_too_long_for_one_argument_is_refused_without_running() -> None:
    backend = LocalBackend()
    observations, session = asyncio.run(_play(_env(backend), [_run("#" * (64 * 1024 + 1)), _submit(0)]))
    assert "longer than 65536 bytes" in observations[0].messages[0]["content"] and not backend.opened
    assert session.metrics["code_runs"] == 0


def test_a_lone_surrogate_in_the_code_is_a_syntax_error_the_policy_sees() -> None:
    observations, _ = asyncio.run(_play(_env(), [_run("print('\ud800')"), _submit(0)]))
    assert observations[0].messages[0]["content"].startswith("SyntaxError") and observations[0].status == Status.RUNNING


def test_a_policy_that_answers_at_once_opens_no_sandbox() -> None:
    backend = LocalBackend()
    asyncio.run(_play(_env(backend), [_submit(0)]))
    assert backend.opened == []


def test_a_run_without_a_report_resets_the_sandbox_and_the_next_run_gets_a_fresh_one() -> None:
    used = LocalSandbox()
    backend = LocalBackend(used)
    env = _env(backend)

    async def play() -> tuple[list[Observation], Session]:
        session = await env.start(SAMPLE)
        first = await env.observation(session, _run("print('ok')"))
        used.output = "Killed"  # the runner died under the code: no report
        second = await env.observation(session, _run("import os; os.kill(os.getppid(), 9)"))
        third = await env.observation(session, _run("print('again')"))
        await env.end(session)
        return [first, second, third], session

    (first, second, third), session = asyncio.run(play())
    assert first.messages[0]["content"] == "ok\n"
    assert "without a report" in second.messages[0]["content"] and "sandbox was reset" in second.messages[0]["content"]
    assert used.closed and second.status == Status.RUNNING
    assert third.messages[0]["content"] == "again\n" and len(backend.opened) == 2 and backend.opened[1].closed
    assert session.metrics["sandbox_resets"] == 1 and session.metrics["code_successes"] == 2


def test_a_used_sandbox_that_fails_is_reset_but_a_new_one_that_fails_is_a_task_error() -> None:
    used = LocalSandbox()
    backend = LocalBackend(used)
    env = _env(backend)

    async def play() -> list[Observation]:
        session = await env.start(SAMPLE)
        first = await env.observation(session, _run("print(1)"))
        used.fail_runs = True
        second = await env.observation(session, _run("print(2)"))
        third = await env.observation(session, _run("print(3)"))
        await env.end(session)
        return [first, second, third]

    first, second, third = asyncio.run(play())
    assert first.messages[0]["content"] == "1\n" and "sandbox was reset" in second.messages[0]["content"]
    assert third.messages[0]["content"] == "3\n" and used.closed

    observations, _ = asyncio.run(_play(_env(LocalBackend(LocalSandbox(fail_runs=True))), [_run("print(1)")]))
    assert observations[0].status == Status.TASK_ERROR
    observations, _ = asyncio.run(_play(_env(LocalBackend(fail_open=True)), [_run("print(1)")]))
    assert observations[0].status == Status.TASK_ERROR


def test_end_closes_the_episodes_sandbox() -> None:
    backend = LocalBackend()
    asyncio.run(_play(_env(backend), [_run("print(1)"), _submit(0)]))
    assert backend.opened[0].closed


def test_the_golden_policy_submits_the_printed_number_and_zero_when_none() -> None:
    policy = python_env.golden(SAMPLE)
    first = policy([])["tool_calls"][0]["function"]
    assert first["name"] == "run_python" and json.loads(first["arguments"])["code"] == SAMPLE["code"]

    def submitted(output: str) -> object:
        call = policy([{"role": "tool", "content": output}])["tool_calls"][0]["function"]
        return json.loads(call["arguments"])["answer"]

    assert submitted("304\n") == 304 and submitted("90.76\n") == 90.76 and submitted("NameError: x") == 0
    assert python_env.printed_number("-1.5e3") == -1500.0 and python_env.printed_number("1 2") is None
    assert python_env.noop(SAMPLE)([])["tool_calls"][0]["function"] == {"name": "submit", "arguments": '{"answer": 0}'}


def test_settings_reach_the_family_from_the_run_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_ENVS__PYTHON_MAX_CODE_RUNS", "2")
    monkeypatch.setenv("ROLLSTREAM_ENVS__PYTHON_UNEXECUTED_CODE_PENALTY", "true")
    monkeypatch.setenv("ROLLSTREAM_ENVS__OS_SANDBOX__BACKEND", "bwrap")
    env = registry.environment("python", load_config().envs)
    assert (env.max_code_runs, env.penalize_unexecuted) == (2, True)  # type: ignore[attr-defined]
    assert env.sandbox_settings.backend == "bwrap"  # type: ignore[attr-defined]


def test_a_jsonl_file_of_generated_tasks_loads_as_the_split(tmp_path: Path) -> None:
    path = tmp_path / "python.jsonl"
    tasks = registry.samples("python", "dev", SETTINGS)[:3]
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks), encoding="utf-8")
    assert registry.family("python").load(path) == list(tasks)
