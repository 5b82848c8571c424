"""WebShop's purchase score (princeton-nlp/WebShop web_agent_site/engine/goal.py `get_reward`).

    reward = r_type * (attribute matches + option matches + price ok) / (#goal attributes + #goal options + 1)

- attributes: a goal attribute matches when thefuzz's token_set_ratio with one of the product's
  `Attributes` is > 85, or when it occurs (as a substring) in the lowercased title, features or
  description;
- options: each *purchased* option value (colours normalised by `normalize_color`) matches when it
  equals a goal option (option "size": exact) or fuzzily matches one (> 85), or occurs in the title,
  features or description;
- price: 1 when the price paid is at most the goal's `price_upper`;
- r_type (product type): 1, lowered to 0.5 when neither the search query, two product-category
  levels nor over 20% of the goal name's nouns match, to 0.1 when under 10% of the nouns match
  and to 0 when none does.

Two deliberate departures, both stated where they apply:
- Upstream picks the nouns of the names with spaCy's `en_core_web_lg` tagger (a 500 MB model that
  is not available here); `name_nouns` keeps the lowercased word tokens that are not function
  words instead, so adjectives count as nouns too. Identical names still score 1.
- Upstream counts every purchased option that matches, so buying extra options that happen to
  appear in the text can push the total above 1; the score is clipped to [0, 1] as the WebShop
  paper defines it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from thefuzz import fuzz

FUZZY_MATCH = 85  # goal.py: `score > 85`
EXACT_MATCH_OPTIONS = ("size",)  # goal.py EXACT_MATCH_OPTS
PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # goal.py: the price caps goals are drawn from

# web_agent_site/engine/normalize.py COLOR_SET, in its order (the first contained colour wins).
COLOR_SET = (
    "alabaster", "apricot", "aqua", "ash", "asphalt", "azure", "banana", "beige", "black", "blue", "blush",
    "bordeaux", "bronze", "brown", "burgundy", "camel", "camo", "caramel", "champagne", "charcoal", "cheetah",
    "chestnut", "chocolate", "christmas", "coffee", "cognac", "copper", "coral", "cranberry", "cream", "crystal",
    "dark", "denim", "eggplant", "elephant", "espresso", "fuchsia", "gold", "granite", "grape", "graphite", "grass",
    "gray", "green", "grey", "heather", "indigo", "ivory", "ivy", "khaki", "lavender", "lemon", "leopard", "light",
    "lilac", "lime", "magenta", "maroon", "mauve", "merlot", "midnight", "mint", "mocha", "multicolor", "mushroom",
    "mustard", "natural", "navy", "nude", "olive", "orange", "peach", "pewter", "pink", "plum", "purple", "rainbow",
    "red", "rose", "royal", "rust", "sand", "sapphire", "seashell", "silver", "skull", "slate", "steel", "stone",
    "stonewash", "sunflower", "tan", "taupe", "teal", "tiger", "turquoise", "violet", "walnut", "wheat", "white",
    "wine", "yellow",
)

# Function words that spaCy never tags NOUN/PROPN; what is left of a name stands in for its nouns.
_FUNCTION_WORDS = frozenset(
    "a an the and or of for with in on to by from at as is are be this that these those it its your you i we "
    "our my me not no nor but so if than then too very can will just all any each per into over under up out "
    "about pack count oz fl inch inches ft lb lbs x".split()
)
_WORD = re.compile(r"[a-z][a-z'-]*")


def normalize_color(value: str) -> str:
    """The first COLOR_SET colour contained in the value, else the value itself."""
    for color in COLOR_SET:
        if color in value:
            return color
    return value


def name_nouns(name: str) -> list[str]:
    """Stand-in for goal.py's spaCy NOUN/PROPN tokens of a product name (see the module docstring)."""
    return [w for w in _WORD.findall(name.lower()) if w not in _FUNCTION_WORDS]


def type_reward(purchased: Mapping[str, Any], goal: Mapping[str, Any]) -> dict[str, Any]:
    """goal.py get_type_reward: is the purchase the same kind of product as the goal's?"""
    query_match = purchased["query"] == goal["query"]
    purchased_category = {x.strip() for x in purchased["product_category"].split("›")}
    goal_category = {x.strip() for x in goal["product_category"].split("›")}
    category_match = len(purchased_category & goal_category) >= 2
    purchased_nouns, desired_nouns = name_nouns(purchased["name"]), name_nouns(goal["name"])
    overlap = len(set(purchased_nouns) & set(desired_nouns))
    title_score = 0.2 if not desired_nouns else overlap / len(desired_nouns)
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return {"r_type": r_type, "query_match": query_match, "category_match": category_match,
            "title_score": title_score}


def _in_text(value: str, product: Mapping[str, Any]) -> bool:
    return (value in product["Title"].lower() or value in " ".join(product["BulletPoints"]).lower()
            or value in product["Description"].lower())


def attribute_matches(purchased: Mapping[str, Any], goal_attributes: Sequence[str]) -> int:
    """goal.py get_attribute_reward: how many goal attributes the product has (fuzzy, or in its text)."""
    matches = 0
    for wanted in goal_attributes:
        if any(fuzz.token_set_ratio(have, wanted) > FUZZY_MATCH for have in purchased["Attributes"]):
            matches += 1
        elif _in_text(wanted, purchased):
            matches += 1
    return matches


def option_matches(purchased: Mapping[str, Any], goal_options: Sequence[str],
                   chosen_options: Mapping[str, str]) -> int:
    """goal.py get_option_reward: how many chosen options match a goal option (or the product text)."""
    goals = [normalize_color(o) for o in goal_options]
    matches = 0
    for name, raw_value in chosen_options.items():
        value = normalize_color(raw_value)
        if name.lower() in EXACT_MATCH_OPTIONS:
            matched = value in goals
        else:
            matched = any(fuzz.token_set_ratio(g, value) > FUZZY_MATCH for g in goals)
        if matched or _in_text(value, purchased):
            matches += 1
    return matches


def goal_option_values(goal: Mapping[str, Any]) -> list[str]:
    """Human goals list their options; synthetic goals map option name -> value (goal.py accepts both)."""
    options = goal["goal_options"]
    return list(options.values()) if isinstance(options, Mapping) else list(options)


def purchase_reward(purchased: Mapping[str, Any], goal: Mapping[str, Any], price: float,
                    chosen_options: Mapping[str, str]) -> tuple[float, dict[str, Any]]:
    """goal.py get_reward (verbose): the score in [0, 1] and its parts."""
    kind = type_reward(purchased, goal)
    goal_options = goal_option_values(goal)
    r_price = price <= goal["price_upper"]
    attributes = attribute_matches(purchased, goal["attributes"])
    options = option_matches(purchased, goal_options, chosen_options)
    total = (attributes + options + r_price) / (len(goal["attributes"]) + len(goal_options) + 1)
    reward = min(1.0, total * kind["r_type"])
    info = {**kind, "r_price": float(r_price), "r_att": attributes / max(len(goal["attributes"]), 1),
            "r_option": options / len(goal_options) if goal_options else 1.0}
    return reward, info
