"""The policy-loss options (learner.policy_loss, is_correction, is_level) against hand-computed values,
the default against the loss as it was before them, and one learner step on a tiny model with each."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers.tiny_learner import multi_turn_batch, tiny_model
from torch import Tensor

from learner.loss import level_log_ratio, policy_loss
from learner.settings import LearnerSettings
from learner.step import make_optimizer, train_step
from pipeline.run.config import RollstreamConfig
from pipeline.run.study import variant_config

CLIPS = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, kl_clamp=10.0, entropy_coef=0.0)
BEHAV = -1.0  # every token's rollout log-prob in the hand-computed cases


def loss_of(ratios, advantages, *, rhos=None, mask=None, kl_coef=0.0, ref_minus_logp=None, **options):
    """One row: behav = -1, prox = behav + log(rho), logp = prox + log(r), so r and rho are as given."""
    r = torch.tensor([ratios], dtype=torch.float64)
    rho = torch.tensor([rhos if rhos is not None else [1.0] * len(ratios)], dtype=torch.float64)
    behav = torch.full_like(r, BEHAV)
    prox = behav + rho.log()
    logp = (prox + r.log()).requires_grad_(True)
    ref = logp.detach() + (torch.tensor([ref_minus_logp], dtype=torch.float64) if ref_minus_logp else 0.0)
    adv = torch.tensor([advantages], dtype=torch.float64)
    mask_t = torch.tensor([mask if mask is not None else [1] * len(ratios)], dtype=torch.float64)
    loss, metrics = policy_loss(logp, behav, ref, adv, mask_t, torch.zeros_like(r), int(mask_t.sum()),
                                kl_coef=kl_coef, prox_logprobs=prox, **CLIPS, **options)
    loss.backward()
    return loss.item(), {k: v.item() for k, v in metrics.items()}, logp.grad[0].tolist()


# --- the default: AgentRL's loss, bit for bit ---

def test_default_options_are_bit_identical_to_the_loss_before_them():
    gen = torch.Generator().manual_seed(3)
    shape = (3, 11)
    base = torch.randn(shape, generator=gen, dtype=torch.float32) - 2.0
    rollout = base + 1.2 * torch.randn(shape, generator=gen)  # off-policy: some ratios clip, some dual-clip
    ref = base + 0.3 * torch.randn(shape, generator=gen)
    adv = 2.0 * torch.randn(shape, generator=gen)
    mask = (torch.rand(shape, generator=gen) > 0.3).float()
    entropy = torch.rand(shape, generator=gen)
    args = (rollout, ref, adv, mask, entropy, int(mask.sum()) + 5)
    knobs = dict(CLIPS, entropy_coef=0.01, kl_coef=1e-4)

    def run(fn, **extra):
        logp = base.clone().requires_grad_(True)
        loss, metrics = fn(logp, *args, **knobs, **extra)
        loss.backward()
        return loss, metrics, logp.grad

    before = run(agentrl_loss_before_options)
    for result in (run(policy_loss), run(policy_loss, objective="ppo", is_correction="none", is_level="token",
                                         prox_logprobs=base + 1.0)):  # prox is not read by plain ppo
        assert torch.equal(result[0], before[0])
        assert result[1].keys() == before[1].keys()
        for name in before[1]:
            assert torch.equal(result[1][name], before[1][name]), name
        assert torch.equal(result[2], before[2])
    assert before[1]["actor/pg_clipfrac"] > 0 and before[1]["actor/pg_clipfrac_lower"] > 0


def test_settings_default_to_ppo_without_correction_and_name_the_prox_pass():
    settings = LearnerSettings()
    assert (settings.policy_loss, settings.is_correction, settings.is_level, settings.is_cap) == (
        "ppo", "none", "token", 2.0)
    assert not settings.needs_prox_logprobs
    assert LearnerSettings(policy_loss="decoupled").needs_prox_logprobs
    assert LearnerSettings(is_correction="tis").needs_prox_logprobs
    assert not LearnerSettings(policy_loss="cispo").needs_prox_logprobs


@pytest.mark.parametrize("field, value", [("policy_loss", "grpo"), ("is_correction", "mis"),
                                          ("is_level", "turn"), ("is_cap", 1.0)])
def test_settings_reject_an_unknown_option_or_a_cap_not_above_one(field, value):
    with pytest.raises(ValueError):
        LearnerSettings(**{field: value})


# --- cispo (MiniMax-M1) ---

def test_cispo_weighs_a_times_logp_by_the_clipped_ratio_without_its_gradient():
    loss, metrics, grad = loss_of([1.5, 0.5, 1.1], [1.0, -1.0, 2.0], objective="cispo")
    logp = [BEHAV + math.log(r) for r in (1.5, 0.5, 1.1)]
    weights = [1.2, 0.8, 1.1]  # clip(r, 0.8, 1.2)
    expected = sum(-w * a * lp for w, a, lp in zip(weights, [1.0, -1.0, 2.0], logp, strict=True)) / 3
    assert loss == pytest.approx(expected) == pytest.approx(0.449747, abs=1e-6)
    # Only the weight is clipped: every token keeps the gradient -w * A / N (PPO would give 0 to the clipped two).
    assert grad == pytest.approx([-1.2 / 3, 0.8 / 3, -2.2 / 3])
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


def test_cispo_without_correction_takes_its_ratio_to_the_rollout():
    # rho is ignored by cispo + none: r = exp(logp - behav) = r * rho here.
    loss, _, _ = loss_of([1.0], [1.0], rhos=[1.5], objective="cispo")
    assert loss == pytest.approx(-1.2 * (BEHAV + math.log(1.5)))


# --- decoupled (AReaL) ---

def test_decoupled_clips_around_the_proximal_policy_and_weighs_by_prox_over_behaviour():
    loss, metrics, grad = loss_of([1.1, 1.5], [1.0, 1.0], rhos=[2.0, 0.5], objective="decoupled")
    assert loss == pytest.approx((-2.0 * 1.1 - 0.5 * 1.2) / 2)  # the weight is uncapped: 2.0
    assert grad == pytest.approx([-2.0 * 1.1 / 2, 0.0])  # the second token is clipped (r 1.5 > 1.2)
    assert metrics["actor/is_weight"] == pytest.approx(1.25)
    assert metrics["actor/is_clipfrac"] == 0.0
    assert metrics["actor/ppo_kl"] == pytest.approx(-(math.log(1.1) + math.log(1.5)) / 2)
    assert metrics["actor/behav_kl"] == pytest.approx(-(math.log(2.0) + math.log(0.5)) / 2)


def test_decoupled_keeps_the_dual_clip_for_negative_advantages():
    loss, _, _ = loss_of([5.0], [-2.0], rhos=[0.5], objective="decoupled")
    assert loss == pytest.approx(0.5 * 2.0 * 3.0)


def test_options_that_need_the_proximal_policy_refuse_to_run_without_it():
    one = torch.zeros(1, 1)
    for options in (dict(objective="decoupled"), dict(is_correction="tis"), dict(is_correction="icepop")):
        with pytest.raises(ValueError, match="needs prox_logprobs"):
            policy_loss(one, one, one, one, torch.ones(1, 1), one, 1, kl_coef=0.0, **CLIPS, **options)


# --- tis and icepop ---

def test_tis_weighs_each_token_by_its_ratio_truncated_at_the_cap():
    loss, metrics, grad = loss_of([1.0, 1.0], [1.0, -1.0], rhos=[3.0, 0.5], is_correction="tis")
    assert loss == pytest.approx((-2.0 * 1.0 + 0.5 * 1.0) / 2)  # w = min(rho, 2) = 2, 0.5
    assert grad == pytest.approx([-2.0 / 2, 0.5 / 2])
    assert metrics["actor/is_weight"] == pytest.approx(1.25)
    assert metrics["actor/is_clipfrac"] == pytest.approx(0.5)


def test_tis_takes_the_recomputed_policy_as_the_old_one_of_the_ppo_clip():
    # r = pi / prox = 1.5 is clipped at 1.2 though pi / behav = 1.5 * 0.9 = 1.35 would be too:
    # the point is which ratio the clip sees; with r = 1.1 and rho = 1.5, pi / behav = 1.65 would clip, r does not.
    loss, metrics, grad = loss_of([1.1], [1.0], rhos=[1.5], is_correction="tis")
    assert loss == pytest.approx(-1.5 * 1.1)
    assert grad == pytest.approx([-1.5 * 1.1])
    assert metrics["actor/pg_clipfrac"] == 0.0


def test_tis_cap_is_a_setting():
    loss, _, _ = loss_of([1.0], [1.0], rhos=[3.0], is_correction="tis", is_cap=2.5)
    assert loss == pytest.approx(-2.5)


def test_icepop_masks_tokens_whose_ratio_leaves_the_band_and_keeps_the_rest_weighted():
    loss, metrics, grad = loss_of([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], rhos=[3.0, 0.4, 1.5], is_correction="icepop",
                                  kl_coef=1e-4, ref_minus_logp=[0.5, 0.5, 0.5])
    k3 = math.exp(0.5) - 0.5 - 1.0
    assert metrics["actor/pg_loss"] == pytest.approx(-1.5 / 3)  # masked tokens stay in the denominator
    assert metrics["actor/kl_loss"] == pytest.approx(k3)  # and in the KL term
    assert loss == pytest.approx(-1.5 / 3 + 1e-4 * k3)
    dk3 = -(math.exp(0.5) - 1.0) * 1e-4 / 3  # d/dlogp of the KL term alone
    assert grad == pytest.approx([dk3, dk3, -1.5 / 3 + dk3])
    assert metrics["actor/is_clipfrac"] == pytest.approx(2 / 3)
    assert metrics["actor/is_weight"] == pytest.approx(0.5)


def test_icepop_keeps_ratios_just_inside_the_band_at_their_value():
    loss, _, _ = loss_of([1.0, 1.0], [1.0, 1.0], rhos=[1.99, 0.51], is_correction="icepop")
    assert loss == pytest.approx((-1.99 - 0.51) / 2)


def test_a_correction_bounds_decoupleds_weight_the_same_way_as_ppos():
    for correction in ("tis", "icepop"):
        ppo = loss_of([1.1, 1.0], [1.0, -1.0], rhos=[3.0, 0.8], is_correction=correction)
        decoupled = loss_of([1.1, 1.0], [1.0, -1.0], rhos=[3.0, 0.8], is_correction=correction, objective="decoupled")
        assert decoupled[0] == pytest.approx(ppo[0]) and decoupled[2] == pytest.approx(ppo[2])
        assert decoupled[1] == pytest.approx(ppo[1])


def test_cispo_with_tis_multiplies_both_weights():
    loss, _, grad = loss_of([1.5], [1.0], rhos=[3.0], objective="cispo", is_correction="tis")
    logp = BEHAV + math.log(3.0) + math.log(1.5)
    assert loss == pytest.approx(-2.0 * 1.2 * logp)
    assert grad == pytest.approx([-2.0 * 1.2])


# --- granularity: sequence and chunk (ROLL's IPA) ---

def test_chunks_are_the_runs_of_ones_of_each_rows_loss_mask():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 0], [1, 1, 0, 1, 0, 0, 0, 0, 0]], dtype=torch.float64)
    log_ratio = torch.tensor([[9.0, 1.0, 3.0, 9.0, 9.0, 0.5, 1.0, 1.5, 9.0],
                              [2.0, 4.0, 9.0, -1.0, 9.0, 9.0, 9.0, 9.0, 9.0]], dtype=torch.float64)
    chunk = level_log_ratio(log_ratio, mask, "chunk")
    assert chunk.tolist() == [[0, 2, 2, 0, 0, 1, 1, 1, 0], [3, 3, 0, -1, 0, 0, 0, 0, 0]]
    sequence = level_log_ratio(log_ratio, mask, "sequence")
    assert sequence.tolist() == [[0, 1.4, 1.4, 0, 0, 1.4, 1.4, 1.4, 0], [5 / 3, 5 / 3, 0, 5 / 3, 0, 0, 0, 0, 0]]
    assert torch.equal(level_log_ratio(log_ratio, mask, "token"), log_ratio)


def test_a_non_finite_log_ratio_off_the_mask_does_not_reach_a_chunk_mean():
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    log_ratio = torch.tensor([[float("inf"), 1.0, 2.0]])
    assert level_log_ratio(log_ratio, mask, "chunk").tolist() == [[0.0, 1.5, 1.5]]
    assert level_log_ratio(log_ratio, mask, "sequence").tolist() == [[0.0, 1.5, 1.5]]


def test_chunk_level_ppo_clips_each_turns_geometric_mean_ratio():
    # Two turns: r = (1.21, 1) -> 1.1 each; r = (2, 0.5, 1) -> 1 each. A = 1, no clip binds.
    mask = [0, 1, 1, 0, 0, 1, 1, 1, 0]
    ratios = [1.0, 1.21, 1.0, 1.0, 1.0, 2.0, 0.5, 1.0, 1.0]
    loss, _, grad = loss_of(ratios, [1.0] * 9, mask=mask, is_level="chunk")
    assert loss == pytest.approx(-(1.1 + 1.1 + 1.0 + 1.0 + 1.0) / 5)
    # Each token of a turn gets -r_turn / N: the turn's |c| losses share one mean log-ratio.
    assert grad == pytest.approx([0.0, -1.1 / 5, -1.1 / 5, 0.0, 0.0, -1 / 5, -1 / 5, -1 / 5, 0.0])
    token_level, _, _ = loss_of(ratios, [1.0] * 9, mask=mask)
    assert token_level == pytest.approx(-(1.2 + 1.0 + 1.2 + 0.5 + 1.0) / 5)  # per token, 1.21 and 2 clip at 1.2


def test_chunk_level_icepop_masks_a_whole_turn():
    # Turn 1: rho = (4, 1.44) -> geometric mean 2.4 > 2: masked. Turn 2: rho = (4, 0.25) -> 1: kept, weight 1.
    mask = [0, 1, 1, 0, 1, 1]
    loss, metrics, _ = loss_of([1.0] * 6, [1.0] * 6, rhos=[1.0, 4.0, 1.44, 1.0, 4.0, 0.25], mask=mask,
                               is_correction="icepop", is_level="chunk")
    assert loss == pytest.approx(-(0 + 0 + 1.0 + 1.0) / 4)
    assert metrics["actor/is_clipfrac"] == pytest.approx(0.5)
    token_level, _, _ = loss_of([1.0] * 6, [1.0] * 6, rhos=[1.0, 4.0, 1.44, 1.0, 4.0, 0.25], mask=mask,
                                is_correction="icepop")
    assert token_level == pytest.approx(-(0 + 1.44 + 0 + 0) / 4)


def test_sequence_level_tis_truncates_the_sequences_geometric_mean_ratio():
    # rho = (4, 1) -> sqrt(4) = 2 for both tokens; cap 1.5.
    loss, metrics, _ = loss_of([1.0, 1.0], [1.0, 1.0], rhos=[4.0, 1.0], is_correction="tis", is_level="sequence",
                               is_cap=1.5)
    assert loss == pytest.approx(-1.5)
    assert metrics["actor/is_clipfrac"] == 1.0


# --- the learner trains with each option (a scaled-down step on the tiny model, no services) ---

OPTIONS = [  # every objective, every correction, every level (not every combination: each is a few seconds)
    ("ppo", "none", "token"), ("cispo", "none", "token"), ("decoupled", "none", "token"),
    ("ppo", "tis", "token"), ("ppo", "icepop", "token"), ("ppo", "none", "chunk"),
    ("ppo", "icepop", "chunk"), ("cispo", "tis", "sequence"), ("decoupled", "tis", "chunk"),
]


@pytest.fixture(scope="module")
def actor_and_batch():
    model = tiny_model()
    return model, multi_turn_batch(model, [1.0, -0.5, 2.0, -1.5])


@pytest.mark.parametrize("objective, correction, level", OPTIONS)
def test_the_learner_trains_with_each_option(actor_and_batch, objective, correction, level):
    base, items = actor_and_batch
    settings = LearnerSettings(lr=1e-3, max_tokens_per_micro_batch=40, policy_loss=objective,
                               is_correction=correction, is_level=level)
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = train_step(model, ref, make_optimizer(model, settings), items, settings)
    assert metrics["actor/micro_batches"] > 1
    assert metrics["actor/step_skipped"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["actor/grad_norm"] > 0
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    if settings.needs_prox_logprobs:
        # The proximal policy is the actor at the start of the step: r = 1 up to float noise.
        assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-5)
        assert metrics["actor/behav_kl"] != 0.0
        assert "timing/prox_s" in metrics
    else:
        assert "actor/is_weight" not in metrics and "timing/prox_s" not in metrics


def count_forwards(model: torch.nn.Module) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("objective, correction, extra_pass", [("ppo", "none", False), ("ppo", "tis", True),
                                                              ("decoupled", "none", True)])
def test_the_prox_pass_runs_once_per_micro_batch_only_when_an_option_needs_it(actor_and_batch, objective,
                                                                              correction, extra_pass):
    base, items = actor_and_batch
    settings = LearnerSettings(max_tokens_per_micro_batch=40, policy_loss=objective, is_correction=correction)
    model = copy.deepcopy(base)
    calls = count_forwards(model)
    metrics = train_step(model, copy.deepcopy(base), make_optimizer(model, settings), items, settings)
    assert calls[0] == metrics["actor/micro_batches"] * (2 if extra_pass else 1)


def test_tis_on_policy_equals_plain_ppo():
    # When the engine's log-probs are the learner's own (rho = 1), every correction weight is 1.
    model = tiny_model()
    items = multi_turn_batch(model, [1.0, -0.5, 2.0], drift=0.0)
    results = {}
    for correction in ("none", "tis", "icepop"):
        settings = LearnerSettings(is_correction=correction)
        actor = copy.deepcopy(model)
        results[correction] = train_step(actor, copy.deepcopy(model), make_optimizer(actor, settings), items, settings)
    for correction in ("tis", "icepop"):
        for name in ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert results[correction][name] == pytest.approx(results["none"][name], rel=1e-4, abs=1e-6), name
        assert results[correction]["actor/is_weight"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("variant, options", [
    ("cispo", ("cispo", "none", "token")), ("decoupled-tis", ("decoupled", "tis", "token")),
    ("icepop", ("ppo", "icepop", "token")), ("ipa", ("ppo", "none", "chunk")),
])
def test_each_option_is_a_study_variant_that_reaches_the_learner(variant, options):
    learner = variant_config(RollstreamConfig(), variant, 0).learner_settings()
    assert (learner.policy_loss, learner.is_correction, learner.is_level) == options


# --- the loss before the options, verbatim, for the bit-identity test ---

def agentrl_loss_before_options(
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
    """learner.loss.policy_loss as it was before the options (commit aa8982b), kept verbatim."""
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
