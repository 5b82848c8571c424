"""Golden and no-op solutions over AgentBench's OS data (data/1..7), with the pass rates measured here."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from env_workers.envs import registry
from env_workers.envs.base import EnvSettings, Environment, Policy, TaskError
from env_workers.envs.os_env import make
from env_workers.sandbox import SandboxSettings

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
