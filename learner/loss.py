"""The policy loss, as AgentRL trains it: dual-clip PPO against the rollout policy, k3 KL, token-mean.

Reproduces the actor loss of AgentRL (Zhang et al., "AgentRL: Scaling Agentic Reinforcement
Learning with a Multi-Turn, Multi-Task Framework", arXiv 2510.04206), which inherits verl's
`compute_policy_loss` / `kl_penalty("low_var_kl")` / `agg_loss("token-mean")`:

- PPO clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
  arXiv 1707.06347), with separate lower and upper clip ranges;
- dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
  Reinforcement Learning", arXiv 1912.09729): for negative advantages the loss is also bounded
  by -A * c, so a token whose ratio exploded cannot dominate the batch;
- low-variance KL to a frozen reference policy, the k3 estimator
  exp(ref - logp) - (ref - logp) - 1 (J. Schulman, "Approximating KL Divergence", 2020,
  http://joschu.net/blog/kl-approx.html), clamped to +-kl_clamp, added with coefficient kl_coef;
- an entropy bonus with coefficient 0 by default.

The behaviour policy of the ratio is the **rollout** log-prob each engine reported while
sampling (possibly a stale engine); by default it is never recomputed, which is what makes the
ratio an importance weight for cross-policy sampling (the options below add the learner's own
recomputed log-prob as a third policy).

Token-mean over a global batch split into micro-batches: every per-token sum below is divided
by the number of action tokens of the *whole* batch (`global_action_tokens`), not of the
micro-batch. Summing the micro-batch losses (gradient accumulation) then gives exactly
sum over all action tokens / number of action tokens, so each micro-batch weighs by its token
count. The diagnostics are normalized the same way, so they also add up across micro-batches.

All per-token tensors here are (B, T-1): position t holds the log-prob of token t+1 of the
sequence, predicted from the logits at position t (see learner/microbatch.py).

Options (`LearnerSettings.policy_loss`, `is_correction`, `is_level`, `is_cap`; the default, ppo with
no correction at token level, is the AgentRL loss above, unchanged). Notation: pi_theta the policy
being trained, pi_behav the rollout (behaviour) log-prob the engine reported, pi_prox the learner's
own log-prob recomputed under no_grad at the start of the step (learner/step.py), A the advantage,
r = pi_theta / pi_old the policy ratio, rho = pi_prox / pi_behav the behaviour ratio, C = is_cap:

- `ppo`: dual-clip PPO on r, the loss above.
- `cispo` (MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
  arXiv 2506.13585): -sg(clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A * log pi_theta.
  Only the weight is clipped, so every token keeps a gradient.
- `decoupled` (AReaL, Fu et al., "AReaL: A Large-Scale Asynchronous Reinforcement Learning System
  for Language Reasoning", arXiv 2505.24298): dual-clip PPO around pi_old = pi_prox, times
  the behaviour weight rho (uncapped unless a correction below caps it).
- `tis` (Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
  2025, https://fengyao.notion.site/off-policy-rl): pi_old = pi_prox, and the loss of each token is
  weighted by min(rho, C).
- `icepop` (Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
  Thinking Model", arXiv 2510.18855, IcePop): pi_old = pi_prox, and the weight is rho where
  1/C <= rho <= C, else 0: such tokens are masked out of the policy-gradient term (they stay in
  the KL term and in the token-mean's denominator, so the batch's scale does not move).
- `is_level`: the granularity of every ratio (r and rho). `token`: per token. `sequence`: the
  geometric mean over the sequence's action tokens, exp(mean log ratio) (ROLL's `geometric`;
  GSPO's length-normalized ratio, Zheng et al., arXiv 2507.18071), not the product, which over a
  few hundred tokens leaves [1/C, C] for almost every sequence. `chunk`: ROLL's IPA (alibaba/ROLL,
  `compute_segment_masked_mean`), the geometric mean over each chunk, one chunk = one contiguous
  run of 1s of the loss mask within a sequence, i.e. one assistant turn (the environment's tokens
  between two turns have mask 0).

SAO (seed 000 §7.1; `LearnerSettings.advantage_estimator: sao`) has an actor loss of its own,
`dis_policy_loss`: -gate * A * rho with rho = pi_theta / pi_behav and the gate shut (0) wherever rho
leaves [dis_low, dis_high] (DIS, a two-sided hard gate), its advantages from the critic
(learner/sao.py). The KL and entropy terms and the token-mean are the same as above.

With one optimizer step per batch, pi_prox equals pi_theta in value (the weights are only stepped
after the last micro-batch), so r = 1 and the PPO clip around pi_prox does not bind: decoupled,
tis and icepop then train on -w * A * grad log pi_theta, w the behaviour weight. With a
correction, decoupled is the same expression as ppo.
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner.settings import ISCorrection, ISLevel, PolicyLoss

# verl clamps log-ratios before exp so that a stale-engine outlier cannot overflow.
LOG_RATIO_BOUND = 20.0


def next_token_logits(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, temperature: float, prefix_len: int = 0
) -> Tensor:
    """Logits of a HF causal LM for each next token, divided by the sampling temperature.

    Returns (B, T-1, V): position t holds the logits of token t+1, scaled as the engines sampled.
    With prefix_len P > 0 (the first P tokens are the same in every row, learner/microbatch.py), the prefix
    runs once, its keys and values repeated for each row and kept in the autograd graph, and only positions
    P.. are returned, (B, T-1-P, V): the loss and gradients over them are those of a full forward (tested),
    at the cost of P + B x (T-P) tokens instead of B x T.
    """
    if prefix_len:
        cache = model(input_ids=input_ids[:1, :prefix_len], use_cache=True).past_key_values  # (1, P) keys/values
        cache.batch_repeat_interleave(input_ids.shape[0])  # (B, P)
        logits = model(input_ids=input_ids[:, prefix_len:], attention_mask=attention_mask,
                       past_key_values=cache, use_cache=False).logits  # (B, T-P, V)
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
    # Logits at position t predict token t+1: drop the last position, whose token is unseen.
    return logits[:, :-1, :].float() / temperature  # (B, T-1-P, V)


def token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """log p(input_ids[:, t+1] | prefix) from next_token_logits; (B, T-1, V) -> (B, T-1)."""
    labels = input_ids[:, 1:]  # (B, T-1)
    log_norm = torch.logsumexp(logits, dim=-1)  # (B, T-1)
    label_logits = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T-1, 1) -> (B, T-1)
    return label_logits - log_norm  # (B, T-1)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of each next-token distribution; (B, T-1, V) -> (B, T-1).

    H = logsumexp(z) - sum softmax(z) * z, without materializing log_softmax. Pass detached
    logits when the entropy coefficient is 0, so it costs no autograd memory over the vocabulary.
    """
    probs = torch.softmax(logits, dim=-1)  # (B, T-1, V)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)  # (B, T-1)


def level_log_ratio(log_ratio: Tensor, loss_mask: Tensor, level: ISLevel) -> Tensor:
    """Each action token's log-ratio at `level`; (B, T-1) -> (B, T-1), 0 where loss_mask is 0.

    token: unchanged. sequence: the mean over the row's action tokens (one row = one sequence).
    chunk: the mean over the token's chunk, a contiguous run of 1s of the row's loss_mask (one
    assistant turn; ROLL's IPA). exp() of a mean log-ratio is the geometric mean of the ratios.
    The gradient flows to every token of the sequence or chunk.
    """
    if level == "token":
        return log_ratio
    action = loss_mask > 0  # (B, T-1)
    # where, not a product: a non-finite log-ratio off the mask must not reach a mean as 0 * inf.
    on_mask = torch.where(action, log_ratio, torch.zeros_like(log_ratio))  # (B, T-1)
    if level == "sequence":
        tokens = action.sum(-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)  # (B, 1)
        mean = on_mask.sum(-1, keepdim=True) / tokens  # (B, 1)
        return torch.where(action, mean.expand_as(log_ratio), torch.zeros_like(log_ratio))  # (B, T-1)
    if level == "chunk":
        # A chunk starts where the mask goes 0 -> 1; its id (1, 2, ...) is the running count of starts.
        before = torch.nn.functional.pad(action[:, :-1], (1, 0))  # (B, T-1): the previous token's flag
        chunk_id = torch.cumsum((action & ~before).long(), dim=-1) * action.long()  # (B, T-1), 0 off the mask
        slots = log_ratio.shape[-1] + 1  # ids 0 .. T-1
        sums = on_mask.new_zeros(on_mask.shape[0], slots).scatter_add(-1, chunk_id, on_mask)  # (B, S)
        counts = on_mask.new_zeros(on_mask.shape[0], slots).scatter_add(
            -1, chunk_id, action.to(log_ratio.dtype)).clamp(min=1.0)  # (B, S)
        means = (sums / counts).gather(-1, chunk_id)  # (B, S) -> (B, T-1)
        return torch.where(action, means, torch.zeros_like(log_ratio))  # (B, T-1)
    raise ValueError(f"unknown is_level {level!r}")


def k3_kl(ref_logprobs: Tensor, logprobs: Tensor, kl_clamp: float) -> Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref), exp(ref - logp) - (ref - logp) - 1, clamped to +-kl_clamp."""
    ref_log_ratio = ref_logprobs - logprobs
    kl = torch.exp(ref_log_ratio) - ref_log_ratio - 1.0
    return torch.clamp(kl, min=-kl_clamp, max=kl_clamp)


def policy_loss(
    logprobs: Tensor,
    rollout_logprobs: Tensor,
    ref_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    entropy: Tensor,
    global_action_tokens: int,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    kl_coef: float,
    kl_clamp: float,
    entropy_coef: float,
    prox_logprobs: Tensor | None = None,
    objective: PolicyLoss = "ppo",
    is_correction: ISCorrection = "none",
    is_level: ISLevel = "token",
    is_cap: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy loss (`objective`, off-policy correction) + k3 KL - entropy bonus, token-mean over
    `global_action_tokens`.

    All tensor arguments are (B, T-1); `loss_mask` is 1 on action tokens; `prox_logprobs`, the
    learner's own log-probs at the start of the step (no graph), is needed by decoupled and by any
    correction. Returns the loss of this micro-batch (to be summed over micro-batches) and detached
    diagnostics named actor/pg_loss, actor/pg_clipfrac, actor/pg_clipfrac_lower, actor/ppo_kl,
    actor/kl_loss, actor/entropy, and with a behaviour weight actor/is_weight, actor/is_clipfrac,
    actor/behav_kl, each a token-mean share that sums over micro-batches like the loss.
    """
    if global_action_tokens <= 0:
        raise ValueError("the batch has no action tokens to train on")
    # decoupled and the corrections separate the behaviour policy (rollout) from the old policy (prox).
    behaviour_weighted = objective == "decoupled" or is_correction != "none"
    if behaviour_weighted and prox_logprobs is None:
        raise ValueError(f"policy_loss {objective!r} with is_correction {is_correction!r} needs prox_logprobs")
    mask = loss_mask.to(logprobs.dtype)

    def token_mean(per_token: Tensor) -> Tensor:
        """This micro-batch's share of the global token-mean: sum(x * mask) / global tokens."""
        return (per_token * mask).sum() / global_action_tokens

    # --- policy ratio r = pi_theta / pi_old: pi_old is the rollout's, or the recomputed proximal policy ---
    old_logprobs = prox_logprobs if behaviour_weighted else rollout_logprobs
    log_ratio = level_log_ratio(logprobs - old_logprobs, loss_mask, is_level)
    # Clamped before exp so that a stale-engine outlier cannot overflow; the clips below bound it anyway.
    log_ratio = torch.clamp(log_ratio, min=-LOG_RATIO_BOUND, max=LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)

    if objective == "cispo":
        # --- CISPO (MiniMax-M1): the clipped ratio, stop-gradient, weighs A * log pi_theta ---
        cispo_weight = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
        pg_losses = -cispo_weight * advantages * logprobs
        with torch.no_grad():
            pg_clipfrac = token_mean((cispo_weight != ratio).to(mask.dtype))
            pg_clipfrac_lower = token_mean(torch.zeros_like(mask))  # no dual clip in CISPO
    else:
        # --- PPO clipped surrogate (Schulman et al. 2017) ---
        pg_losses1 = -advantages * ratio
        pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
        clipped = torch.maximum(pg_losses1, pg_losses2)

        # --- dual clip for negative advantages (Ye et al. 2020) ---
        pg_losses3 = -advantages * clip_ratio_c
        dual_clipped = torch.minimum(clipped, pg_losses3)
        pg_losses = torch.where(advantages < 0, dual_clipped, clipped)
        with torch.no_grad():
            pg_clipfrac = token_mean((pg_losses2 > pg_losses1).to(mask.dtype))
            pg_clipfrac_lower = token_mean(((clipped > pg_losses3) & (advantages < 0)).to(mask.dtype))

    behaviour_metrics: dict[str, Tensor] = {}
    if behaviour_weighted:
        # --- behaviour weight w from rho = pi_prox / pi_behav: raw (AReaL), truncated (TIS) or masked (IcePop) ---
        behav_log_ratio = level_log_ratio(prox_logprobs - rollout_logprobs, loss_mask, is_level)
        rho = torch.exp(torch.clamp(behav_log_ratio, min=-LOG_RATIO_BOUND, max=LOG_RATIO_BOUND))
        if is_correction == "tis":
            is_weight = torch.clamp(rho, max=is_cap)
        elif is_correction == "icepop":
            is_weight = torch.where((rho >= 1.0 / is_cap) & (rho <= is_cap), rho, torch.zeros_like(rho))
        else:
            is_weight = rho
        pg_losses = is_weight.detach() * pg_losses
        with torch.no_grad():
            behaviour_metrics = {
                "actor/is_weight": token_mean(is_weight),
                "actor/is_clipfrac": token_mean((is_weight != rho).to(mask.dtype)),  # truncated or masked
                # Approximate KL(behaviour || proximal), k1: how far the engines' log-probs are from the learner's.
                "actor/behav_kl": token_mean(rollout_logprobs - prox_logprobs),
            }
    pg_loss = token_mean(pg_losses)

    # --- k3 KL to the frozen reference (Schulman 2020), clamped ---
    kl_loss = token_mean(k3_kl(ref_logprobs, logprobs, kl_clamp))

    entropy_loss = token_mean(entropy)
    loss = pg_loss + kl_coef * kl_loss - entropy_coef * entropy_loss

    with torch.no_grad():
        # Approximate KL(old || current), k1 estimator, as verl reports it.
        ppo_kl = token_mean(-log_ratio)
    metrics = {
        "actor/pg_loss": pg_loss.detach(),
        "actor/pg_clipfrac": pg_clipfrac,
        "actor/pg_clipfrac_lower": pg_clipfrac_lower,
        "actor/ppo_kl": ppo_kl,
        "actor/kl_loss": kl_loss.detach(),
        "actor/entropy": entropy_loss.detach(),
        **behaviour_metrics,
    }
    return loss, metrics


def dis_policy_loss(
    logprobs: Tensor,
    rollout_logprobs: Tensor,
    ref_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    entropy: Tensor,
    global_action_tokens: int,
    *,
    dis_low: float,
    dis_high: float,
    kl_coef: float,
    kl_clamp: float,
    entropy_coef: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAO's actor loss (seed 000 §7.1): the policy gradient with the rollout ratio, hard-gated on both sides
    (DIS), + k3 KL - entropy bonus, token-mean over `global_action_tokens`. Per action token, with
    A the critic's advantage (learner/sao.py, skip-observation GAE):

        rho  = pi_theta / pi_rollout = exp(logp - behav)            (with gradient)
        gate = 1 if dis_low <= sg(rho) <= dis_high else 0
        pg   = -gate * A * rho         gradient -gate * A * rho * grad log pi_theta

    the importance-weighted policy gradient, PPO's unclipped surrogate: the gate, not a clip, is the trust
    region, and a token outside it gives no gradient at all (it stays in the KL term and in the token-mean's
    denominator, as IcePop's masked tokens do). pi_theta is the learner's policy as it trains: with one
    optimizer step per batch its value is the learner's log-prob at the start of the step, so the gate sees the
    whole learner/rollout gap (engine numerics, stale and cross-policy turns).

    Diagnostics under the loss's usual names, so reports and the progress line read alike: actor/pg_clipfrac
    is the share of tokens the gate masks, actor/pg_clipfrac_lower those below dis_low, actor/ppo_kl the k1
    estimate of KL(rollout || learner), actor/is_weight the mean of gate * rho (a masked token counts 0).
    """
    if global_action_tokens <= 0:
        raise ValueError("the batch has no action tokens to train on")
    mask = loss_mask.to(logprobs.dtype)

    def token_mean(per_token: Tensor) -> Tensor:
        """This micro-batch's share of the global token-mean: sum(x * mask) / global tokens."""
        return (per_token * mask).sum() / global_action_tokens

    # --- rollout ratio rho = pi_theta / pi_rollout, clamped before exp (a stale-engine outlier must not overflow) ---
    log_rho = torch.clamp(logprobs - rollout_logprobs, min=-LOG_RATIO_BOUND, max=LOG_RATIO_BOUND)
    rho = torch.exp(log_rho)

    # --- DIS: two-sided hard gate on the ratio; outside [dis_low, dis_high] the token is masked ---
    with torch.no_grad():
        gate = ((rho >= dis_low) & (rho <= dis_high)).to(mask.dtype)

    # --- policy gradient, importance-weighted: -A * rho (PPO's unclipped surrogate), kept tokens only ---
    pg_losses = -gate * advantages * rho
    pg_loss = token_mean(pg_losses)

    # --- k3 KL to the frozen reference (Schulman 2020), clamped ---
    kl_loss = token_mean(k3_kl(ref_logprobs, logprobs, kl_clamp))

    entropy_loss = token_mean(entropy)
    loss = pg_loss + kl_coef * kl_loss - entropy_coef * entropy_loss

    with torch.no_grad():
        metrics = {
            "actor/pg_loss": pg_loss.detach(),
            "actor/pg_clipfrac": token_mean(1.0 - gate),
            "actor/pg_clipfrac_lower": token_mean((rho < dis_low).to(mask.dtype)),
            # Approximate KL(rollout || learner), k1 estimator, as verl reports ppo_kl.
            "actor/ppo_kl": token_mean(-log_rho.detach()),
            "actor/kl_loss": kl_loss.detach(),
            "actor/entropy": entropy_loss.detach(),
            # the mean weight gate * rho, a masked token counting 0 (as icepop's actor/is_weight)
            "actor/is_weight": token_mean(gate * rho.detach()),
        }
    return loss, metrics
