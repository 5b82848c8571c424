"""calc: generated arithmetic, after AgentRL's simple-calculator example.

A task asks for the value of a left-nested expression such as ((17 + 5) * 3) - 8 and offers
`add(a, b)`, `subtract(a, b)`, `multiply(a, b)` and `submit(answer)`; reward 1 when the submitted
number is the expression's value. Tasks are generated from the seed, split and index alone, so
sample 12 of dev is the same task in every process. Answers are never 0, so that the no-op
(submit 0) cannot pass by luck.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
    scripted,
    tool,
)

OPERATIONS = {"add": ("+", lambda a, b: a + b), "subtract": ("-", lambda a, b: a - b),
              "multiply": ("*", lambda a, b: a * b)}

SYSTEM_PROMPT = ("You are a careful calculator agent. Compute the value of the expression the user gives by "
                 "calling the tools for each operation, one at a time, then call submit with the final result.")

_NUMBER = {"type": "number"}
TOOLS = [
    tool("add", "Return a + b.", {"a": _NUMBER, "b": _NUMBER}),
    tool("subtract", "Return a - b.", {"a": _NUMBER, "b": _NUMBER}),
    tool("multiply", "Return a * b.", {"a": _NUMBER, "b": _NUMBER}),
    tool("submit", "Submit the final result; this ends the task.", {"answer": _NUMBER}),
]


def expression(task: Mapping[str, Any]) -> str:
    """Left-nested with explicit parentheses, so operator precedence never changes the order: ((a + b) * c) - d."""
    text = str(task["start"])
    for turn, (op, operand) in enumerate(task["steps"]):
        text = f"{text if turn == 0 else f'({text})'} {OPERATIONS[op][0]} {operand}"
    return text


def make_task(split: str, index: int, seed: int, operands: tuple[int, int] = (2, 30),
              operations: tuple[int, int] = (1, 3)) -> dict[str, Any]:
    """The task at (seed, split, index), operands and operation count drawn from the inclusive ranges given;
    a string seed makes Random deterministic across processes."""
    rng = random.Random(f"{seed}/{split}/{index}")
    while True:
        start = rng.randint(*operands)
        steps = [(rng.choice(sorted(OPERATIONS)), rng.randint(*operands)) for _ in range(rng.randint(*operations))]
        value = start
        for op, operand in steps:
            value = OPERATIONS[op][1](value, operand)
        if value != 0:
            return {"id": f"calc-{split}-{index}", "start": start, "steps": steps, "answer": value}


def generate(split: str, settings: EnvSettings) -> list[dict[str, Any]]:
    """The split's tasks; `rl` skips any expression that a `train` task (a demonstration's source) also has."""
    def task(split: str, index: int) -> dict[str, Any]:
        operations = settings.calc_split_operations.get(split, settings.calc_operations)
        return make_task(split, index, settings.calc_seed, settings.calc_operands, operations)

    if split != "rl":
        count = {"train": settings.calc_train_tasks, "dev": settings.calc_dev_tasks}[split]
        return [task(split, index) for index in range(count)]
    demonstrated = {expression(t) for t in generate("train", settings)}
    tasks: list[dict[str, Any]] = []
    index = 0
    while len(tasks) < settings.calc_rl_tasks:
        candidate = task("rl", index)
        if expression(candidate) not in demonstrated:
            tasks.append(candidate)
        index += 1
    return tasks


def load(path: Path) -> list[dict[str, Any]]:
    """A JSONL file of calc tasks (the generated form: id, start, steps, answer)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class CalcEnvironment(Environment):
    family = "calc"

    async def open(self, sample: Mapping[str, Any]) -> Opened:
        question = f"What is {expression(sample)}?"
        return Opened([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}], TOOLS)

    async def call_tool(self, session: Session, call: ToolCall) -> Outcome:
        if call.name == "submit":
            correct = call.arguments["answer"] == session.sample["answer"]
            return Outcome("Submitted.", Status.COMPLETED, float(correct), {"score": float(correct)})
        if call.name not in OPERATIONS:
            raise ActionError(f"no tool {call.name}")
        value = OPERATIONS[call.name][1](call.arguments["a"], call.arguments["b"])
        return Outcome(_number_text(value))


def _number_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def make(settings: EnvSettings) -> CalcEnvironment:
    return CalcEnvironment(max_rounds=settings.calc_rounds)


def golden(task: Mapping[str, Any]) -> Policy:
    """Each operation in order on the running value, then submit it."""
    messages, value = [], task["start"]
    for turn, (op, operand) in enumerate(task["steps"]):
        messages.append(assistant_call(op, {"a": value, "b": operand}, call_id=f"call_{turn}"))
        value = OPERATIONS[op][1](value, operand)
    messages.append(assistant_call("submit", {"answer": value}, call_id=f"call_{len(messages)}"))
    return scripted(messages)


def noop(task: Mapping[str, Any]) -> Policy:
    """Submits 0 straight away."""
    return scripted([assistant_call("submit", {"answer": 0})])


FAMILY = Family(name="calc", make=make, load=load, splits={"train": (), "rl": (), "dev": ()},
                golden=golden, noop=noop, generate=generate)
