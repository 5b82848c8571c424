"""Golden and no-op solutions over AgentBench's OS data (data/1..7), the generated easy tier and its perturbed
variants, with the pass rates measured here."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest
from helpers.sandboxes import dockerd  # noqa: F401  (a fixture)
from typer.testing import CliRunner

from env_workers.envs import os_tiers, registry
from env_workers.envs.base import EnvSettings, Environment, Policy, TaskError, assistant_call
from env_workers.envs.os_env import make
from env_workers.sandbox import SandboxSettings
from pipeline.cli import env as env_cmd

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKER_HOST = f"unix://{REPO_ROOT / '.run' / 'dockerd' / 'docker.sock'}"
# Golden failures on both backends: apt-get without network (new-00005, 00006, 00008), process
# counts that differ between the agent's shell and the checker's exec (bootstrap-00000, 00015, 00047).
BOTH_GOLDEN_FAILS = {
    "data/6/new-00005", "data/6/new-00006", "data/6/new-00008",
    "data/7/bootstrap-00000", "data/7/bootstrap-00015", "data/7/bootstrap-00047",
}
# bubblewrap maps one uid (root): chgrp to another group fails (new-00002). Its chown in new-00000/1
# fails too, but only in an init script whose exit code AgentBench ignores, and the checks pass.
BWRAP_GOLDEN_FAILS = BOTH_GOLDEN_FAILS | {"data/6/new-00002"}
# Counts taken at an instant: the agent's answer and the checker's recount run a moment apart, and a
# pipeline's forked-but-not-yet-exec'd children show as `bash` (00001), the host's memory use moves
# (00008). Their golden passes most runs and fails some, on any backend: not asserted either way.
TIMING_DEPENDENT = {"data/7/bootstrap-00001", "data/7/bootstrap-00008"}

pytestmark = pytest.mark.integration


async def _reward(env: Environment, sample: dict, policy: Policy) -> float | None:
    """The episode's reward, or None when the task could not be built (an error, not a pass)."""
    try:
        session = await env.start(sample)
    except TaskError:
        return None
    history = list(session.messages)
    try:
        while True:
            message = policy(history)
            observation = await env.observation(session, message)
            history += [message, *observation.messages]
            if observation.finish:
                return observation.reward
    finally:
        await env.end(session)


def _check(settings: SandboxSettings, samples: list[dict]) -> tuple[set[str], set[str]]:
    family = registry.family("os")

    async def run() -> list[tuple[float | None, float | None]]:
        env, gate = make(EnvSettings(), settings), asyncio.Semaphore(4)

        async def both(sample: dict) -> tuple[float | None, float | None]:
            async with gate:
                return (await _reward(env, sample, family.golden(sample)),
                        await _reward(env, sample, family.noop(sample)))

        return await asyncio.gather(*(both(sample) for sample in samples))

    results = asyncio.run(run())
    golden_fails = {s["id"] for s, (golden, _) in zip(samples, results) if golden != 1.0}
    noop_passes = {s["id"] for s, (_, noop) in zip(samples, results) if noop == 1.0}
    return golden_fails, noop_passes


def test_golden_passes_and_noop_fails_on_all_os_tasks_under_bwrap() -> None:
    samples = list(registry.samples("os", "test", EnvSettings()))
    assert len(samples) == 114
    golden_fails, noop_passes = _check(SandboxSettings(backend="bwrap"), samples)
    assert golden_fails - TIMING_DEPENDENT == BWRAP_GOLDEN_FAILS
    assert noop_passes == set()


@pytest.mark.parametrize("split, tasks", [("easy-dev", 60), ("easy-train", 600)])
def test_golden_passes_and_noop_fails_on_every_generated_easy_task_under_bwrap(split: str, tasks: int) -> None:
    samples = list(registry.samples("os", split, EnvSettings()))
    assert len(samples) == tasks
    assert _check(SandboxSettings(backend="bwrap"), samples) == (set(), set())


def test_golden_passes_and_noop_fails_on_all_os_tasks_under_docker() -> None:
    """Docker's writable layer (bounded by a tmpfs) lets init scripts write to /, /usr and /etc."""
    subprocess.run([REPO_ROOT / "infra" / "sandbox" / "dockerd.sh", "start"], check=True)
    samples = list(registry.samples("os", "test", EnvSettings()))
    golden_fails, noop_passes = _check(SandboxSettings(backend="docker", docker_host=DOCKER_HOST), samples)
    assert golden_fails - TIMING_DEPENDENT == BOTH_GOLDEN_FAILS
    assert noop_passes == set()


def test_env_check_passes_golden_and_fails_noop_on_every_easy_dev_variant_under_bwrap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`rollstream env check --family os --split easy-dev-variants`: each easy-dev task in each of its variants."""
    monkeypatch.setenv("ROLLSTREAM_ENVS__OS_SANDBOX__BACKEND", "bwrap")
    result = CliRunner().invoke(env_cmd.app, ["check", "--family", "os", "--split", "easy-dev-variants", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "family": "os", "tasks": 171, "golden_pass": 171, "noop_pass": 0, "errors": 0, "failing_ids": [],
        "variants": {"missing_tool": {"tasks": 51, "golden_pass": 51, "noop_pass": 0, "errors": 0},
                     "moved_file": {"tasks": 60, "golden_pass": 60, "noop_pass": 0, "errors": 0},
                     "working_directory": {"tasks": 60, "golden_pass": 60, "noop_pass": 0, "errors": 0}},
    }


@pytest.fixture(params=["bwrap", "docker"])
def backend_settings(request: pytest.FixtureRequest) -> SandboxSettings:
    if request.param == "docker":
        return SandboxSettings(backend="docker", docker_host=request.getfixturevalue("dockerd"))
    return SandboxSettings(backend="bwrap")


async def _first_outputs(env: Environment, runs: list[tuple[dict, str]]) -> list[str]:
    """For each (sample, command): the output of the command as the episode's first action, in a session of its own."""
    outputs = []
    for sample, command in runs:
        session = await env.start(sample)
        try:
            observation = await env.observation(session, assistant_call("bash_action", {"script": command}))
            outputs.append(observation.messages[0]["content"])
        finally:
            await env.end(session)
    return outputs


def test_variants_perturb_their_own_session_and_nothing_beyond_it(backend_settings: SandboxSettings) -> None:
    variants = {s["id"]: s for s in registry.samples("os", "easy-dev-variants", EnvSettings())}
    moved = variants["easy-dev-00001~moved"]
    [home] = [h for h in os_tiers.MOVED_HOMES if h in moved["description"]]
    cwd = variants["easy-dev-00000~cwd"]["variant"]["cwd"]
    plain = registry.sample("os", "easy-dev", 1, EnvSettings())
    missing, started, placed, after = asyncio.run(_first_outputs(make(EnvSettings(), backend_settings), [
        (variants["easy-dev-00001~no-grep"], "grep -q root /etc/passwd; echo rc=$?; /usr/bin/grep -q root /etc/passwd; "
                                              "echo rc=$?; export PATH=/usr/bin:/bin:/usr/sbin:/sbin; grep; echo rc=$?"),
        (variants["easy-dev-00000~cwd"], "pwd"),
        (moved, f"ls {home} /root"),
        (plain, "grep -q root /etc/passwd; echo rc=$?; pwd"),
    ]))
    assert "grep: command not found" in missing and missing.count("rc=127") == 3  # by name, by path, any PATH
    assert started.strip() == cwd
    assert placed.split() == [f"{home}:", "c.txt", "/root:"]
    assert after.split() == ["rc=0", "/"]  # the next session has its grep and starts in /
