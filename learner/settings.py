"""Learner settings: one validated model (the step, publishing, retention, the process loop);
the step itself is in learner/step.py."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.precision import Precision
from schemas.prometheus import MetricsHost, MetricsPort

PolicyLoss = Literal["ppo", "cispo", "decoupled"]
ISCorrection = Literal["none", "tis", "icepop"]
ISLevel = Literal["token", "sequence", "chunk"]
AdvantageEstimator = Literal["group", "sao"]


class LearnerSettings(BaseModel):
    """Hyperparameters of the learner (AgentRL's 14B five-task config unless noted)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate, AgentRL's 1e-6."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Optimizer steps over which the learning rate rises linearly to `lr` (step k of them uses
    lr * k / lr_warmup_steps); 0: none, verl's default (lr_warmup_steps_ratio 0) that AgentRL keeps.
    AdamW's first steps move every weight by about lr whatever the gradient's noise, so a short run
    of few steps is dominated by them unless they are warmed up."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay, 0 as in AgentRL's actor config."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas, verl's (and torch's) default that AgentRL keeps."""
    clip_ratio_low: float = Field(0.2, ge=0, lt=1)
    """PPO lower clip range (ratio >= 1 - clip_ratio_low), AgentRL's 0.2."""
    clip_ratio_high: float = Field(0.2, ge=0)
    """PPO upper clip range (ratio <= 1 + clip_ratio_high), AgentRL's 0.2."""
    clip_ratio_c: float = Field(3.0, gt=1)
    """Dual-clip bound c for negative advantages, AgentRL's (verl's) 3.0."""
    kl_coef: float = Field(1e-4, ge=0)
    """Coefficient of the k3 KL loss to the reference model, AgentRL's 1e-4."""
    kl_clamp: float = Field(10.0, gt=0)
    """The k3 KL per token is clamped to +-kl_clamp, verl's low_var_kl bound of 10."""
    temperature: float = Field(0.8, gt=0)
    """Logits are divided by the sampling temperature before log-softmax, AgentRL's 0.8."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient, AgentRL's 0."""
    policy_loss: PolicyLoss = "ppo"
    """The policy objective (formulas in learner/loss.py and ARCHITECTURE.md): "ppo", AgentRL's dual-clip PPO;
    "cispo", MiniMax-M1's clipped stop-gradient weight on A * log pi; "decoupled", AReaL's PPO around the
    learner's recomputed log-probs weighted by their ratio to the rollout's."""
    is_correction: ISCorrection = "none"
    """Off-policy correction of the rollout/learner gap: "none" (AgentRL); "tis", truncated importance sampling,
    weight min(rho, is_cap) (Yao et al. 2025); "icepop", tokens whose rho leaves [1/is_cap, is_cap] masked
    (Ling Team 2025). rho = recomputed / rollout probability."""
    is_level: ISLevel = "token"
    """Granularity of the ratios: "token" (AgentRL); "sequence", their geometric mean over the sequence (ROLL's
    geometric); "chunk", over each assistant turn, a contiguous run of loss-mask 1s (ROLL's IPA)."""
    is_cap: float = Field(2.0, gt=1)
    """C of tis (weight <= C) and icepop (kept where 1/C <= rho <= C): the TIS blog's C = 2 (IcePop's band is
    a setting of its own there; here it is [1/C, C])."""
    updates_per_batch: int = Field(1, ge=1)
    """Optimizer steps per batch: its trajectories are split, in batch order, into this many mini-batches of nearly
    equal size, and each mini-batch is one clipped update against the rollout's log-probs (and the proximal ones, for
    the corrections: recomputed once, before the first update), as verl's ppo_mini_batch_size (train_batch_size /
    ppo_mini_batch_size updates) and AReaL's ppo_n_minibatches split a batch. One weight version per batch whatever
    this is. 1 (ours, as before this setting): one step per batch; the paper does not state its value."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm, AgentRL's (verl's) 1.0."""
    compute_dtype: Precision = "float32"
    """What the policy's forward passes compute in (not in the paper): bfloat16 is torch autocast (matrix products in
    bfloat16; weights, optimizer state, log-softmax and loss float32); auto is bfloat16 on a CPU with AMX-BF16 or
    AVX512-BF16, float32 elsewhere (schemas/precision.py). float32 by default: on the default policy's shape the
    casts cost more than the bfloat16 products save (docs/BENCHMARKS.md, "bench precision")."""
    max_tokens_per_micro_batch: int = Field(16384, gt=0)
    """Padded tokens per micro-batch (rows x longest row), verl's ppo_max_token_len_per_gpu 16384."""
    share_prompts: bool = True
    """Not in the paper: pack the members of a group (one prompt) into the same micro-batches and run their shared
    prompt through the model once per micro-batch, its keys and values repeated for each row (learner/microbatch.py;
    the same loss and gradients, tested). On these tasks the prompt is most of a trajectory's tokens, so this is
    most of the forward and backward work saved. One learner process only (torchrun's wrappers expect one forward per
    backward) and not with SAO; elsewhere every row runs whole."""
    bucket_size_mb: int = Field(512, gt=0)
    """Broadcast bucket size in MiB, slime's update-weight-buffer-size of 512 MiB (not in the paper)."""
    max_shard_mb: int = Field(2048, gt=0)
    """Max safetensors shard size in MiB when staging a version (not in the paper)."""
    checkpoint_interval: int = Field(10, gt=0)
    """Steps between checkpoints (not in the paper; verl's save_freq is per experiment)."""
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """How torchrun's ranks share the model: "ddp" replicates it, "fsdp" shards it with FSDP2 (verl's default: fsdp)."""
    stale_step: int = Field(25, gt=0)
    """The stale pool is refreshed every stale_step versions, AgentRL's 25 (broadcast and retention follow it)."""
    keep_versions: int = Field(3, gt=0)
    """Newest staged versions kept in MinIO for engines that missed a broadcast (not in the paper)."""
    keep_stale_versions: int = Field(2, ge=0)
    """Newest multiples of stale_step kept for the stale pool (not in the paper)."""
    keep_checkpoints: int = Field(2, gt=0)
    """Newest checkpoints kept (not in the paper; verl keeps all unless told otherwise)."""
    poll_timeout_s: float = Field(1.0, gt=0)
    """How long one poll of `batches` waits before the loop checks for a stop (not in the paper)."""
    commit_timeout_s: float = Field(30.0, gt=0)
    """How long transient errors of one `batches` offset commit are retried before the learner goes on
    without it, with a new consumer (not in the paper; the checkpoints hold the learner's position)."""
    metrics_port: MetricsPort = None
    """Port of the learner's Prometheus /metrics, served by rank 0 (not in the paper): None none, 0 any free
    port (schemas/prometheus.py)."""
    metrics_host: MetricsHost = "127.0.0.1"
    """Address the learner's /metrics binds (not in the paper): 0.0.0.0 lets a scraper on another host (a Kubernetes
    pod's Prometheus) reach it; loopback by default so a process opens nothing it was not asked for."""
    seed: int = Field(0, ge=0)
    """Seeds torch's RNG when the process starts (not in the paper; a run sets it from its `seed`); a resumed
    learner takes the RNG states its checkpoint saved instead."""

    # -- SAO, seed 000 §7.1 (learner/sao.py; ARCHITECTURE.md "SAO") --
    advantage_estimator: AdvantageEstimator = "group"
    """Where each action token's advantage comes from: "group", the batch's (GRPO then per-task normalization,
    computed by the streams; AgentRL); "sao", single-sample agentic optimization (seed 000 §7.1): a value head
    on the policy's final hidden state, skip-observation GAE from the trajectory's reward computed here, the
    DIS-gated policy gradient as the actor loss (policy_loss, is_correction and is_level do not apply) and
    critic_updates_per_step critic updates per actor step. Needs batches without group advantages
    (streams.advantage "none", usually with streams.group_size 1); one learner process only."""
    gae_gamma: float = Field(1.0, gt=0, le=1)
    """SAO's discount per generated token (the GAE recursion steps over the policy's tokens only). The source
    is not available here: 1.0, verl's algorithm.gamma, since a reward at the end of thousands of tokens must
    not vanish."""
    gae_lambda: float = Field(0.95, ge=0, le=1)
    """SAO's GAE lambda. Source not available here: 0.95, CleanRL's gae_lambda (GAE, Schulman et al. 2015).
    Below 1 the critic's bootstrap carries the credit; at gae_gamma = gae_lambda = 1 the advantage telescopes
    to R - V and skipping the observations changes nothing."""
    critic_lr: float = Field(1e-5, gt=0)
    """AdamW learning rate of SAO's value head: verl's critic.optim.lr 1e-5 (the source's value is not
    available here)."""
    critic_updates_per_step: int = Field(2, ge=1)
    """SAO's critic optimizer steps per actor step, each on the whole batch: 2, seed 000 §7.1."""
    dis_low: float = Field(0.5, gt=0, lt=1)
    """Lower bound of SAO's DIS gate: an action token whose ratio pi_learner / pi_rollout is below it is masked
    out of the policy gradient. 0.5 = 1/C with C = 2, IcePop's and the TIS blog's C (source value not available)."""
    dis_high: float = Field(2.0, gt=1)
    """Upper bound of SAO's DIS gate: a token whose ratio is above it is masked out. 2.0 = C (as dis_low)."""

    @model_validator(mode="after")
    def _sao_has_its_own_actor_loss(self) -> LearnerSettings:
        # SAO's actor loss is the DIS-gated policy gradient; an objective or correction set beside it would be ignored.
        if self.advantage_estimator == "sao":
            others = {name: getattr(self, name) for name, default in
                      (("policy_loss", "ppo"), ("is_correction", "none"), ("is_level", "token"))
                      if getattr(self, name) != default}
            if others:
                raise ValueError("advantage_estimator sao trains with its own actor loss (DIS-gated policy gradient): "
                                 + ", ".join(f"{k} {v!r}" for k, v in others.items()) + " does not apply; leave it out")
        return self

    @property
    def sao(self) -> bool:
        """Whether the learner estimates the advantages itself with SAO's critic (advantage_estimator "sao")."""
        return self.advantage_estimator == "sao"

    @property
    def needs_prox_logprobs(self) -> bool:
        """Whether the step recomputes the learner's own log-probs before training (decoupled, or a correction)."""
        return self.policy_loss == "decoupled" or self.is_correction != "none"

    @property
    def bucket_size_bytes(self) -> int:
        """Broadcast bucket size in bytes."""
        return self.bucket_size_mb * 1024 * 1024

    @property
    def max_shard_bytes(self) -> int:
        """Staged shard size in bytes."""
        return self.max_shard_mb * 1024 * 1024

    # -- delta versions (learner/delta.py, learner/publish.py VersionStager) --
    snapshot_interval: int = Field(10, ge=1)
    """A version is staged full every snapshot_interval versions (and at version 0 and after a restart), the
    others as their change against the previous one; 1: every version full (not in the paper; rollstream's own:
    an engine that missed the chain replays at most 9 small deltas after the snapshot)."""
    publish_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """The dtype the weights are staged and broadcast in, converted once per version: the engines' serving
    dtype (bfloat16 where they serve bf16 on GPUs, float32 on CPU engines); None: as trained (float32)."""
    delta_zstd_level: int = Field(3, ge=1, le=22)
    """zstd level of a delta's XOR bytes: zstd's own default 3 (not in the paper)."""
