"""Oracle demonstrations: rendered exactly as the chat template renders the conversation, with the
loss mask on exactly the assistant tokens; the SFT loss sees nothing else; the `model sft` CLI
rejects bad input in one line. The tokenizer is the real default-policy one (built in memory)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from transformers import Qwen2ForCausalLM
from typer.testing import CliRunner

from env_workers.chat_template import ChatEncoder
from env_workers.envs import calc, registry
from env_workers.envs.base import EnvSettings
from env_workers.tool_parser import parse_tool_calls
from learner.loss import next_token_logits
from learner.microbatch import MicroBatch, make_micro_batches, shared_prefix_length
from pipeline.policy.demonstrations import Demonstration, demonstrations, oracle_episode, tokenize
from pipeline.cli.model import app
from pipeline.policy.model_init import PolicyModelSettings, build_config, build_tokenizer, init_model
from pipeline.policy.sft import SftSettings, batches, lr_at, masked_token_losses

SETTINGS = EnvSettings()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def encoder(tokenizer) -> ChatEncoder:
    return ChatEncoder(tokenizer)


def _episode(family: str, split: str, index: int):
    sample = registry.sample(family, split, index, SETTINGS)
    spec = registry.family(family)
    return asyncio.run(oracle_episode(family, spec.make(SETTINGS), sample, spec.golden(sample)))


def _assistant_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


@pytest.mark.parametrize(("family", "split"), [("calc", "train"), ("db", "standard")])
def test_demonstration_is_exactly_the_template_rendering_of_the_oracle_conversation(tokenizer, encoder, family, split):
    episode = _episode(family, split, 3)
    demo = tokenize(encoder, episode)
    last = max(i for i, m in enumerate(episode.messages) if m["role"] == "assistant")
    text = tokenizer.apply_chat_template(episode.messages[:last + 1], tools=episode.tools, tokenize=False)
    assert encoder.decode(demo.input_ids) == text
    assert demo.input_ids == tokenizer.encode(text, add_special_tokens=False)


def test_each_assistant_turn_renders_as_the_template_renders_a_tool_call(tokenizer, encoder):
    episode = _episode("calc", "train", 5)
    demo = tokenize(encoder, episode)
    sample = registry.sample("calc", "train", 5, SETTINGS)
    golden = _golden_messages(sample)
    spans = _assistant_spans(demo.loss_mask)
    assert len(spans) == len(golden) == len(sample["steps"]) + 1
    for (start, end), message in zip(spans, golden):
        call = message["tool_calls"][0]["function"]
        arguments = json.loads(call["arguments"])
        expected = (f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {json.dumps(arguments)}}}\n'
                    f"</tool_call><|im_end|>")
        assert encoder.decode(demo.input_ids[start:end]) == expected


def _golden_messages(sample) -> list[dict]:
    policy, history, messages = calc.golden(sample), [], []
    for _ in range(len(sample["steps"]) + 1):
        message = policy(history)
        messages.append(message)
        history.append(message)
    return messages


def test_loss_mask_covers_exactly_the_assistant_tokens_and_their_closing_eos(encoder):
    episode = _episode("db", "standard", 0)
    demo = tokenize(encoder, episode)
    assert len(demo.loss_mask) == len(demo.input_ids)
    spans = _assistant_spans(demo.loss_mask)
    assistants = [m for m in episode.messages if m["role"] == "assistant"]
    assert len(spans) == len(assistants)
    for start, end in spans:
        # The generation prompt is context right before, the template's newline right after.
        assert encoder.decode(demo.input_ids[:start]).endswith("<|im_start|>assistant\n")
        assert encoder.decode(demo.input_ids[end:end + 1]) == "\n"
        assert demo.input_ids[end - 1] == encoder.eos_token_id
        assert encoder.eos_token_id not in demo.input_ids[start:end - 1]
        text = encoder.decode(demo.input_ids[start:end - 1])
        assert parse_tool_calls(text).error is None
    assert demo.target_tokens == sum(end - start for start, end in spans)


def test_parsed_demonstrated_calls_are_the_oracle_actions(encoder):
    sample = registry.sample("calc", "train", 9, SETTINGS)
    demo = tokenize(encoder, _episode("calc", "train", 9))
    parsed = [parse_tool_calls(encoder.decode(demo.input_ids[s:e - 1])) for s, e in _assistant_spans(demo.loss_mask)]
    actions = [(p.tool_calls[0]["function"]["name"], json.loads(p.tool_calls[0]["function"]["arguments"])) for p in parsed]
    expected = [(m["tool_calls"][0]["function"]["name"], json.loads(m["tool_calls"][0]["function"]["arguments"]))
                for m in _golden_messages(sample)]
    assert actions == expected


def test_only_oracle_episodes_with_full_credit_become_demonstrations(encoder):
    pool = registry.samples("calc", "train", SETTINGS)[:3]
    found, failed = asyncio.run(demonstrations("calc", calc.make(SETTINGS), pool, calc.noop, encoder))
    assert (found, failed) == ([], 3)
    found, failed = asyncio.run(demonstrations("calc", calc.make(SETTINGS), pool, calc.golden, encoder))
    assert (len(found), failed) == (3, 0)
    assert [d.sample_id for d in found] == [s["id"] for s in pool]


def test_sft_loss_ignores_every_token_outside_the_mask():
    torch.manual_seed(0)
    logits = torch.randn(1, 6, 11)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0]])  # shifted: positions 2, 3 predict tokens 3, 4
    before = masked_token_losses(logits[:, :-1], ids, mask)
    changed = logits.clone()
    changed[0, [0, 1, 4, 5]] += torch.randn(4, 11) * 5
    after = masked_token_losses(changed[:, :-1], ids, mask)
    assert torch.equal(before, after)
    expected = -torch.log_softmax(logits[0, 2], -1)[4]
    assert torch.isclose(before[0, 2], expected)
    assert before[0, [0, 1, 4]].abs().sum() == 0


def test_every_demonstration_is_trained_once_per_epoch_in_steps_of_one_family():
    families = ["calc"] * 10 + ["kg"] * 5
    plan = batches(families, SftSettings(epochs=3, batch_size=4), np.random.default_rng(0))
    assert len(plan) == 3 * (3 + 2)
    for epoch in range(3):
        assert sorted(sum(plan[epoch * 5:epoch * 5 + 5], [])) == list(range(15))
    assert all(len({families[i] for i in step}) == 1 and len(step) <= 4 for step in plan)
    assert {families[step[0]] for step in plan[:5]} == {"calc", "kg"}


def test_the_lr_warms_up_then_decays():
    settings = SftSettings(warmup_steps=2, lr=1.0, min_lr_ratio=0.1)
    rates = [lr_at(step, 9, settings) for step in range(9)]
    assert rates[:2] == [0.5, 1.0]
    assert rates[1:] == sorted(rates[1:], reverse=True) and rates[-1] >= 0.1


def test_sft_rejects_an_unknown_family_in_one_line(tmp_path):
    result = CliRunner().invoke(app, ["sft", "--model", str(tmp_path), "--out", str(tmp_path / "out"),
                                      "--families", "calc,chess"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "rollstream model sft: unknown families ['chess']; known: calc, db, kg, os, webshop, alfworld, python"]


def test_demonstration_target_tokens_count_the_mask():
    assert Demonstration("calc", "x", [1, 2, 3, 4], [0, 1, 1, 0]).target_tokens == 2


def _rows(*rows: tuple[list[int], list[int]]) -> MicroBatch:
    items = [(np.asarray(ids), np.asarray(mask), np.zeros(len(ids)), 0.0) for ids, mask in rows]
    (micro,) = make_micro_batches(items, 10_000, pad_token_id=0)
    return micro


def test_shared_prefix_stops_where_rows_differ_or_where_a_target_is_predicted():
    differ = _rows(([5, 6, 7, 8, 9], [0, 0, 0, 0, 1]), ([5, 6, 3, 8, 9, 9], [0, 0, 0, 0, 1, 1]))
    assert shared_prefix_length(differ) == 2
    # Identical up to the end: the prefix ends at the position that predicts the first target (token 3).
    same = _rows(([5, 6, 7, 8, 9], [0, 0, 0, 1, 1]), ([5, 6, 7, 8, 9], [0, 0, 0, 0, 1]))
    assert shared_prefix_length(same) == 2


def test_running_the_shared_prefix_once_gives_the_loss_and_gradients_of_a_full_forward(tokenizer):
    settings = PolicyModelSettings(hidden_size=64, num_layers=2, num_heads=1, num_kv_heads=1, intermediate_size=128)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(build_config(settings, tokenizer))
    prompt = list(range(40, 70))
    micro = _rows((prompt + [71, 72, 73, 74], [0] * 31 + [1, 1, 1]), (prompt + [75, 76], [0] * 31 + [1]),
                  (prompt + [77, 78, 79], [0] * 31 + [1, 1]))
    ids, attention = torch.from_numpy(micro.input_ids), torch.from_numpy(micro.attention_mask)

    full = masked_token_losses(next_token_logits(model, ids, attention, 1.0), ids,
                               torch.from_numpy(micro.loss_mask)).sum()
    full.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    prefix_len = shared_prefix_length(micro)
    assert prefix_len == 30
    shared = masked_token_losses(next_token_logits(model, ids, attention, 1.0, prefix_len), ids[:, prefix_len:],
                                 torch.from_numpy(micro.loss_mask[:, prefix_len:])).sum()
    shared.backward()
    assert torch.isclose(shared, full, rtol=1e-5)
    for got, want in zip((p.grad for p in model.parameters()), expected):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)


def test_sft_rejects_samples_that_leave_a_family_without_a_count_in_one_line(tmp_path):
    init_model(PolicyModelSettings(num_layers=1), tmp_path / "policy")
    result = CliRunner().invoke(app, ["sft", "--model", str(tmp_path / "policy"), "--out", str(tmp_path / "out"),
                                      "--families", "calc,kg", "--samples", "calc=8"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == ["rollstream model sft: --samples names no count for kg"]


def test_model_eval_refuses_a_directory_without_a_checkpoint_or_an_unknown_family_in_one_line(tmp_path):
    result = CliRunner().invoke(app, ["eval", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"rollstream model eval: {tmp_path} is not a checkpoint directory (config.json and tokenizer_config.json)"]
    result = CliRunner().invoke(app, ["eval", "--model", str(tmp_path), "--families", "chess"])
    assert result.output.strip().splitlines() == [
        "rollstream model eval: unknown families ['chess']; known: calc, db, kg, os, webshop, alfworld, python"]
