"""WebShop's purchase score (goal.py get_reward) against cases worked out by hand from its definition."""

from __future__ import annotations

from typing import Any

import pytest

from env_workers.envs.webshop_reward import name_nouns, normalize_color, purchase_reward, type_reward

PRODUCT: dict[str, Any] = {
    "name": "Aurelia Night Moisturizer Cream", "Title": "Aurelia Night Moisturizer Cream",
    "query": "face moisturizer", "product_category": "Beauty › Skin Care › Face › Creams",
    "Attributes": ["paraben free", "dry skin"], "BulletPoints": ["Made with hyaluronic acid."],
    "Description": "A rich cream for the night.",
}
GOAL: dict[str, Any] = {
    "name": "Aurelia Night Moisturizer Cream", "query": "face moisturizer",
    "product_category": "Beauty › Skin Care › Face › Creams",
    "attributes": ["paraben free", "hyaluronic acid"], "goal_options": ["lavender", "3.4 fl oz"],
    "price_upper": 30.0,
}
RIGHT_OPTIONS = {"scent": "lavender", "size": "3.4 fl oz"}


def test_goal_product_with_goal_options_under_the_price_scores_one() -> None:
    # attributes: "paraben free" in Attributes, "hyaluronic acid" in the features text: 2 of 2.
    reward, info = purchase_reward(PRODUCT, GOAL, 20.0, RIGHT_OPTIONS)
    assert reward == 1.0 and info["r_type"] == 1.0 and info["r_att"] == 1.0


def test_each_missed_part_costs_one_share_of_attributes_plus_options_plus_one() -> None:
    # 2 attributes + 2 options + price = 5 shares.
    assert purchase_reward(PRODUCT, GOAL, 20.0, {"scent": "lavender"})[0] == pytest.approx(4 / 5)
    assert purchase_reward(PRODUCT, GOAL, 35.0, RIGHT_OPTIONS)[0] == pytest.approx(4 / 5)
    assert purchase_reward(PRODUCT, GOAL, 35.0, {})[0] == pytest.approx(2 / 5)
    without_text = dict(PRODUCT, BulletPoints=["Rich."])
    assert purchase_reward(without_text, GOAL, 20.0, RIGHT_OPTIONS)[0] == pytest.approx(4 / 5)


def test_size_options_match_exactly_others_fuzzily() -> None:
    goal = dict(GOAL, goal_options=["honey almond"])
    # 2 attributes + 1 option + price = 4 shares; token-set fuzzy match ignores word order...
    assert purchase_reward(PRODUCT, goal, 20.0, {"flavor": "almond honey"})[0] == 1.0
    # ...but a size must be the same string.
    assert purchase_reward(PRODUCT, goal, 20.0, {"size": "almond honey"})[0] == pytest.approx(3 / 4)


def test_an_option_found_in_the_product_text_counts() -> None:
    goal = dict(GOAL, goal_options=["red"])
    assert purchase_reward(PRODUCT, goal, 20.0, {"finish": "rich"})[0] == 1.0  # "rich" is in the description


def test_colours_are_normalised_before_matching() -> None:
    goal = dict(GOAL, goal_options=["black forest"])
    assert purchase_reward(PRODUCT, goal, 20.0, {"color": "jet black"})[0] == 1.0
    assert [normalize_color(c) for c in ("", "black forest", "violet lavender", "steelivy fuchsia", "123alabaster",
                                         "webshop")] == ["", "black", "lavender", "fuchsia", "alabaster", "webshop"]


def test_product_type_scales_the_whole_score() -> None:
    other = {"query": "x", "product_category": "Electronics › Audio"}
    # no query or category match; 1 of 4 goal nouns in the name (0.25 > 0.2): type still 1
    assert type_reward(dict(other, name="Lumen Cream"), GOAL)["r_type"] == 1.0
    # 1 of 7 goal nouns (1/7 < 0.2, >= 0.1): 0.5
    goal7 = dict(GOAL, name="aurelia night moisturizer cream jar tub pot")
    assert type_reward(dict(other, name="Lumen Cream"), goal7)["r_type"] == 0.5
    # 1 of 11 goal nouns (< 0.1): 0.1; none: 0
    goal11 = dict(goal7, name=goal7["name"] + " lid box set kit")
    assert type_reward(dict(other, name="Lumen Cream"), goal11)["r_type"] == 0.1
    assert type_reward(dict(other, name="Lumen Speaker"), GOAL)["r_type"] == 0.0
    wrong = dict(PRODUCT, name="Lumen Speaker", query="x", product_category="Electronics › Audio")
    assert purchase_reward(wrong, GOAL, 20.0, RIGHT_OPTIONS)[0] == 0.0


def test_a_query_match_keeps_full_type_credit_when_a_fifth_of_the_nouns_or_fewer_match() -> None:
    same_query = {"query": "face moisturizer", "product_category": "Electronics › Audio"}
    goal5 = dict(GOAL, name="aurelia night moisturizer cream jar")  # 1 of 5 = 0.2, not > 0.2
    assert type_reward(dict(same_query, name="Lumen Cream"), goal5)["r_type"] == 1.0
    assert type_reward({"query": "x", "product_category": "Electronics › Audio", "name": "Lumen Cream"},
                       goal5)["r_type"] == 0.5


def test_name_nouns_drop_function_words() -> None:
    assert name_nouns("A Pack of 2 Lavender Candles for the Home") == ["lavender", "candles", "home"]


def test_extra_matching_options_cannot_push_the_score_above_one() -> None:
    options = dict(RIGHT_OPTIONS, finish="rich")
    assert purchase_reward(PRODUCT, GOAL, 20.0, options)[0] == 1.0
