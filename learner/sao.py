"""SAO, single-sample agentic optimization (seed 000 §7.1): the critic and skip-observation GAE.

The source document is not available here; this is the standard reading of its description
(ARCHITECTURE.md, "SAO"), with each choice that is ours said so:

- **Value model.** A value head: one linear layer on the policy's final hidden state (after the
  final norm), `V(s_t) = w . sg(h_t) + b`, zero-initialized so that the first advantages are the
  discounted reward alone. The hidden state is detached: the value loss trains the head only,
  so the policy's weights (and the version an engine serves) move with the actor's step alone.
  The head lives beside the policy, never inside it, so it is never published to engines
  (learner/publish.py stages the policy's state dict) and is checkpointed apart
  (learner/checkpoint.py, `Critic.state` / `Critic.load`).
- **Skip-observation GAE.** Per trajectory, the recursion runs over the policy's own tokens only
  (loss_mask 1), in order: k = 0 .. K-1. The environment's tokens between two assistant turns
  (loss_mask 0) do not advance it: no discount, no reward, no bootstrap step across them. With
  V_k the value of the state before generated token k, r_k = 0 except r_{K-1} = R (the
  trajectory's reward on its last generated token) and V_K = 0 (the trajectory ended):

      delta_k = r_k + gamma * V_{k+1} - V_k
      A_k     = delta_k + gamma * lambda * A_{k+1}        (A_K = 0)
      G_k     = A_k + V_k                                  (the critic's regression target)

  so the bootstrap of a turn's last token is the value of the *next turn's first token*, whose
  state already holds the environment's answer.
- **Critic updates.** `critic_updates_per_step` (2) AdamW steps per actor step, each on the whole
  batch: value loss 0.5 * (V - G)^2, token-mean over the action tokens (CleanRL's unclipped
  v_loss), on the features and returns of the batch as the actor step saw it.

Alignment (learner/microbatch.py): the per-token arrays are shifted, position t refers to token
t+1 and is predicted from the hidden state at position t, so `values[:, t]` is the value of the
state before token t+1 is generated, aligned with `loss_mask[:, t]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from learner.settings import LearnerSettings


class ValueHead(torch.nn.Module):
    """V(s) = w . h + b on the policy's final hidden state h; (..., H) -> (...)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1)
        # Zero: the first step's advantages are the discounted reward itself, not a random head's noise.
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, features: Tensor) -> Tensor:
        return self.linear(features.float()).squeeze(-1)


@dataclass
class Critic:
    """SAO's value model: the head and its own optimizer (the actor's AdamW never sees it)."""

    head: ValueHead
    optimizer: torch.optim.Optimizer

    def state(self) -> dict[str, dict]:
        """What a checkpoint keeps of it (learner/checkpoint.py)."""
        return {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load(self, state: dict[str, dict]) -> None:
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])


def make_critic(policy: torch.nn.Module, settings: LearnerSettings) -> Critic:
    """A zero value head over the policy's hidden size, on its device, with AdamW at critic_lr (the actor's
    betas and weight decay)."""
    head = ValueHead(policy.config.hidden_size).to(next(policy.parameters()).device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.critic_lr, betas=settings.adam_betas,
                                  weight_decay=settings.weight_decay)
    return Critic(head, optimizer)


def next_token_logits_and_features(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                                   temperature: float) -> tuple[Tensor, Tensor]:
    """One forward of a HF causal LM: learner/loss.py next_token_logits (B, T-1, V), and the final hidden
    state at the same positions, detached (B, T-1, H): position t's state is the one token t+1 is sampled in."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    logits = out.logits[:, :-1, :].float() / temperature  # (B, T-1, V)
    features = out.hidden_states[-1][:, :-1, :].detach().float()  # (B, T-1, H), after the final norm; float32 under autocast too
    return logits, features


def skip_observation_gae(values: np.ndarray, loss_mask: np.ndarray, reward: float, gamma: float,
                         lam: float) -> tuple[np.ndarray, np.ndarray]:
    """(advantages, returns) of one trajectory, (T,) each, 0 where loss_mask is 0 (module docstring).

    values[t] is the value of the state before token t; only the tokens with loss_mask 1 take part, in
    order, so the environment's tokens between them are skipped; the reward is on the last of them.
    """
    if values.shape != loss_mask.shape:
        raise ValueError(f"values {values.shape} and loss_mask {loss_mask.shape} differ in shape")
    positions = np.flatnonzero(loss_mask)  # the policy's own tokens, in order
    advantages = np.zeros(len(values), dtype=np.float64)
    returns = np.zeros(len(values), dtype=np.float64)
    next_value, next_advantage = 0.0, 0.0  # V_K = 0 and A_K = 0: the trajectory ended after its last token
    for k in range(len(positions) - 1, -1, -1):
        t = positions[k]
        r_k = reward if k == len(positions) - 1 else 0.0
        delta = r_k + gamma * next_value - float(values[t])
        advantages[t] = delta + gamma * lam * next_advantage
        returns[t] = advantages[t] + float(values[t])
        next_value, next_advantage = float(values[t]), advantages[t]
    return advantages, returns


def batch_gae(values: np.ndarray, loss_mask: np.ndarray, rewards: np.ndarray, gamma: float,
              lam: float) -> tuple[np.ndarray, np.ndarray]:
    """skip_observation_gae of each row: values and loss_mask (B, T), rewards (B,) -> (B, T) each."""
    advantages = np.zeros(values.shape, dtype=np.float64)
    returns = np.zeros(values.shape, dtype=np.float64)
    for row in range(values.shape[0]):
        advantages[row], returns[row] = skip_observation_gae(values[row], loss_mask[row], float(rewards[row]),
                                                             gamma, lam)
    return advantages, returns


def value_loss(values: Tensor, returns: Tensor) -> Tensor:
    """0.5 * mean (V - G)^2 over the given action tokens (CleanRL's unclipped v_loss); (N,), (N,) -> ()."""
    return 0.5 * ((values - returns) ** 2).mean()


def explained_variance(values: Tensor, returns: Tensor) -> float:
    """1 - Var(G - V) / Var(G) (CleanRL's diagnostic): 1 a perfect critic, 0 a constant one; nan when G is."""
    var_returns = float(returns.var(unbiased=False))
    return math.nan if var_returns == 0 else 1.0 - float((returns - values).var(unbiased=False)) / var_returns


def update_critic(critic: Critic, features: Tensor, returns: Tensor, settings: LearnerSettings) -> dict[str, float]:
    """critic_updates_per_step AdamW steps of the value head on the batch's action tokens: features (N, H) as
    the actor step saw them, GAE returns (N,). Each step takes the whole batch (a linear head on N x H fits
    where the policy's activations did). Returns critic/* metrics; critic/updates counts the steps taken (a
    step whose gradient norm is not finite is skipped, as the actor's is)."""
    params = list(critic.head.parameters())
    first_loss = grad_norm = math.nan
    taken = 0
    for update in range(settings.critic_updates_per_step):
        critic.optimizer.zero_grad(set_to_none=True)
        loss = value_loss(critic.head(features), returns)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, settings.grad_clip))
        if update == 0:
            first_loss = float(loss.detach())  # the critic's error on this batch before it trains on it
        if math.isfinite(grad_norm):  # as the actor: a non-finite step would write NaN into the head
            critic.optimizer.step()
            taken += 1
    critic.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        after = float(value_loss(critic.head(features), returns))
    return {"critic/value_loss": first_loss, "critic/value_loss_after": after, "critic/grad_norm": grad_norm,
            "critic/updates": float(taken), "critic/lr": settings.critic_lr}
