"""`rollstream bench peer`'s pure part: the TRL settings that reproduce ours, what cannot be matched, the
compared figures, the plot; and that TRL's Qwen2.5 chat template, which TRL's copy of our tokenizer gets so that
TRL can parse tool calls, renders calc's conversations exactly as our template does, the environment class's
methods given calc's own tool schemas."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers.utils import get_json_schema

from env_workers.envs import calc, registry
from env_workers.envs.base import EnvSettings
from pipeline.bench import peer_logic
from pipeline.bench.pipeline_logic import stage_cpu
from pipeline.policy.model_init import CHAT_TEMPLATE, build_tokenizer

SHARED = peer_logic.matched(group_size=8, prompts_per_step=6, max_turns=6, max_new_tokens=256, max_total_len=4096,
                            temperature=0.8, lr=1e-4, lr_warmup_steps=0, kl_coef=1e-4, clip_ratio_low=0.2,
                            clip_ratio_high=0.28, clip_ratio_c=3.0, grad_clip=1.0, weight_decay=0.0,
                            adam_betas=(0.9, 0.999), entropy_coef=0.0, steps=24, seed=3, precision="float32")


def _calc_conversation() -> list[dict]:
    """A calc episode as TRL holds it: our environment's prompt, tool calls with parsed (dict) arguments as TRL's
    response parser gives them, tool messages with the tool's name as TRL writes them."""
    envs = EnvSettings()
    env = registry.environment("calc", envs)
    session = asyncio.run(env.start(registry.sample("calc", "rl", 0, envs)))
    return [*session.messages,
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 17, "b": 5}}}]},
            {"role": "tool", "name": "add", "content": "22"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "multiply", "arguments": {"a": 22, "b": 3.5}}},
                {"type": "function", "function": {"name": "submit", "arguments": {"answer": 77}}}]},
            {"role": "tool", "name": "multiply", "content": "77"},
            {"role": "tool", "name": "submit", "content": "Submitted."},
            {"role": "assistant", "content": "Done."}]


TOOL_NAMES = ("add", "subtract", "multiply", "submit")


def _env_tools() -> list:
    """The tools TRL takes from peer_trl's environment class: its public methods."""
    from pipeline.bench.peer_env import RollstreamCalc  # noqa: PLC0415

    return [getattr(RollstreamCalc, name) for name in TOOL_NAMES]


def test_trl_renders_calc_conversations_exactly_as_ours_with_calc_tool_schemas():
    """TRL's Qwen2.5 template over the environment class's methods (as TRL passes them, schemas from
    calc_tool_schemas) against our template over calc.TOOLS: every prefix, with and without the generation prompt."""
    from trl.chat_template_utils import qwen2_5_chat_template  # noqa: PLC0415

    from pipeline.bench.peer_env import calc_tool_schemas  # noqa: PLC0415

    tokenizer = build_tokenizer()
    messages = _calc_conversation()
    with calc_tool_schemas():
        for cut in range(2, len(messages) + 1):  # every prefix, as each turn's prompt is rendered
            for generation_prompt in (True, False):
                ours = tokenizer.apply_chat_template(messages[:cut], tools=calc.TOOLS, chat_template=CHAT_TEMPLATE,
                                                     tokenize=False, add_generation_prompt=generation_prompt)
                trl = tokenizer.apply_chat_template(messages[:cut], tools=_env_tools(), tokenize=False,
                                                    chat_template=qwen2_5_chat_template,
                                                    add_generation_prompt=generation_prompt)
                assert ours == trl


def test_calc_tool_schemas_give_calc_schemas_to_the_environment_methods_only_and_only_inside():
    from transformers.utils import chat_template_utils  # noqa: PLC0415

    from pipeline.bench.peer_env import calc_tool_schemas  # noqa: PLC0415

    def other(x: int):  # noqa: ANN202
        """Another tool.

        Args:
            x: a value
        """

    with calc_tool_schemas():
        assert [chat_template_utils.get_json_schema(tool) for tool in _env_tools()] == calc.TOOLS
        assert chat_template_utils.get_json_schema(other) == get_json_schema(other)
    described = chat_template_utils.get_json_schema(_env_tools()[0])  # outside: get_json_schema's, described
    assert described["function"]["parameters"]["properties"]["a"]["description"] == "a number"
    assert any("get_json_schema" in d for d in peer_logic.FIXED_DIFFERENCES)


def test_one_optimizer_step_per_batch_of_every_group():
    config = peer_logic.grpo_config(SHARED, output_dir="out", use_vllm=False)
    assert config["num_generations"] == 8
    assert config["per_device_train_batch_size"] == 8 * 6
    assert config["gradient_accumulation_steps"] == config["steps_per_generation"] == config["num_iterations"] == 1
    assert config["max_steps"] == 24


def test_grpo_config_carries_every_shared_hyperparameter():
    config = peer_logic.grpo_config(SHARED, output_dir="out", use_vllm=False)
    assert (config["learning_rate"], config["beta"], config["epsilon"], config["epsilon_high"], config["delta"]) == \
        (1e-4, 1e-4, 0.2, 0.28, 3.0)
    assert (config["temperature"], config["max_grad_norm"], config["weight_decay"], config["seed"]) == (0.8, 1.0, 0.0, 3)
    assert (config["adam_beta1"], config["adam_beta2"]) == (0.9, 0.999)
    assert config["loss_type"] == "dapo"  # token-mean over the global batch, as learner/loss.py
    assert config["lr_scheduler_type"] == "constant"  # TRL's default decays linearly; our lr does not
    assert config["gradient_checkpointing"] is False
    assert config["max_tool_calling_iterations"] == 5  # six assistant turns
    assert config["shuffle_dataset"] is False


def test_trl_trains_in_bf16_exactly_when_our_learner_does():
    assert peer_logic.grpo_config(SHARED, output_dir="out", use_vllm=False)["bf16"] is False
    assert peer_logic.grpo_config({**SHARED, "precision": "bfloat16"}, output_dir="out", use_vllm=False)["bf16"] is True


def test_engines_in_another_precision_than_the_training_are_a_difference():
    def listed(shared: dict, engine_dtype: str) -> bool:
        out = peer_logic.differences(shared, entropy_coef=0.0, filter_all_equal=False, stale_engines=1,
                                     generation="transformers", engine_dtype=engine_dtype)
        return any(d.startswith("generation precision") for d in out)

    assert not listed(SHARED, "float32")
    assert listed({**SHARED, "precision": "bfloat16"}, "float32")


def test_warmup_keeps_a_constant_rate_after_it():
    config = peer_logic.grpo_config({**SHARED, "lr_warmup_steps": 3}, output_dir="out", use_vllm=False)
    assert (config["lr_scheduler_type"], config["warmup_steps"]) == ("constant_with_warmup", 3)


def test_trl_accepts_the_mapped_configuration():
    from trl import GRPOConfig  # noqa: PLC0415

    args = GRPOConfig(**peer_logic.grpo_config(SHARED, output_dir="/tmp/rollstream-peer-unit", use_vllm=False))
    assert args.generation_batch_size == 48 and args.num_generations == 8


def test_completion_budget_is_every_turn_within_the_total_length():
    assert peer_logic.max_completion_length(SHARED) == 6 * 256
    assert peer_logic.max_completion_length({**SHARED, "max_new_tokens": 1024}) == 4096


def test_differences_name_what_this_configuration_adds():
    plain = peer_logic.differences(SHARED, entropy_coef=0.0, filter_all_equal=False, stale_engines=0,
                                   generation="transformers", engine_dtype="float32")
    assert plain[:len(peer_logic.FIXED_DIFFERENCES)] == list(peer_logic.FIXED_DIFFERENCES)
    assert plain[-1] == "generation: TRL used transformers"
    more = peer_logic.differences(SHARED, entropy_coef=0.01, filter_all_equal=True, stale_engines=1,
                                  generation="transformers", engine_dtype="float32")
    assert len(more) == len(plain) + 3
    assert any("entropy" in d for d in more) and any("stale" in d for d in more)


def test_an_unfinished_episode_gets_the_incomplete_punishment():
    assert peer_logic.incomplete_reward(True, 1.0, -0.2) == 1.0
    assert peer_logic.incomplete_reward(True, 0.0, -0.2) == 0.0
    assert peer_logic.incomplete_reward(False, 0.0, -0.2) == -0.2


def _traj(index: int, ok: bool) -> dict:
    return {"split": "dev", "sample_index": index, "status": "completed" if ok else "task_limit_reached",
            "env_reward": 1.0 if ok else 0.0}


def test_held_out_change_is_paired_per_sample():
    before = [_traj(i, i < 2) for i in range(4)] * 2
    after = [_traj(i, i < 3) for i in range(4)] * 2
    held = peer_logic.held_out(before, after)
    assert (held["before"], held["after"], held["episodes"]) == (0.5, 0.75, [8, 8])
    assert held["change"]["samples"] == 4 and held["change"]["mean"] == pytest.approx(0.25)
    assert held["change"]["up"] == 1 and held["change"]["down"] == 0


def test_throughput_over_the_training_window():
    row = peer_logic.throughput(trained_tokens=1000, trajectories=50, steps=4, wall_s=200.0, startup_s=30.0,
                                peak_memory_bytes=2**30)
    assert (row["trained_tokens_per_s"], row["trajectories_per_s"], row["s_per_step"]) == (5.0, 0.25, 50.0)


def test_curve_and_count_take_only_trained_batches():
    ok, bad = {"status": "completed", "env_reward": 1.0}, {"status": "completed", "env_reward": 0.0}
    batches = [{"batch_id": "b1", "items": [{"trajectory": ok}, {"trajectory": bad}]},
               {"batch_id": "b2", "items": [{"trajectory": ok}, {"trajectory": ok}]},
               {"batch_id": "b3", "items": [{"trajectory": bad}]}]  # cut, never trained
    weights = [{"batch_id": None, "version": 0, "published_at_ms": 0},
               {"batch_id": "b2", "version": 2, "published_at_ms": 13_000},
               {"batch_id": "b1", "version": 1, "published_at_ms": 11_000}]
    assert peer_logic.rollstream_curve(batches, weights, start_ms=1_000) == [
        {"step": 1, "t_s": 10.0, "success": 0.5}, {"step": 2, "t_s": 12.0, "success": 1.0}]
    assert peer_logic.trained_trajectories(batches, weights) == 4


def test_ratio_is_ours_over_theirs_and_held_out_compares_paired_means():
    ours = {"trained_tokens_per_s": 30.0, "trajectories_per_s": 0.3}
    peer = {"trained_tokens_per_s": 10.0, "trajectories_per_s": 0.2}
    result = peer_logic.comparison(ours, peer, {"change": {"mean": 0.1}}, {"change": {"mean": 0.05}})
    assert result["ratio"] == 3.0 and result["trajectories_ratio"] == pytest.approx(1.5)
    assert result["held_out_change_at_least_peer"] is True
    assert result["held_out_change_difference"] == pytest.approx(0.05)
    assert peer_logic.comparison(ours, {**peer, "trained_tokens_per_s": 0.0}, {"change": None},
                                 {"change": None})["ratio"] is None


def test_the_ratio_is_the_product_of_cpu_per_token_and_cores_busy_on_one_machine():
    cores = 2

    def side(tokens: int, wall_s: float, busy_cpu_s: float) -> dict:
        samples = [(0, 100.0), (int(wall_s * 1000), 100.0 + busy_cpu_s)]
        return {**peer_logic.throughput(trained_tokens=tokens, trajectories=48, steps=12, wall_s=wall_s,
                                        startup_s=0.0, peak_memory_bytes=1),
                **stage_cpu(samples, [(0, int(wall_s * 1000))], tokens, cores)}

    ours, peer = side(60_000, 110.0, 210.0), side(72_000, 250.0, 480.0)
    result = peer_logic.comparison(ours, peer, {"change": None}, {"change": None})
    assert result["cpu_per_token_ratio"] == pytest.approx((480.0 / 72_000) / (210.0 / 60_000))
    assert result["cpu_busy_ratio"] == pytest.approx((210.0 / 220.0) / (480.0 / 500.0))
    assert result["ratio"] == pytest.approx(result["cpu_per_token_ratio"] * result["cpu_busy_ratio"])


def test_without_cpu_figures_the_ratio_has_no_factors():
    ours = {"trained_tokens_per_s": 30.0, "trajectories_per_s": 0.3}
    peer = {"trained_tokens_per_s": 10.0, "trajectories_per_s": 0.2, "cpu_s_per_token": None, "cpu_busy": None}
    result = peer_logic.comparison(ours, peer, {"change": None}, {"change": None})
    assert result["cpu_per_token_ratio"] is None and result["cpu_busy_ratio"] is None


def test_plot_writes_one_png_with_both_curves(tmp_path):
    path = tmp_path / "peer.png"
    peer_logic.plot_curves({"rollstream": [{"t_s": 1.0, "success": 0.2}, {"t_s": 2.0, "success": 0.4}],
                            "TRL": [{"t_s": 3.0, "success": 0.1}]}, path, "calc")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
