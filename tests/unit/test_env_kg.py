"""kg family: AgentBench's KG tools over MetaQA, checked on all 900 dev questions (KB loaded once)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from env_workers.envs import kg, kg_graph, registry
from env_workers.envs.base import EnvSettings, Status, assistant_call
from env_workers.envs.check import check_family

SETTINGS = EnvSettings()

TINY_KB = """Heat|directed_by|Michael Mann
Heat|starred_actors|Al Pacino
Heat|starred_actors|Robert De Niro
Heat|release_year|1995
Collateral|directed_by|Michael Mann
Collateral|release_year|2004
Collateral|starred_actors|Tom Cruise
Ronin|starred_actors|Robert De Niro
Ronin|release_year|1998
"""


@pytest.fixture
def tiny_env(tmp_path: Path) -> kg.KgEnvironment:
    path = tmp_path / "kb.txt"
    path.write_text(TINY_KB, encoding="utf-8")
    return kg.KgEnvironment(max_rounds=15, kb_path=path)


SAMPLE = {"id": "q", "question": "which movies did Michael Mann direct", "topic": "Michael Mann",
          "qtype": "director_to_movie", "answers": ["Heat", "Collateral"]}


def _play(env: kg.KgEnvironment, sample: dict[str, Any], messages: list[dict[str, Any]]) -> list[Any]:
    async def go() -> list[Any]:
        session = await env.start(sample)
        try:
            return [await env.observation(session, m) for m in messages]
        finally:
            await env.end(session)

    return asyncio.run(go())


def test_golden_passes_all_900_dev_questions_and_noop_none() -> None:
    family = registry.family("kg")
    result = asyncio.run(check_family(family, family.make(SETTINGS), registry.samples("kg", "dev", SETTINGS)))
    assert result == {"family": "kg", "tasks": 900, "golden_pass": 900, "noop_pass": 0, "errors": 0,
                      "failing_ids": []}


@pytest.mark.parametrize("split, hops", [("1hop-dev", 1), ("2hop-dev", 2)])
def test_each_hop_tier_is_one_hop_count_of_the_dev_questions_and_passes_the_check(split: str, hops: int) -> None:
    samples = registry.samples("kg", split, SETTINGS)
    assert len(samples) == 300 and all(s["id"].startswith(f"{hops}-hop/qa_dev/") for s in samples)
    assert all(s["qtype"].count("_to_") == hops for s in samples)
    family = registry.family("kg")
    result = asyncio.run(check_family(family, family.make(SETTINGS), samples))
    assert result == {"family": "kg", "tasks": 300, "golden_pass": 300, "noop_pass": 0, "errors": 0,
                      "failing_ids": []}


def test_hop_tiers_train_on_the_train_questions_only() -> None:
    for hops in (1, 2):
        train = registry.samples("kg", f"{hops}hop-train", SETTINGS)
        assert len(train) == 3000 and all(s["id"].startswith(f"{hops}-hop/qa_train/") for s in train)
    assert {"1hop-train", "1hop-dev", "2hop-train", "2hop-dev"} <= set(registry.split_names("kg"))


def test_questions_load_with_topic_qtype_and_answers() -> None:
    first = registry.samples("kg", "dev", SETTINGS)[0]
    assert first["id"] == "1-hop/qa_dev/0"
    assert "[" not in first["question"] and first["topic"] in first["question"]
    assert first["qtype"].count("_to_") == 1 and first["answers"]


def test_qtype_path_maps_to_relations_both_ways() -> None:
    assert kg.path_relations("director_to_movie_to_genre") == ["directed_by_inv", "has_genre"]
    assert kg.path_relations("movie_to_tags") == ["has_tags"]


def test_graph_indexes_both_directions() -> None:
    graph = kg_graph.parse(TINY_KB.splitlines())
    mann = graph.entity("Michael Mann")
    assert graph.relations([mann]) == ["directed_by_inv"]
    assert {graph.names[e] for e in graph.neighbors([mann], "directed_by_inv")} == {"Heat", "Collateral"}


def test_neighbors_need_listed_relation_and_topic_is_never_an_answer(tiny_env: kg.KgEnvironment) -> None:
    early, listed, hop, back = _play(tiny_env, SAMPLE, [
        assistant_call("get_neighbors", {"variable": "Michael Mann", "relation": "directed_by_inv"}),
        assistant_call("get_relations", {"variable": "Michael Mann"}),
        assistant_call("get_neighbors", {"variable": "Michael Mann", "relation": "directed_by_inv"}),
        assistant_call("get_neighbors", {"variable": "#0", "relation": "directed_by"}),
    ])
    assert "cannot be executed" in early.messages[0]["content"] and early.metrics["tool_errors"] == 1
    assert listed.messages[0]["content"] == "[directed_by_inv]"
    assert hop.messages[0]["content"] == "variable #0, which are instances of movie"
    assert "cannot be executed" in back.messages[0]["content"]  # get_relations(#0) was never called


def test_final_answer_as_text_grades_exact_set_and_records_f1(tiny_env: kg.KgEnvironment) -> None:
    *_, done = _play(tiny_env, SAMPLE, [
        assistant_call("get_relations", {"variable": "Michael Mann"}),
        assistant_call("get_neighbors", {"variable": "Michael Mann", "relation": "directed_by_inv"}),
        {"role": "assistant", "content": "Thought: done.\nFinal Answer: #0"},
    ])
    assert (done.status, done.reward, done.metrics["score"]) == (Status.COMPLETED, 1.0, 1.0)


def test_partial_answer_scores_f1_but_no_reward(tiny_env: kg.KgEnvironment) -> None:
    sample = dict(SAMPLE, answers=["Heat", "Collateral", "Thief"])
    *_, done = _play(tiny_env, sample, [
        assistant_call("get_relations", {"variable": "Michael Mann"}),
        assistant_call("get_neighbors", {"variable": "Michael Mann", "relation": "directed_by_inv"}),
        assistant_call("final_answer", {"variable": "#0"}),
    ])
    assert done.reward == 0.0 and done.metrics["score"] == pytest.approx(0.8)


def test_invalid_variable_id_is_told_and_the_session_goes_on(tiny_env: kg.KgEnvironment) -> None:
    (obs,) = _play(tiny_env, SAMPLE, [{"role": "assistant", "content": "Final Answer: #4"}])
    assert obs.messages == [{"role": "user", "content": kg.INVALID_VARIABLE}] and not obs.finish


def test_intersection_count_and_superlatives(tiny_env: kg.KgEnvironment) -> None:
    sample = {"id": "q", "question": "q", "topic": "Robert De Niro", "qtype": "actor_to_movie", "answers": ["Ronin"]}
    obs = _play(tiny_env, sample, [
        assistant_call("get_relations", {"variable": "Robert De Niro"}),
        assistant_call("get_neighbors", {"variable": "Robert De Niro", "relation": "starred_actors_inv"}),
        assistant_call("get_attributes", {"variable": "#0"}),
        assistant_call("argmax", {"variable": "#0", "attribute": "release_year"}),
        assistant_call("intersection", {"variable1": "#0", "variable2": "#1"}),
        assistant_call("count", {"variable": "#0"}),
        assistant_call("intersection", {"variable1": "#0", "variable2": "#3"}),
        assistant_call("final_answer", {"variable": "#2"}),
    ])
    assert obs[2].messages[0]["content"] == "[release_year]"
    assert obs[3].messages[0]["content"] == "variable #1, which are instances of movie"
    assert obs[5].messages[0]["content"] == "variable #3, which is a number"
    assert "not of the same type" in obs[6].messages[0]["content"]
    assert (obs[-1].status, obs[-1].reward) == (Status.COMPLETED, 1.0)


def test_entity_not_in_the_question_is_rejected(tiny_env: kg.KgEnvironment) -> None:
    (obs,) = _play(tiny_env, SAMPLE, [assistant_call("get_relations", {"variable": "Heat"})])
    assert "cannot be executed" in obs.messages[0]["content"]


def test_plain_text_without_final_answer_is_malformed(tiny_env: kg.KgEnvironment) -> None:
    (obs,) = _play(tiny_env, SAMPLE, [{"role": "assistant", "content": "I think it is Heat."}])
    assert obs.metrics["malformed_calls"] == 1 and not obs.finish
