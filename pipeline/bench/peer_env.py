"""The environment class TRL's rollouts use in `rollstream bench peer`: rollstream's own environment behind TRL's
documented multi-turn interface (`environment_factory`: the public methods of the class become the policy's tools,
`reset` starts an episode, `get_reward` scores it). It reimplements nothing: `reset` starts a session of the
family's environment (env_workers/envs/base.py) on the row's sample, each tool method sends the call to
`Environment.observation` as the assistant message a rollstream policy would have sent, and `get_reward` is the
agent loop's reward of the session. Only calc has such a class: TRL needs the tools as methods with signatures
and docstrings.

The tool schemas in TRL's prompt are calc's own (`calc_tool_schemas`): transformers builds a method's schema
with get_json_schema, which requires a description of every argument, and a prompt carrying those descriptions
is not the prompt the policy learned: the default policy's greedy first call was right on 19 of 24 rl samples
with calc's schemas and on 2 of 24 with the described ones (2026-12-05).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

from env_workers.envs import calc, registry
from env_workers.envs.base import EnvSettings, Session, assistant_call
from pipeline.analysis.evaluation import FULL_CREDIT
from pipeline.bench.peer_logic import incomplete_reward


class Episodes:
    """What the environments saw, for the curve: (step, success) of every scored episode."""

    def __init__(self) -> None:
        self.scored: list[tuple[int, bool]] = []
        self.step = 0


class RollstreamCalc:
    """rollstream's calc environment as TRL's environment class: one instance per rollout, reset per episode."""

    def __init__(self, envs: EnvSettings, split: str, punishment: float, episodes: Episodes) -> None:
        self._env = registry.environment("calc", envs)
        self._envs, self._split, self._punishment, self._episodes = envs, split, punishment, episodes
        self._loop = asyncio.new_event_loop()  # the environment API is async; TRL calls these methods in its thread
        self._session: Session | None = None
        self._calls = 0

    def reset(self, **row: Any) -> None:
        """Starts an episode of the row's sample (the prompt is the row's, rendered by the same environment)."""
        if self._session is not None:
            self._loop.run_until_complete(self._env.end(self._session))
        sample = registry.sample("calc", self._split, int(row["sample_index"]), self._envs)
        self._session = self._loop.run_until_complete(self._env.start(sample))
        self._calls = 0
        return None

    # The tools have no return annotation: get_json_schema would add a "return" entry to the schema TRL puts in
    # the prompt, which rollstream's tool list (env_workers/envs/calc.py TOOLS) does not have.
    def add(self, a: float, b: float):  # type: ignore[no-untyped-def]
        """Return a + b.

        Args:
            a: a number
            b: a number
        """
        return self._call("add", {"a": a, "b": b})

    def subtract(self, a: float, b: float):  # type: ignore[no-untyped-def]
        """Return a - b.

        Args:
            a: a number
            b: a number
        """
        return self._call("subtract", {"a": a, "b": b})

    def multiply(self, a: float, b: float):  # type: ignore[no-untyped-def]
        """Return a * b.

        Args:
            a: a number
            b: a number
        """
        return self._call("multiply", {"a": a, "b": b})

    def submit(self, answer: float):  # type: ignore[no-untyped-def]
        """Submit the final result; this ends the task.

        Args:
            answer: the final result
        """
        return self._call("submit", {"answer": answer})

    def get_reward(self) -> float:
        """The agent loop's reward of the episode: the environment's when it finished, else the punishment."""
        session = self._session
        assert session is not None, "get_reward before reset"
        reward = incomplete_reward(session.finished, session.reward, self._punishment)
        self._episodes.scored.append((self._episodes.step, session.finished and session.reward >= FULL_CREDIT))
        return reward

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        session = self._session
        assert session is not None, "a tool call before reset"
        if session.finished:  # rollstream's loop would have stopped at the end of the task; TRL goes on
            return "Error: the task is over."
        self._calls += 1
        # The arguments as the policy wrote them: JSON numbers come back from TRL's parser as int or float.
        message = assistant_call(name, arguments, call_id=f"call_{self._calls}")
        observation = self._loop.run_until_complete(self._env.observation(session, message))
        return "\n".join(m["content"] for m in observation.messages)


_CALC_SCHEMAS = {tool["function"]["name"]: tool for tool in calc.TOOLS}


def calc_schema(func: Callable[..., Any]) -> dict[str, Any] | None:
    """calc's own schema (env_workers/envs/calc.py TOOLS) of one of RollstreamCalc's tool methods, else None."""
    name = getattr(func, "__name__", "")
    if getattr(func, "__qualname__", "") != f"{RollstreamCalc.__name__}.{name}" or name not in _CALC_SCHEMAS:
        return None
    return copy.deepcopy(_CALC_SCHEMAS[name])


@contextlib.contextmanager
def calc_tool_schemas() -> Iterator[None]:
    """While inside, transformers renders (and TRL's response parser types) RollstreamCalc's methods with calc's own
    schemas instead of get_json_schema's; other functions keep get_json_schema's. transformers offers no hook for a
    method's schema, so both module-level names that call it are replaced (transformers is pinned)."""
    from transformers.utils import chat_template_utils  # noqa: PLC0415 (TRL's process only)
    from transformers.utils.chat_parsing import response_parser  # noqa: PLC0415

    original = chat_template_utils.get_json_schema

    def schema(func: Callable[..., Any]) -> dict[str, Any]:
        return calc_schema(func) or original(func)

    modules = (chat_template_utils, response_parser)
    for module in modules:
        module.get_json_schema = schema  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in modules:
            module.get_json_schema = original  # type: ignore[attr-defined]
