"""One learner step on a tiny Qwen2 model: sign, masking and micro-batch invariance."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.loss import next_token_logits, token_logprobs
from learner.settings import LearnerSettings
from learner.step import make_optimizer, steps_taken, train_step, warmup_lr

TEMPERATURE = 0.8


def tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=300, max_position_embeddings=128,
    )
    return Qwen2ForCausalLM(config)


def on_policy_batch(model, advantages, seed: int = 1):
    """Random prompts with sampled-looking action tails; rollout log-probs from the model itself."""
    rng = np.random.default_rng(seed)
    items = []
    for advantage in advantages:
        n = int(rng.integers(10, 24))
        prompt = int(rng.integers(3, n - 3))
        ids = rng.integers(0, 300, size=n).astype(np.int32)
        mask = np.zeros(n, dtype=np.uint8)
        mask[prompt:] = 1
        logprobs = action_logprobs(model, ids, mask)
        items.append((ids, mask, logprobs, advantage))
    return items


def action_logprobs(model, ids, mask) -> np.ndarray:
    """The model's log-prob of each action token, aligned to input ids (0 elsewhere)."""
    with torch.no_grad():
        input_ids = torch.from_numpy(ids[None].astype(np.int64))  # (1, T)
        lp = token_logprobs(next_token_logits(model, input_ids, torch.ones_like(input_ids), TEMPERATURE), input_ids)
    out = np.zeros(len(ids), dtype=np.float32)
    out[1:] = lp[0].numpy()  # (T-1,) -> positions 1..T-1
    return out * mask


def mean_action_logprob(model, items) -> float:
    total = sum(float(action_logprobs(model, ids, mask).sum()) for ids, mask, _, _ in items)
    return total / sum(int(mask.sum()) for _, mask, _, _ in items)


@pytest.fixture(scope="module")
def settings() -> LearnerSettings:
    return LearnerSettings(lr=1e-3, max_tokens_per_micro_batch=48)


def test_step_decreases_the_loss_on_its_own_batch_with_positive_advantages(settings):
    model = tiny_model()
    ref = copy.deepcopy(model)
    optimizer = make_optimizer(model, settings)
    items = on_policy_batch(model, [1.0, 0.5, 2.0, 1.0, 0.3, 1.5])
    before = mean_action_logprob(model, items)

    first = train_step(model, ref, optimizer, items, settings)
    second = train_step(model, ref, optimizer, items, settings)  # reports the loss at the new weights

    assert first["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-5)  # on-policy: ratio 1
    assert first["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # actor == reference
    assert second["actor/loss"] < first["actor/loss"]
    assert second["actor/kl_loss"] > 0.0
    assert mean_action_logprob(model, items) > before
    assert first["actor/micro_batches"] > 1
    assert first["actor/action_tokens"] == sum(int(m.sum()) for _, m, _, _ in items)


def test_negative_advantages_lower_the_sampled_tokens_probability(settings):
    model = tiny_model()
    ref = copy.deepcopy(model)
    items = on_policy_batch(model, [-1.0, -0.5, -2.0])
    before = mean_action_logprob(model, items)
    train_step(model, ref, make_optimizer(model, settings), items, settings)
    assert mean_action_logprob(model, items) < before


def test_zero_advantages_on_policy_give_no_gradient(settings):
    # At step 1 the actor equals the reference, so the k3 KL has zero gradient as well.
    model = tiny_model()
    items = on_policy_batch(model, [0.0, 0.0])
    metrics = train_step(model, copy.deepcopy(model), make_optimizer(model, settings), items, settings)
    assert metrics["actor/grad_norm"] == pytest.approx(0.0, abs=1e-7)


def test_non_action_tokens_do_not_affect_the_step(settings):
    model = tiny_model()
    items = on_policy_batch(model, [1.0, -0.5, 2.0])
    noisy = [(ids, mask, np.where(mask == 1, lp, -50.0).astype(np.float32), adv) for ids, mask, lp, adv in items]
    results = []
    for batch in (items, noisy):
        actor = copy.deepcopy(model)
        results.append(train_step(actor, copy.deepcopy(model), make_optimizer(actor, settings), batch, settings))
    clean, with_noise = ({k: v for k, v in r.items() if not k.startswith("timing/")} for r in results)
    assert with_noise == pytest.approx(clean)


def test_micro_batch_budget_does_not_change_the_step():
    model = tiny_model()
    items = on_policy_batch(model, [1.0, -0.5, 2.0, 0.7, -1.2])
    # make it off-policy so that clipping and KL terms are exercised
    items = [(ids, mask, lp - 0.3 * mask, adv) for ids, mask, lp, adv in items]
    results = []
    for budget in (24, 10_000):
        actor = copy.deepcopy(model)
        settings = LearnerSettings(max_tokens_per_micro_batch=budget, share_prompts=False)
        results.append(train_step(actor, copy.deepcopy(model), make_optimizer(actor, settings), items, settings))
    small, large = results
    assert small["actor/micro_batches"] > 1 and large["actor/micro_batches"] == 1
    for name in ("actor/loss", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm"):
        assert small[name] == pytest.approx(large[name], rel=1e-4, abs=1e-6), name


def group_batch(model, groups: int, members: int, seed: int = 2):
    """`groups` prompts, each with `members` different action tails (a GRPO group), slightly off-policy."""
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(groups):
        prompt = rng.integers(0, 300, size=int(rng.integers(12, 20)))
        for _ in range(members):
            tail = rng.integers(0, 300, size=int(rng.integers(3, 9)))
            ids = np.concatenate([prompt, tail]).astype(np.int32)
            mask = np.r_[np.zeros(len(prompt), np.uint8), np.ones(len(tail), np.uint8)]
            mask[-2] = 0  # an environment token inside the tail
            items.append((ids, mask, action_logprobs(model, ids, mask) - 0.2 * mask, float(rng.normal())))
    return items


@pytest.mark.parametrize("policy_loss", ["ppo", "decoupled"])
def test_shared_prompts_give_the_step_of_whole_rows(policy_loss):
    model = tiny_model()
    items = group_batch(model, groups=3, members=4)
    results, gradients = [], []
    for share in (False, True):
        actor = copy.deepcopy(model)
        settings = LearnerSettings(lr=1e-3, max_tokens_per_micro_batch=10_000, share_prompts=share,
                                   policy_loss=policy_loss)
        optimizer = make_optimizer(actor, settings)
        results.append(train_step(actor, copy.deepcopy(model), optimizer, items, settings))
        # Adam's first moment after one step is (1 - beta1) x the clipped gradient. (The weights themselves move
        # by about lr x sign(gradient), which float noise flips where a gradient is near zero.)
        gradients.append([optimizer.state[p]["exp_avg"].clone() for p in actor.parameters()])
    whole, shared = results
    assert (whole["actor/micro_batches"], shared["actor/micro_batches"]) == (1, 3)  # one prompt per micro-batch
    for name in ("actor/loss", "actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
                 "actor/action_tokens"):
        assert shared[name] == pytest.approx(whole[name], rel=1e-4, abs=1e-6), name
    for got, want in zip(*gradients, strict=True):
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-8)


def test_updates_per_batch_step_on_consecutive_mini_batches_as_separate_steps_would():
    # Two updates on a batch of three groups: the weights of one step on its first six trajectories, then one on the
    # other six, and the batch's metrics are the updates' token-means weighted by their action tokens.
    model = tiny_model()
    items = group_batch(model, groups=3, members=4)
    one = LearnerSettings(lr=1e-3, max_tokens_per_micro_batch=10_000)
    two = one.model_copy(update={"updates_per_batch": 2})

    split = copy.deepcopy(model)
    optimizer = make_optimizer(split, two)
    metrics = train_step(split, copy.deepcopy(model), optimizer, items, two)
    apart = copy.deepcopy(model)
    apart_optimizer = make_optimizer(apart, one)
    first = train_step(apart, copy.deepcopy(model), apart_optimizer, items[:6], one)
    second = train_step(apart, copy.deepcopy(model), apart_optimizer, items[6:], one)

    assert (metrics["actor/updates"], steps_taken(optimizer)) == (2, 2)
    for got, want in zip(split.parameters(), apart.parameters(), strict=True):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)
    tokens = (first["actor/action_tokens"], second["actor/action_tokens"])
    assert metrics["actor/action_tokens"] == sum(tokens)
    for name in ("actor/loss", "actor/pg_loss", "actor/ppo_kl", "actor/kl_loss"):
        weighted = (first[name] * tokens[0] + second[name] * tokens[1]) / sum(tokens)
        assert metrics[name] == pytest.approx(weighted, rel=1e-4, abs=1e-7), name
    assert metrics["actor/grad_norm"] == pytest.approx((first["actor/grad_norm"] + second["actor/grad_norm"]) / 2)


def test_the_proximal_log_probs_of_every_update_come_from_the_weights_before_the_first(monkeypatch):
    import learner.step as step

    model = tiny_model()
    settings = LearnerSettings(lr=1e-3, max_tokens_per_micro_batch=10_000, policy_loss="decoupled",
                               updates_per_batch=3)
    optimizer = make_optimizer(model, settings)
    actor_passes: list[int] = []  # optimizer steps taken when each pass over the actor's own log-probs ran
    recompute = step._logprobs_without_graph

    def recorded(policy, *args, **kwargs):
        if policy is model:
            actor_passes.append(steps_taken(optimizer))
        return recompute(policy, *args, **kwargs)

    monkeypatch.setattr(step, "_logprobs_without_graph", recorded)
    train_step(model, copy.deepcopy(model), optimizer, group_batch(model, groups=3, members=4), settings)
    assert actor_passes == [0, 0, 0] and steps_taken(optimizer) == 3


def test_a_batch_smaller_than_updates_per_batch_takes_one_update_per_trajectory(settings):
    model = tiny_model()
    items = on_policy_batch(model, [1.0, -1.0])
    many = settings.model_copy(update={"updates_per_batch": 5})
    optimizer = make_optimizer(model, many)
    assert train_step(model, copy.deepcopy(model), optimizer, items, many)["actor/updates"] == 2
    assert steps_taken(optimizer) == 2


def test_settings_are_frozen_and_reject_unknown_fields():
    settings = LearnerSettings()
    assert (settings.lr, settings.clip_ratio_c, settings.kl_coef, settings.temperature) == (1e-6, 3.0, 1e-4, 0.8)
    with pytest.raises(ValueError):
        LearnerSettings(learning_rate=1.0)
    with pytest.raises(ValueError):
        settings.lr = 1.0  # type: ignore[misc]


def test_a_non_finite_gradient_skips_the_optimizer_step(settings):
    model = tiny_model()
    items = on_policy_batch(model, [1.0, 2.0])
    ref = copy.deepcopy(model)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    metrics = train_step(model, ref, make_optimizer(model, settings), items, settings)
    assert metrics["actor/step_skipped"] == 1.0
    for name, p in model.named_parameters():
        assert torch.allclose(p, before[name], rtol=0, atol=0, equal_nan=True), name


def test_a_batch_encoded_with_another_chat_template_is_refused_by_name():
    from learner.process import TemplateMismatch, check_template

    batch = {"batch_id": "b1", "items": [{"trajectory": {"trajectory_id": "t1", "template_fingerprint": "a" * 64}},
                                          {"trajectory": {"trajectory_id": "t2", "template_fingerprint": "b" * 64}}]}
    check_template({**batch, "items": batch["items"][:1]}, "a" * 64)
    with pytest.raises(TemplateMismatch, match=r"batch b1: 1 trajectories \(e.g. t2\)"):
        check_template(batch, "a" * 64)


def test_the_learning_rate_rises_linearly_over_the_warmup_steps_then_stays_at_lr():
    settings = LearnerSettings(lr=1e-4, lr_warmup_steps=4)
    assert [warmup_lr(settings, k) for k in range(6)] == pytest.approx([2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4, 1e-4])
    assert warmup_lr(LearnerSettings(lr=1e-4), 0) == 1e-4  # no warmup: lr from the first step


def test_the_warmup_follows_the_optimizers_own_step_count_so_a_resumed_learner_continues_it():
    settings = LearnerSettings(lr=1e-3, lr_warmup_steps=3, max_tokens_per_micro_batch=48)
    model = tiny_model()
    ref = copy.deepcopy(model)
    optimizer = make_optimizer(model, settings)
    items = on_policy_batch(model, [1.0, -1.0])
    lrs = [train_step(model, ref, optimizer, items, settings)["actor/lr"] for _ in range(2)]
    assert lrs == pytest.approx([1e-3 / 3, 2e-3 / 3]) and steps_taken(optimizer) == 2

    resumed = copy.deepcopy(model)  # a learner restarted from a checkpoint of model and optimizer
    restored = make_optimizer(resumed, settings)
    restored.load_state_dict(optimizer.state_dict())
    assert train_step(resumed, ref, restored, items, settings)["actor/lr"] == pytest.approx(1e-3)


def test_a_bfloat16_step_keeps_float32_weights_and_moves_them_as_the_float32_step_does(settings):
    model = tiny_model()
    items = on_policy_batch(model, [1.0, -0.5, 2.0, 1.0])
    moved = {}
    for dtype in ("float32", "bfloat16"):
        actor = copy.deepcopy(model)
        chosen = settings.model_copy(update={"compute_dtype": dtype})
        metrics = train_step(actor, copy.deepcopy(model), make_optimizer(actor, chosen), items, chosen)
        assert all(p.dtype == torch.float32 for p in actor.parameters())
        assert np.isfinite(metrics["actor/loss"])
        moved[dtype] = torch.cat([(a - b).flatten() for a, b in zip(actor.parameters(), model.parameters())])
    # Autocast changes the products' rounding, not the step: both move the weights the same way.
    assert torch.nn.functional.cosine_similarity(moved["float32"], moved["bfloat16"], dim=0) > 0.9


def test_the_progress_line_names_the_updates_of_a_step_that_took_several():
    from learner.process import progress_line

    metrics = {"actor/pg_loss": 0.0, "actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "actor/kl_loss": 0.0,
               "actor/entropy": 0.1, "actor/grad_norm": 0.5, "perf/tokens_per_s": 100.0, "timing/wait_s": 0.0,
               "timing/ref_s": 0.1, "timing/actor_s": 0.2, "timing/publish_s": 0.3}
    assert "gnorm 0.500 100 tok/s" in progress_line(1, 1, metrics | {"actor/updates": 1.0})
    assert "gnorm 0.500 (3 updates) 100 tok/s" in progress_line(1, 1, metrics | {"actor/updates": 3.0})
