"""The AgentRL policy loss against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.loss import next_token_logits, policy_loss, token_entropy, token_logprobs

CLIPS = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, kl_clamp=10.0, entropy_coef=0.0)


def loss_of(ratios, advantages, *, mask=None, ref_minus_logp=None, kl_coef=0.0, global_tokens=None):
    """Runs the loss on one row of tokens with logp = log(ratio) + rollout (rollout = -1)."""
    ratio = torch.tensor([ratios], dtype=torch.float64)
    rollout = torch.full_like(ratio, -1.0)
    logp = (rollout + ratio.log()).requires_grad_(True)
    ref = (logp.detach() + torch.tensor([ref_minus_logp])) if ref_minus_logp is not None else logp.detach()
    adv = torch.tensor([advantages], dtype=torch.float64)
    mask_t = torch.tensor([mask if mask is not None else [1] * len(ratios)], dtype=torch.float64)
    tokens = global_tokens if global_tokens is not None else int(mask_t.sum())
    loss, metrics = policy_loss(
        logp, rollout, ref, adv, mask_t, torch.zeros_like(ratio), tokens, kl_coef=kl_coef, **CLIPS
    )
    return loss, metrics, logp


def test_unclipped_ratio_gives_minus_advantage_times_ratio():
    loss, metrics, _ = loss_of([1.1, 0.9], [1.0, 2.0])
    assert loss.item() == pytest.approx((-1.1 - 1.8) / 2)
    assert metrics["actor/pg_clipfrac"].item() == 0.0
    assert metrics["actor/ppo_kl"].item() == pytest.approx(-(math.log(1.1) + math.log(0.9)) / 2)


def test_positive_advantage_is_clipped_above_one_plus_clip_high():
    loss, metrics, logp = loss_of([1.5], [1.0])
    assert loss.item() == pytest.approx(-1.2)
    assert metrics["actor/pg_clipfrac"].item() == 1.0
    loss.backward()
    assert logp.grad.abs().sum().item() == 0.0  # clipped: no gradient pushes further


def test_negative_advantage_is_clipped_below_one_minus_clip_low():
    loss, metrics, logp = loss_of([0.5], [-1.0])
    assert loss.item() == pytest.approx(0.8)
    assert metrics["actor/pg_clipfrac"].item() == 1.0
    assert metrics["actor/pg_clipfrac_lower"].item() == 0.0
    loss.backward()
    assert logp.grad.abs().sum().item() == 0.0


def test_dual_clip_bounds_negative_advantage_loss_by_c():
    loss, metrics, logp = loss_of([5.0], [-2.0])
    assert loss.item() == pytest.approx(2.0 * 3.0)  # min(max(10, 2.4), 6)
    assert metrics["actor/pg_clipfrac_lower"].item() == 1.0
    loss.backward()
    assert logp.grad.abs().sum().item() == 0.0


def test_dual_clip_does_not_apply_to_positive_advantages():
    loss, metrics, _ = loss_of([5.0], [2.0])
    assert loss.item() == pytest.approx(-2.0 * 1.2)
    assert metrics["actor/pg_clipfrac_lower"].item() == 0.0


def test_k3_kl_to_reference_is_added_with_its_coefficient():
    d = 0.5  # ref - logp
    loss, metrics, _ = loss_of([1.0], [0.0], ref_minus_logp=[d], kl_coef=1e-4)
    k3 = math.exp(d) - d - 1
    assert metrics["actor/kl_loss"].item() == pytest.approx(k3)
    assert loss.item() == pytest.approx(1e-4 * k3)


def test_k3_kl_is_clamped_to_ten():
    _, metrics, _ = loss_of([1.0], [0.0], ref_minus_logp=[5.0], kl_coef=1e-4)
    assert metrics["actor/kl_loss"].item() == pytest.approx(10.0)


def test_masked_tokens_contribute_nothing():
    plain, plain_metrics, _ = loss_of([1.1], [1.0], ref_minus_logp=[0.3], kl_coef=1e-4)
    masked, masked_metrics, logp = loss_of(
        [1.1, 50.0], [1.0, -7.0], mask=[1, 0], ref_minus_logp=[0.3, 4.0], kl_coef=1e-4
    )
    assert masked.item() == pytest.approx(plain.item())
    for name in plain_metrics:
        assert masked_metrics[name].item() == pytest.approx(plain_metrics[name].item())
    masked.backward()
    assert logp.grad[0, 1].item() == 0.0


def test_token_mean_weights_micro_batches_by_their_action_tokens():
    # One token in the first micro-batch, three in the second: the token-mean is over 4 tokens,
    # not the mean of the two micro-batch means.
    first, _, _ = loss_of([1.1], [1.0], global_tokens=4)
    second, _, _ = loss_of([0.9, 1.0, 1.05], [1.0, -1.0, 0.5], global_tokens=4)
    whole, _, _ = loss_of([1.1, 0.9, 1.0, 1.05], [1.0, 1.0, -1.0, 0.5])
    assert (first + second).item() == pytest.approx(whole.item())
    assert whole.item() == pytest.approx((-1.1 - 0.9 + 1.0 - 0.525) / 4)


def test_a_batch_without_action_tokens_is_rejected():
    with pytest.raises(ValueError, match="no action tokens"):
        loss_of([1.0], [1.0], mask=[0], global_tokens=0)


def test_token_logprobs_use_the_next_token_and_the_temperature():
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=300, max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(config).eval()
    input_ids = torch.randint(0, 300, (2, 7))  # (B, T)
    attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        logits = next_token_logits(model, input_ids, attention_mask, 0.8)  # (B, T-1, V)
        logprobs, entropy = token_logprobs(logits, input_ids), token_entropy(logits)
        logits = model(input_ids=input_ids).logits / 0.8  # (B, T, V)
        log_softmax = torch.log_softmax(logits, dim=-1)
    assert logprobs.shape == entropy.shape == (2, 6)
    for b in range(2):
        for t in range(6):
            assert logprobs[b, t].item() == pytest.approx(log_softmax[b, t, input_ids[b, t + 1]].item(), abs=1e-5)
            expected_entropy = -(log_softmax[b, t].exp() * log_softmax[b, t]).sum()
            assert entropy[b, t].item() == pytest.approx(expected_entropy.item(), abs=1e-4)
