"""A GENERATED WebShop catalog and goal set, in the schema of WebShop's own data files.

WebShop's product files (items_shuffle_1000.json, items_ins_v2_1000.json, items_human_ins.json)
could not be obtained here (see the data README), so the tests and the default mix use this
small synthetic stand-in: made-up products of eight kinds with their attributes, options, prices,
descriptions and reviews, and one human-style instruction for some of them. It is generated from a
seed alone (the same in every process) and written in upstream's raw schema, so it goes through the
same loader as the real files:

- `products`: items_shuffle*.json rows (asin, name, full_description, small_description, pricing
  as "$a" or "$a$b", customization_options {Name: [{value, image}]}, category, query,
  product_category, images);
- `attributes`: items_ins_v2*.json ({asin: {attributes, instruction, instruction_attributes}});
- `human_instructions`: items_human_ins.json ({asin: [{instruction, instruction_attributes,
  instruction_options, asin}]});
- `reviews`: reviews.json rows ({asin, reviews: [{title, stars, review}], average_rating}).

Nothing here is WebShop data; scores on it say nothing about WebShop's own tasks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Kind:
    """One kind of generated product: where it sits in the store and what it can have."""

    noun: str
    category: str
    query: str
    product_category: str
    styles: tuple[str, ...]
    attributes: tuple[str, ...]
    options: dict[str, tuple[str, ...]]
    price: tuple[float, float]


KINDS = (
    Kind("moisturizer", "beauty", "face moisturizer",
         "Beauty & Personal Care › Skin Care › Face › Creams & Moisturizers",
         ("hydrating", "night", "daily", "matte"),
         ("paraben free", "cruelty free", "dry skin", "sensitive skin", "hyaluronic acid", "fragrance free"),
         {"size": ("1.7 fl oz", "3.4 fl oz", "pack of 2"), "scent": ("unscented", "lavender", "citrus")}, (8, 45)),
    Kind("shampoo", "beauty", "sulfate free shampoo",
         "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
         ("volumizing", "clarifying", "repair", "color safe"),
         ("sulfate free", "natural ingredients", "damaged hair", "long lasting", "vegan", "argan oil"),
         {"size": ("8 fl oz", "16 fl oz", "32 fl oz"), "scent": ("coconut", "mint", "rose")}, (6, 30)),
    Kind("sneaker", "fashion", "men running shoes",
         "Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running",
         ("lightweight", "trail", "breathable", "cushioned"),
         ("non slip", "rubber sole", "memory foam", "arch support", "machine washable", "lace up"),
         {"color": ("black", "navy blue", "grey white", "red"), "size": ("8", "9", "10", "11", "12")}, (30, 120)),
    Kind("hoodie", "fashion", "women pullover hoodie",
         "Clothing, Shoes & Jewelry › Women › Clothing › Fashion Hoodies & Sweatshirts",
         ("oversized", "fleece", "cropped", "zip"),
         ("long sleeve", "machine wash", "soft fabric", "drawstring closure", "polyester cotton", "loose fit"),
         {"color": ("heather grey", "olive green", "pink", "white"), "size": ("small", "medium", "large", "x-large")},
         (18, 60)),
    Kind("headphones", "electronics", "wireless bluetooth headphones",
         "Electronics › Headphones, Earbuds & Accessories › Headphones › Over-Ear Headphones",
         ("wireless", "noise cancelling", "foldable", "studio"),
         ("bluetooth 5.0", "noise cancelling", "long battery life", "built in microphone", "hands free",
          "high fidelity"),
         {"color": ("black", "silver", "rose gold")}, (25, 200)),
    Kind("charger", "electronics", "usb c fast charger",
         "Electronics › Computers & Accessories › Laptop Accessories › Chargers & Adapters",
         ("fast", "compact", "dual port", "travel"),
         ("fast charging", "usb c", "high power", "easy carry", "overheat protection", "wall mount"),
         {"color": ("white", "black"), "size": ("20w", "45w", "65w")}, (9, 50)),
    Kind("trail mix", "grocery", "healthy snack trail mix",
         "Grocery & Gourmet Food › Snack Foods › Trail Mix",
         ("roasted", "sweet and salty", "tropical", "protein"),
         ("gluten free", "non gmo", "low sugar", "high protein", "individually wrapped", "keto friendly"),
         {"flavor name": ("original", "dark chocolate", "honey almond"), "size": ("6 count", "12 count", "24 count")},
         (5, 35)),
    Kind("coffee", "grocery", "whole bean coffee",
         "Grocery & Gourmet Food › Beverages › Coffee, Tea & Cocoa › Coffee › Whole Coffee Beans",
         ("dark roast", "medium roast", "espresso", "decaf"),
         ("fair trade", "usda organic", "single origin", "low acid", "freshly roasted", "kosher"),
         {"flavor name": ("classic", "hazelnut", "vanilla"), "size": ("12 ounce", "2 pound", "5 pound")}, (10, 70)),
)
BRANDS = ("Aurelia", "Brightfield", "Copperleaf", "Dunmore", "Everwell", "Fairhaven", "Glenrock", "Harbor & Pine",
          "Ironwood", "Juniper Lane", "Kestrel", "Lumen")
REVIEW_LINES = (("Great value", 5, "Exactly as described and arrived quickly."),
                ("Works well", 4, "Does what it says; would buy again."),
                ("Just okay", 3, "Fine for the price, nothing special."),
                ("Disappointed", 2, "Quality was lower than I expected."))


def _asin(rng: random.Random) -> str:
    return "B0" + "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789") for _ in range(8))


def _product(rng: random.Random, asin: str) -> tuple[dict[str, Any], dict[str, Any], Kind]:
    kind = rng.choice(KINDS)
    brand, style = rng.choice(BRANDS), rng.choice(kind.styles)
    attributes = rng.sample(kind.attributes, rng.randint(2, 4))
    options = {name: rng.sample(values, rng.randint(2, len(values))) for name, values in kind.options.items()
               if rng.random() < 0.8}
    if not options:  # every product has something to choose, so a goal always names an option
        name = rng.choice(sorted(kind.options))
        options = {name: list(kind.options[name])}
    name = f"{brand} {style.title()} {kind.noun.title()} - {', '.join(a.title() for a in attributes[:2])}"
    low = round(rng.uniform(*kind.price), 2)
    pricing = f"${low:.2f}" if rng.random() < 0.7 else f"${low:.2f}${low * rng.uniform(1.1, 1.6):.2f}"
    product = {
        "asin": asin,
        "name": name,
        "full_description": f"The {brand} {style} {kind.noun} is made for everyday use. "
                            f"It is {attributes[0]} and {attributes[1]}.",
        "small_description": [f"{a.capitalize()}." for a in attributes] + [f"A {style} {kind.noun} by {brand}."],
        "pricing": pricing,
        "customization_options": {k.title(): [{"value": v, "image": None} for v in vs] for k, vs in options.items()},
        "category": kind.category,
        "query": kind.query,
        "product_category": kind.product_category,
        "images": [f"https://example.invalid/{asin}.jpg"],
    }
    return product, {"attributes": attributes}, kind


def _instruction(rng: random.Random, product: dict[str, Any], attributes: list[str], kind: Kind,
                 easy: bool = False) -> dict[str, Any]:
    """A human-style goal for the product: one or two of its attributes and a value of each option; `easy`: one
    attribute and one option's value (the easy tier)."""
    wanted = rng.sample(attributes, 1 if easy else rng.randint(1, min(2, len(attributes))))
    options = product["customization_options"]
    if easy:
        name = rng.choice(sorted(options))
        options = {name: options[name]}
    chosen = {k.lower(): rng.choice(vs)["value"] for k, vs in options.items()}
    option_text = " and ".join(f"{k} {v}" for k, v in chosen.items())
    text = f"i am looking for a {' and '.join(wanted)} {kind.noun} in {option_text}"
    return {"asin": product["asin"], "instruction": text, "instruction_attributes": wanted,
            "instruction_options": list(chosen.values())}


def generate(seed: int, products: int, goals: int, easy: bool = False) -> dict[str, Any]:
    """The four upstream files' contents: {products, attributes, human_instructions, reviews}. `easy` keeps the
    same products (drawn first) and gives single-attribute, single-option goals."""
    rng = random.Random(f"webshop-catalog/{seed}")
    asins: list[str] = []
    while len(asins) < products:  # distinct ids, drawn in order
        asin = _asin(rng)
        if asin not in asins:
            asins.append(asin)
    rows, attributes, kinds = [], {}, {}
    for asin in asins:
        product, attrs, kind = _product(rng, asin)
        rows.append(product)
        attributes[asin], kinds[asin] = attrs, kind
    reviews = [{"asin": asin, "average_rating": round(rng.uniform(3, 5), 1),
                "reviews": [{"title": t, "stars": s, "review": b} for t, s, b in rng.sample(REVIEW_LINES, 2)]}
               for asin in asins]
    instructions = {}
    for product in rng.sample(rows, goals):
        asin = product["asin"]
        instructions[asin] = [_instruction(rng, product, attributes[asin]["attributes"], kinds[asin], easy)]
    return {"products": rows, "attributes": attributes, "human_instructions": instructions, "reviews": reviews}
