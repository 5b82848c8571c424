"""alfworld family: AgentBench's rules around the real ALFWorld engine (one shipped game, reused).

The golden and no-op checks over six games (one per task type) are in
tests/integration/test_env_alfworld.py: each game start costs the engine 1-3 s.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from env_workers.envs import alfworld, registry
from env_workers.envs.base import EnvSettings, Observation, Status, assistant_call

SETTINGS = EnvSettings()
GAMES = SETTINGS.data_root / alfworld.GAMES_DIR


@pytest.fixture(scope="module")
def env() -> alfworld.AlfworldEnvironment:
    return alfworld.make(SETTINGS)


@pytest.fixture(scope="module")
def sample() -> dict[str, Any]:
    return registry.samples("alfworld", "dev", SETTINGS)[0]


def _play(env: alfworld.AlfworldEnvironment, sample: dict[str, Any],
          messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Observation]]:
    async def go() -> tuple[list[dict[str, Any]], list[Observation]]:
        session = await env.start(sample)
        try:
            observations = []
            for message in messages:
                observations.append(await env.observation(session, message))
                if observations[-1].finish:
                    break
            return session.messages, observations
        finally:
            await env.end(session)

    return asyncio.run(go())


def _act(action: str) -> dict[str, Any]:
    return assistant_call("take_action", {"action": action})


def test_splits_keep_agentbench_order_filtered_to_shipped_games() -> None:
    counts = {split: len(registry.samples("alfworld", split, SETTINGS)) for split in ("dev", "standard", "new_std")}
    assert counts == {"dev": 15, "standard": 38, "new_std": 71}
    every = alfworld.load(GAMES)
    assert len(every) == 104 and {s["task_type"] for s in every} == set(alfworld.TASK_TYPES.values())
    first = registry.samples("alfworld", "dev", SETTINGS)[0]
    assert first["task_type"] == "pick_and_place_simple" and first["game"].endswith("game.tw-pddl")


def test_the_simple_tier_splits_the_two_shortest_game_types_by_a_seeded_draw() -> None:
    train = registry.samples("alfworld", "simple-train", SETTINGS)
    dev = registry.samples("alfworld", "simple-dev", SETTINGS)
    assert (len(train), len(dev)) == (20, 10)
    every = {s["id"] for s in alfworld.load(GAMES) if s["task_type"] in alfworld.SIMPLE_TYPES}
    assert {s["id"] for s in train} | {s["id"] for s in dev} == every and not {s["id"] for s in train} & {
        s["id"] for s in dev}
    assert [s["task_type"] for s in dev].count("pick_and_place_simple") == 6
    assert alfworld.generate("simple-dev", SETTINGS) == list(dev)
    other = alfworld.generate("simple-dev", SETTINGS, alfworld.AlfworldSettings(simple_seed=8))
    assert {s["id"] for s in other} != {s["id"] for s in dev}


def test_three_repeats_rule_counts_only_consecutive_identical_actions() -> None:
    assert alfworld.repeated(["look", "look", "look"], 3)
    assert not alfworld.repeated(["look", "inventory", "look", "look"], 3)
    assert not alfworld.repeated(["look", "look"], 3)


def test_observations_and_actions_are_cleaned_as_agentbench_does() -> None:
    assert alfworld.clean_observation("You arrive at loc 12. On the desk 1, you see a pen.") == \
        "On the desk 1, you see a pen."
    assert alfworld.clean_observation("Nothing happened.") == "Nothing happened."
    assert alfworld.clean_action("  Go To Desk 1\nthen look") == "go to desk 1"
    assert alfworld.available_actions(["look", "inventory"]) == " AVAILABLE ACTIONS: look\ninventory\n"


def test_prompt_has_the_task_and_admissible_actions_and_the_walkthrough_wins(
        env: alfworld.AlfworldEnvironment, sample: dict[str, Any]) -> None:
    walkthrough = json.loads(Path(sample["game"]).read_text(encoding="utf-8"))["walkthrough"]
    prompt, observations = _play(env, sample, [_act(action) for action in walkthrough])
    task = prompt[1]["content"]
    assert task.startswith("Here is your task. ") and "Your task is to:" in task and "Welcome" not in task
    assert " AVAILABLE ACTIONS: " in task and "\ninventory\n" in task
    assert (observations[-1].status, observations[-1].reward) == (Status.COMPLETED, 1.0)
    assert all(o.status == Status.RUNNING for o in observations[:-1])


def test_same_action_three_times_fails_and_text_actions_and_malformed_calls_are_handled(
        env: alfworld.AlfworldEnvironment, sample: dict[str, Any]) -> None:
    _, obs = _play(env, sample, [
        assistant_call("teleport", {"action": "x"}),
        {"role": "assistant", "content": "I will look around."},
        {"role": "assistant", "content": "THOUGHT: first look.\nACTION: look"},
        _act("inventory"),
        _act("LOOK"),
        _act("look"),
        _act(" look "),
        _act("look"),
    ])
    assert "unknown tool" in obs[0].messages[0]["content"]
    assert obs[1].messages[0]["content"].startswith("Error: no tool call")
    assert "AVAILABLE ACTIONS" in obs[2].messages[0]["content"]  # the text form is an action too
    assert [o.status for o in obs[3:]] == [Status.RUNNING, Status.RUNNING, Status.RUNNING,
                                            Status.AGENT_INVALID_ACTION]
    assert obs[-1].reward == 0.0 and obs[-1].metrics["malformed_calls"] == 2
