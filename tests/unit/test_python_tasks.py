"""python family tasks: generated word problems, deterministic by seed, with answers the generator computes
and graded exactly (no sandbox here; the golden and no-op runs in bubblewrap are in
tests/integration/test_python_env.py)."""

from __future__ import annotations

import collections
import contextlib
import io
import random
from fractions import Fraction

import pytest

from env_workers.envs import python_tasks, registry
from env_workers.envs.base import EnvSettings
from env_workers.envs.python_env import printed_number

SETTINGS = EnvSettings()


class FixedRandom(random.Random):
    """Hands out the given integers in order for randint/randrange, and the first choices for choice/sample,
    so that a kind's parameters are known and its answer can be worked out by hand."""

    def __init__(self, *numbers: int) -> None:
        super().__init__(0)
        self.numbers = list(numbers)

    def randint(self, a: int, b: int) -> int:
        value = self.numbers.pop(0)
        assert a <= value <= b
        return value

    def randrange(self, start: int, stop: int | None = None, step: int = 1) -> int:
        return self.numbers.pop(0)

    def choice(self, seq):
        return self.numbers.pop(0) if isinstance(seq, range) else seq[0]

    def sample(self, population, k, **_):
        if isinstance(population, range):
            return [self.numbers.pop(0) for _ in range(k)]
        return list(population[:k])


def _printed(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})  # the generator's own code, not a policy's
    return out.getvalue()


def test_splits_have_the_configured_sizes_and_the_levels_and_kinds_in_turn() -> None:
    train, dev = registry.samples("python", "train", SETTINGS), registry.samples("python", "dev", SETTINGS)
    assert (len(train), len(dev)) == (300, 50)
    assert set(registry.split_names("python")) == {"train", "dev"}
    assert collections.Counter(t["level"] for t in train) == {1: 100, 2: 100, 3: 100}
    kinds = collections.Counter(t["kind"] for t in train)
    assert set(kinds) == {kind.__name__ for kinds in python_tasks.LEVELS.values() for kind in kinds}
    assert max(kinds.values()) - min(kinds.values()) <= 9  # level 3 has four kinds, the others three
    small = EnvSettings(python_train_tasks=9, python_dev_tasks=4)
    assert [len(registry.samples("python", s, small)) for s in ("train", "dev")] == [9, 4]


def test_same_seed_gives_the_same_tasks_and_another_seed_others() -> None:
    assert python_tasks.make_task("dev", 5, 7, "x") == python_tasks.make_task("dev", 5, 7, "x")
    other = python_tasks.generate("dev", 8, 300, 50)
    assert [t["question"] for t in other] != [t["question"] for t in registry.samples("python", "dev", SETTINGS)]
    with pytest.raises(ValueError, match="no python split 'test'"):
        python_tasks.generate("test", 7, 300, 50)


def test_the_dev_split_shares_no_question_with_train() -> None:
    train = {t["question"] for t in registry.samples("python", "train", SETTINGS)}
    dev = [t["question"] for t in registry.samples("python", "dev", SETTINGS)]
    assert not train & set(dev) and len(set(dev)) == len(dev)


def test_no_answer_is_zero_so_submitting_zero_never_passes() -> None:
    for task in (*registry.samples("python", "train", SETTINGS), *registry.samples("python", "dev", SETTINGS)):
        assert Fraction(task["answer"]) != 0
        assert not python_tasks.grade(0, task["exact"], task["places"])


def test_every_golden_program_prints_a_number_the_grader_accepts() -> None:
    for task in (*registry.samples("python", "train", SETTINGS), *registry.samples("python", "dev", SETTINGS)):
        printed = printed_number(_printed(task["code"]))
        assert printed is not None and python_tasks.grade(printed, task["exact"], task["places"]), task["id"]
        assert Fraction(task["answer"]) == round(Fraction(task["exact"]), task["places"])


@pytest.mark.parametrize(("kind", "numbers", "answer", "places"), [
    # 3 notebooks at $4 and 5 pens at $2 (the first two items): 12 + 10.
    (python_tasks.shopping, (3, 4, 5, 2), Fraction(22), 0),
    # 50 cookies (4 boxes of 11 and 6 more) into boxes of 11: 6 left.
    (python_tasks.leftover, (11, 4, 6), Fraction(6), 0),
    # The younger is 10, the gap 5, in 3 years: (10+5+3) + (10+3) = 31 is the stated total; the answer is 10.
    (python_tasks.ages, (10, 5, 3), Fraction(10), 0),
    # $200, 25% off, 10% tax: 200 * 0.75 * 1.1 = 165.
    (python_tasks.discount, (200, 25, 10), Fraction(165), 2),
    # 60 km at 30 km/h (2 h) and 60 km at 60 km/h (1 h): 120 km in 3 h.
    (python_tasks.average_speed, (60, 60, 30, 60), Fraction(40), 2),
    # 3 h and 6 h alone: 1/3 + 1/6 = 1/2 of the job an hour.
    (python_tasks.work_together, (3, 6), Fraction(2), 2),
    # $1000 at 10% for 3 years: 1331.
    (python_tasks.compound_interest, (1000, 10, 3), Fraction(1331), 2),
    # 1..100 divisible by 2 or 3: 50 + 33 - 16 = 67; of those divisible by 5 (by 10 or 15): 10 + 6 - 3 = 13.
    (python_tasks.multiples, (100, 2, 3, 5), Fraction(54), 0),
    # 10..210 with digit sum 5: 14, 23, 32, 41, 50, 104, 113, 122, 131, 140, 203.
    (python_tasks.digit_sum, (10, 200, 5), Fraction(11), 0),
    # 1000 growing 10% a year, rounded down: 1100, 1210, 1331, 1464, 1610, 1771, 1948, 2142: past 2100 after 8.
    (python_tasks.population, (1000, 10, 2, 100), Fraction(8), 0),
])
def test_each_kind_computes_the_answer_worked_out_by_hand(kind, numbers, answer, places):
    problem = kind(FixedRandom(*numbers))
    assert (problem.answer, problem.places) == (answer, places)
    assert python_tasks.grade(printed_number(_printed(problem.code)), str(problem.answer), places)


def test_answer_text_is_a_whole_number_or_two_places_rounded_half_to_even() -> None:
    assert python_tasks.answer_text(Fraction(42), 0) == "42"
    assert python_tasks.answer_text(Fraction(165), 2) == "165.00"
    assert python_tasks.answer_text(Fraction(2), 3) == "2.000"
    assert python_tasks.answer_text(Fraction(600210, 6613), 2) == "90.76"
    assert python_tasks.answer_text(Fraction(12345, 1000), 2) == "12.34"  # a tie goes to the even digit
    with pytest.raises(ValueError, match="not whole"):
        python_tasks.answer_text(Fraction(1, 2), 0)


@pytest.mark.parametrize(("submitted", "passes"), [
    (42, True), (42.0, True), (42.5, False), (41, False), (43, False), (4.2e1, True),
    (True, False), ("42", False), (None, False), (float("nan"), False), (float("inf"), False),
])
def test_whole_number_answers_are_graded_exactly(submitted, passes):
    assert python_tasks.grade(submitted, "42", 0) is passes


@pytest.mark.parametrize(("submitted", "passes"), [
    (90.76, True), (90.7606, True), (90.76224, True), (90.77, False), (90.75, False), (91, False), (9076, False),
])
def test_two_place_answers_pass_within_half_a_unit_of_the_exact_value(submitted, passes):
    assert python_tasks.grade(submitted, "600210/6613", 2) is passes  # 90.7606...


def test_at_an_exact_tie_both_neighbours_pass_and_nothing_further() -> None:
    assert python_tasks.grade(12.34, "2469/200", 2) and python_tasks.grade(12.35, "2469/200", 2)  # 12.345
    assert not python_tasks.grade(12.33, "2469/200", 2) and not python_tasks.grade(12.36, "2469/200", 2)


def test_questions_and_programs_stay_short() -> None:
    train = registry.samples("python", "train", SETTINGS)
    assert max(len(t["question"]) for t in train) < 260
    assert max(len(t["code"]) for t in train) < 200
