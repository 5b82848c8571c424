"""webshop family: WebShop's pages, BM25 search and purchase over the GENERATED catalog (all 100 goals)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from env_workers.envs import registry, webshop, webshop_catalog
from env_workers.envs.base import EnvSettings, Observation, Status, assistant_call
from env_workers.envs.check import check_family

SETTINGS = EnvSettings()


@pytest.fixture(scope="module")
def env() -> webshop.WebshopEnvironment:
    return webshop.make(SETTINGS)


@pytest.fixture(scope="module")
def sample() -> dict[str, Any]:
    return registry.samples("webshop", "generated-dev", SETTINGS)[0]


def _play(env: webshop.WebshopEnvironment, sample: dict[str, Any], messages: list[dict[str, Any]]) -> list[Observation]:
    async def go() -> list[Observation]:
        session = await env.start(sample)
        try:
            return [await env.observation(session, m) for m in messages]
        finally:
            await env.end(session)

    return asyncio.run(go())


def _search(keywords: str) -> dict[str, Any]:
    return assistant_call("search_action", {"keywords": keywords})


def _click(value: str) -> dict[str, Any]:
    return assistant_call("click_action", {"value": value})


def _clickables(observation: Observation) -> list[str]:
    text = observation.messages[0]["content"]
    return json.loads(text.split("Available Actions:\n")[1])["clickables"]


def test_golden_buys_every_generated_goal_with_full_score_and_noop_none() -> None:
    family = registry.family("webshop")
    environment = family.make(SETTINGS)
    for split, tasks in (("generated-dev", 20), ("generated-train", 80)):
        result = asyncio.run(check_family(family, environment, registry.samples("webshop", split, SETTINGS)))
        assert result == {"family": "webshop", "tasks": tasks, "golden_pass": tasks, "noop_pass": 0, "errors": 0,
                          "failing_ids": []}


def test_generated_catalog_is_deterministic_labelled_and_in_upstream_schema() -> None:
    first, again = webshop_catalog.generate(7, 300, 100), webshop_catalog.generate(7, 300, 100)
    assert first == again and first != webshop_catalog.generate(8, 300, 100)
    assert len(first["products"]) == 300 and len(first["human_instructions"]) == 100
    assert set(first["products"][0]) >= {"asin", "name", "full_description", "small_description", "pricing",
                                          "customization_options", "category", "query", "product_category"}
    instruction = next(iter(first["human_instructions"].values()))[0]
    assert set(instruction) >= {"instruction", "instruction_attributes", "instruction_options"}
    assert "GENERATED" in webshop_catalog.__doc__ and "GENERATED" in webshop.__doc__
    assert registry.split_names("webshop") == ["generated-dev", "generated-easy-dev", "generated-easy-train",
                                               "generated-train"]


def test_golden_buys_every_easy_goal_and_noop_none() -> None:
    family = registry.family("webshop")
    environment = family.make(SETTINGS)
    for split, tasks in (("generated-easy-dev", 50), ("generated-easy-train", 250)):
        result = asyncio.run(check_family(family, environment, registry.samples("webshop", split, SETTINGS)))
        assert result == {"family": "webshop", "tasks": tasks, "golden_pass": tasks, "noop_pass": 0, "errors": 0,
                          "failing_ids": []}


def test_easy_goals_want_one_attribute_and_one_option_of_the_same_products() -> None:
    easy = registry.samples("webshop", "generated-easy-dev", SETTINGS)
    assert all(len(s["goal"]["attributes"]) == 1 and len(s["goal"]["goal_options"]) == 1 for s in easy)
    assert webshop_catalog.generate(7, 300, 300, easy=True)["products"] == webshop_catalog.generate(7, 300, 100)["products"]
    assert webshop_catalog.generate(7, 300, 300, easy=True) == webshop_catalog.generate(7, 300, 300, easy=True)
    other = webshop.generate("generated-easy-dev", SETTINGS, webshop.WebshopSettings(seed=8))
    assert [s["goal"]["asin"] for s in other] != [s["goal"]["asin"] for s in easy]
    dev = {s["goal"]["asin"] for s in easy}
    assert not dev & {s["goal"]["asin"] for s in registry.samples("webshop", "generated-easy-train", SETTINGS)}


def test_upstream_files_in_a_directory_load_as_the_same_goals(tmp_path: Path) -> None:
    raw = webshop_catalog.generate(3, 40, 10)
    for name, key in (("items_shuffle_1000.json", "products"), ("items_ins_v2_1000.json", "attributes"),
                      ("items_human_ins.json", "human_instructions"), ("reviews.json", "reviews")):
        (tmp_path / name).write_text(json.dumps(raw[key]), encoding="utf-8")
    samples = webshop.load(tmp_path)
    assert len(samples) == 10 and samples[0]["id"] == "webshop/0" and samples[0]["catalog"] == str(tmp_path.resolve())
    family = registry.family("webshop")
    result = asyncio.run(check_family(family, family.make(SETTINGS), samples))
    assert (result["golden_pass"], result["noop_pass"], result["errors"]) == (10, 0, 0)


def test_bm25_ranks_the_matching_title_first_and_unknown_words_find_nothing() -> None:
    catalog = webshop.catalog(webshop.generated_source(webshop.WebshopSettings()))
    asin, product = next(iter(catalog.products.items()))
    assert catalog.index.search(product["Title"])[0] == asin
    assert catalog.index.search("zzzqqq xyzzy") == []
    assert len(catalog.index.search("the and with")) <= webshop.SEARCH_RETURN_N


def test_results_paginate_ten_at_a_time(env: webshop.WebshopEnvironment, sample: dict[str, Any]) -> None:
    first, second, back = _play(env, sample, [_search("moisturizer cream shampoo"), _click("Next >"), _click("< Prev")])
    text = first.messages[0]["content"]
    assert "Page 1 (Total results: 50)" in text and "Next >" in text
    assert sum(c.startswith("b0") for c in _clickables(first)) == 10
    assert "Page 2 (Total results: 50)" in second.messages[0]["content"] and "< prev" in _clickables(second)
    assert _clickables(back) == _clickables(first)


def test_item_page_shows_options_sub_pages_and_remembers_choices(env: webshop.WebshopEnvironment,
                                                                 sample: dict[str, Any]) -> None:
    goal = sample["goal"]
    catalog = webshop.catalog(sample["catalog"])
    product = catalog.products[goal["asin"]]
    option_name, values = next(iter(product["options"].items()))
    obs = _play(env, sample, [_search(goal["name"]), _click(goal["asin"]), _click(values[0].upper()),
                              _click("Features"), _click("< Prev"), _click("Reviews"), _click("Description")])
    item = obs[1].messages[0]["content"]
    assert product["Title"] in item and f"Price: {product['Price']}" in item and "Buy Now" in item
    assert all(v in _clickables(obs[1]) for v in values)
    assert product["BulletPoints"][0] in obs[3].messages[0]["content"]
    assert product["Reviews"][0]["title"] in obs[5].messages[0]["content"]
    assert "not clickable" in obs[6].messages[0]["content"]  # Description is on the item page, not a sub-page
    assert obs[6].metrics["tool_errors"] == 1


def test_buying_the_right_product_without_its_options_earns_partial_credit(env: webshop.WebshopEnvironment,
                                                                            sample: dict[str, Any]) -> None:
    goal = sample["goal"]
    *_, bought = _play(env, sample, [_search(goal["name"]), _click(goal["asin"]), _click("Buy Now")])
    assert bought.status == Status.COMPLETED and 0 < bought.reward < 1
    shares = len(goal["attributes"]) + len(goal["goal_options"]) + 1
    assert bought.reward == pytest.approx((shares - len(goal["goal_options"])) / shares)
    assert bought.metrics["r_option"] == 0.0 and "Your score" in bought.messages[0]["content"]


def test_search_needs_the_search_page_and_empty_search_does_nothing(env: webshop.WebshopEnvironment,
                                                                    sample: dict[str, Any]) -> None:
    empty, results, again, home = _play(env, sample, [_search("  "), _search("coffee"), _search("tea"),
                                                       _click("Back to Search")])
    assert "Nothing happened" in empty.messages[0]["content"] and empty.metrics["tool_errors"] == 0
    assert "Total results" in results.messages[0]["content"]
    assert "no search bar" in again.messages[0]["content"] and again.metrics["tool_errors"] == 1
    assert '"has_search_bar": true' in home.messages[0]["content"]


def test_malformed_calls_are_counted_and_the_session_goes_on(env: webshop.WebshopEnvironment,
                                                             sample: dict[str, Any]) -> None:
    unknown, mistyped, text = _play(env, sample, [
        assistant_call("buy", {"value": "x"}),
        assistant_call("search_action", {"keywords": 3}),
        {"role": "assistant", "content": "search[coffee]"},
    ])
    assert "unknown tool" in unknown.messages[0]["content"]
    assert "must be of type string" in mistyped.messages[0]["content"]
    assert text.metrics["malformed_calls"] == 3 and not text.finish


def test_twenty_rounds_without_buying_reach_the_limit(env: webshop.WebshopEnvironment, sample: dict[str, Any]) -> None:
    observations = _play(env, sample, [_search("coffee"), *[_click("Next >"), _click("< Prev")] * 9, _click("Next >")])
    assert len(observations) == 20 and observations[-1].status == Status.TASK_LIMIT_REACHED
    assert observations[-1].reward == 0.0
