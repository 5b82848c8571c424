"""A scripted policy that loops: a tiny policy fine-tuned until, on any calc task, every turn it samples is
the same tool call (`add(a=1, b=1)`), for tests of the behaviour alerts on the real stack.

Why a trained model and not a mock: the alerts watch what the real agent loop counts from what a real
engine sampled, so the loop has to come out of vLLM. The random policy of pipeline/policy/random_policy.py
is the starting point; its demonstrations are calc episodes played with that one call each turn (the
environment's real replies in between), tokenized as the agent loop records them
(pipeline.policy.demonstrations.tokenize), and trained with the SFT's own step until the per-token loss is
small enough for sampling at temperature 1 to repeat the call nearly every time.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from env_workers.chat_template import ChatEncoder
from env_workers.envs import registry
from env_workers.envs.base import EnvSettings, Environment, assistant_call
from pipeline.policy.demonstrations import Episode, template_message, tokenize
from pipeline.policy.random_policy import ensure_random_policy
from pipeline.policy.sft import SftSettings, save_checkpoint, train_step

LOOPED_CALL = ("add", {"a": 1, "b": 1})
TARGET_LOSS = 1e-3
"""Mean per-token loss at which training stops: about 50 tokens per call, so a call is sampled exactly with
probability near exp(-50 x 1e-3) = 0.95 at temperature 1."""


async def _looping_episodes(env: Environment, pool: list[dict[str, Any]], turns: int) -> list[Episode]:
    """`turns` turns of LOOPED_CALL on each sample of `pool`, with the environment's replies."""
    episodes = []
    for sample in pool:
        session = await env.start(sample)
        try:
            messages = list(session.messages)
            for turn in range(turns):
                call = assistant_call(*LOOPED_CALL, call_id=f"call_{turn}")
                observation = await env.observation(session, call)
                messages += [template_message(call), *observation.messages]
            episodes.append(Episode("calc", str(sample["id"]), messages, list(session.tools)))
        finally:
            await env.end(session)
    return episodes


def ensure_looping_policy(path: Path, *, samples: int = 16, turns: int = 4, max_steps: int = 400) -> Path:
    """The looping policy in `path` (made when missing; a policy already there is left as it is)."""
    if (path / "config.json").is_file():
        return path
    start = path.parent / f"{path.name}-start"
    ensure_random_policy(start)
    tokenizer = AutoTokenizer.from_pretrained(start)
    encoder = ChatEncoder(tokenizer)
    envs = EnvSettings()
    pool = registry.samples("calc", "train", envs)[:samples]
    episodes = asyncio.run(_looping_episodes(registry.environment("calc", envs), pool, turns))
    demos = [tokenize(encoder, episode) for episode in episodes]

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    settings = SftSettings(families=("calc",), samples={"calc": samples}, lr=3e-3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else encoder.eos_token_id
    model.train()
    losses = [train_step(model, optimizer, demos, settings.lr, settings, pad) for _ in range(20)]
    while np.mean(losses[-5:]) > TARGET_LOSS:
        if len(losses) >= max_steps:
            raise RuntimeError(f"the looping policy did not reach loss {TARGET_LOSS} in {max_steps} steps: {losses[-5:]}")
        losses.append(train_step(model, optimizer, demos, settings.lr, settings, pad))
    model.eval()
    save_checkpoint(model, start, path)
    return path
