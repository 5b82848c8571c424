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
sampling (possibly a stale engine); it is never recomputed, which is what makes the ratio an
importance weight for cross-policy sampling.

Token-mean over a global batch split into micro-batches: every per-token sum below is divided
by the number of action tokens of the *whole* batch (`global_action_tokens`), not of the
micro-batch. Summing the micro-batch losses (gradient accumulation) then gives exactly
sum over all action tokens / number of action tokens, so each micro-batch weighs by its token
count. The diagnostics are normalized the same way, so they also add up across micro-batches.

All per-token tensors here are (B, T-1): position t holds the log-prob of token t+1 of the
sequence, predicted from the logits at position t (see learner/microbatch.py).
"""

from __future__ import annotations

import torch
from torch import Tensor


def next_token_logits(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, temperature: float
) -> Tensor:
    """Logits of a HF causal LM for each next token, divided by the sampling temperature.

    Returns (B, T-1, V): position t holds the logits of token t+1, scaled as the engines sampled.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
    # Logits at position t predict token t+1: drop the last position, whose token is unseen.
    return logits[:, :-1, :].float() / temperature  # (B, T-1, V)


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
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dual-clip PPO + k3 KL - entropy bonus, token-mean over `global_action_tokens`.

    All tensor arguments are (B, T-1); `loss_mask` is 1 on action tokens. Returns the loss of
    this micro-batch (to be summed over micro-batches) and detached diagnostics named
    actor/pg_loss, actor/pg_clipfrac, actor/pg_clipfrac_lower, actor/ppo_kl, actor/kl_loss,
    actor/entropy, each a token-mean share that sums over micro-batches like the loss.
    """
    if global_action_tokens <= 0:
        raise ValueError("the batch has no action tokens to train on")
    mask = loss_mask.to(logprobs.dtype)

    def token_mean(per_token: Tensor) -> Tensor:
        """This micro-batch's share of the global token-mean: sum(x * mask) / global tokens."""
        return (per_token * mask).sum() / global_action_tokens

    # --- importance ratio to the behaviour (rollout) policy ---
    log_ratio = logprobs - rollout_logprobs
    # verl clamps before exp so a stale-engine outlier cannot overflow; the clip below bounds it anyway.
    log_ratio = torch.clamp(log_ratio, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)

    # --- PPO clipped surrogate (Schulman et al. 2017) ---
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(pg_losses1, pg_losses2)

    # --- dual clip for negative advantages (Ye et al. 2020) ---
    pg_losses3 = -advantages * clip_ratio_c
    dual_clipped = torch.minimum(clipped, pg_losses3)
    pg_losses = torch.where(advantages < 0, dual_clipped, clipped)
    pg_loss = token_mean(pg_losses)

    # --- k3 KL to the frozen reference (Schulman 2020), clamped ---
    ref_log_ratio = ref_logprobs - logprobs
    kl = torch.exp(ref_log_ratio) - ref_log_ratio - 1.0
    kl = torch.clamp(kl, min=-kl_clamp, max=kl_clamp)
    kl_loss = token_mean(kl)

    entropy_loss = token_mean(entropy)
    loss = pg_loss + kl_coef * kl_loss - entropy_coef * entropy_loss

    with torch.no_grad():
        pg_clipfrac = token_mean((pg_losses2 > pg_losses1).to(mask.dtype))
        pg_clipfrac_lower = token_mean(((clipped > pg_losses3) & (advantages < 0)).to(mask.dtype))
        # Approximate KL(behaviour || current), k1 estimator, as verl reports it.
        ppo_kl = token_mean(-log_ratio)
    metrics = {
        "actor/pg_loss": pg_loss.detach(),
        "actor/pg_clipfrac": pg_clipfrac,
        "actor/pg_clipfrac_lower": pg_clipfrac_lower,
        "actor/ppo_kl": ppo_kl,
        "actor/kl_loss": kl_loss.detach(),
        "actor/entropy": entropy_loss.detach(),
    }
    return loss, metrics
