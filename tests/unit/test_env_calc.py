"""calc family: generated arithmetic, deterministic by (seed, split, index)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from env_workers.envs import calc, registry
from env_workers.envs.base import EnvSettings, Status, assistant_call
from env_workers.envs.check import check_family

SETTINGS = EnvSettings()


def _check(split: str) -> dict[str, Any]:
    family = registry.family("calc")
    return asyncio.run(check_family(family, family.make(SETTINGS), registry.samples("calc", split, SETTINGS)))


def test_golden_passes_every_task_of_every_split_and_noop_none() -> None:
    assert _check("dev") == {"family": "calc", "tasks": 200, "golden_pass": 200, "noop_pass": 0, "errors": 0,
                             "failing_ids": []}
    train = _check("train")
    assert (train["tasks"], train["golden_pass"], train["noop_pass"], train["errors"]) == (5000, 5000, 0, 0)
    rl = _check("rl")
    assert (rl["tasks"], rl["golden_pass"], rl["noop_pass"], rl["errors"]) == (2000, 2000, 0, 0)


def test_the_rl_split_shares_no_task_with_the_demonstrated_train_split() -> None:
    # RL after SFT trains on `rl`; a task the policy was fine-tuned on would give a group of equal rewards.
    def expressions(split: str) -> set[str]:
        return {calc.expression(task) for task in registry.samples("calc", split, SETTINGS)}

    assert not expressions("rl") & expressions("train")


def test_tasks_are_deterministic_by_seed_split_and_index() -> None:
    assert calc.make_task("dev", 3, 7) == calc.make_task("dev", 3, 7)
    assert calc.make_task("dev", 3, 7) != calc.make_task("train", 3, 7)
    assert calc.make_task("dev", 3, 7) != calc.make_task("dev", 3, 8)
    assert calc.make_task("dev", 3, 7) == {"id": "calc-dev-3", "start": 29,
                                           "steps": [("subtract", 28), ("add", 15), ("subtract", 5)], "answer": 11}


def test_expression_is_left_nested_with_parentheses() -> None:
    task = {"start": 29, "steps": [("subtract", 28), ("add", 15), ("multiply", 5)]}
    assert calc.expression(task) == "((29 - 28) + 15) * 5"


def test_operands_and_operation_counts_stay_in_the_configured_ranges() -> None:
    easy = registry.samples("calc", "train", EnvSettings(calc_operands=(2, 9), calc_operations=(1, 1)))
    assert all(len(t["steps"]) == 1 and 2 <= t["start"] <= 9 and 2 <= t["steps"][0][1] <= 9 for t in easy)
    assert {t["start"] for t in easy} == set(range(2, 10))
    assert calc.make_task("dev", 3, 7, (2, 30), (1, 3)) == calc.make_task("dev", 3, 7)  # the defaults


def test_a_split_can_draw_its_own_operation_counts_while_the_others_keep_the_default() -> None:
    settings = EnvSettings(calc_split_operations={"rl": (3, 3), "dev": (3, 3)})
    for split in ("rl", "dev"):
        assert {len(t["steps"]) for t in registry.samples("calc", split, settings)} == {3}
    assert registry.samples("calc", "train", settings) == registry.samples("calc", "train", SETTINGS)
    demonstrated = {calc.expression(t) for t in registry.samples("calc", "train", settings)}
    assert not demonstrated & {calc.expression(t) for t in registry.samples("calc", "rl", settings)}


def test_an_empty_or_non_positive_range_or_an_unknown_split_is_refused() -> None:
    for bad in ({"calc_operands": (9, 2)}, {"calc_operations": (0, 2)}, {"calc_split_operations": {"rl": (3, 2)}}):
        with pytest.raises(ValidationError, match="smallest <= largest"):
            EnvSettings(**bad)
    with pytest.raises(ValidationError, match="calc_split_operations.test"):
        EnvSettings(calc_split_operations={"test": (3, 3)})


def test_no_generated_answer_is_zero() -> None:
    assert all(t["answer"] != 0 for t in registry.samples("calc", "train", SETTINGS))


def test_tools_compute_and_submit_grades_the_final_value() -> None:
    async def go() -> list[Any]:
        env = calc.make(SETTINGS)
        session = await env.start({"id": "x", "start": 6, "steps": [("multiply", 7)], "answer": 42})
        try:
            return [await env.observation(session, assistant_call("multiply", {"a": 6, "b": 7})),
                    await env.observation(session, assistant_call("submit", {"answer": 42}))]
        finally:
            await env.end(session)

    product, submitted = asyncio.run(go())
    assert product.messages[0]["content"] == "42" and not product.finish
    assert (submitted.status, submitted.reward, submitted.finish) == (Status.COMPLETED, 1.0, True)


def test_string_number_is_malformed_and_rounds_are_limited_to_eight() -> None:
    async def go() -> list[Any]:
        env = calc.make(SETTINGS)
        session = await env.start(calc.make_task("dev", 0, 7))
        try:
            return [await env.observation(session, assistant_call("add", {"a": "1", "b": 2})) for _ in range(8)]
        finally:
            await env.end(session)

    observations = asyncio.run(go())
    assert "'a' must be of type number" in observations[0].messages[0]["content"]
    assert observations[-1].status == Status.TASK_LIMIT_REACHED
    assert sum(o.finish for o in observations) == 1
