"""OS tasks as plain data: loading, script resolution, AgentBench's grading, the oracles, output cuts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from env_workers.envs import os_oracle
from env_workers.envs.os_tasks import (
    TaskFormatError,
    grade,
    load_tasks,
    match_answer,
    parse_task,
    script_argv,
    scripts_dir_for,
)
from env_workers.sandbox.base import ShellChannel, ShellSession, truncate_output


def _write_task_tree(root: Path, tasks: object) -> Path:
    data = root / "os_interaction" / "data" / "3"
    scripts = root / "os_interaction" / "scripts" / "3" / "check"
    data.mkdir(parents=True)
    scripts.mkdir(parents=True)
    (scripts / "integer-match.py").write_text("from sys import argv\nexit(int(argv[1]) != int(argv[2]))\n")
    path = data / "t.json"
    path.write_text(json.dumps(tasks))
    return path


def test_task_file_pairs_with_scripts_folder_of_same_number(tmp_path: Path) -> None:
    assert scripts_dir_for(tmp_path / "os" / "data" / "5" / "new.json") == tmp_path / "os" / "scripts" / "5"


def test_training_set_uses_scripts_of_data_7(tmp_path: Path) -> None:
    assert scripts_dir_for(tmp_path / "os" / "train_0317" / "training.json") == tmp_path / "os" / "scripts" / "7"


def test_file_script_is_read_from_paired_scripts_folder(tmp_path: Path) -> None:
    task = {"description": "d", "evaluation": {"check": [None, {"language": "python", "file": "check/integer-match.py"}],
                                               "example": "echo 3"}}
    [sample] = load_tasks(_write_task_tree(tmp_path, task))
    assert sample["id"] == "data/3/t-00000"
    assert sample["check"][0] is None
    assert sample["check"][1][0] == "python" and "int(argv[1])" in sample["check"][1][1]
    assert sample["example"] == ["bash", "echo 3"]
    assert sample["image"] == "default" and sample["init"] == []


def test_missing_script_file_is_a_format_error(tmp_path: Path) -> None:
    task = [{"description": "d", "evaluation": {"check": {"file": "check/nope.sh"}}}]
    with pytest.raises(TaskFormatError):
        load_tasks(_write_task_tree(tmp_path, task))


def test_create_given_as_list_counts_as_no_create(tmp_path: Path) -> None:
    sample = parse_task({"description": "d", "create": [{"init": "x"}], "evaluation": {"match": "a"}}, tmp_path, "i")
    assert sample["init"] == [] and sample["image"] == "default"


def test_top_level_example_counts_as_the_evaluation_example(tmp_path: Path) -> None:
    sample = parse_task({"description": "d", "example": {"code": "ls"}, "evaluation": {"check": [None]}}, tmp_path, "i")
    assert sample["example"] == ["bash", "ls"]


def test_plain_string_match_strips_the_answer() -> None:
    assert match_answer({"answer": "love", "strip": True}, "  love\n")
    assert not match_answer({"answer": "love"}, " love")
    assert match_answer({"regex": r"^\d+$"}, "42")
    assert not match_answer({"answer": "love", "strip": True}, None)


def test_bash_scripts_get_answer_after_double_dash_as_agentbench() -> None:
    assert script_argv(["bash", "echo $1"], ["7"]) == [["bash", "-c", "echo $1", "--", "7"]]
    assert script_argv(["bash", "true"], []) == [["bash", "-c", "true"]]
    assert script_argv(["python", "print(1)"], ["a", "b"]) == [["python3", "-c", "print(1)", "a", "b"]]
    assert len(script_argv(["c++", "int main(){}"], ["x"])) == 2


class _FakeRunner:
    """Exit code and output per script code; records the arguments each got."""

    def __init__(self, results: dict[str, tuple[int, str]]) -> None:
        self.results, self.calls = results, []

    async def __call__(self, script: list[str], params: Sequence[str]) -> tuple[int, str]:
        self.calls.append((script[1], list(params)))
        return self.results[script[1]]


def _check_task() -> dict:
    return {"id": "t", "match": None, "example": ["bash", "EXAMPLE"],
            "check": [None, ["python", "COMPARE"]]}


def test_check_chain_passes_answer_and_earlier_outputs() -> None:
    runner = _FakeRunner({"EXAMPLE": (0, "220\n"), "COMPARE": (0, "")})
    assert asyncio.run(grade(_check_task(), "220", runner))
    assert runner.calls == [("EXAMPLE", ["220"]), ("COMPARE", ["220", "220\n"])]


def test_check_chain_fails_at_first_nonzero_exit() -> None:
    runner = _FakeRunner({"EXAMPLE": (1, ""), "COMPARE": (0, "")})
    assert not asyncio.run(grade(_check_task(), "220", runner))
    assert [call[0] for call in runner.calls] == ["EXAMPLE"]


def test_finish_without_answer_is_checked_as_the_string_none() -> None:
    runner = _FakeRunner({"EXAMPLE": (0, "1"), "COMPARE": (1, "")})
    assert not asyncio.run(grade(_check_task(), None, runner))
    assert runner.calls[0][1] == ["None"]


def test_null_check_without_example_is_a_format_error() -> None:
    task = {"id": "t", "match": None, "example": None, "check": [None]}
    with pytest.raises(TaskFormatError):
        asyncio.run(grade(task, "x", _FakeRunner({})))


def test_golden_runs_example_then_answers_its_output() -> None:
    policy = os_oracle.golden({"match": None, "example": ["python", "print(1)"]})
    first = policy([{"role": "user", "content": "q"}])
    assert first["tool_calls"][0]["function"]["name"] == "bash_action"
    assert json.loads(first["tool_calls"][0]["function"]["arguments"]) == {"script": "python3 -c 'print(1)'"}
    second = policy([first, {"role": "tool", "tool_call_id": "call_0", "content": "1\n"}])
    assert json.loads(second["tool_calls"][0]["function"]["arguments"]) == {"answer": "1"}


def test_golden_answers_match_tasks_directly_and_noop_finishes() -> None:
    task = {"match": {"answer": "love", "strip": True}, "example": None}
    call = os_oracle.golden(task)([])["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("answer_action", {"answer": "love"})
    assert os_oracle.noop(task)([])["tool_calls"][0]["function"]["name"] == "finish_action"


def test_long_output_is_cut_as_agentbench_cuts_it() -> None:
    assert truncate_output("x" * 800, 800, 780) == "x" * 800
    cut = truncate_output("x" * 801, 800, 780)
    assert cut == "x" * 780 + "\n[truncated because the output is too long]"


class _EchoShell(ShellChannel):
    """Answers each command line with canned output and the marker it asked for; can die."""

    def __init__(self, replies: list[bytes | None]) -> None:
        self.replies, self.queue, self.killed = replies, asyncio.Queue(), False

    async def send(self, data: bytes) -> None:
        token_part = data.split(b"__RS_")[1].split(b"_%s")[0]
        reply = self.replies.pop(0) if b"base64" in data and self.replies else b""
        if reply is None:  # the shell exits mid-command
            await self.queue.put(b"partial")
            await self.queue.put(b"")
            return
        await self.queue.put(reply + b"\n__RS_" + token_part + b"_3__\n")

    async def receive(self) -> bytes:
        return await self.queue.get()

    async def interrupt(self) -> None: ...

    async def kill(self) -> None:
        self.killed = True


def test_shell_session_reads_output_and_exit_code_and_restarts_after_exit() -> None:
    opened: list[_EchoShell] = []

    async def open_channel() -> ShellChannel:
        opened.append(_EchoShell([b"", b"hello", None] if not opened else [b"", b"again"]))
        return opened[-1]

    async def scenario() -> list:
        session = ShellSession(open_channel)
        return [await session.run("echo hello", 5), await session.run("exit", 5), await session.run("x", 5)]

    first, died, after = asyncio.run(scenario())
    assert (first.output, first.exit_code, first.shell_restarted) == ("hello", 3, False)
    assert (died.output, died.exit_code) == ("partial", -1) and opened[0].killed
    assert (after.output, after.shell_restarted, len(opened)) == ("again", True, 2)
