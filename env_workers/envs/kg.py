"""kg: AgentBench's knowledge-graph task (src/server/tasks/knowledgegraph/) as function calls over MetaQA.

The seven tools keep AgentBench's names, arguments and rules: results of get_neighbors,
intersection, argmax, argmin and count become variables #0, #1, ... (their contents are not shown,
only their type); get_neighbors needs a relation that get_relations listed for that variable;
argmax/argmin need an attribute that get_attributes listed; intersection needs two variables of one
type. An argument is a variable (`#N`) or one of the prompt's entities. The answer is given as
AgentBench's text `Final Answer: #N` (in the assistant's content) or with the `final_answer` tool;
reward 1 when the variable's entities are exactly the gold set, F1 recorded as `score`.

MetaQA's rule that the question's topic entity is never an answer (the gold sets are built by
removing it after every hop, see the data README) is applied by get_neighbors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from env_workers.envs import kg_graph
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

INSTRUCTIONS = """You are an agent that answers questions based on the knowledge stored in a knowledge base. To achieve this, you can use the provided tools to query the KB.
A variable can be either an entity or a set of entities (i.e., the result of a previous query). get_relations lists all relations of a variable, so you can decide which relation is the most useful to find the answer; get_neighbors can only be used with a relation that get_relations listed for that variable. A relation name ending in _inv follows the relation backwards (from a person to the movies).
intersection needs two variables of the same type. get_attributes lists the numerical attributes of a variable; use it only for superlative questions, before argmax or argmin. count returns the number of entities of a variable.
After a variable is produced along the process, you need to judge whether a variable is the final answer to the question. Each variable is represented as an id starting from 0. For example, #0 is the first variable, #1 is the second variable, and so on.
Once you find the answer, respond with 'Final Answer: #id', where id is the id of the variable that you think is the final answer. For example, if you think #3 is the final answer, you MUST respond with 'Final Answer: #3'.
You can only take ONE action at a time!! After you get the observation from its execution, you can take another action. You can take at most 15 actions to find the answer to the question."""

_VARIABLE = {"type": "string", "description": "A variable such as #0, or an entity named in the question."}
_NAME = {"type": "string"}
TOOLS = [
    tool("get_relations", "List the relations of a variable or entity.", {"variable": _VARIABLE}),
    tool("get_neighbors", "Follow a relation from a variable or entity; returns a new variable.",
         {"variable": _VARIABLE, "relation": _NAME}),
    tool("intersection", "Intersect two variables of the same type; returns a new variable.",
         {"variable1": _VARIABLE, "variable2": _VARIABLE}),
    tool("get_attributes", "List the numerical attributes of a variable.", {"variable": _VARIABLE}),
    tool("argmax", "The entities of a variable with the largest value of an attribute; returns a new variable.",
         {"variable": _VARIABLE, "attribute": _NAME}),
    tool("argmin", "The entities of a variable with the smallest value of an attribute; returns a new variable.",
         {"variable": _VARIABLE, "attribute": _NAME}),
    tool("count", "The number of entities of a variable; returns a new variable.", {"variable": _VARIABLE}),
    tool("final_answer", "Give a variable as the final answer; this ends the task.", {"variable": _VARIABLE}),
]

FINAL_ANSWER = re.compile(r"(?:Find|Final) Answer: #(\d+)")  # AgentBench's pattern
INVALID_VARIABLE = "Invalid variable id! Need to recheck the action."  # AgentBench's text
TOPIC = re.compile(r"\[([^\]]+)\]")

# MetaQA question-type words -> relation (the data README's table).
TYPE_RELATION = {
    "director": "directed_by", "writer": "written_by", "actor": "starred_actors", "year": "release_year",
    "language": "in_language", "genre": "has_genre", "tags": "has_tags", "tag": "has_tags",
    "imdbrating": "has_imdb_rating", "imdbvotes": "has_imdb_votes",
}


@dataclass(frozen=True)
class Variable:
    type: str
    entities: frozenset[int] = frozenset()
    number: int | None = None  # set for count's result, whose answer is the number itself


@dataclass
class KgState:
    graph: kg_graph.Graph
    topics: dict[str, int]
    topic_type: str
    variables: list[Variable] = field(default_factory=list)
    relations_listed: dict[str, list[str]] = field(default_factory=dict)
    attributes_listed: dict[str, list[str]] = field(default_factory=dict)


def load(path: Path) -> list[dict[str, Any]]:
    """A MetaQA qa_*.txt file with its qa_*_qtype.txt beside it; ids are `<hop dir>/<file stem>/<line>`."""
    qtype_path = path.with_name(f"{path.stem}_qtype.txt")
    lines = path.read_text(encoding="utf-8").splitlines()
    qtypes = qtype_path.read_text(encoding="utf-8").splitlines()
    if len(qtypes) != len(lines):
        raise ValueError(f"{qtype_path} has {len(qtypes)} lines, {path} has {len(lines)}")
    samples = []
    for index, (line, qtype) in enumerate(zip(lines, qtypes, strict=True)):
        question, answers = line.split("\t")
        samples.append({
            "id": f"{path.parent.name}/{path.stem}/{index}",
            "question": TOPIC.sub(r"\1", question),
            "topic": TOPIC.search(question).group(1),
            "qtype": qtype.strip(),
            "answers": answers.split("|"),
        })
    return samples


def path_relations(qtype: str) -> list[str]:
    """The relations a question type walks: movie_to_X forwards, X_to_movie backwards."""
    words = qtype.split("_to_")
    relations = []
    for here, there in zip(words, words[1:]):
        relations.append(TYPE_RELATION[there] if here == "movie" else TYPE_RELATION[here] + kg_graph.INVERSE)
    return relations


def f1(predicted: set[str], gold: set[str]) -> float:
    """AgentBench's per-question F1 (0 when nothing overlaps)."""
    overlap = len(predicted & gold)
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(predicted), overlap / len(gold)
    return 2 * precision * recall / (precision + recall)


class KgEnvironment(Environment):
    family = "kg"

    def __init__(self, max_rounds: int, kb_path: Path) -> None:
        super().__init__(max_rounds)
        self.kb_path = kb_path

    async def open(self, sample: Mapping[str, Any]) -> Opened:
        graph = kg_graph.load(self.kb_path)
        topic = sample["topic"]
        entity = graph.entity(topic)
        if entity is None:
            raise KeyError(f"topic entity {topic!r} is not in the KB")
        state = KgState(graph, {topic: entity}, sample["qtype"].split("_to_")[0])
        question = f"A new question: {sample['question']}\nEntities: [{topic}]"
        messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": question}]
        return Opened(messages, TOOLS, state)

    async def call_tool(self, session: Session, call: ToolCall) -> Outcome:
        state: KgState = session.state
        args = call.arguments
        if call.name == "final_answer":
            return self._answer(session, args["variable"])
        try:
            return Outcome(self._run(state, call.name, args))
        except ValueError as error:
            shown = ", ".join(str(v) for v in args.values())
            raise ActionError(f"{call.name}({shown}) cannot be executed: {error}") from error

    async def on_text(self, session: Session, content: str) -> Outcome | None:
        # AgentBench reads only what precedes a hallucinated "Observation:" and unescapes "\_".
        text = content.split("Observation:")[0].replace("\\_", "_")
        found = FINAL_ANSWER.findall(text)
        if not found:
            return None
        return self._answer(session, f"#{found[0]}")

    def _answer(self, session: Session, reference: str) -> Outcome:
        state: KgState = session.state
        index = _variable_index(reference)
        if index is None or index >= len(state.variables):
            return Outcome(INVALID_VARIABLE)
        variable = state.variables[index]
        if variable.number is not None:
            predicted = {str(variable.number)}
        else:
            predicted = {state.graph.names[e] for e in variable.entities}
        gold = set(session.sample["answers"])
        correct = predicted == gold
        return Outcome("Final answer recorded.", Status.COMPLETED, float(correct), {"score": f1(predicted, gold)})

    def _run(self, state: KgState, name: str, args: Mapping[str, str]) -> str:
        if name == "get_relations":
            key, variable = _resolve(state, args["variable"])
            relations = state.graph.relations(variable.entities)
            state.relations_listed[key] = relations
            return f"[{', '.join(relations)}]"
        if name == "get_neighbors":
            key, variable = _resolve(state, args["variable"])
            relation = args["relation"].strip()
            if relation not in state.relations_listed.get(key, ()):
                raise ValueError("relation must be one that get_relations listed for this variable")
            found = state.graph.neighbors(variable.entities, relation) - set(state.topics.values())
            return _new(state, Variable(kg_graph.range_type(relation), frozenset(found)))
        if name == "intersection":
            first, second = (_resolve(state, args[k], variables_only=True)[1] for k in ("variable1", "variable2"))
            if first.type != second.type:
                raise ValueError("the two variables are not of the same type; you may explore them with get_relations")
            return _new(state, Variable(first.type, first.entities & second.entities))
        if name == "get_attributes":
            key, variable = _resolve(state, args["variable"], variables_only=True)
            attributes = state.graph.attributes(variable.entities)
            state.attributes_listed[key] = attributes
            return f"[{', '.join(attributes)}]"
        if name in ("argmax", "argmin"):
            key, variable = _resolve(state, args["variable"], variables_only=True)
            attribute = args["attribute"].strip()
            if attribute not in state.attributes_listed.get(key, ()):
                raise ValueError("attribute must be one that get_attributes listed for this variable")
            return _new(state, Variable(variable.type, _extreme(state.graph, variable.entities, attribute, name)))
        if name == "count":
            _, variable = _resolve(state, args["variable"], variables_only=True)
            return _new(state, Variable("number", number=len(variable.entities)))
        raise ValueError(f"no tool {name}")


def _variable_index(reference: str) -> int | None:
    text = reference.strip().removeprefix("variable ").removeprefix("Variable ").strip()
    if text.startswith("#") and text[1:].isdigit():
        return int(text[1:])
    return None


def _resolve(state: KgState, reference: str, variables_only: bool = False) -> tuple[str, Variable]:
    """A `#N` variable, or (where the tool takes one, as in AgentBench) an entity of the prompt."""
    index = _variable_index(reference)
    if index is not None:
        if index >= len(state.variables):
            raise ValueError(f"there is no variable #{index}")
        return f"#{index}", state.variables[index]
    name = reference.strip()
    if variables_only or name not in state.topics:
        raise ValueError("the argument must be a variable (#N)" + ("" if variables_only else " or an entity of the question"))
    return name, Variable(state.topic_type, frozenset({state.topics[name]}))


def _new(state: KgState, variable: Variable) -> str:
    state.variables.append(variable)
    number = len(state.variables) - 1
    if variable.number is not None:
        return f"variable #{number}, which is a number"
    return f"variable #{number}, which are instances of {variable.type}"


def _extreme(graph: kg_graph.Graph, entities: frozenset[int], attribute: str, which: str) -> frozenset[int]:
    valued = {e: v for e in entities if (v := graph.value(e, attribute)) is not None}
    if not valued:
        return frozenset()
    best = max(valued.values()) if which == "argmax" else min(valued.values())
    return frozenset(e for e, v in valued.items() if v == best)


def make(settings: EnvSettings) -> KgEnvironment:
    return KgEnvironment(max_rounds=settings.kg_rounds, kb_path=settings.data_root / "metaqa" / "kb.txt")


def golden(sample: Mapping[str, Any]) -> Policy:
    """Walks the question type's path from the topic entity (get_relations, then get_neighbors, each hop)."""
    actions: list[dict[str, Any]] = []
    current = sample["topic"]
    for hop, relation in enumerate(path_relations(sample["qtype"])):
        actions.append(assistant_call("get_relations", {"variable": current}, call_id=f"call_{2 * hop}"))
        actions.append(assistant_call("get_neighbors", {"variable": current, "relation": relation},
                                      call_id=f"call_{2 * hop + 1}"))
        current = f"#{hop}"
    actions.append({"role": "assistant", "content": f"Final Answer: {current}"})

    def policy(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return actions[min(sum(m.get("role") == "assistant" for m in history), len(actions) - 1)]

    return policy


def noop(sample: Mapping[str, Any]) -> Policy:
    """Follows the topic's first relation, counts the result and answers with that count."""
    topic = sample["topic"]

    def policy(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        turn = sum(m.get("role") == "assistant" for m in history)
        if turn == 0:
            return assistant_call("get_relations", {"variable": topic})
        if turn == 1:
            first = str(history[-1].get("content", "")).strip("[]").split(", ")[0]
            return assistant_call("get_neighbors", {"variable": topic, "relation": first}, call_id="call_1")
        if turn == 2:
            return assistant_call("count", {"variable": "#0"}, call_id="call_2")
        return {"role": "assistant", "content": "Final Answer: #1"}

    return policy


FAMILY = Family(
    name="kg",
    make=make,
    load=load,
    splits={
        "train": tuple(f"metaqa/{hop}-hop/qa_train.txt" for hop in (1, 2, 3)),
        "dev": tuple(f"metaqa/{hop}-hop/qa_dev.txt" for hop in (1, 2, 3)),
        # The easy tiers: one hop, then two (issue 21); same questions as in train/dev, by hop count.
        **{f"{hop}hop-{part}": (f"metaqa/{hop}-hop/qa_{part}.txt",) for hop in (1, 2) for part in ("train", "dev")},
    },
    golden=golden,
    noop=noop,
)
