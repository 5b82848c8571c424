"""python family tasks: generated math word problems of graded difficulty, each with its answer and golden code.

ToRL (Li et al. 2025, "ToRL: Scaling Tool-Integrated RL", arXiv 2503.23383) trains on competition math
with a code interpreter; a policy of our size needs shorter problems, so these are generated:

- level 1, one or two operations: a shopping bill, what is left over after packing, an age puzzle;
- level 2, rates and percentages: a discounted price with tax, an average speed, two people working together;
- level 3, a loop is the easy way: compound interest, a count of multiples (inclusion-exclusion), a count of
  numbers by digit sum, years until a population passes a threshold.

The generator computes each answer itself, in exact rational arithmetic (`fractions.Fraction`), and writes
the golden code separately: a short program that recomputes the answer in floating point, by brute force
where the generator uses a formula (ages, multiples). The golden policy runs that code in the sandbox and
submits what it prints, so a wrong answer, wrong code or a broken sandbox makes a golden episode fail.

Answers are integers (graded exactly) or decimals the question asks for to two places (`places` 2, graded
within half a unit of the second place of the exact value: `grade`); a sample keeps both the answer as asked
(`answer`) and the exact value (`exact`, a fraction's text). No answer is 0, so the no-op (submit 0) never passes.
Tasks come from the seed, the split and the index alone (the same task in every process); levels take
turns by index, and the kinds of a level take turns among its indices.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

SPLITS = ("train", "dev")
NAMES = ("Ana", "Ben", "Chloe", "Dev", "Eva", "Farid", "Grace", "Hugo", "Ines", "Jon", "Kira", "Liam")
ITEMS = (("notebook", "notebooks"), ("pen", "pens"), ("apple", "apples"), ("ticket", "tickets"),
         ("candle", "candles"), ("mug", "mugs"), ("kite", "kites"), ("lamp", "lamps"))
GOODS = (("cookies", "boxes"), ("eggs", "cartons"), ("apples", "crates"), ("pencils", "packs"), ("cards", "decks"))
PRODUCTS = ("jacket", "bicycle", "desk", "camera", "guitar", "printer", "sofa", "watch")
JOBS = ("paint the fence", "mow the lawn", "tile the floor", "pack the boxes", "clean the hall")
TOWNS = ("Ashford", "Brook", "Cliffton", "Dunmore", "Elmstead", "Fairholm")
# Added to half a unit of the last asked place: room for the rounding error of a float that was printed.
FLOAT_SLACK = Fraction(1, 10**9)


@dataclass(frozen=True)
class Problem:
    """One generated word problem: its text, exact answer, the decimal places asked for and golden code."""

    kind: str
    question: str
    answer: Fraction
    places: int
    code: str


def _to_places(places: int) -> str:
    return " Give the answer rounded to 2 decimal places." if places == 2 else " Answer with a whole number."


# --- level 1 ------------------------------------------------------------------------------------


def shopping(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    (one, many), (other, others) = rng.sample(ITEMS, 2)
    a, p, b, q = rng.randint(2, 12), rng.randint(2, 25), rng.randint(2, 12), rng.randint(2, 25)
    question = (f"{name} buys {a} {many} at ${p} each and {b} {others} at ${q} each. "
                f"How many dollars does {name} spend in total?")
    code = f"{one}_count, {one}_price = {a}, {p}\n{other}_count, {other}_price = {b}, {q}\n" \
           f"print({one}_count * {one}_price + {other}_count * {other}_price)\n"
    return Problem("shopping", question, Fraction(a * p + b * q), 0, code)


def leftover(rng: random.Random) -> Problem:
    goods, packs = rng.choice(GOODS)
    size = rng.randint(3, 15)
    count = rng.randint(2, 40) * size + rng.randint(1, size - 1)  # never a multiple: something is left
    question = (f"A shop has {count} {goods} and packs them into {packs} of {size}. "
                f"How many {goods} are left over after filling as many {packs} as possible?")
    code = f"left = {count}\nwhile left >= {size}:\n    left -= {size}\nprint(left)\n"
    return Problem("leftover", question, Fraction(count % size), 0, code)


def ages(rng: random.Random) -> Problem:
    older, younger = rng.sample(NAMES, 2)
    young_age, gap, years = rng.randint(4, 40), rng.randint(1, 30), rng.randint(2, 15)
    total = (young_age + gap + years) + (young_age + years)
    question = (f"{older} is {gap} years older than {younger}. In {years} years their ages will add up to "
                f"{total}. How old is {younger} now?")
    # Brute force over ages, where the generator solved the equation.
    code = (f"for age in range(200):\n    if (age + {gap} + {years}) + (age + {years}) == {total}:\n"
            f"        print(age)\n        break\n")
    return Problem("ages", question, Fraction(young_age), 0, code)


# --- level 2 ------------------------------------------------------------------------------------


def discount(rng: random.Random) -> Problem:
    product = rng.choice(PRODUCTS)
    price, off, tax = rng.randint(20, 900), rng.choice(range(5, 55, 5)), rng.randint(3, 15)
    question = (f"A {product} costs ${price}. It is on sale for {off}% off, and a sales tax of {tax}% is added to "
                f"the sale price. How many dollars does the {product} cost in the end?{_to_places(2)}")
    value = Fraction(price) * (1 - Fraction(off, 100)) * (1 + Fraction(tax, 100))
    code = f"price = {price}\nsale = price * (1 - {off} / 100)\nprint(round(sale * (1 + {tax} / 100), 2))\n"
    return Problem("discount", question, value, 2, code)


def average_speed(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    d1, d2 = rng.randint(10, 300), rng.randint(10, 300)
    v1, v2 = rng.sample(range(20, 130, 5), 2)
    question = (f"{name} drives {d1} km at {v1} km/h and then {d2} km at {v2} km/h. What is {name}'s average "
                f"speed over the whole trip, in km/h?{_to_places(2)}")
    value = Fraction(d1 + d2) / (Fraction(d1, v1) + Fraction(d2, v2))
    code = f"hours = {d1} / {v1} + {d2} / {v2}\nprint(round(({d1} + {d2}) / hours, 2))\n"
    return Problem("average_speed", question, value, 2, code)


def work_together(rng: random.Random) -> Problem:
    first, second = rng.sample(NAMES, 2)
    job = rng.choice(JOBS)
    a, b = rng.sample(range(2, 25), 2)
    question = (f"{first} can {job} alone in {a} hours, and {second} can do it alone in {b} hours. Working "
                f"together at those rates, how many hours do they need?{_to_places(2)}")
    code = f"rate = 1 / {a} + 1 / {b}\nprint(round(1 / rate, 2))\n"
    return Problem("work_together", question, Fraction(a * b, a + b), 2, code)


# --- level 3 ------------------------------------------------------------------------------------


def compound_interest(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    principal, rate, years = rng.randrange(500, 10001, 100), rng.randint(1, 12), rng.randint(3, 25)
    question = (f"{name} deposits ${principal} in an account that pays {rate}% interest per year, compounded "
                f"once a year. How many dollars are in the account after {years} years?{_to_places(2)}")
    value = Fraction(principal) * (1 + Fraction(rate, 100)) ** years
    code = (f"balance = {principal}\nfor year in range({years}):\n    balance *= 1 + {rate} / 100\n"
            f"print(round(balance, 2))\n")
    return Problem("compound_interest", question, value, 2, code)


def multiples(rng: random.Random) -> Problem:
    limit = rng.randint(100, 5000)
    a, b, c = rng.sample(range(2, 14), 3)
    question = (f"How many whole numbers from 1 to {limit} are divisible by {a} or by {b}, but not by {c}?"
                f"{_to_places(0)}")

    def count(*divisors: int) -> int:
        return limit // math.lcm(*divisors)

    # Inclusion-exclusion here; the golden code counts one by one.
    either = count(a) + count(b) - count(a, b)
    either_and_c = count(a, c) + count(b, c) - count(a, b, c)
    code = (f"print(sum(1 for n in range(1, {limit} + 1) if (n % {a} == 0 or n % {b} == 0) and n % {c} != 0))\n")
    return Problem("multiples", question, Fraction(either - either_and_c), 0, code)


def digit_sum(rng: random.Random) -> Problem:
    low = rng.randint(1, 4000)
    high = low + rng.randint(200, 5000)
    target = rng.randint(5, 25)
    question = f"How many whole numbers from {low} to {high} have digits that add up to {target}?{_to_places(0)}"
    answer = sum(1 for n in range(low, high + 1) if sum(int(d) for d in str(n)) == target)
    code = f"print(sum(1 for n in range({low}, {high} + 1) if sum(map(int, str(n))) == {target}))\n"
    return Problem("digit_sum", question, Fraction(answer), 0, code)


def population(rng: random.Random) -> Problem:
    town = rng.choice(TOWNS)
    start, rate, times = rng.randrange(1000, 50001, 100), rng.randint(2, 15), rng.randint(2, 6)
    threshold = start * times + rng.randint(0, start - 1)
    question = (f"{town} has {start} people. Every year its population grows by {rate}%, rounded down to a "
                f"whole number of people. After how many years does it first exceed {threshold} people?"
                f"{_to_places(0)}")
    people, years = start, 0
    while people <= threshold:  # grows by at least 20 a year: start >= 1000, rate >= 2
        people, years = people + people * rate // 100, years + 1
    code = (f"people, years = {start}, 0\nwhile people <= {threshold}:\n    people += people * {rate} // 100\n"
            f"    years += 1\nprint(years)\n")
    return Problem("population", question, Fraction(years), 0, code)


LEVELS: dict[int, tuple[Callable[[random.Random], Problem], ...]] = {
    1: (shopping, leftover, ages),
    2: (discount, average_speed, work_together),
    3: (compound_interest, multiples, digit_sum, population),
}


def answer_text(value: Fraction, places: int) -> str:
    """The answer as the question asks for it: a whole number, or rounded (half to even) to `places` places."""
    if places == 0:
        if value.denominator != 1:
            raise ValueError(f"a whole-number answer is not whole: {value}")
        return str(value.numerator)
    units = round(value * 10**places)
    sign, units = ("-" if units < 0 else ""), abs(units)
    return f"{sign}{units // 10**places}.{units % 10**places:0{places}d}"


def make_problem(split: str, index: int, seed: int) -> tuple[int, Problem]:
    """(level, problem) at (seed, split, index): levels 1, 2, 3 in turn, each level's kinds in turn;
    a string seed makes Random the same in every process."""
    level = index % len(LEVELS) + 1
    kinds = LEVELS[level]
    kind = kinds[(index // len(LEVELS)) % len(kinds)]
    rng = random.Random(f"python/{seed}/{split}/{index}")
    while True:
        problem = kind(rng)
        if Fraction(answer_text(problem.answer, problem.places)) != 0:  # never 0, so the no-op fails
            return level, problem


def make_task(split: str, index: int, seed: int, task_id: str) -> dict[str, Any]:
    level, problem = make_problem(split, index, seed)
    return {"id": task_id, "question": problem.question, "level": level, "kind": problem.kind,
            "answer": answer_text(problem.answer, problem.places), "exact": str(problem.answer),
            "places": problem.places, "code": problem.code}


def generate(split: str, seed: int, train_tasks: int, dev_tasks: int) -> list[dict[str, Any]]:
    """A split's tasks; dev skips any question that train has word for word."""
    if split not in SPLITS:
        raise ValueError(f"no python split {split!r}; splits: {', '.join(SPLITS)}")
    if split == "train":
        return [make_task("train", i, seed, f"python-train-{i:05d}") for i in range(train_tasks)]
    seen = {make_problem("train", i, seed)[1].question for i in range(train_tasks)}
    tasks: list[dict[str, Any]] = []
    index = 0
    while len(tasks) < dev_tasks:
        if make_problem("dev", index, seed)[1].question not in seen:
            tasks.append(make_task("dev", index, seed, f"python-dev-{len(tasks):05d}"))
        index += 1
    return tasks


def grade(submitted: Any, exact: str, places: int) -> bool:
    """Whether a submitted number is the task's answer (`exact`, a fraction's text): a whole-number answer
    exactly (42 and 42.0 pass, 42.5 does not); a two-place answer within half a unit of its second place
    (0.005) of the exact value, so the exact value and its correct rounding pass (at an exact tie both
    neighbours, so a printed float that lands on the other side of the tie passes too) and any other
    two-place number fails. Anything but a finite number
    (a string, a bool, NaN, infinity) is wrong."""
    if isinstance(submitted, bool) or not isinstance(submitted, (int, float)):
        return False
    if isinstance(submitted, float) and not math.isfinite(submitted):
        return False
    value, expected = Fraction(submitted), Fraction(exact)
    if places == 0:
        return value == expected
    return abs(value - expected) <= Fraction(1, 2 * 10**places) + FLOAT_SLACK
