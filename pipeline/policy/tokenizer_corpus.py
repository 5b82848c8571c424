"""The texts the default policy's tokenizer learns its merges from: oracle episodes of the environments.

Each text is one successful golden episode of a family's train split, rendered whole by the chat
template (system prompt, tool schemas, user task, tool calls, tool responses): exactly what the
policy reads and writes, so the merges fit it and no held-out sample is seen. Deterministic: the
first samples of each split, in order. alfworld is left out: its episodes start a planner each
(over a second apiece), and its texts are what the policy reads least.

Example:

    from pipeline.policy.tokenizer_corpus import tokenizer_corpus
    texts = tokenizer_corpus({"calc": 50})
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping

from env_workers.envs import registry
from pipeline.policy.demonstrations import oracle_episodes
from pipeline.policy.model_init import build_tokenizer
from pipeline.policy.splits import TRAIN_SPLITS
from pipeline.run.config import load_config

# Episodes per family: merges saturate well below these (measured: 2048 merges learned from
# calc 600 / kg 200 / os 40 / db 60 shorten them no more than from these counts).
DEFAULT_EPISODES = {"calc": 200, "kg": 100, "os": 24, "db": 60, "webshop": 40}


def tokenizer_corpus(episodes: Mapping[str, int] = DEFAULT_EPISODES) -> list[str]:
    """Rendered text of the first successful oracle episodes of each family's train split."""
    template = build_tokenizer()  # the chat template alone: rendering text needs no merges
    envs = load_config().envs
    texts: list[str] = []
    for name, count in episodes.items():
        samples = registry.samples(name, TRAIN_SPLITS[name], envs)[:count]
        played, _ = asyncio.run(oracle_episodes(name, registry.environment(name, envs), samples,
                                                registry.family(name).golden))
        texts += [template.apply_chat_template(e.messages, tools=e.tools, tokenize=False) for e in played]
    return texts


@functools.cache
def default_corpus() -> tuple[str, ...]:
    """`tokenizer_corpus()` of the default counts, made once per process (tests make many policies)."""
    return tuple(tokenizer_corpus())
