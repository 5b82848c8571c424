"""Supervised demonstrations from the environments' oracle solvers, tokenized as the agent loop records them.

A demonstration is one successful golden episode (env_workers/envs/check.py's rule: completed with
full credit), played through the environment API itself: the prompt (system + user) and tools
from `env.start`, then for each golden action the assistant message with its tool calls and the
environment's reply messages. Nothing is rendered by hand: every token comes from the
tokenizer's own chat template, the way env_workers/agent_loop.py builds its record:

- the prompt is encode(prompt, add_generation_prompt=True);
- an assistant turn is encode(history + turn) minus the record so far; its tokens up to and
  including the first eos (`<|im_end|>` for Qwen) are the training targets (loss_mask 1), the
  rest (the template's newline after eos) is context, as the loop appends it with loss_mask 0;
- environment messages are encode(history + replies, add_generation_prompt=True) minus the
  record, loss_mask 0. The last reply (after the finishing action) is left out: no turn reads it.

Tool-call arguments are given to the template as JSON objects, not strings: Qwen2.5's own template
always applies `tojson` to them (a string would come out quoted), ours applies it to objects too.
Each turn is also checked against the agent loop's view of it, a plain assistant message whose
content is the decoded text: if the template rendered the two differently, the policy would be
trained on tokens the loop never reproduces, so that is an error (DemonstrationError).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from env_workers.chat_template import ChatEncoder
from env_workers.envs import registry
from env_workers.envs.base import Environment, Policy, Status, TaskError

FULL_CREDIT = 1.0


class DemonstrationError(ValueError):
    """The chat template cannot turn an oracle episode into the token record the agent loop would make."""


@dataclass(frozen=True)
class Episode:
    """One successful oracle episode: the whole conversation and the tools it offered."""

    family: str
    sample_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]


@dataclass(frozen=True)
class Demonstration:
    """An episode as training data: input_ids and loss_mask (1 on exactly the assistant tokens)."""

    family: str
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]

    @property
    def target_tokens(self) -> int:
        return sum(self.loss_mask)


def split_error(splits: Mapping[str, str]) -> str | None:
    """Why (family, split) pairs cannot be asked for demonstrations or evaluation, in one line; None when
    the registry has every family and split. Checked before anything is loaded: a typo in a split name
    would otherwise surface only after the tokenizer and the first families' episodes."""
    for family, split in splits.items():
        try:
            known = registry.split_names(family)
        except registry.UnknownFamily as error:
            return str(error)
        if split not in known:
            return f"family {family!r} has no split {split!r}; splits: {', '.join(known)}"
    return None


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An oracle's assistant message as a chat template takes it: arguments as objects, no null content."""
    calls = [
        {**call, "function": {**call["function"], "arguments": _arguments(call["function"].get("arguments"))}}
        for call in message.get("tool_calls") or []
    ]
    rendered: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if calls:
        rendered["tool_calls"] = calls
    return rendered


def _arguments(arguments: Any) -> Any:
    return json.loads(arguments) if isinstance(arguments, str) else arguments


async def oracle_episode(family: str, env: Environment, sample: Mapping[str, Any], policy: Policy) -> Episode | None:
    """Plays `policy` on `sample` to the end; the episode when it succeeded with full credit, else None."""
    try:
        session = await env.start(sample)
    except TaskError:
        return None
    try:
        # The policy reads the conversation as the environment API gives it (tool-call arguments as
        # JSON strings); the episode keeps it as the template renders it (arguments as objects).
        played, rendered = list(session.messages), list(session.messages)
        while True:
            message = policy(played)
            observation = await env.observation(session, message)
            played += [message, *observation.messages]
            rendered += [template_message(message), *observation.messages]
            if observation.finish:
                break
        if observation.status != Status.COMPLETED or observation.reward < FULL_CREDIT:
            return None
        return Episode(family, str(sample["id"]), rendered, list(session.tools))
    finally:
        await env.end(session)


def tokenize(encoder: ChatEncoder, episode: Episode) -> Demonstration:
    """The token record of `episode`, built as the agent loop builds its own (see the module docstring)."""
    messages, tools = episode.messages, episode.tools
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise DemonstrationError(f"{episode.sample_id}: the episode has no assistant turn")
    ids = encoder.encode(messages[:turns[0]], tools, add_generation_prompt=True)
    mask = [0] * len(ids)
    for n, turn in enumerate(turns):
        rendered = encoder.extension(ids, messages[:turn + 1], tools, add_generation_prompt=False)
        if encoder.eos_token_id not in rendered:
            raise DemonstrationError(f"{episode.sample_id}: the template does not close an assistant turn with eos")
        target = rendered.index(encoder.eos_token_id) + 1
        loop_view = {"role": "assistant", "content": encoder.decode(rendered[:target - 1])}
        if encoder.encode([*messages[:turn], loop_view], tools, add_generation_prompt=False) != ids + rendered:
            raise DemonstrationError(
                f"{episode.sample_id}: turn {n} renders differently as tool calls and as the text the agent loop keeps"
            )
        ids += rendered
        mask += [1] * target + [0] * (len(rendered) - target)
        if n + 1 < len(turns):
            replies = encoder.extension(ids, messages[:turns[n + 1]], tools, add_generation_prompt=True)
            ids += replies
            mask += [0] * len(replies)
    return Demonstration(episode.family, episode.sample_id, ids, mask)


async def oracle_episodes(
    family: str, env: Environment, samples: Sequence[Mapping[str, Any]],
    golden: Callable[[Mapping[str, Any]], Policy], on_played: Callable[[], None] = lambda: None,
) -> tuple[list[Episode], int]:
    """(successful oracle episodes, oracle failures) for `samples`, in order; `golden(sample)` is the family's
    oracle, `on_played` is called after each sample (a progress bar: os episodes take ~0.1 s each in a sandbox)."""
    found: list[Episode] = []
    failed = 0
    for sample in samples:
        episode = await oracle_episode(family, env, sample, golden(sample))
        on_played()
        if episode is None:
            failed += 1
        else:
            found.append(episode)
    return found, failed


async def demonstrations(
    family: str, env: Environment, samples: Sequence[Mapping[str, Any]],
    golden: Callable[[Mapping[str, Any]], Policy], encoder: ChatEncoder, on_played: Callable[[], None] = lambda: None,
) -> tuple[list[Demonstration], int]:
    """(demonstrations, oracle failures) for `samples`, in order; `golden(sample)` is the family's oracle."""
    episodes, failed = await oracle_episodes(family, env, samples, golden, on_played)
    return [tokenize(encoder, episode) for episode in episodes], failed
