"""The default policy served by a real vLLM CPU engine: token ids in, token ids and log-probs out,
the agent loop's token-in-token-out invariant, and train/inference log-prob agreement.

One engine per test session (about 45 s to start on 2 cores): `rollstream engine`, started as
`rollstream up` starts its engines (tests/helpers/vllm.py). It runs with `--logprobs-mode
processed_logprobs` so the log-probs it returns are those of the temperature-scaled distribution
it samples from (the behaviour policy), as the learner's PPO ratio needs.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from helpers.vllm import serving_engine
from pydantic import SecretStr
from transformers import AutoModelForCausalLM, AutoTokenizer

from env_workers.agent_loop import Rollout, run_agent_loop
from env_workers.chat_template import ChatEncoder
from env_workers.engine_client import EngineClient, auth_headers, completion_request
from env_workers.settings import AgentLoopSettings
from pipeline.policy.model_init import PolicyModelSettings, init_model
from schemas.arrays import unpack_ids, unpack_logprobs, unpack_mask

pytestmark = pytest.mark.integration

TEMPERATURE = 0.8
# Measured on this machine (2 CPU cores, float32, vLLM 0.32 CPU, eager): the largest gap between
# the engine's and torch's log-prob of a sampled token was 9.5e-7 (mean 2.5e-7) over 244 tokens.
# The bound leaves an order of magnitude for other CPUs' kernels while still catching any real
# mismatch (a wrong temperature or raw log-probs are off by > 0.1). The engine serves float32 (`--dtype`): in
# bfloat16 the gaps are about 1e-2 (docs/BENCHMARKS.md, "bench precision").
LOGPROB_TOLERANCE = 1e-4
TOOLS = [{"type": "function", "function": {"name": "echo", "description": "Echo text.", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
# The engine requires a key (agent_loop.engine_api_key, from the environment as a run sets it); every request sends it.
ENGINE_KEY = SecretStr("test-engine-key")


@dataclass
class Engine:
    url: str
    model_dir: Path
    start_s: float


@pytest.fixture(scope="session")
def engine(tmp_path_factory) -> Iterator[Engine]:
    """The default policy's shape with a bytes-only tokenizer, initialized in a temporary directory and
    served by one `rollstream engine`. Bytes only: the tests below restrict sampling to byte ids
    (printable ASCII), which with learned merges could be sampled in a split no re-encoding gives back."""
    model_dir = tmp_path_factory.mktemp("policy")
    init_model(PolicyModelSettings(vocab_size=256), model_dir)
    with serving_engine(model_dir, tmp_path_factory.mktemp("engines"), args=("--max-model-len", "2048", "--dtype", "float32"),
                        env={**os.environ, "ROLLSTREAM_AGENT_LOOP__ENGINE_API_KEY": ENGINE_KEY.get_secret_value()},
                        ) as (served, start_s):
        yield Engine(served.url, model_dir, start_s)


@pytest.fixture(scope="session")
def encoder(engine) -> ChatEncoder:
    return ChatEncoder(AutoTokenizer.from_pretrained(engine.model_dir))


def _client(engine: Engine, encoder: ChatEncoder, **kwargs: Any) -> EngineClient:
    return EngineClient(engine_id="engine-0", base_url=engine.url, model=str(engine.model_dir),
                        stop_token_ids=[encoder.eos_token_id], weight_version=0, api_key=ENGINE_KEY, **kwargs)


@dataclass
class _Observation:
    messages: list[dict[str, Any]]
    reward: float
    status: str
    finish: bool
    metrics: dict[str, float]


@dataclass
class _Session:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    rounds: int = 0


class EchoEnv:
    """Answers any message with a tool result (or a nudge) and completes after three rounds."""

    async def start(self, sample: dict[str, Any]) -> _Session:
        return _Session([{"role": "system", "content": "Echo things."},
                         {"role": "user", "content": f"Echo {sample['word']}."}], TOOLS)

    async def observation(self, session: _Session, message: dict[str, Any]) -> _Observation:
        session.rounds += 1
        calls = message.get("tool_calls") or []
        messages = ([{"role": "tool", "tool_call_id": c["id"], "content": "echoed é ✓"} for c in calls]
                    or [{"role": "user", "content": "Call the echo tool."}])
        done = session.rounds >= 3
        return _Observation(messages, 1.0 if done else 0.0, "completed" if done else "running", done,
                            {"rounds": float(session.rounds)})

    async def end(self, session: _Session) -> None:
        return None


def _rollouts(engine: Engine, encoder: ChatEncoder, count: int, **client_kwargs: Any) -> list[Rollout]:
    settings = AgentLoopSettings(max_turns=6, max_total_len=2048, max_new_tokens=48, temperature=TEMPERATURE,
                                 engine_retry_backoff_s=0.0)

    async def main() -> list[Rollout]:
        client = _client(engine, encoder, **client_kwargs)
        try:
            return await asyncio.gather(*[
                run_agent_loop(
                    {"request": {"run": "it", "group_id": "g", "member": m, "group_size": count, "task": "echo",
                                 "split": "train", "sample_index": 0}, "turn_pools": ["current"] * 6},
                    {"word": f"w{m}"}, EchoEnv(), encoder, lambda pool: ("current", client), settings,
                    worker_id="it", clock=time.time,
                )
                for m in range(count)
            ])
        finally:
            await client.aclose()

    return asyncio.run(main())


def _check_token_record(encoder: ChatEncoder, rollout: Rollout) -> None:
    """Re-encoding the final history gives input_ids (outside the turns, where a turn's sampled ids were
    kept although not canonical); loss_mask is 1 on exactly the generated tokens."""
    t = rollout.trajectory
    ids = unpack_ids(t["input_ids"]).tolist()
    mask = unpack_mask(t["loss_mask"]).tolist()
    generated = [i for turn in t["turns"] for i in range(turn["start"], turn["start"] + turn["length"])]
    assert [i for i, m in enumerate(mask) if m] == generated
    if t["status"] == "agent_validation_failed":  # non-canonical last turn: invariant up to its start
        last = t["turns"][-1]["start"]
        assert encoder.encode(rollout.messages[:-1], rollout.tools, True) == ids[:last]
        return
    ends_on_assistant = rollout.messages[-1]["role"] == "assistant"
    expected = encoder.encode(rollout.messages, rollout.tools, not ends_on_assistant)
    if not t["metrics"]["noncanonical_turns"]:
        assert expected == ids
        return
    # Turns kept as sampled (noncanonical_turns: keep) are not the canonical ids of their text, and text
    # with invalid UTF-8 does not decode alike in and out of context: every other token must be the
    # canonical encoding's, so each run of loss_mask 0 (prompt, closes, environment answers) is found in
    # `expected`, in order, the prompt at its start. A run's last token is left out where a turn follows:
    # the template's "assistant\n" may merge with a turn's leading newlines in the canonical encoding.
    found = 0
    for start, stop in _mask_zero_runs(mask):
        run = ids[start:stop - 1] if stop < len(ids) else ids[start:stop]
        at = next((i for i in range(found, len(expected) - len(run) + 1) if expected[i:i + len(run)] == run), None)
        assert at is not None and (start > 0 or at == 0), f"tokens {start}..{stop} are not the template's"
        found = at + len(run)


def _mask_zero_runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, stop) of every maximal run of 0s in `mask`."""
    runs, start = [], None
    for i, m in enumerate([*mask, 1]):
        if m == 0 and start is None:
            start = i
        elif m == 1 and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_completion_with_token_ids_in_returns_token_ids_and_logprobs(engine, encoder):
    prompt = encoder.encode([{"role": "user", "content": "hi"}], None, True)

    async def main():
        client = _client(engine, encoder)
        try:
            return await client.generate(prompt, 16, TEMPERATURE)
        finally:
            await client.aclose()

    generation = asyncio.run(main())
    assert 1 <= len(generation.token_ids) == len(generation.logprobs) <= 16
    assert all(0 <= i < len(encoder.tokenizer) for i in generation.token_ids)
    assert all(math.isfinite(lp) and lp <= 0.0 for lp in generation.logprobs)
    assert (generation.engine_id, generation.weight_version) == ("engine-0", 0)


def test_engine_refuses_requests_without_its_key_and_serves_them_with_it(engine):
    assert httpx.get(f"{engine.url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{engine.url}/v1/models", headers=auth_headers(SecretStr("wrong")), timeout=30).status_code == 401
    assert httpx.get(f"{engine.url}/v1/models", headers=auth_headers(ENGINE_KEY), timeout=30).status_code == 200
    # The routes that change the weights want it too; the state route stays open to probes.
    assert httpx.post(f"{engine.url}/rollstream/load", json={"version": 1, "path": "/nowhere"},
                      timeout=30).status_code == 401
    assert httpx.get(f"{engine.url}/rollstream/state", timeout=30).json()["version"] == 0


def test_stop_token_is_returned_with_its_logprob(engine, encoder):
    eos = encoder.eos_token_id
    body = completion_request(str(engine.model_dir), [257, 104, 105], 8, TEMPERATURE, [eos], allowed_token_ids=[eos])
    choice = httpx.post(f"{engine.url}/v1/completions", json=body, headers=auth_headers(ENGINE_KEY),
                        timeout=60).json()["choices"][0]
    assert (choice["token_ids"], choice["finish_reason"]) == ([eos], "stop")
    assert choice["logprobs"]["token_logprobs"] == [0.0]  # the only allowed token: probability 1


def test_agent_loop_keeps_the_token_record_exact_over_multi_turn_rollouts(engine, encoder):
    # Printable ASCII, newline, the tool-call tags and eos: random output that is always valid
    # text, so the rollouts run several turns (parse errors and tool results included).
    allowed = [10, *range(32, 127), encoder.eos_token_id,
               *encoder.tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])]
    rollouts = _rollouts(engine, encoder, 4, allowed_token_ids=allowed)
    for rollout in rollouts:
        _check_token_record(encoder, rollout)
    assert sum(len(r.trajectory["turns"]) for r in rollouts) >= 8
    assert {r.trajectory["status"] for r in rollouts} <= {"completed", "task_limit_reached", "agent_context_limit"}


def test_engine_logprobs_match_a_torch_forward_pass_of_the_same_weights(engine, encoder):
    rollouts = _rollouts(engine, encoder, 6)  # unconstrained sampling: the policy's own distribution
    for rollout in rollouts:
        _check_token_record(encoder, rollout)
    model = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
    gaps: list[float] = []
    for rollout in rollouts:
        t = rollout.trajectory
        ids = torch.tensor(unpack_ids(t["input_ids"]), dtype=torch.long)[None]   # (1, T)
        mask = torch.tensor(unpack_mask(t["loss_mask"]), dtype=torch.bool)        # (T,)
        rollout_logprobs = torch.tensor(unpack_logprobs(t["rollout_logprobs"]))   # (T,)
        with torch.no_grad():
            logits = model(ids).logits[0, :-1] / TEMPERATURE                      # (T-1, V): predicts ids[1:]
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]  # (T-1,)
        gaps.extend((logprobs[mask[1:]] - rollout_logprobs[1:][mask[1:]]).abs().tolist())
    print(f"\ntrain/inference log-prob gap over {len(gaps)} tokens: max {max(gaps):.2e}, "
          f"mean {sum(gaps) / len(gaps):.2e}; engine start {engine.start_s:.1f} s", file=sys.stderr)
    assert len(gaps) >= 6
    assert max(gaps) < LOGPROB_TOLERANCE
