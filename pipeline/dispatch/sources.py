"""What the dispatcher feeds, from its command-line form: "calc,db:standard" and "calc=32,os=6".

A family's split and sample count come from the environment registry (env_workers/envs/registry.py),
so a family is known here as soon as it is registered. Every refusal is a ValueError whose message
is one line (the `rollstream dispatch` command prints it).
"""

from __future__ import annotations

from env_workers.envs import registry
from env_workers.envs.base import EnvSettings
from pipeline.dispatch.logic import TaskSource
from pipeline.run.config import load_config


def parse_limit(text: str | None) -> int | dict[str, int] | None:
    """"6" -> 6 for every family; "calc=32,os=6" -> per family (others: all samples)."""
    if not text:
        return None
    if text.strip().isdigit():
        return int(text)
    limits = {}
    for item in text.split(","):
        name, sep, count = item.strip().partition("=")
        if not sep or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"sample counts are N or FAMILY=N,...; got {item!r}")
        limits[name.strip()] = int(count)
    return limits


def parse_weights(text: str) -> dict[str, int]:
    """"calc=3,db=2" -> groups per round-robin turn; "" -> {} (1 each)."""
    parsed = parse_limit(text)
    if isinstance(parsed, int):
        raise ValueError(f"--weights are FAMILY=N,...; got {text!r}")
    return parsed or {}


def parse_sources(spec: str, default_split: str | dict[str, str],
                  limit: int | dict[str, int] | None = None,
                  weights: dict[str, int] | None = None, envs: EnvSettings | None = None) -> tuple[TaskSource, ...]:
    """"calc,db:standard" -> one TaskSource per family (split after ':', else default_split, one
    name or one per family), with the split's sample count from the environment registry, at most `limit`,
    and its round-robin weight from `weights` (default 1). `envs` sizes the splits (default: the configuration's)."""
    weights = weights or {}
    envs = envs or load_config().envs
    sources = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, _, split = item.partition(":")
        split = split or (default_split if isinstance(default_split, str) else default_split.get(name, ""))
        try:
            splits = registry.split_names(name)
            if split not in splits:
                raise ValueError(f"family {name!r} has no split {split!r}; splits: {', '.join(splits)}")
            count = len(registry.samples(name, split, envs))
        except registry.UnknownFamily as e:
            raise ValueError(str(e)) from None
        if count == 0:
            raise ValueError(f"family {name!r} split {split!r} has no samples")
        cap = limit.get(name) if isinstance(limit, dict) else limit
        sources.append(TaskSource(task=name, split=split, count=min(count, cap) if cap else count,
                                  weight=weights.get(name, 1)))
    unknown = sorted(set(weights) - {source.task for source in sources})
    if unknown:
        raise ValueError(f"weights name families that are not trained: {', '.join(unknown)}")
    return tuple(sources)
