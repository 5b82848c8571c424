"""SAO (seed 000 §7.1): skip-observation GAE on hand-computed values, the DIS gate, the critic's updates,
the settings that select it on both sides, and where the value head goes (checkpoints, not engines)."""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
import torch
from helpers.tiny_learner import multi_turn_batch, tiny_model

from learner import checkpoint, publish
from learner.loss import dis_policy_loss
from learner.process import LearnerLoop, batch_items
from learner.sao import batch_gae, make_critic, skip_observation_gae
from learner.settings import LearnerSettings
from learner.step import make_optimizer, steps_taken, train_step
from pipeline.run.config import RollstreamConfig
from pipeline.run.study import variant_config
from schemas import samples
from schemas.arrays import pack_ids, pack_logprobs, pack_mask
from schemas.settings import KafkaSettings
from streams.aggregation import add_member, decide
from streams.batching import build_batch
from streams.settings import StreamsSettings

# --- skip-observation GAE, by hand ---


def test_gae_over_one_turn_steps_token_by_token_with_the_reward_on_the_last():
    # Positions 0-1 are the prompt (their values must not be read); gamma 0.9, lambda 0.8, gamma*lambda 0.72.
    values = np.array([9.0, 9.0, 0.5, 0.6, 0.8])
    advantages, returns = skip_observation_gae(values, np.array([0, 0, 1, 1, 1]), 1.0, gamma=0.9, lam=0.8)
    # t=4: delta = 1 - 0.8 = 0.2                       A = 0.2
    # t=3: delta = 0.9 * 0.8 - 0.6 = 0.12              A = 0.12 + 0.72 * 0.2 = 0.264
    # t=2: delta = 0.9 * 0.6 - 0.5 = 0.04              A = 0.04 + 0.72 * 0.264 = 0.23008
    assert advantages.tolist() == pytest.approx([0.0, 0.0, 0.23008, 0.264, 0.2])
    assert returns.tolist() == pytest.approx([0.0, 0.0, 0.73008, 0.864, 1.0])  # G = A + V


def test_gae_skips_the_environments_tokens_between_two_assistant_turns():
    # turn 1 = positions 1, 2; the environment's answer = 3, 4 (values 7: a recursion over them would show);
    # turn 2 = 5, 6; position 7 trails (mask 0). gamma 0.9, lambda 0.5, gamma*lambda 0.45, reward 2.
    values = np.array([9.0, 0.2, 0.4, 7.0, 7.0, 0.5, 0.7, 9.0])
    mask = np.array([0, 1, 1, 0, 0, 1, 1, 0])
    advantages, returns = skip_observation_gae(values, mask, 2.0, gamma=0.9, lam=0.5)
    # t=6: delta = 2 - 0.7 = 1.3                        A = 1.3
    # t=5: delta = 0.9 * 0.7 - 0.5 = 0.13               A = 0.13 + 0.45 * 1.3 = 0.715
    # t=2: delta = 0.9 * V(5) - 0.4 = 0.05, bootstrapped from the next generated token, not from t=3
    #                                                    A = 0.05 + 0.45 * 0.715 = 0.37175
    # t=1: delta = 0.9 * 0.4 - 0.2 = 0.16               A = 0.16 + 0.45 * 0.37175 = 0.3272875
    assert advantages.tolist() == pytest.approx([0.0, 0.3272875, 0.37175, 0.0, 0.0, 0.715, 1.3, 0.0])
    assert returns.tolist() == pytest.approx([0.0, 0.5272875, 0.77175, 0.0, 0.0, 1.215, 2.0, 0.0])
    # Counting the environment's two tokens as steps would discount twice more and bootstrap from V = 7:
    not_skipped, _ = skip_observation_gae(values, np.array([0, 1, 1, 1, 1, 1, 1, 0]), 2.0, gamma=0.9, lam=0.5)
    assert not_skipped[2] != pytest.approx(advantages[2])


def test_gae_with_gamma_and_lambda_one_telescopes_to_the_reward_minus_the_value():
    values = np.array([0.0, 0.3, -0.1, 5.0, 0.25])
    advantages, returns = skip_observation_gae(values, np.array([0, 1, 1, 0, 1]), 1.0, gamma=1.0, lam=1.0)
    assert advantages.tolist() == pytest.approx([0.0, 0.7, 1.1, 0.0, 0.75])
    assert returns.tolist() == pytest.approx([0.0, 1.0, 1.0, 0.0, 1.0])


def test_gae_of_a_batch_is_each_rows_and_a_row_without_action_tokens_gets_zeros():
    values = np.array([[9.0, 0.5, 0.6, 0.8], [1.0, 1.0, 1.0, 1.0]])
    mask = np.array([[0, 1, 1, 1], [0, 0, 0, 0]])  # the second row: padding, or a trajectory that never acted
    advantages, returns = batch_gae(values, mask, np.array([1.0, 5.0]), gamma=0.9, lam=0.8)
    row, row_returns = skip_observation_gae(values[0], mask[0], 1.0, gamma=0.9, lam=0.8)
    assert advantages[0].tolist() == row.tolist() and returns[0].tolist() == row_returns.tolist()
    assert advantages[1].tolist() == [0.0] * 4 and returns[1].tolist() == [0.0] * 4


# --- DIS: the two-sided hard gate on pi_learner / pi_rollout ---

def dis(ratios, advantages, *, low=0.5, high=2.0, kl_coef=0.0):
    """One row with rollout log-probs 0 and learner log-probs log(ratio): rho is the ratio, exactly."""
    logp = torch.tensor([ratios], dtype=torch.float64).log().requires_grad_(True)
    behav = torch.zeros_like(logp)
    adv = torch.tensor([advantages], dtype=torch.float64)
    mask = torch.ones_like(behav)
    loss, metrics = dis_policy_loss(logp, behav, logp.detach(), adv, mask, torch.zeros_like(behav), len(ratios),
                                    dis_low=low, dis_high=high, kl_coef=kl_coef, kl_clamp=10.0, entropy_coef=0.0)
    loss.backward()
    return loss.item(), {k: v.item() for k, v in metrics.items()}, logp.grad[0].tolist()


def test_dis_masks_exactly_the_tokens_whose_ratio_leaves_the_bounds():
    ratios = [0.4, 0.5, 1.0, 2.0, 2.1, 3.0]  # 0.5 and 2.0 are on the bounds: kept
    advantages = [1.0, 1.0, -1.0, 1.0, 1.0, -1.0]
    loss, metrics, grad = dis(ratios, advantages)
    # kept: -A * rho over the six tokens' mean; masked tokens count in the denominator
    assert loss == pytest.approx(-(0.5 - 1.0 + 2.0) / 6)
    # d/dlogp of -A * rho is -A * rho: the policy gradient weighted by the ratio, 0 where the gate is shut
    assert grad == pytest.approx([0.0, -0.5 / 6, 1.0 / 6, -2.0 / 6, 0.0, 0.0])
    assert metrics["actor/pg_clipfrac"] == pytest.approx(3 / 6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 6)
    assert metrics["actor/is_weight"] == pytest.approx((0.5 + 1.0 + 2.0) / 6)


def test_dis_bounds_are_settings():
    _, metrics, grad = dis([0.85, 1.2, 1.3], [1.0, 1.0, 1.0], low=0.8, high=1.25)
    assert grad == pytest.approx([-0.85 / 3, -1.2 / 3, 0.0])
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 3) and metrics["actor/pg_clipfrac_lower"] == 0.0


def test_dis_keeps_the_kl_term_of_a_masked_token():
    logp = torch.tensor([[math.log(3.0)]], dtype=torch.float64, requires_grad=True)
    ref = logp.detach() + 0.5
    loss, metrics = dis_policy_loss(logp, torch.zeros_like(ref), ref, torch.ones_like(ref), torch.ones_like(ref),
                                    torch.zeros_like(ref), 1, dis_low=0.5, dis_high=2.0, kl_coef=1e-2, kl_clamp=10.0,
                                    entropy_coef=0.0)
    k3 = math.exp(0.5) - 0.5 - 1.0
    assert metrics["actor/pg_loss"] == 0.0
    assert loss.item() == pytest.approx(1e-2 * k3)


# --- the learner trains with SAO (tiny model, no services) ---

SAO = LearnerSettings(lr=1e-3, critic_lr=1e-2, max_tokens_per_micro_batch=40, advantage_estimator="sao")


@pytest.fixture(scope="module")
def actor_and_batch():
    model = tiny_model()
    # With SAO the items' scalars are the trajectories' rewards.
    return model, multi_turn_batch(model, [1.0, 0.0, 1.0, -0.2])


def test_the_learner_trains_the_policy_and_the_critic_with_sao(actor_and_batch):
    base, items = actor_and_batch
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    critic = make_critic(model, SAO)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = train_step(model, ref, make_optimizer(model, SAO), items, SAO, critic=critic)
    assert metrics["actor/micro_batches"] > 1 and metrics["actor/step_skipped"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert float(critic.head.linear.weight.detach().abs().sum()) > 0  # the zero head has moved
    assert metrics["critic/value_loss_after"] < metrics["critic/value_loss"]
    assert metrics["actor/pg_clipfrac"] > 0  # the batch's rollout drift leaves [0.5, 2] for a few tokens
    # The zero head's first values are 0: every action token's advantage is lambda^(tokens after it) * R.
    expected = [SAO.gae_lambda ** k * reward for _, mask, _, reward in items for k in range(int(mask.sum()))]
    assert metrics["critic/values_mean"] == 0.0
    assert metrics["actor/advantage_mean"] == pytest.approx(float(np.mean(expected)), rel=1e-5)


def test_sao_trains_under_bfloat16_autocast_with_a_float32_critic(actor_and_batch):
    base, items = actor_and_batch
    model = copy.deepcopy(base)
    settings = SAO.model_copy(update={"compute_dtype": "bfloat16"})
    critic = make_critic(model, settings)
    metrics = train_step(model, copy.deepcopy(base), make_optimizer(model, settings), items, settings, critic=critic)
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["critic/value_loss_after"] < metrics["critic/value_loss"]
    assert critic.head.linear.weight.dtype == torch.float32


@pytest.mark.parametrize("updates", [2, 3])
def test_the_critic_takes_its_updates_per_actor_step(actor_and_batch, updates):
    base, items = actor_and_batch
    settings = SAO.model_copy(update={"critic_updates_per_step": updates})
    model = copy.deepcopy(base)
    critic, optimizer = make_critic(model, settings), make_optimizer(model, settings)
    for step in (1, 2):
        metrics = train_step(model, copy.deepcopy(base), optimizer, items, settings, critic=critic)
        assert steps_taken(optimizer) == step
        assert steps_taken(critic.optimizer) == updates * step
        assert metrics["critic/updates"] == updates


def test_sao_on_the_rollouts_own_log_probs_gates_nothing():
    model = tiny_model()
    items = multi_turn_batch(model, [1.0, 0.0], drift=0.0)
    metrics = train_step(model, copy.deepcopy(model), make_optimizer(model, SAO), items, SAO,
                         critic=make_critic(model, SAO))
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/is_weight"] == pytest.approx(1.0, abs=1e-4)


def test_sao_refuses_to_step_without_a_critic_or_across_ranks(actor_and_batch):
    base, items = actor_and_batch
    model = copy.deepcopy(base)
    with pytest.raises(ValueError, match="needs the critic"):
        train_step(model, base, make_optimizer(model, SAO), items, SAO)

    class TwoRanks:
        rank, world = 0, 2

    with pytest.raises(ValueError, match="one process"):
        train_step(model, base, make_optimizer(model, SAO), items, SAO, sync=TwoRanks(), critic=make_critic(model, SAO))


# --- settings, on each side and across them ---

def test_sao_is_off_by_default_and_has_the_documented_defaults():
    settings = LearnerSettings()
    assert settings.advantage_estimator == "group" and not settings.sao
    assert (settings.gae_gamma, settings.gae_lambda, settings.critic_lr, settings.critic_updates_per_step,
            settings.dis_low, settings.dis_high) == (1.0, 0.95, 1e-5, 2, 0.5, 2.0)
    assert StreamsSettings().advantage == "group"


@pytest.mark.parametrize("field, value", [("policy_loss", "cispo"), ("is_correction", "icepop"), ("is_level", "chunk")])
def test_sao_refuses_an_actor_option_it_would_ignore(field, value):
    with pytest.raises(ValueError, match=f"{field} '{value}' does not apply"):
        LearnerSettings(advantage_estimator="sao", **{field: value})


@pytest.mark.parametrize("field, value", [("dis_low", 1.0), ("dis_high", 1.0), ("gae_lambda", 1.5),
                                          ("gae_gamma", 0.0), ("critic_updates_per_step", 0)])
def test_sao_settings_out_of_range_are_refused(field, value):
    with pytest.raises(ValueError):
        LearnerSettings(advantage_estimator="sao", **{field: value})


@pytest.mark.parametrize("streams, message", [
    ({"advantage": "none", "adv_norm": "erpo", "task_adv_norm": False}, "adv_norm erpo cannot apply"),
    ({"advantage": "none", "positive_only_steps": 4}, "positive_only_steps cannot apply"),
    ({"group_size": 1}, r"min_members \(2\) must not exceed group_size \(1\)"),
])
def test_streams_refuse_what_would_drop_or_ignore_every_group(streams, message):
    with pytest.raises(ValueError, match=message):
        StreamsSettings(**streams)


def test_the_learners_estimator_and_the_streams_advantage_must_agree():
    with pytest.raises(ValueError, match="advantage_estimator 'sao' needs streams.advantage 'none'"):
        RollstreamConfig(learner={"advantage_estimator": "sao"})
    with pytest.raises(ValueError, match="advantage_estimator 'group' needs streams.advantage 'group'"):
        RollstreamConfig(streams={"advantage": "none"})


def test_the_sao_study_variant_runs_single_samples_into_the_learners_critic():
    cpu = RollstreamConfig(agent_loop={"max_turns": 6}, streams={"max_turns": 6, "batch_size": 6}, max_steps=24,
                           mix={"val_interval": 24})
    cfg = variant_config(cpu, "sao", 0)
    assert (cfg.streams.group_size, cfg.streams.min_members, cfg.streams.advantage) == (1, 1, "none")
    assert cfg.streams.min_trajectories == cpu.streams.min_trajectories  # as many trajectories per step as base
    assert cfg.learner_settings().sao


# --- the streams pass single trajectories through with their rewards ---

def trajectory(reward: float, group_id: str = "g1") -> dict:
    return {**samples.trajectory(reward=reward), "run": "run", "group_id": group_id, "trajectory_id": f"{group_id}-0",
            "group_size": 1, "member": 0, "input_ids": pack_ids(range(5)), "loss_mask": pack_mask([0, 1, 1, 0, 1]),
            "rollout_logprobs": pack_logprobs([0.0] * 5), "num_tokens": 5}


def test_with_advantage_none_a_group_of_one_is_emitted_and_batched_with_its_reward_and_advantage_0():
    # filter_all_equal as configs/cpu.yaml has it: a group of one is never all-equal, so it is never dropped
    settings = StreamsSettings(group_size=1, min_members=1, batch_size=2, first_batch_factor=1.0, advantage="none",
                               filter_all_equal=True)
    groups = []
    for group_id, reward in (("g1", 0.75), ("g2", -0.2)):
        state = add_member(None, trajectory(reward, group_id), 1_000).state
        decision = decide(state, 1_001, 5, settings)
        assert (decision.action, decision.reason) == ("emit", "complete")
        assert decision.group["members"][0]["advantage"] == 0.0
        groups.append(decision.group)
    batch = build_batch("run", 0, 5, groups, settings, now_ms=2_000)
    assert [(i["trajectory"]["reward"], i["group_advantage"], i["advantage"]) for i in batch["items"]] == [
        (0.75, 0.0, 0.0), (-0.2, 0.0, 0.0)]
    # the same groups under GRPO: a group of one has advantage R / (1 + eps), then the task normalization
    grpo = StreamsSettings(group_size=1, min_members=1, batch_size=2, first_batch_factor=1.0)
    assert decide(add_member(None, trajectory(0.75), 1_000).state, 1_001, 5, grpo).group["members"][0][
        "advantage"] == pytest.approx(0.75)


def test_the_learner_reads_the_rewards_of_a_batch_with_sao_and_the_advantages_otherwise():
    batch = samples.batch()  # rewards 1.0 and 0.0, advantages 1.0 and -1.0
    assert [item[3] for item in batch_items(batch, lambda uri: b"")] == [1.0, -1.0]
    assert [item[3] for item in batch_items(batch, lambda uri: b"", rewards=True)] == [1.0, 0.0]


# --- the value head: in checkpoints, never published ---

def published_names(model: torch.nn.Module) -> set[str]:
    """The tensor names LearnerLoop._publish stages: the policy's state dict less its tied aliases."""
    return set(publish.without_aliases(checkpoint.full_weights(model), publish.tied_aliases(model)))


def test_the_value_head_is_not_part_of_the_policys_published_weights():
    model = tiny_model()
    policy_only = published_names(model)
    critic = make_critic(model, SAO)
    assert published_names(model) == policy_only
    assert critic.head.linear.weight.shape == (1, model.config.hidden_size)
    # the check has teeth: a head put inside the policy is staged with it
    model.value_head = critic.head
    assert published_names(model) - policy_only == {"value_head.linear.weight", "value_head.linear.bias"}


def loop(model, settings, critic):
    return LearnerLoop(run="r", settings=settings, model=model, optimizer=make_optimizer(model, settings),
                       step_fn=lambda items: {}, model_config={}, kafka=KafkaSettings(), mc=None, producer=None,
                       critic=critic)


def test_the_learner_loop_refuses_a_value_head_inside_the_policy_or_a_critic_that_does_not_fit():
    model = tiny_model()
    critic = make_critic(model, SAO)
    assert loop(model, SAO, critic).critic is critic
    model.value_head = critic.head  # now in the policy's state dict: it would be staged for the engines
    with pytest.raises(ValueError, match="must not be a module of the policy"):
        loop(model, SAO, critic)
    with pytest.raises(ValueError, match="a critic is needed with advantage_estimator sao"):
        loop(tiny_model(), SAO, None)
    with pytest.raises(ValueError, match="a critic is needed with advantage_estimator sao, and only then"):
        loop(tiny_model(), LearnerSettings(), make_critic(model, SAO))


class DictStore:
    """The few Minio calls a checkpoint makes, on a dict."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def put_object(self, bucket, key, data, length, content_type=None):
        self.objects[key] = data.read()

    def fput_object(self, bucket, key, path, part_size=None):
        with open(path, "rb") as f:
            self.objects[key] = f.read()

    def get_object(self, bucket, key):
        body = io.BytesIO(self.objects[key])
        body.release_conn = lambda: None
        return body

    def fget_object(self, bucket, key, path):
        with open(path, "wb") as f:
            f.write(self.objects[key])


def test_a_checkpoint_keeps_the_critic_beside_the_policy_and_restores_it(actor_and_batch):
    base, items = actor_and_batch
    model = copy.deepcopy(base)
    critic, optimizer = make_critic(model, SAO), make_optimizer(model, SAO)
    train_step(model, copy.deepcopy(base), optimizer, items, SAO, critic=critic)
    store = DictStore()
    checkpoint.save_checkpoint(store, "r", checkpoint.TrainingState(step=1, version=1),
                               checkpoint.full_weights(model), checkpoint.full_optimizer_state(model, optimizer),
                               critic.state())
    loaded = checkpoint.load_latest(store, "r")
    assert set(loaded.model) == set(model.state_dict())  # the policy's tensors alone
    fresh = make_critic(model, SAO)
    fresh.load(loaded.critic)
    assert torch.equal(fresh.head.linear.weight, critic.head.linear.weight)
    assert steps_taken(fresh.optimizer) == SAO.critic_updates_per_step
    # without SAO nothing is kept under `critic`
    checkpoint.save_checkpoint(store, "g", checkpoint.TrainingState(), checkpoint.full_weights(model), {})
    assert checkpoint.load_latest(store, "g").critic is None


def test_the_learner_process_refuses_sao_under_torchrun_before_joining_the_ranks(monkeypatch, tmp_path):
    from pipeline.run.learner import LearnerJob, LearnerRefused, run_learner

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(LearnerRefused, match="sao trains its critic in one process"):
        run_learner(RollstreamConfig(), SAO, LearnerJob(run="r", model_path=tmp_path), lambda line: None)
