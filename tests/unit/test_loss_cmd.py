"""`rollstream loss` in-process: the documented example, agreement with the learner's training step on the
same arrays and with an independent implementation of each documented formula, user errors."""

from __future__ import annotations

import copy
import itertools
import json
import math

import numpy as np
import pytest
from helpers.tiny_learner import multi_turn_batch, shifted_logprobs, tiny_model
from typer.testing import CliRunner

from learner.sao import make_critic
from learner.settings import LearnerSettings
from learner.step import make_optimizer, train_step
from pipeline.cli.loss import app

EXAMPLE = {"logprobs": [[-1.0, -0.5]], "old_logprobs": [[-1.1, -0.4]], "ref_logprobs": [[-1.0, -0.6]],
           "advantages": [[1.0, 1.0]], "loss_mask": [[1, 1]], "kl_coef": 0.001}


def run(tmp_path, data, *args):
    path = tmp_path / "input.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return CliRunner().invoke(app, ["--input", str(path), *args])


def run_json(tmp_path, data, *args) -> dict:
    result = run(tmp_path, data, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_documented_example_gives_its_hand_computed_loss(tmp_path):
    out = run_json(tmp_path, EXAMPLE)
    ratios = (math.exp(0.1), math.exp(-0.1))  # both inside [0.8, 1.2]
    kl = (0.0, math.exp(-0.1) + 0.1 - 1.0)  # k3 of ref - logp = (0, -0.1)
    assert out["pg_loss"] == pytest.approx(-sum(ratios) / 2, abs=1e-12)
    assert out["kl_loss"] == pytest.approx(sum(kl) / 2, abs=1e-12)
    assert out["loss"] == pytest.approx(-sum(ratios) / 2 + 0.001 * sum(kl) / 2, abs=1e-12)
    assert out["loss"] == pytest.approx(-1.0050018, abs=1e-7)
    assert out["metrics"]["actor/pg_clipfrac"] == 0.0
    # d loss / d logprobs = -A * r / N - kl_coef * (exp(ref - lp) - 1) / N
    assert out["grad_logprobs"][0] == pytest.approx(
        [-ratios[0] / 2, -ratios[1] / 2 - 0.001 * (math.exp(-0.1) - 1.0) / 2], abs=1e-12)


def test_cispo_example_lets_the_gradient_through_a_clipped_weight(tmp_path):
    data = {**EXAMPLE, "old_logprobs": [[-1.5, -0.4]], "kl_coef": 0.0}  # r = e^0.5 = 1.65: clipped to 1.2
    out = run_json(tmp_path, data, "--loss", "cispo")
    assert out["pg_loss"] == pytest.approx((-1.2 * -1.0 - math.exp(-0.1) * -0.5) / 2, abs=1e-12)
    assert out["grad_logprobs"][0] == pytest.approx([-1.2 / 2, -math.exp(-0.1) / 2], abs=1e-12)


def test_readable_output_without_json(tmp_path):
    result = run(tmp_path, EXAMPLE, "--is", "tis", "--is-level", "chunk")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == "ppo + tis (chunk level)"
    assert any(line.startswith("loss ") for line in result.stdout.splitlines())
    assert "is_weight" in result.stdout


# --- agreement with the learner's training step on the same arrays ---

def arrays_of(model, ref, items) -> dict:
    """The step's per-token arrays, computed here without the learner's collate: position t is token t+1."""
    data: dict = {k: [] for k in ("logprobs", "old_logprobs", "ref_logprobs", "advantages", "loss_mask")}
    for ids, mask, rollout, advantage in items:
        action = mask[1:].astype(np.float64)  # (T-1,)
        data["logprobs"].append(shifted_logprobs(model, ids).tolist())
        data["ref_logprobs"].append(shifted_logprobs(ref, ids).tolist())
        data["old_logprobs"].append((rollout[1:] * action).tolist())
        data["advantages"].append((advantage * action).tolist())
        data["loss_mask"].append(action.astype(int).tolist())
    return data


@pytest.fixture(scope="module")
def step_inputs():
    model, ref = tiny_model(), tiny_model(seed=5)  # another reference, so the KL term is not 0
    items = multi_turn_batch(model, [1.0, -0.5, 2.0, -1.5], drift=0.5)
    return model, ref, items, arrays_of(model, ref, items)


@pytest.mark.parametrize("objective, correction, level", [
    ("ppo", "none", "token"), ("cispo", "none", "token"), ("decoupled", "tis", "chunk"), ("ppo", "icepop", "sequence"),
])
def test_command_agrees_with_the_learners_training_step(tmp_path, step_inputs, objective, correction, level):
    model, ref, items, data = step_inputs
    settings = LearnerSettings(kl_coef=0.05, max_tokens_per_micro_batch=40, policy_loss=objective,
                               is_correction=correction, is_level=level)
    actor = copy.deepcopy(model)
    step = train_step(actor, copy.deepcopy(ref), make_optimizer(actor, settings), items, settings)
    assert step["actor/micro_batches"] > 1
    out = run_json(tmp_path, {**data, "kl_coef": 0.05}, "--loss", objective, "--is", correction, "--is-level", level)
    for name in ("loss", "pg_loss", "kl_loss"):
        assert out[name] == pytest.approx(step[f"actor/{name}"], rel=1e-4, abs=1e-6), name
    for name, value in out["metrics"].items():
        assert value == pytest.approx(step[name], rel=1e-4, abs=1e-5), name


# --- agreement with an independent implementation of the documented formulas ---

def documented_loss(data: dict, objective: str, correction: str, level: str) -> dict[str, float]:
    """The formulas of `rollstream loss --help` and ARCHITECTURE.md, written out token by token in plain Python."""
    low, high, c = data["clip_ratio_low"], data["clip_ratio_high"], data["clip_ratio_c"]
    cap, kl_coef, kl_clamp = data["is_cap"], data["kl_coef"], 10.0
    weighted = objective == "decoupled" or correction != "none"
    pg_sum = kl_sum = 0.0
    tokens = 0
    for s, lp in enumerate(data["logprobs"]):
        behav, prox, ref = data["old_logprobs"][s], data["prox_logprobs"][s], data["ref_logprobs"][s]
        adv, mask = data["advantages"][s], data["loss_mask"][s]
        action = [t for t in range(len(lp)) if mask[t] == 1]
        if level == "token":
            groups = [[t] for t in action]
        elif level == "sequence":
            groups = [action] if action else []
        else:  # chunk: maximal runs of consecutive 1s
            groups = [[t for t, _ in run] for one, run in itertools.groupby(enumerate(mask), key=lambda x: x[1] == 1)
                      if one]
        for group in groups:
            old = prox if weighted else behav
            r = math.exp(sum(lp[t] - old[t] for t in group) / len(group))
            rho = math.exp(sum(prox[t] - behav[t] for t in group) / len(group))
            if correction == "tis":
                w = min(rho, cap)
            elif correction == "icepop":
                w = rho if 1 / cap <= rho <= cap else 0.0
            else:
                w = rho if objective == "decoupled" else 1.0
            for t in group:
                a = adv[t]
                if objective == "cispo":
                    pg = -min(max(r, 1 - low), 1 + high) * a * lp[t]
                else:
                    pg = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
                    if a < 0:
                        pg = min(pg, -a * c)
                pg_sum += w * pg
        for t in action:
            d = ref[t] - lp[t]
            kl_sum += min(max(math.exp(d) - d - 1, -kl_clamp), kl_clamp)
            tokens += 1
    return {"pg_loss": pg_sum / tokens, "kl_loss": kl_sum / tokens, "loss": (pg_sum + kl_coef * kl_sum) / tokens}


def random_input(seed: int) -> dict:
    """Ragged multi-turn sequences with log-prob gaps wide enough that clips, dual clips and masks all occur."""
    rng = np.random.default_rng(seed)
    data: dict = {k: [] for k in ("logprobs", "old_logprobs", "prox_logprobs", "ref_logprobs", "advantages",
                                  "loss_mask")}
    for _ in range(6):
        mask = [0] * int(rng.integers(1, 4))
        for _turn in range(int(rng.integers(1, 4))):
            mask += [1] * int(rng.integers(1, 6)) + [0] * int(rng.integers(1, 3))
        n = len(mask)
        behav = -rng.exponential(1.5, n)
        prox = behav + rng.normal(0, 0.8, n)
        data["old_logprobs"].append(behav.tolist())
        data["prox_logprobs"].append(prox.tolist())
        data["logprobs"].append((prox + rng.normal(0, 0.4, n)).tolist())
        data["ref_logprobs"].append((prox + rng.normal(0, 0.5, n)).tolist())
        data["advantages"].append([float(rng.normal(0, 1.5))] * n)
        data["loss_mask"].append(mask)
    return {**data, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "kl_coef": 0.01,
            "is_cap": 1.8}


@pytest.mark.parametrize("objective, correction, level", list(itertools.product(
    ("ppo", "cispo", "decoupled"), ("none", "tis", "icepop"), ("token", "sequence", "chunk"))))
def test_command_agrees_with_an_independent_implementation_of_its_formulas(tmp_path, objective, correction, level):
    data = random_input(seed=7)
    out = run_json(tmp_path, data, "--loss", objective, "--is", correction, "--is-level", level)
    expected = documented_loss(data, objective, correction, level)
    for name in ("loss", "pg_loss", "kl_loss"):
        assert out[name] == pytest.approx(expected[name], rel=1e-9, abs=1e-12), name


def test_the_random_input_exercises_every_clip_and_mask(tmp_path):
    data = random_input(seed=7)
    token = run_json(tmp_path, data)["metrics"]
    assert token["actor/pg_clipfrac"] > 0 and token["actor/pg_clipfrac_lower"] > 0
    for correction in ("tis", "icepop"):
        assert 0 < run_json(tmp_path, data, "--is", correction)["metrics"]["actor/is_clipfrac"] < 1


def test_prox_logprobs_default_to_logprobs(tmp_path):
    data = {k: v for k, v in random_input(seed=3).items() if k != "prox_logprobs"}
    without = run_json(tmp_path, data, "--loss", "decoupled")
    with_prox = run_json(tmp_path, {**data, "prox_logprobs": data["logprobs"]}, "--loss", "decoupled")
    assert without["loss"] == with_prox["loss"] and without["grad_logprobs"] == with_prox["grad_logprobs"]


# --- --loss sao: skip-observation GAE from values and rewards, then the DIS-gated actor loss ---

SAO_EXAMPLE = {  # two assistant turns (positions 1-2, 5-6) with the environment's answer (3-4) between them
    "logprobs": [[0.0, math.log(1.5), math.log(0.4), 0.0, 0.0, 0.0, math.log(2.0), 0.0]],
    "old_logprobs": [[0.0] * 8], "ref_logprobs": [[0.0, math.log(1.5), math.log(0.4), 0.0, 0.0, 0.0, math.log(2.0), 0.0]],
    "values": [[9.0, 0.2, 0.4, 7.0, 7.0, 0.5, 0.7, 9.0]], "loss_mask": [[0, 1, 1, 0, 0, 1, 1, 0]], "rewards": [2.0],
    "gae_gamma": 0.9, "gae_lambda": 0.5,
}


def test_sao_example_skips_the_environments_tokens_and_gates_the_out_of_bound_ratio(tmp_path):
    out = run_json(tmp_path, SAO_EXAMPLE, "--loss", "sao")
    # as tests/unit/test_sao.py works it out: the turn's last token bootstraps from the next turn's first
    advantages = [0.0, 0.3272875, 0.37175, 0.0, 0.0, 0.715, 1.3, 0.0]
    assert out["advantages"][0] == pytest.approx(advantages)
    assert out["returns"][0] == pytest.approx([0.0, 0.5272875, 0.77175, 0.0, 0.0, 1.215, 2.0, 0.0])
    # rho = 1.5, 0.4 (below 0.5: masked), 1.0, 2.0 (on the bound: kept)
    assert out["pg_loss"] == pytest.approx(-(1.5 * 0.3272875 + 1.0 * 0.715 + 2.0 * 1.3) / 4)
    assert out["grad_logprobs"][0] == pytest.approx([0.0, -1.5 * 0.3272875 / 4, 0.0, 0.0, 0.0, -0.715 / 4,
                                                     -2.0 * 1.3 / 4, 0.0])
    assert out["metrics"]["actor/pg_clipfrac"] == pytest.approx(1 / 4)
    assert out["value_loss"] == pytest.approx(0.5 * ((0.5272875 - 0.2) ** 2 + (0.77175 - 0.4) ** 2
                                                     + (1.215 - 0.5) ** 2 + (2.0 - 0.7) ** 2) / 4)


def test_sao_command_agrees_with_the_learners_sao_step(tmp_path, step_inputs):
    model, ref, items, data = step_inputs
    settings = LearnerSettings(kl_coef=0.05, max_tokens_per_micro_batch=40, advantage_estimator="sao")
    actor = copy.deepcopy(model)
    critic = make_critic(actor, settings)  # zero: every value of the step's first pass is 0
    step = train_step(actor, copy.deepcopy(ref), make_optimizer(actor, settings), items, settings, critic=critic)
    assert step["actor/micro_batches"] > 1 and step["actor/pg_clipfrac"] > 0
    sao_data = {**{k: v for k, v in data.items() if k != "advantages"}, "kl_coef": 0.05,
                "values": [[0.0] * len(row) for row in data["loss_mask"]], "rewards": [item[3] for item in items]}
    out = run_json(tmp_path, sao_data, "--loss", "sao")
    for name in ("loss", "pg_loss", "kl_loss"):
        assert out[name] == pytest.approx(step[f"actor/{name}"], rel=1e-4, abs=1e-6), name
    for name, value in out["metrics"].items():
        assert value == pytest.approx(step[name], rel=1e-4, abs=1e-5), name
    action = [a for row, mask in zip(out["advantages"], data["loss_mask"]) for a, m in zip(row, mask) if m]
    assert float(np.mean(action)) == pytest.approx(step["actor/advantage_mean"], rel=1e-5)
    assert out["value_loss"] == pytest.approx(step["critic/value_loss"], rel=1e-4)


# --- user errors ---

@pytest.mark.parametrize("data, args, message", [
    ("{not json", (), "is not JSON"),
    ([1, 2], (), "must hold one JSON object"),
    ({**EXAMPLE, "loss_mask": None}, (), "lacks the list(s) loss_mask"),
    ({**EXAMPLE, "clip_ratio": 0.2}, (), "unknown key(s) clip_ratio"),
    ({**EXAMPLE, "advantages": [[1.0, 1.0], [1.0]]}, (), "one list per sequence expected"),
    ({**EXAMPLE, "advantages": [[1.0]]}, (), "sequence 0: every list must hold the same number"),
    ({**EXAMPLE, "advantages": [["a", 1.0]]}, (), "invalid input"),
    ({**EXAMPLE, "loss_mask": [[0, 2]]}, (), "loss_mask holds values other than 0 and 1"),
    ({**EXAMPLE, "loss_mask": [[0, 0]]}, (), "no action tokens"),
    ({**EXAMPLE, "is_cap": 0.5}, (), "invalid settings: is_cap"),
    ({k: v for k, v in SAO_EXAMPLE.items() if k != "rewards"}, ("--loss", "sao"), "lacks the list(s) rewards"),
    ({**SAO_EXAMPLE, "rewards": [1.0, 2.0]}, ("--loss", "sao"), "rewards must hold one number per sequence (1)"),
    ({**SAO_EXAMPLE, "advantages": [[0.0] * 8]}, ("--loss", "sao"), "unknown key(s) advantages"),
    ({**SAO_EXAMPLE, "dis_low": 1.5}, ("--loss", "sao"), "invalid settings: dis_low"),
    (SAO_EXAMPLE, ("--loss", "sao", "--is", "tis"), "is_correction 'tis' does not apply"),
])
def test_bad_input_is_one_line_and_nonzero_exit(tmp_path, data, args, message):
    result = run(tmp_path, data, *args)
    assert result.exit_code == 2
    assert message in result.stderr and result.stderr.count("\n") == 1 and result.stdout == ""


def test_an_unknown_option_value_is_refused(tmp_path):
    result = run(tmp_path, EXAMPLE, "--loss", "grpo")
    assert result.exit_code == 2 and result.stdout == ""


def test_missing_file_is_a_user_error(tmp_path):
    result = CliRunner().invoke(app, ["--input", str(tmp_path / "absent.json")])
    assert result.exit_code == 2 and "cannot read" in result.stderr


def test_help_shows_an_example_and_each_formula():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0 and "rollstream loss --input" in result.stdout
    for term in ("cispo:", "decoupled:", "--is tis:", "--is icepop:", "chunk", "kl = clamp(", "--loss sao",
                 "gate = 1 if dis_low"):
        assert term in result.stdout, term
