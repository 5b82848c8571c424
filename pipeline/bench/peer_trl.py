"""TRL's side of `rollstream bench peer`, run as a child process (`python -m pipeline.bench.peer_trl SPEC`):
TRL's GRPOTrainer trains the starting policy on the family's training split, its rollouts calling rollstream's
own environment through TRL's documented multi-turn interface (`environment_factory`: the methods of an
environment class become the policy's tools, `reset` starts an episode, `get_reward` scores it).

The environment class (pipeline/bench/peer_env.py) wraps rollstream's environment API and reimplements nothing.

The tokenizer is ours with TRL's copy of the Qwen2.5 chat template, which TRL needs to recognize to parse tool
calls; with calc's own tool schemas (peer_env.calc_tool_schemas) it renders every calc conversation exactly as
ours (tests/unit/test_peer_logic.py asserts it).

The spec (JSON) names the model, the output folder, the shared settings (peer_logic.matched), the family,
split and sample count, the environment settings and the reward settings; the result (JSON, `result` in the
spec) gives the timings, the trained tokens and trajectories, the training curve and the saved checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.chat_template_utils import qwen2_5_chat_template  # noqa: E402

from env_workers.envs import registry  # noqa: E402
from env_workers.envs.base import EnvSettings  # noqa: E402
from pipeline.bench.peer_env import Episodes, RollstreamCalc, calc_tool_schemas  # noqa: E402
from pipeline.bench.peer_logic import grpo_config  # noqa: E402
from pipeline.policy.sft import WEIGHT_SUFFIXES  # noqa: E402


class CountingTrainer(GRPOTrainer):
    """GRPOTrainer that counts what it trains on (policy tokens: completion mask x tool mask) and nothing else."""

    trained_tokens = 0
    trajectories = 0

    def _generate_and_score_completions(self, inputs):  # type: ignore[no-untyped-def]
        output = super()._generate_and_score_completions(inputs)
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        self.trained_tokens += int(mask.sum().item())
        self.trajectories += int(mask.shape[0])
        return output


class StepClock(TrainerCallback):
    """Times every optimizer step and closes the curve's point of each."""

    def __init__(self, episodes: Episodes) -> None:
        self.episodes = episodes
        self.started = 0.0
        self.step_ends: list[float] = []
        self.curve: list[dict[str, Any]] = []

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.started = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        now = time.monotonic() - self.started
        self.step_ends.append(now)
        mine = [ok for step, ok in self.episodes.scored if step == self.episodes.step]
        self.curve.append({"step": state.global_step, "t_s": now,
                           "success": sum(mine) / len(mine) if mine else 0.0})
        self.episodes.step += 1


def prompts(envs: EnvSettings, split: str, count: int) -> list[dict[str, Any]]:
    """The first `count` samples of the split with the prompt rollstream's environment renders for each."""
    env, rows = registry.environment("calc", envs), []
    for index in range(count):
        session = asyncio.run(env.start(registry.sample("calc", split, index, envs)))
        rows.append({"prompt": session.messages, "sample_index": index})
        asyncio.run(env.end(session))
    return rows


def save_checkpoint(trainer: GRPOTrainer, base: Path, out: Path) -> None:
    """The trained weights beside the base checkpoint's tokenizer files (our chat template: the evaluation of
    both sides' checkpoints renders prompts alike)."""
    out.mkdir(parents=True, exist_ok=True)
    for path in base.iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, out / path.name)
    trainer.model.save_pretrained(out)


def main(spec_path: str) -> None:
    begun = time.monotonic()
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # the cores this process was given, all of them
    envs = EnvSettings(**spec["envs"])
    shared = spec["shared"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    tokenizer.chat_template = qwen2_5_chat_template  # renders as ours on calc conversations (see the docstring)
    tokenizer.padding_side = "left"
    count = shared["steps"] * shared["prompts_per_step"]
    dataset = Dataset.from_list(prompts(envs, spec["split"], count))
    episodes = Episodes()
    clock = StepClock(episodes)
    args = GRPOConfig(**grpo_config(shared, output_dir=spec["output_dir"], use_vllm=spec["use_vllm"]))
    with calc_tool_schemas():
        trainer = CountingTrainer(
            model=spec["model"], args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[clock],
            environment_factory=lambda: RollstreamCalc(envs, spec["split"], spec["incomplete_punishment"], episodes))
        startup_s = time.monotonic() - begun
        started, started_ms = time.monotonic(), int(time.time() * 1000)
        trainer.train()
        wall_s = time.monotonic() - started
    save_checkpoint(trainer, Path(spec["model"]), Path(spec["checkpoint"]))
    Path(spec["result"]).write_text(json.dumps({
        "wall_s": wall_s, "startup_s": startup_s, "steps": trainer.state.global_step,
        "trained_tokens": trainer.trained_tokens, "trajectories": trainer.trajectories,
        "step_ends_s": clock.step_ends, "curve": clock.curve, "checkpoint": spec["checkpoint"],
        "window_ms": [started_ms, started_ms + int(wall_s * 1000)],
        "threads": torch.get_num_threads(), "log_history": trainer.state.log_history}))


if __name__ == "__main__":
    main(sys.argv[1])
