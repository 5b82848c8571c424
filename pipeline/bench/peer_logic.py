"""The pure part of `rollstream bench peer`: which TRL GRPOTrainer settings reproduce a rollstream run's, what
cannot be matched, the figures compared, and the plot of both learning curves.

Settings (TRL 1.16's GRPOConfig, read from its source, beside ours):
- the group: num_generations = streams.group_size; prompts per step = streams.batch_size, so one generation
  batch is batch_size x group_size completions and per_device_train_batch_size is set to all of them with
  gradient_accumulation_steps 1 and steps_per_generation 1: one optimizer step per batch, one PPO epoch
  (num_iterations 1), as our learner takes one step per batch (its micro-batches accumulate).
- the loss: loss_type "dapo" normalizes the per-token loss by the active tokens of the whole generation batch,
  which is our token-mean over the global batch (learner/loss.py); epsilon / epsilon_high are our clip range;
  `delta` clamps the ratio from above, which changes the clipped surrogate only for negative advantages (for a
  positive one the clipped term already wins above 1 + epsilon_high): our dual clip c; beta is our kl_coef on the
  same k3 estimator; the ratio is to the policy that sampled (num_iterations 1: TRL's old log-probs are the
  current ones, ours the engine's, on-policy apart from the stale pool).
- optimizer: AdamW with our lr, betas, weight decay, gradient clip and warm-up; lr_scheduler_type "constant" (our
  learner keeps lr constant after the warm-up; TRL's default is a linear decay); gradient checkpointing off (our
  learner recomputes nothing; TRL's default turns it on, which would cost it time for memory we do not need).
- sampling: our temperature, top_p 1 and top_k off (our engines sample the full distribution, as TRL's defaults).
- precision: `bf16` is our learner's compute dtype on this host (learner.compute_dtype): both are torch autocast
  over float32 weights and optimizer state (mixed precision). TRL's own default is bf16=True; our learner's is
  float32 on a CPU (schemas/precision.py). TRL's transformers generation runs under the same autocast (accelerate
  wraps the prepared model's forward); our engines serve in engines.dtype, reported under `differences` when it is
  not the learner's.

Throughput is counted the same way on both sides: trained tokens are the policy's own tokens in trained
trajectories (our loss_mask, TRL's completion mask times tool mask), over the wall time from the first rollout
to the last optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pipeline.analysis.evaluation import is_success, paired_change

# What each side's wall time counts: the training loop, from its first rollout to its last optimizer step
# (rollstream: first dispatched task to the last weight version published; TRL: trainer.train()). Start-up
# (engines, loading the model) is reported apart as `startup_s`.
WALL = "first rollout to last optimizer step"

# Settings that cannot be matched whatever the configuration: the algorithms differ here.
FIXED_DIFFERENCES: tuple[str, ...] = (
    "pipeline: rollstream is asynchronous (rollouts go on while the learner trains, a stale engine pool serves part "
    "of the turns); TRL's GRPOTrainer is synchronous (generate a batch, then train on it)",
    "advantages: rollstream normalizes GRPO advantages per task across the batch (AgentRL's task normalization); "
    "TRL has no such step (scale_rewards='group' is its closest: per-group std only)",
    "group std: both use the Bessel-corrected std of the group, rollstream adds 1e-6, TRL 1e-4 (fixed in its code)",
    "KL: both k3 to the reference model; rollstream clamps it per token to +-learner.kl_clamp, TRL does not clamp",
    "tool schemas: the same in both prompts, but in TRL's process only by replacing transformers' get_json_schema "
    "for the environment class's methods with calc's own schemas (get_json_schema would describe every argument, "
    "a prompt the policy was not trained on)",
    "turn limit: rollstream caps each turn at agent_loop.max_new_tokens and the trajectory at max_total_len; TRL caps "
    "the whole multi-turn completion (every turn and every tool response) at max_completion_length, set to "
    "max_turns x max_new_tokens bounded by max_total_len",
    "end of an episode: rollstream stops a trajectory when the environment finishes it (after submit); TRL goes on "
    "generating after every tool response until the policy makes no tool call or max_tool_calling_iterations is "
    "reached, so a TRL episode has one more assistant turn after submit, which it trains on",
    "a message without a tool call: rollstream answers it with the environment's error message and the episode "
    "goes on (a malformed call); TRL ends the episode there (the reward then is the incomplete punishment)",
    "a call with missing or unknown arguments: rollstream's environment answers with its error text; TRL calls the "
    "method with the arguments as keywords and answers with the Python error it raises",
    "generation: rollstream's engines are vLLM servers (token ids in, ids and log-probs out); TRL's rollouts use the "
    "generation mode reported under `generation`",
)


def matched(*, group_size: int, prompts_per_step: int, max_turns: int, max_new_tokens: int, max_total_len: int,
            temperature: float, lr: float, lr_warmup_steps: int, kl_coef: float, clip_ratio_low: float,
            clip_ratio_high: float, clip_ratio_c: float, grad_clip: float, weight_decay: float,
            adam_betas: tuple[float, float], entropy_coef: float, steps: int, seed: int,
            precision: Literal["float32", "bfloat16"]) -> dict[str, Any]:
    """The settings both sides share, under our names (what `--json` reports as `matched`); `precision` is the
    training's compute dtype as resolved on this host."""
    return {"group_size": group_size, "prompts_per_step": prompts_per_step, "max_turns": max_turns,
            "max_new_tokens": max_new_tokens, "max_total_len": max_total_len, "temperature": temperature, "lr": lr,
            "lr_warmup_steps": lr_warmup_steps, "kl_coef": kl_coef, "clip_ratio_low": clip_ratio_low,
            "clip_ratio_high": clip_ratio_high, "clip_ratio_c": clip_ratio_c, "grad_clip": grad_clip,
            "weight_decay": weight_decay, "adam_betas": list(adam_betas), "entropy_coef": entropy_coef,
            "steps": steps, "seed": seed, "precision": precision}


def max_completion_length(shared: Mapping[str, Any]) -> int:
    """TRL's one budget for a whole multi-turn completion: every turn at our per-turn cap, within max_total_len."""
    return min(shared["max_turns"] * shared["max_new_tokens"], shared["max_total_len"])


def grpo_config(shared: Mapping[str, Any], *, output_dir: str, use_vllm: bool) -> dict[str, Any]:
    """Keyword arguments of trl.GRPOConfig that reproduce `shared` (see the module docstring for each)."""
    batch = shared["group_size"] * shared["prompts_per_step"]
    return {
        "output_dir": output_dir,
        "num_generations": shared["group_size"],
        "per_device_train_batch_size": batch,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_iterations": 1,
        "max_steps": shared["steps"],
        "loss_type": "dapo",
        "scale_rewards": "group",
        "epsilon": shared["clip_ratio_low"],
        "epsilon_high": shared["clip_ratio_high"],
        "delta": shared["clip_ratio_c"],
        "beta": shared["kl_coef"],
        "learning_rate": shared["lr"],
        "lr_scheduler_type": "constant_with_warmup" if shared["lr_warmup_steps"] else "constant",
        "warmup_steps": shared["lr_warmup_steps"],
        "max_grad_norm": shared["grad_clip"],
        "weight_decay": shared["weight_decay"],
        "adam_beta1": shared["adam_betas"][0],
        "adam_beta2": shared["adam_betas"][1],
        "temperature": shared["temperature"],
        "top_p": 1.0,
        "top_k": 0,
        "max_completion_length": max_completion_length(shared),
        # one assistant turn per generation: the first turn, then one per tool-calling iteration
        "max_tool_calling_iterations": shared["max_turns"] - 1,
        "seed": shared["seed"],
        "shuffle_dataset": False,  # the dispatcher's seed-0 order: the split's samples in index order
        "gradient_checkpointing": False,
        "use_cpu": True,
        "bf16": shared["precision"] == "bfloat16",  # autocast over float32 weights, as our learner's bfloat16
        "use_vllm": use_vllm,
        "vllm_mode": "colocate",
        "save_strategy": "no",
        "report_to": "none",
        "logging_steps": 1,
        "disable_tqdm": True,
    }


def differences(shared: Mapping[str, Any], *, entropy_coef: float, filter_all_equal: bool, stale_engines: int,
                generation: str, engine_dtype: str) -> list[str]:
    """Every setting that could not be matched: the fixed ones and those this configuration adds."""
    out = list(FIXED_DIFFERENCES)
    if entropy_coef:
        out.append(f"entropy bonus: rollstream {entropy_coef}, TRL has none in GRPOTrainer's loss")
    if filter_all_equal:
        out.append("groups of equal rewards: rollstream drops them and rolls out more (streams.filter_all_equal); "
                   "TRL trains on every group")
    if stale_engines:
        out.append(f"engines: rollstream has {stale_engines} stale-pool engine(s) besides the current pool; TRL "
                   "generates with the policy being trained")
    if engine_dtype != shared["precision"]:
        out.append(f"generation precision: rollstream's engines serve in {engine_dtype} (engines.dtype), TRL generates "
                   f"in {shared['precision']} (its bf16 autocast covers generation too)")
    out.append(f"generation: TRL used {generation}")
    return out


def incomplete_reward(finished: bool, env_reward: float, incomplete_punishment: float) -> float:
    """The reward the agent loop gives an episode (env_workers/agent_loop.py): the environment's when it finished
    it, the incomplete punishment when the turn limit ended it. TRL's episode that ends without the environment
    finishing it is the turn limit (or a message without a tool call, which rollstream would have answered)."""
    return env_reward if finished else incomplete_punishment


def throughput(*, trained_tokens: int, trajectories: int, steps: int, wall_s: float, startup_s: float,
               peak_memory_bytes: int) -> dict[str, Any]:
    """One side's figures over its training window (WALL)."""
    return {"wall_s": wall_s, "startup_s": startup_s, "steps": steps, "trained_tokens": trained_tokens,
            "trajectories": trajectories,
            "trained_tokens_per_s": trained_tokens / wall_s if wall_s > 0 else 0.0,
            "trajectories_per_s": trajectories / wall_s if wall_s > 0 else 0.0,
            "s_per_step": wall_s / steps if steps else None, "peak_memory_bytes": peak_memory_bytes}


def held_out(before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Success before and after on the same held-out samples, and the change paired per sample with its 95%
    interval (pipeline/analysis/evaluation.paired_change), over trajectory events of two evaluations."""
    def rate(trajs: Sequence[Mapping[str, Any]]) -> float | None:
        return sum(is_success(t) for t in trajs) / len(trajs) if trajs else None

    return {"before": rate(before), "after": rate(after), "episodes": [len(before), len(after)],
            "change": paired_change(before, after)}


def trained_trajectories(batches: Iterable[Mapping[str, Any]], weights: Iterable[Mapping[str, Any]]) -> int:
    """Trajectories in the batches the learner trained (a version was published for each)."""
    trained = {w["batch_id"] for w in weights if w.get("batch_id") is not None}
    return sum(len(b["items"]) for b in batches if b["batch_id"] in trained)


def rollstream_curve(batches: Iterable[Mapping[str, Any]], weights: Iterable[Mapping[str, Any]],
                     start_ms: int) -> list[dict[str, Any]]:
    """Training success per learner step against seconds since `start_ms`: each trained batch's trajectories,
    at the time its version was published."""
    batch_of = {b["batch_id"]: b for b in batches}
    out = []
    for w in sorted((w for w in weights if w.get("batch_id") is not None), key=lambda w: w["version"]):
        batch = batch_of.get(w["batch_id"])
        if batch is None:
            continue
        trajs = [item["trajectory"] for item in batch["items"]]
        out.append({"step": w["version"], "t_s": (w["published_at_ms"] - start_ms) / 1000,
                    "success": sum(is_success(t) for t in trajs) / len(trajs) if trajs else 0.0})
    return out


def comparison(ours: Mapping[str, Any], peer: Mapping[str, Any], ours_held: Mapping[str, Any],
               peer_held: Mapping[str, Any]) -> dict[str, Any]:
    """`ratio` (our trained tokens/s over TRL's), its two factors on one machine's cores (`cpu_per_token_ratio`,
    TRL's busy CPU per trained token over ours; `cpu_busy_ratio`, our share of the cores busy over TRL's; None
    where a side's CPU was not measured) and whether our held-out change is at least TRL's (paired means)."""
    def over(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y else None

    a, b = ours_held.get("change"), peer_held.get("change")
    return {"ratio": over(ours["trained_tokens_per_s"], peer["trained_tokens_per_s"]),
            "trajectories_ratio": over(ours["trajectories_per_s"], peer["trajectories_per_s"]),
            "cpu_per_token_ratio": over(peer.get("cpu_s_per_token"), ours.get("cpu_s_per_token")),
            "cpu_busy_ratio": over(ours.get("cpu_busy"), peer.get("cpu_busy")),
            "held_out_change_at_least_peer": None if a is None or b is None else a["mean"] >= b["mean"],
            "held_out_change_difference": None if a is None or b is None else a["mean"] - b["mean"]}


def plot_curves(curves: Mapping[str, Sequence[Mapping[str, Any]]], path: Path, title: str) -> None:
    """Both learning curves (training success per step against wall seconds) on one figure, written to `path`."""
    import matplotlib  # noqa: PLC0415 (only the plot needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in curves.items():
        ax.plot([p["t_s"] for p in points], [p["success"] for p in points], marker="o", label=label)
    ax.set_xlabel("seconds since the first rollout")
    ax.set_ylabel("training success (share of the step's episodes)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
