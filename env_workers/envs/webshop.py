"""webshop: WebShop's text environment (princeton-nlp/WebShop web_agent_site) as function calls.

Pages as WebShop's text mode renders them (visible texts joined by " [SEP] "): the search page,
search results (50 hits, 10 a page, "Next >" / "< Prev"), an item page (its options, title, price,
rating, Description / Features / Reviews and Buy Now), the three sub-pages and the done page.
Tools `search_action(keywords)` (only where the page has a search bar) and `click_action(value)`
(a value among the page's clickables, case-insensitive, as upstream's `click[value]`); 20 rounds;
Buy Now ends the task with WebShop's purchase score (webshop_reward.py) as the reward.
Each tool result ends with the page's available actions, as AgentBench shows them.

Search is BM25 with Lucene's formula and pyserini's defaults (k1 0.9, b 0.4) over the documents
WebShop indexes (title, description, first feature, options), written with numpy; only documents
that share a term with the query are hits, as in Lucene. Tokens are lowercased alphanumeric runs
(Lucene's analyser also stems and drops stopwords; this one does not).

Data: WebShop's own files (items_shuffle*.json, items_ins_v2*.json, items_human_ins.json and,
when present, reviews.json, same schema as upstream) from a directory given to `load` (e.g.
`rollstream env check --family webshop --data DIR`), human goals as upstream builds them. They are
absent here, so the family's registered splits ("generated-dev", "generated-train", and the easy tier's
"generated-easy-dev", "generated-easy-train": one attribute and one option per goal) play a
GENERATED catalog and goal set of the same schema (webshop_catalog.py): results on it are not
WebShop results. A sample names its catalog ("generated:<seed>" or a directory); catalogs are
built once per process.

Oracle: search the goal product's name, page to it, click it, choose the goal's options, Buy Now.
No-op: an empty search (which, as upstream, does nothing), then give up (clicking Buy Now where
there is none) until the round limit.
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from env_workers.envs import webshop_catalog
from env_workers.envs.base import (
    ActionError,
    EnvSettings,
    Environment,
    Family,
    Opened,
    Outcome,
    Policy,
    Session,
    Status,
    ToolCall,
    assistant_call,
    tool,
)
from env_workers.envs.webshop_reward import PRICE_RANGE, purchase_reward

log = logging.getLogger(__name__)


class WebshopSettings(BaseModel):
    """The WebShop family's limits and its generated stand-in catalog."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rounds: int = 20
    """AgentRL / AgentBench WebShop: 20 rounds."""
    seed: int = 7
    """Seed of the generated catalog and goals (the data README's Random(7) convention)."""
    products: int = 300
    """Generated products (no paper default; WebShop's small file has 1,000)."""
    goals: int = 100
    """Generated goals (no paper default)."""
    dev_goals: int = 20
    """Generated goals in generated-dev; the rest are generated-train."""
    easy_goals: int = 300
    """Goals of the easy tier (one attribute, one option each) on the same generated products (at most `products`)."""
    easy_dev_goals: int = 50
    """Easy goals in generated-easy-dev; the rest are generated-easy-train."""


SEARCH_RETURN_N = 50  # engine.py
PRODUCT_WINDOW = 10  # engine.py
BM25_K1, BM25_B = 0.9, 0.4  # pyserini's LuceneSearcher defaults
GOAL_SHUFFLE_SEED = 233  # web_agent_text_env.py: random.seed(233); random.shuffle(goals)
END_BUTTON, NEXT_PAGE, PREV_PAGE, BACK_TO_SEARCH = "Buy Now", "Next >", "< Prev", "Back to Search"
SUB_PAGES = ("Description", "Features", "Reviews")
GENERATED = "generated"
GENERATED_EASY = "generated-easy"  # the same products, single-attribute single-option goals

INSTRUCTIONS = """You are web shopping. I will give you instructions about what to do. You have to follow the instructions.
Every round I will give you an observation and a list of available actions, you have to respond with an action based on the state and instruction.
You can use the search_action tool if search is available. You can click one of the buttons in clickables with the click_action tool.
If the action is not valid, nothing happens. Keywords in search are up to you, but the value in click must be a value in the list of available actions.
Remember that your keywords in search should be carefully designed. You can take at most 20 actions; buying a product with "Buy Now" ends the task."""

TOOLS = [
    tool("search_action", "Search the shop (only where the page has a search bar).",
         {"keywords": {"type": "string", "description": "The search keywords."}}),
    tool("click_action", "Click a button, product, option or link shown among the page's clickables.",
         {"value": {"type": "string", "description": "One of the clickables, e.g. 'Buy Now' or a product id."}}),
]


# --- catalog: upstream's loader (engine.py load_products, goal.py get_human_goals) ----------------

@dataclass(frozen=True)
class Catalog:
    """Products in engine form, their prices, the goals and the search index."""

    products: dict[str, dict[str, Any]]
    prices: dict[str, float]
    goals: list[dict[str, Any]]
    index: "Bm25"


def _pricing(raw: str | None) -> tuple[list[float], str]:
    if not raw:
        return [100.0], "$100.0"
    pricing = [float(Decimal(re.sub(r"[^\d.]", "", p))) for p in raw.split("$")[1:]]
    if len(pricing) == 1:
        return pricing, f"${pricing[0]}"
    return pricing[:2], f"${pricing[0]} to ${pricing[1]}"


def _engine_product(raw: Mapping[str, Any], attributes: Mapping[str, Any], reviews: Mapping[str, Any]) -> dict[str, Any]:
    """engine.py load_products for one product: the fields the pages and the reward read."""
    asin = raw["asin"]
    options: dict[str, list[str]] = {}
    for name, contents in (raw.get("customization_options") or {}).items():
        if contents is not None:
            options[name.lower()] = [c["value"].strip().replace("/", " | ").lower() for c in contents]
    review = reviews.get(asin, {})
    bullets = raw["small_description"]
    pricing, price_tag = _pricing(raw.get("pricing"))
    return {
        "asin": asin, "name": raw["name"], "Title": raw["name"], "Description": raw["full_description"],
        "BulletPoints": bullets if isinstance(bullets, list) else [bullets],
        "category": raw["category"], "query": raw["query"].lower().strip(), "product_category": raw["product_category"],
        "pricing": pricing, "Price": price_tag, "options": options,
        "Attributes": attributes.get(asin, {}).get("attributes") or ["DUMMY_ATTR"],
        "Reviews": [{"title": r.get("title", ""), "score": r.get("score", r.get("stars")),
                     "body": r.get("body", r.get("review", ""))} for r in review.get("reviews", [])],
        "Rating": review.get("average_rating", "N.A."),
    }


def build_catalog(raw: Mapping[str, Any], seed: int) -> Catalog:
    """Upstream's products, prices and human goals from the four files' contents; draws from Random(seed)."""
    rng = random.Random(seed)
    reviews = {r["asin"]: r for r in raw.get("reviews", [])}
    products: dict[str, dict[str, Any]] = {}
    for item in raw["products"]:
        asin = item["asin"]
        if asin == "nan" or len(asin) > 10 or asin in products:  # engine.py skips these
            continue
        products[asin] = _engine_product(item, raw["attributes"], reviews)
    prices = {}
    for asin, product in products.items():  # engine.py generate_product_prices
        pricing = product["pricing"]
        prices[asin] = pricing[0] if len(pricing) == 1 else rng.uniform(*pricing[:2])
    goals = []
    for asin, product in products.items():  # goal.py get_human_goals
        for instruction in raw["human_instructions"].get(asin, []):
            if not instruction["instruction_attributes"]:
                continue
            caps = [p for p in PRICE_RANGE if p > prices[asin]][:4]
            price_upper, price_text = 1000000.0, ""
            if len(caps) >= 2:
                price_upper = sorted(rng.sample(caps, 2))[1]
                price_text = f", and price lower than {price_upper:.2f} dollars"
            goals.append({"asin": asin, "category": product["category"], "query": product["query"],
                          "name": product["name"], "product_category": product["product_category"],
                          "instruction_text": instruction["instruction"].strip(".") + price_text,
                          "attributes": instruction["instruction_attributes"], "price_upper": price_upper,
                          "goal_options": instruction["instruction_options"]})
    random.Random(GOAL_SHUFFLE_SEED).shuffle(goals)
    return Catalog(products, prices, goals, Bm25.build(products))


def _read_json(directory: Path, pattern: str, required: bool = True) -> Any:
    found = sorted(directory.glob(pattern))
    if not found:
        if required:
            raise FileNotFoundError(f"no {pattern} in {directory}")
        return None
    return json.loads(found[0].read_text(encoding="utf-8"))


@cache
def catalog(source: str) -> Catalog:
    """The catalog a sample names: "generated[-easy]:<seed>:<products>:<goals>", or a directory of WebShop's files."""
    kind, _, numbers = source.partition(":")
    if kind in (GENERATED, GENERATED_EASY) and numbers:
        seed, products, goals = (int(x) for x in numbers.split(":"))
        log.warning("webshop: playing the GENERATED stand-in catalog (%d products, %d goals, seed %d), "
                    "not WebShop's data", products, goals, seed)
        return build_catalog(webshop_catalog.generate(seed, products, goals, easy=kind == GENERATED_EASY), seed)
    directory = Path(source)
    raw = {"products": _read_json(directory, "items_shuffle*.json"),
           "attributes": _read_json(directory, "items_ins_v2*.json"),
           "human_instructions": _read_json(directory, "items_human_ins*.json"),
           "reviews": _read_json(directory, "reviews*.json", required=False) or []}
    return build_catalog(raw, seed=WebshopSettings().seed)


# --- search ---------------------------------------------------------------------------------------

_TOKEN = re.compile(r"[a-z0-9]+")


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


@dataclass(frozen=True)
class Bm25:
    """Lucene's BM25 over a fixed corpus: per-term postings (document indices, term counts)."""

    asins: list[str]
    postings: dict[str, tuple[np.ndarray, np.ndarray]]
    norms: np.ndarray  # k1 * (1 - b + b * length / mean length), per document

    @classmethod
    def build(cls, products: Mapping[str, Mapping[str, Any]]) -> "Bm25":
        asins = list(products)
        counts: dict[str, dict[int, int]] = {}
        lengths = np.zeros(len(asins))
        for i, asin in enumerate(asins):
            words = tokens(_document(products[asin]))
            lengths[i] = len(words)
            for word in words:
                counts.setdefault(word, {}).setdefault(i, 0)
                counts[word][i] += 1
        postings = {w: (np.fromiter(d.keys(), dtype=np.int64), np.fromiter(d.values(), dtype=np.float64))
                    for w, d in counts.items()}
        mean = lengths.mean() if len(asins) else 1.0
        return cls(asins, postings, BM25_K1 * (1 - BM25_B + BM25_B * lengths / max(mean, 1e-9)))

    def search(self, query: str, k: int = SEARCH_RETURN_N) -> list[str]:
        """The ids of the top k documents sharing a term with the query, best first (ties: catalog order)."""
        scores = np.zeros(len(self.asins))
        hit = np.zeros(len(self.asins), dtype=bool)
        n = len(self.asins)
        for word in tokens(query):
            if word not in self.postings:
                continue
            docs, tf = self.postings[word]
            idf = np.log(1 + (n - len(docs) + 0.5) / (len(docs) + 0.5))
            scores[docs] += idf * tf * (BM25_K1 + 1) / (tf + self.norms[docs])
            hit[docs] = True
        order = np.lexsort((np.arange(n), -scores))
        return [self.asins[i] for i in order if hit[i]][:k]


def _document(product: Mapping[str, Any]) -> str:
    """What WebShop's search_engine/convert_product_file_format.py indexes for a product."""
    options = ", and ".join(f"{name}: {', '.join(values)}" for name, values in product["options"].items())
    return " ".join([product["Title"], product["Description"], product["BulletPoints"][0], options])


# --- pages ----------------------------------------------------------------------------------------

@dataclass
class Page:
    """Where the shopper is: the page kind and what it shows."""

    kind: str = "search"  # search | results | item | sub
    keywords: str = ""
    results: list[str] = field(default_factory=list)
    page: int = 1
    asin: str | None = None
    sub: str | None = None
    options: dict[str, str] = field(default_factory=dict)


@dataclass
class WebshopState:
    catalog: Catalog
    goal: Mapping[str, Any]
    page: Page = field(default_factory=Page)


def clickables(state: WebshopState) -> list[str]:
    """The page's clickable values, lowercased as upstream's text_to_clickable keys."""
    page = state.page
    if page.kind == "search":
        return []
    values = [BACK_TO_SEARCH.lower()]
    if page.kind == "results":
        if page.page > 1:
            values.append(PREV_PAGE.lower())
        if len(page.results) > page.page * PRODUCT_WINDOW:
            values.append(NEXT_PAGE.lower())
        values += [a.lower() for a in _window(page)]
    elif page.kind == "item":
        product = state.catalog.products[page.asin]
        values.append(PREV_PAGE.lower())
        values += [v for option_values in product["options"].values() for v in option_values]
        values += [s.lower() for s in SUB_PAGES] + [END_BUTTON.lower()]
    else:
        values.append(PREV_PAGE.lower())
    return values


def _window(page: Page) -> list[str]:
    return page.results[(page.page - 1) * PRODUCT_WINDOW:page.page * PRODUCT_WINDOW]


def render(state: WebshopState) -> str:
    """The page in WebShop's simple text mode, then its available actions."""
    page, instruction = state.page, state.goal["instruction_text"]
    if page.kind == "search":
        texts = ["WebShop", "Instruction:", instruction, "Search"]
    else:
        texts = ["Instruction:", instruction, BACK_TO_SEARCH]
    if page.kind == "results":
        texts.append(f"Page {page.page} (Total results: {len(page.results)})")
        texts += [PREV_PAGE] if page.page > 1 else []
        texts += [NEXT_PAGE] if len(page.results) > page.page * PRODUCT_WINDOW else []
        for asin in _window(page):
            product = state.catalog.products[asin]
            texts += [asin, product["Title"], product["Price"]]
    elif page.kind == "item":
        product = state.catalog.products[page.asin]
        texts.append(PREV_PAGE)
        for name, values in product["options"].items():
            texts += [name, *values]
        texts += [product["Title"], f"Price: {product['Price']}", f"Rating: {product['Rating']}", *SUB_PAGES,
                  END_BUTTON]
    elif page.kind == "sub":
        product = state.catalog.products[page.asin]
        texts.append(PREV_PAGE)
        if page.sub == "Description":
            texts.append(product["Description"])
        elif page.sub == "Features":
            texts += product["BulletPoints"]
        else:
            for review in product["Reviews"]:
                texts += [review["title"], str(review["score"]), review["body"]]
    available = {"has_search_bar": page.kind == "search", "clickables": clickables(state)}
    return " [SEP] ".join(texts) + "\n\nAvailable Actions:\n" + json.dumps(available)


class WebshopEnvironment(Environment):
    family = "webshop"

    async def open(self, sample: Mapping[str, Any]) -> Opened:
        state = WebshopState(catalog(sample["catalog"]), sample["goal"])
        messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": render(state)}]
        return Opened(messages, TOOLS, state)

    async def call_tool(self, session: Session, call: ToolCall) -> Outcome:
        state: WebshopState = session.state
        if call.name == "search_action":
            return self._search(state, call.arguments["keywords"])
        return self._click(state, call.arguments["value"].strip().lower())

    @staticmethod
    def _search(state: WebshopState, keywords: str) -> Outcome:
        if state.page.kind != "search":
            raise ActionError(f"there is no search bar on this page; click '{BACK_TO_SEARCH}' first")
        query = keywords.strip().lower()
        if not query:  # upstream's `search[]` does nothing
            return Outcome("Nothing happened: the search keywords are empty.\n\n" + render(state))
        state.page = Page("results", query, state.catalog.index.search(query))
        return Outcome(render(state))

    @staticmethod
    def _click(state: WebshopState, value: str) -> Outcome:
        page = state.page
        if value not in clickables(state):
            raise ActionError(f"'{value}' is not clickable on this page; available: {clickables(state)}")
        if value == END_BUTTON.lower():
            product = state.catalog.products[page.asin]
            reward, info = purchase_reward(product, state.goal, state.catalog.prices[page.asin], page.options)
            text = (f"Thank you for shopping with us! [SEP] Purchased [SEP] {page.asin} [SEP] options [SEP] "
                    f"{json.dumps(page.options)} [SEP] Your score (min 0.0, max 1.0) [SEP] {reward:.4f}")
            metrics = {"score": reward, "r_type": info["r_type"], "r_att": info["r_att"],
                       "r_option": info["r_option"], "r_price": info["r_price"]}
            return Outcome(text, Status.COMPLETED, reward, metrics)
        if value == BACK_TO_SEARCH.lower():
            state.page = Page()
        elif value == NEXT_PAGE.lower():
            page.page += 1
        elif value == PREV_PAGE.lower():
            if page.kind == "results":
                page.page -= 1
            elif page.kind == "item":
                page.kind, page.asin, page.options = "results", None, {}
            else:
                page.kind, page.sub = "item", None
        elif page.kind == "results":
            page.kind, page.asin = "item", value.upper()
        elif value in (s.lower() for s in SUB_PAGES):
            page.kind, page.sub = "sub", value.capitalize()
        else:  # an option value: upstream records it under its option's name
            product = state.catalog.products[page.asin]
            name = next(n for n, values in reversed(product["options"].items()) if value in values)
            page.options[name] = value
        return Outcome(render(state))


# --- family ---------------------------------------------------------------------------------------

def make(settings: EnvSettings, webshop: WebshopSettings | None = None) -> WebshopEnvironment:
    return WebshopEnvironment(max_rounds=(webshop or WebshopSettings()).rounds)


def _samples(source: str, goals: Sequence[Mapping[str, Any]], prefix: str, start: int = 0) -> list[dict[str, Any]]:
    return [{"id": f"{prefix}/{start + i}", "catalog": source, "goal": dict(goal)} for i, goal in enumerate(goals)]


def generated_source(webshop: WebshopSettings, easy: bool = False) -> str:
    if easy:
        return f"{GENERATED_EASY}:{webshop.seed}:{webshop.products}:{webshop.easy_goals}"
    return f"{GENERATED}:{webshop.seed}:{webshop.products}:{webshop.goals}"


def generate(split: str, settings: EnvSettings, webshop: WebshopSettings | None = None) -> list[dict[str, Any]]:
    """The generated stand-in splits: generated-dev (the first dev_goals goals) and generated-train; the easy
    tier's generated-easy-dev (the first easy_dev_goals easy goals) and generated-easy-train."""
    webshop = webshop or WebshopSettings()
    easy = split.startswith(GENERATED_EASY + "-")
    source = generated_source(webshop, easy)
    goals = catalog(source).goals
    dev = webshop.easy_dev_goals if easy else webshop.dev_goals
    if split.endswith("-dev"):
        return _samples(source, goals[:dev], split)
    return _samples(source, goals[dev:], split, start=dev)


def load(path: Path) -> list[dict[str, Any]]:
    """Every human goal of a directory holding WebShop's data files (or of the directory of one of them)."""
    directory = (path if path.is_dir() else path.parent).resolve()
    return _samples(str(directory), catalog(str(directory)).goals, "webshop")


def golden(sample: Mapping[str, Any]) -> Policy:
    """Searches the goal product's name, pages until it is listed, opens it, picks the goal's options, buys."""
    goal = sample["goal"]
    target = goal["asin"].lower()
    options = [o.lower() for o in (goal["goal_options"].values() if isinstance(goal["goal_options"], Mapping)
                                   else goal["goal_options"])]

    def policy(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        turn = sum(m.get("role") == "assistant" for m in history)
        if turn == 0:
            return assistant_call("search_action", {"keywords": goal["name"]}, "call_0")
        shown = _available(history)
        if target in shown:
            value = target
        elif END_BUTTON.lower() in shown:
            chosen = sum(_clicked(m) in options for m in history if m.get("role") == "assistant")
            value = options[chosen] if chosen < len(options) else END_BUTTON
        else:
            value = NEXT_PAGE
        return assistant_call("click_action", {"value": value}, f"call_{turn}")

    return policy


def _clicked(message: Mapping[str, Any]) -> str | None:
    for call in message.get("tool_calls") or []:
        if call["function"]["name"] == "click_action":
            return json.loads(call["function"]["arguments"])["value"].lower()
    return None


def _available(history: Sequence[Mapping[str, Any]]) -> list[str]:
    """The clickables listed at the end of the last environment message."""
    text = str(history[-1].get("content") or "")
    marker = "Available Actions:\n"
    return json.loads(text[text.rindex(marker) + len(marker):])["clickables"] if marker in text else []


def noop(sample: Mapping[str, Any]) -> Policy:
    """An empty search (nothing happens), then Buy Now where there is nothing to buy, until the round limit."""

    def policy(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        turn = sum(m.get("role") == "assistant" for m in history)
        if turn == 0:
            return assistant_call("search_action", {"keywords": ""})
        return assistant_call("click_action", {"value": END_BUTTON}, f"call_{turn}")

    return policy


FAMILY = Family(
    name="webshop",
    make=make,
    load=load,
    splits={split: () for split in ("generated-dev", "generated-train", "generated-easy-dev", "generated-easy-train")},
    golden=golden,
    noop=noop,
    generate=generate,
)
