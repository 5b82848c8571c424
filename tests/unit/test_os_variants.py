"""Perturbed variants of os tasks: their declarations, the variant splits and what a session does at start
(a stand-in sandbox here; the golden and no-op runs under bubblewrap are in tests/integration/test_os_env.py)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from env_workers.envs import os_tiers, os_variants, registry
from env_workers.envs.base import EnvSettings, TaskError
from env_workers.envs.os_env import make
from env_workers.sandbox.base import ExecResult, Sandbox, SandboxBackend, ShellChannel
from pipeline.dispatch.sources import parse_sources

SETTINGS = EnvSettings(os_tier_train_tasks=12, os_tier_dev_tasks=12)


def _by_id(split: str) -> dict[str, dict]:
    return {sample["id"]: sample for sample in registry.samples("os", split, SETTINGS)}


def test_a_variant_split_lists_every_task_times_its_declared_variants_in_order() -> None:
    for base in os_tiers.SPLITS:
        tasks = registry.samples("os", base, SETTINGS)
        variants = registry.samples("os", base + os_tiers.VARIANTS_SUFFIX, SETTINGS)
        items = os_tiers._items(base, SETTINGS)
        expected = [f"{task['id']}~{raw['name']}" for task, item in zip(tasks, items) for raw in item["variants"]]
        assert [s["id"] for s in variants] == expected
    ids = [s["id"] for s in registry.samples("os", "easy-dev-variants", SETTINGS)]
    assert ids[:6] == ["easy-dev-00000~no-ls", "easy-dev-00000~moved", "easy-dev-00000~cwd",
                       "easy-dev-00001~no-grep", "easy-dev-00001~moved", "easy-dev-00001~cwd"]
    assert {"easy-train-variants", "easy-dev-variants"} <= set(registry.split_names("os"))
    assert not any("variant" in task for task in registry.samples("os", "easy-dev", SETTINGS))


def test_every_kind_of_task_has_a_moved_and_a_working_directory_variant_and_all_but_create_a_missing_tool() -> None:
    kinds_by_task: dict[str, set[str]] = {}
    for sample in registry.samples("os", "easy-train-variants", SETTINGS):
        kinds_by_task.setdefault(sample["id"].split("~")[0], set()).add(sample["variant"]["kind"])
    for index, kinds in enumerate(kinds_by_task.values()):
        has_tool = os_tiers.KINDS[index % 6] != "create_file"
        assert kinds == {"moved_file", "working_directory", *(["missing_tool"] if has_tool else [])}


def test_a_missing_tool_variant_replaces_only_the_example_and_the_new_one_does_without_the_tool() -> None:
    tasks, variants = _by_id("easy-train"), _by_id("easy-train-variants")
    seen = set()
    for variant_id, sample in variants.items():
        if sample["variant"]["kind"] != "missing_tool":
            continue
        tool, task = sample["variant"]["tool"], tasks[variant_id.split("~")[0]]
        seen.add(tool)
        assert {k: v for k, v in sample.items() if k not in ("id", "example", "variant")} == \
               {k: v for k, v in task.items() if k not in ("id", "example")}
        assert re.search(rf"(^|[\s|;&]){re.escape(tool)}\s", task["example"][1])
        assert not re.search(rf"(^|[\s|;&]){re.escape(tool)}\s", sample["example"][1])
    assert seen == {"ls", "grep", "sed"}


def test_a_moved_file_variant_is_the_same_task_with_every_path_under_another_home() -> None:
    tasks, variants = _by_id("easy-train"), _by_id("easy-train-variants")
    moved = [(variant_id, s) for variant_id, s in variants.items() if s["variant"]["kind"] == "moved_file"]
    assert len(moved) == 12
    for variant_id, sample in moved:
        task = tasks[variant_id.split("~")[0]]
        [home] = [h for h in os_tiers.MOVED_HOMES if h in sample["description"]]
        assert "/root" not in sample["description"] + sample["init"][0][1] + sample["example"][1]
        assert sample["description"].replace(home, "/root") == task["description"]
        assert sample["example"][1].replace(home, "/root") == task["example"][1]
        init = sample["init"][0][1].removeprefix(f"mkdir -p {home} && ")
        assert init.replace(home, "/root") == task["init"][0][1]


def test_a_working_directory_variant_is_the_task_itself_with_the_shell_started_elsewhere() -> None:
    tasks, variants = _by_id("easy-dev"), _by_id("easy-dev-variants")
    for variant_id, sample in variants.items():
        if sample["variant"]["kind"] == "working_directory":
            assert sample["variant"]["cwd"] in os_tiers.START_DIRECTORIES
            assert {**sample, "id": "", "variant": None} == {**tasks[variant_id.split("~")[0]], "id": "", "variant": None}


def test_variant_texts_and_commands_stay_short() -> None:
    samples = registry.samples("os", "easy-train-variants", EnvSettings())
    assert len(samples) == 1700
    assert max(len(s["description"]) for s in samples) < 120
    assert max(len(s["example"][1]) for s in samples) < 80


@pytest.mark.parametrize(("raw", "message"), [
    ({"name": "x", "kind": "broken_disk"}, "unknown kind"),
    ({"name": "No Spaces", "kind": "working_directory", "cwd": "/tmp"}, "variant name"),
    ({"name": "x", "kind": "missing_tool"}, "plain command name"),
    ({"name": "x", "kind": "missing_tool", "tool": "grep; rm -rf /"}, "plain command name"),
    ({"name": "x", "kind": "missing_tool", "tool": "/usr/bin/grep"}, "plain command name"),
    ({"name": "x", "kind": "missing_tool", "tool": "bash"}, "cannot go missing"),
    ({"name": "x", "kind": "missing_tool", "tool": "base64"}, "cannot go missing"),
    ({"name": "x", "kind": "missing_tool", "tool": "echo"}, "cannot go missing"),
    ({"name": "x", "kind": "missing_tool", "tool": "grep", "task": {"image": "ubuntu"}}, "may replace only"),
    ({"name": "x", "kind": "moved_file"}, "rendered elsewhere"),
    ({"name": "x", "kind": "working_directory", "cwd": "tmp"}, "absolute path"),
    ({"name": "x", "kind": "working_directory", "cwd": "/tmp/../etc"}, "absolute path"),
    ({"name": "x", "kind": "working_directory", "cwd": "/tmp/$(reboot)"}, "absolute path"),
    ({"name": "x", "kind": "working_directory", "cwd": "/"}, "absolute path"),
])
def test_unsafe_or_malformed_declarations_are_refused(raw: dict, message: str) -> None:
    with pytest.raises(os_variants.VariantError, match=re.escape(message)):
        os_variants.parse_variant(raw)


def test_repeated_variant_names_in_one_task_are_refused() -> None:
    item = {"variants": [os_variants.working_directory("/tmp"), os_variants.working_directory("/srv")]}
    with pytest.raises(os_variants.VariantError, match="repeat"):
        os_variants.variants_of(item)


def test_a_sample_variant_is_checked_again_when_a_session_starts() -> None:
    assert os_variants.from_sample({"id": "plain"}) is None
    moved = os_variants.from_sample({"variant": {"name": "moved", "kind": "moved_file", "tool": None, "cwd": None}})
    assert moved is not None and os_variants.setup_script(moved) is None and os_variants.shell_command(moved) is None
    with pytest.raises(os_variants.VariantError):
        os_variants.from_sample({"variant": {"name": "x", "kind": "missing_tool", "tool": "python3"}})


def test_the_setup_deletes_every_copy_of_the_tool_on_path_and_leaves_the_rest(tmp_path: Path) -> None:
    tool = "rollstream-variant-probe-tool"  # a name no host has: the script runs on this machine
    first, second = tmp_path / "a", tmp_path / "b"
    for folder in (first, second):
        folder.mkdir()
        (folder / tool).write_text("#!/bin/sh\necho here\n")
        (folder / tool).chmod(0o755)
        (folder / "other").write_text("kept")
    script = os_variants.setup_script(os_variants.parse_variant({"name": "x", "kind": "missing_tool", "tool": tool}))
    env = {**os.environ, "PATH": f"{first}:{second}:/usr/bin:/bin"}
    result = subprocess.run(["bash", "-c", f"{script} && {tool}"], env=env, capture_output=True, text=True)
    assert result.returncode == 127 and "command not found" in result.stderr
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["other", "other"]


class RecordingShell:
    """The agent's shell of a RecordingSandbox: records each command, which succeeds."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def ensure(self) -> None:
        self.log.append("shell opened")

    async def run(self, command: str, timeout_s: float) -> ExecResult:
        self.log.append(f"shell {command}")
        return ExecResult(0, "")

    async def close(self) -> None:
        pass


class RecordingSandbox(Sandbox):
    """Records the independent scripts of a session, in order; each succeeds but a variant's setup when told."""

    backend = "recording"

    def __init__(self, log: list[str], setup_exit: int = 0) -> None:
        super().__init__()
        self.shell = RecordingShell(log)  # type: ignore[assignment]
        self.log, self.setup_exit, self.closed = log, setup_exit, False

    async def run(self, argv: Sequence[str], timeout_s: float) -> ExecResult:
        script = argv[-1]
        self.log.append(f"run {script}")
        return ExecResult(self.setup_exit if script.startswith("for path") else 0, "")

    async def _open_shell(self) -> ShellChannel:
        raise NotImplementedError("the recording shell stands in")

    async def _release(self) -> None:
        self.closed = True


class RecordingBackend(SandboxBackend):
    def __init__(self, sandbox: RecordingSandbox) -> None:
        self.sandbox = sandbox

    async def open(self, image: str) -> Sandbox:
        return self.sandbox


def _start(variant_kind: str, setup_exit: int = 0) -> tuple[list[str], RecordingSandbox, object]:
    sample = next(s for s in registry.samples("os", "easy-dev-variants", SETTINGS)
                  if s["variant"]["kind"] == variant_kind)
    log: list[str] = []
    sandbox = RecordingSandbox(log, setup_exit)
    env = make(SETTINGS)
    env._backend = RecordingBackend(sandbox)
    try:
        return log, sandbox, asyncio.run(env.start(sample))
    except TaskError as error:
        return log, sandbox, error


def test_the_variant_is_applied_after_the_shell_opens_and_before_the_task_init() -> None:
    log, _, _ = _start("missing_tool")  # easy-dev-00000~no-ls
    assert [entry[:22] for entry in log] == ["shell opened", "run for path in $(type", "run mkdir -p /root/fil"]
    log, _, _ = _start("working_directory")  # easy-dev-00000~cwd
    assert log[:3] == ["shell opened", "run mkdir -p -- /home", "shell cd -- /home"]
    assert len(log) == 4 and log[3].startswith("run mkdir -p /root/")


def test_a_setup_that_fails_is_a_task_error_and_releases_the_sandbox() -> None:
    log, sandbox, outcome = _start("missing_tool", setup_exit=1)
    assert isinstance(outcome, TaskError) and "no-ls" in str(outcome)
    assert sandbox.closed and not any(entry.startswith("run mkdir") for entry in log)  # the init never ran


def test_a_run_can_take_a_variant_split_as_its_source() -> None:
    [source] = parse_sources("os:easy-dev-variants", "dev", envs=SETTINGS)
    assert (source.task, source.split, source.count) == ("os", "easy-dev-variants",
                                                         len(registry.samples("os", "easy-dev-variants", SETTINGS)))
