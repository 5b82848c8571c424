"""db easy tiers: generated DBBench-format tasks, deterministic by seed, graded by the DBBench grader unchanged."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import pytest

from env_workers.envs import db, db_tiers, registry
from env_workers.envs.base import EnvSettings, assistant_call
from env_workers.envs.check import check_family

SETTINGS = EnvSettings()


def _check(split: str, settings: EnvSettings = SETTINGS) -> dict[str, Any]:
    family = registry.family("db")
    return asyncio.run(check_family(family, family.make(settings), registry.samples("db", split, settings)))


@pytest.mark.parametrize("split, tasks", [("easy-train", 800), ("easy-dev", 100),
                                          ("two-table-train", 800), ("two-table-dev", 100)])
def test_golden_passes_every_generated_task_and_noop_none(split: str, tasks: int) -> None:
    assert _check(split) == {"family": "db", "tasks": tasks, "golden_pass": tasks, "noop_pass": 0, "errors": 0,
                             "failing_ids": []}


def test_the_registry_lists_the_tier_splits_beside_the_shipped_ones() -> None:
    assert db.TIER_SPLITS == db_tiers.split_names()
    assert set(registry.split_names("db")) == {"dev", "standard", *db_tiers.split_names()}


def test_same_seed_gives_the_same_tasks_and_another_seed_others() -> None:
    again = registry.samples("db", "easy-dev", EnvSettings(db_tier_seed=7))
    other = registry.samples("db", "easy-dev", EnvSettings(db_tier_seed=8))
    assert db_tiers.make_task("easy-dev", 5, 7) == db_tiers.make_task("easy-dev", 5, 7)
    assert again == registry.samples("db", "easy-dev", SETTINGS)
    assert [t["description"] for t in other] != [t["description"] for t in again]


def test_a_held_out_split_shares_no_task_with_its_train_split() -> None:
    for tier in db_tiers.TIERS:
        train = {db_tiers._signature(t) for t in registry.samples("db", f"{tier}-train", SETTINGS)}
        dev = {db_tiers._signature(t) for t in registry.samples("db", f"{tier}-dev", SETTINGS)}
        assert not train & dev


def test_the_four_kinds_come_in_equal_shares_on_small_tables() -> None:
    easy = registry.samples("db", "easy-train", SETTINGS)
    assert collections.Counter(t["type"][0] for t in easy) == {"other": 200, "counting": 200, "INSERT": 200,
                                                                "UPDATE": 200}
    assert all(3 <= len(t["table"]["table_info"]["rows"]) <= 5 for t in easy)
    two = registry.samples("db", "two-table-train", SETTINGS)
    assert all(isinstance(t["table"], list) and len(t["table"]) == 2 for t in two)
    assert collections.Counter(t["type"][0] for t in two)["UPDATE"] == 200


def test_sizes_follow_the_settings() -> None:
    settings = EnvSettings(db_tier_train_tasks=12, db_tier_dev_tasks=5)
    assert [len(registry.samples("db", s, settings)) for s in db_tiers.split_names()] == [12, 5, 12, 5]


def _episode(sample: dict[str, Any], messages: list[dict[str, Any]]) -> float:
    env = registry.family("db").make(SETTINGS)

    async def go() -> float:
        session = await env.start(sample)
        try:
            for message in messages:
                observation = await env.observation(session, message)
            return observation.reward
        finally:
            await env.end(session)

    return asyncio.run(go())


def test_a_wrong_answer_or_a_wrong_edit_scores_zero() -> None:
    tasks = registry.samples("db", "easy-dev", SETTINGS)
    select = next(t for t in tasks if t["type"] == ["other"])
    assert _episode(select, [assistant_call("commit_final_answer", {"answers": select["label"]})]) == 1.0
    assert _episode(select, [assistant_call("commit_final_answer", {"answers": ["nothing"]})]) == 0.0
    update = next(t for t in tasks if t["type"] == ["UPDATE"])
    table = update["table"]["table_name"]
    wrong = f"UPDATE `{table}` SET `{update['table']['table_info']['columns'][1]['name']}` = 'zzz'"
    assert _episode(update, [assistant_call("execute_sql", {"query": wrong}),
                             assistant_call("commit_final_answer", {"answers": []}, "call_1")]) == 0.0
    assert _episode(update, [assistant_call("execute_sql", {"query": update["label"][0]}),
                             assistant_call("commit_final_answer", {"answers": []}, "call_1")]) == 1.0


def test_prompts_name_the_tables_and_their_columns() -> None:
    task = registry.samples("db", "two-table-dev", SETTINGS)[0]
    left, right = (t["table_name"] for t in task["table"])
    assert left in task["add_description"] and right in task["add_description"]
    assert db.prompt(task).startswith("Additional table information about the question: The tables are ")
