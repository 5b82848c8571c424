"""os easy tier: generated shell tasks in AgentBench's task format, deterministic by seed (no sandbox here;
the golden and no-op runs in bubblewrap are in tests/integration/test_os_env.py)."""

from __future__ import annotations

import collections
import json

from env_workers.envs import os_oracle, os_tiers, registry
from env_workers.envs.base import EnvSettings
from env_workers.envs.os_tasks import load_tasks

SETTINGS = EnvSettings()


def test_splits_have_the_configured_sizes_and_the_six_kinds_in_turn() -> None:
    assert len(registry.samples("os", "easy-train", SETTINGS)) == 600
    assert len(registry.samples("os", "easy-dev", SETTINGS)) == 60
    small = EnvSettings(os_tier_train_tasks=12, os_tier_dev_tasks=6)
    assert [len(registry.samples("os", s, small)) for s in os_tiers.SPLITS] == [12, 6]
    kinds = collections.Counter(os_tiers.KINDS[i % 6] for i in range(600))
    assert set(kinds.values()) == {100}
    assert {"test", "train", *os_tiers.SPLITS, *os_tiers.VARIANT_SPLITS} == set(registry.split_names("os"))


def test_same_seed_gives_the_same_tasks_and_another_seed_others() -> None:
    assert os_tiers.make_item("easy-dev", 4, 7) == os_tiers.make_item("easy-dev", 4, 7)
    assert os_tiers.make_item("easy-dev", 4, 7) != os_tiers.make_item("easy-dev", 4, 8)
    other = registry.samples("os", "easy-dev", EnvSettings(os_tier_seed=8))
    assert [s["description"] for s in other] != [s["description"] for s in registry.samples("os", "easy-dev", SETTINGS)]


def test_the_held_out_split_shares_no_task_with_train() -> None:
    def keys(split: str) -> set[str]:
        return {json.dumps([s["description"], s["init"]]) for s in registry.samples("os", split, SETTINGS)}

    assert not keys("easy-dev") & keys("easy-train")


def test_tasks_are_in_agentbench_format_and_load_as_the_shipped_tasks_do(tmp_path) -> None:
    items = [os_tiers.make_item("easy-train", i, 7) for i in range(6)]
    scripts = SETTINGS.data_root / os_tiers.SCRIPTS
    (tmp_path / "tier.json").write_text(json.dumps(items), encoding="utf-8")
    loaded = load_tasks(tmp_path / "tier.json", scripts)
    generated = registry.samples("os", "easy-train", SETTINGS)[:6]
    assert [{**s, "id": ""} for s in loaded] == [{**s, "id": ""} for s in generated]
    questions = [s for s in generated if s["check"][0] is None]
    assert len(questions) == 4 and all(s["check"][1][0] == "python" for s in questions)
    assert (scripts / "check" / "integer-match.py").read_text() == generated[0]["check"][1][1]


def test_golden_runs_the_example_first_and_noop_finishes_without_an_answer() -> None:
    for sample in registry.samples("os", "easy-dev", SETTINGS)[:6]:
        first = os_oracle.golden(sample)([])
        call = first["tool_calls"][0]["function"]
        assert call["name"] == "bash_action" and json.loads(call["arguments"])["script"] == sample["example"][1]
        assert os_oracle.noop(sample)([])["tool_calls"][0]["function"]["name"] == "finish_action"


def test_commands_and_descriptions_stay_short() -> None:
    samples = registry.samples("os", "easy-train", SETTINGS)
    assert max(len(s["example"][1]) for s in samples) < 80
    assert max(len(s["description"]) for s in samples) < 120
