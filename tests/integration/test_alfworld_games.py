"""alfworld family: golden (walkthrough) and no-op ("look" until the three-repeats rule) on six real games.

One game per ALFWorld task type, the first of each in AgentBench's dev split; each start costs the
engine 1-3 s, hence `slow`.
"""

from __future__ import annotations

import asyncio

import pytest

from env_workers.envs import registry
from env_workers.envs.base import EnvSettings
from env_workers.envs.check import check_family

pytestmark = pytest.mark.slow
SETTINGS = EnvSettings()


def test_walkthrough_wins_and_noop_fails_on_one_game_of_each_task_type() -> None:
    first_of_type: dict[str, dict] = {}
    for sample in registry.samples("alfworld", "dev", SETTINGS):
        first_of_type.setdefault(sample["task_type"], sample)
    assert len(first_of_type) == 6
    family = registry.family("alfworld")
    result = asyncio.run(check_family(family, family.make(SETTINGS), first_of_type.values()))
    assert result == {"family": "alfworld", "tasks": 6, "golden_pass": 6, "noop_pass": 0, "errors": 0,
                      "failing_ids": []}


@pytest.mark.parametrize("split, games", [("simple-dev", 10), ("simple-train", 20)])
def test_walkthrough_wins_and_noop_fails_on_every_game_of_the_simple_tier(split: str, games: int) -> None:
    family = registry.family("alfworld")
    result = asyncio.run(check_family(family, family.make(SETTINGS), registry.samples("alfworld", split, SETTINGS)))
    assert result == {"family": "alfworld", "tasks": games, "golden_pass": games, "noop_pass": 0, "errors": 0,
                      "failing_ids": []}


def test_concurrent_sessions_of_different_games_start_and_leave_stdout_alone() -> None:
    import sys

    family = registry.family("alfworld")
    env = family.make(SETTINGS)
    games = registry.samples("alfworld", "standard", SETTINGS)[:3]
    stdout = sys.stdout

    async def go() -> list[str]:
        sessions = await asyncio.gather(*(env.start(game) for game in games))
        for session in sessions:
            await env.end(session)
        return [s.messages[1]["content"] for s in sessions]

    prompts = asyncio.run(go())
    assert all(p.startswith("Here is your task. ") for p in prompts) and sys.stdout is stdout
