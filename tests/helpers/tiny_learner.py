"""A tiny Qwen2 actor and multi-turn training batches for it, for tests of the learner's loss options."""

from __future__ import annotations

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.loss import next_token_logits, token_logprobs

TEMPERATURE = 0.8  # LearnerSettings' default, which the step divides the logits by
VOCAB = 300


def tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    """The same tiny Qwen2 the learner-step tests train (2 layers, width 64)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=VOCAB, max_position_embeddings=128,
    )
    return Qwen2ForCausalLM(config)


def shifted_logprobs(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    """(T-1,) float64: position t is the model's log p(ids[t+1] | ids[:t+1]) at TEMPERATURE, without a graph."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        input_ids = torch.from_numpy(ids[None].astype(np.int64))  # (1, T)
        logits = next_token_logits(model, input_ids, torch.ones_like(input_ids), TEMPERATURE)  # (1, T-1, V)
        out = token_logprobs(logits, input_ids)[0].double().numpy()  # (T-1,)
    model.train(was_training)
    return out


def multi_turn_batch(model: torch.nn.Module, advantages: list[float], *, seed: int = 1,
                     drift: float = 0.4) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, float]]:
    """Batch items (input_ids, loss_mask, rollout_logprobs, advantage), each a prompt then 2 or 3 assistant
    turns separated by environment tokens (loss_mask 0). The rollout log-probs are the model's own plus
    Gaussian noise of scale `drift` on action tokens: an engine slightly off the learner's weights, so the
    ratios and the corrections' weights differ from 1 (a few leave [0.5, 2])."""
    rng = np.random.default_rng(seed)
    items = []
    for advantage in advantages:
        mask: list[int] = [0] * int(rng.integers(3, 6))  # the prompt
        for turn in range(int(rng.integers(2, 4))):
            if turn:
                mask += [0] * int(rng.integers(1, 4))  # the environment's answer
            mask += [1] * int(rng.integers(2, 6))
        loss_mask = np.array(mask, dtype=np.uint8)
        ids = rng.integers(0, VOCAB, size=len(mask)).astype(np.int32)
        rollout = np.zeros(len(mask), dtype=np.float32)
        rollout[1:] = shifted_logprobs(model, ids) + drift * rng.standard_normal(len(mask) - 1)
        items.append((ids, loss_mask, (rollout * loss_mask).astype(np.float32), advantage))
    return items
