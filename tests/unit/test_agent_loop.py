"""The token-in, token-out agent loop against a scripted engine and a small fake environment.

The tokenizer is the real default-policy tokenizer (built in memory, no model), so every check
of the token record is a check against the actual chat template.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from env_workers.agent_loop import Rollout, run_agent_loop, trajectory_id
from env_workers.chat_template import ChatEncoder, TemplatePrefixError
from env_workers.engine_client import EngineError, Generation, completion_request, parse_completion
from env_workers.envs.base import Status
from env_workers.settings import LIMIT_STATUSES, WIDE_PUNISHED_STATUSES, AgentLoopSettings
from env_workers.workload import FamilyWorkload, LogNormalCount, StepLatency, new_tokens_cap, step_delay_s, turn_budget
from pipeline.run.config import settings_json
from pipeline.policy.model_init import build_tokenizer
from schemas.arrays import unpack_ids, unpack_logprobs, unpack_mask
from schemas.codec import codec

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
NO_SLEEP = AgentLoopSettings(engine_retry_backoff_s=0.0)


@pytest.fixture(scope="module")
def encoder() -> ChatEncoder:
    return ChatEncoder(build_tokenizer())


def make_task(turn_pools: list[str] | None = None, member: int = 3) -> dict[str, Any]:
    request = {"run": "run-1", "group_id": "g-7", "member": member, "group_size": 8, "task": "calc",
               "split": "train", "sample_index": 11, "epoch": 0, "validation": False, "policy_version": 0,
               "dispatched_at_ms": 0}
    return {"request": request, "turn_pools": turn_pools or ["current"] * 20, "routing_seed": 1,
            "stale_ratio": 0.0, "routing_reason": "mixed", "stale_version": None, "routed_at_ms": 0}


@dataclass
class FakeSession:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]


@dataclass
class FakeEnv:
    """Answers each tool call with a tool message; finishes with `final_status` after `rounds` observations."""

    rounds: int = 2
    final_status: str = "completed"
    final_reward: float = 1.0
    crash_on: int | None = None
    crash_on_start: bool = False
    seen: list[dict[str, Any]] = field(default_factory=list)
    ended: int = 0

    async def start(self, sample: dict[str, Any]) -> FakeSession:
        if self.crash_on_start:
            raise RuntimeError("sandbox did not start")
        return FakeSession([{"role": "system", "content": "Add numbers."},
                            {"role": "user", "content": f"What is {sample['q']}?"}], TOOLS)

    async def observation(self, session: FakeSession, message: dict[str, Any]) -> Any:
        self.seen.append(message)
        if self.crash_on == len(self.seen):
            raise RuntimeError("sandbox died")
        calls = message.get("tool_calls") or []
        messages = [{"role": "tool", "tool_call_id": c["id"], "content": "3"} for c in calls]
        if not calls:
            messages = [{"role": "user", "content": "Please call a tool."}]
        done = len(self.seen) >= self.rounds
        return _Observation(messages, self.final_reward if done else 0.0, self.final_status if done else "running",
                            done, {"rounds": float(len(self.seen)), "score": 0.5})

    async def end(self, session: FakeSession) -> None:
        self.ended += 1


@dataclass
class _Observation:
    messages: list[dict[str, Any]]
    reward: float
    status: str
    finish: bool
    metrics: dict[str, float]


class ScriptedEngine:
    """Replies with scripted outputs: text (+ eos), raw ids, or an exception to raise."""

    def __init__(self, encoder: ChatEncoder, replies: list[Any], engine_id: str = "engine-c0", version: int = 5):
        self.encoder, self.replies, self.engine_id, self.version = encoder, list(replies), engine_id, version
        self.prompts: list[tuple[int, ...]] = []
        self.max_tokens: list[int] = []

    async def generate(self, prompt_ids, max_tokens: int, temperature: float) -> Generation:
        self.prompts.append(tuple(prompt_ids))
        self.max_tokens.append(max_tokens)
        reply = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        if isinstance(reply, Exception):
            raise reply
        if isinstance(reply, str):
            ids, finish = [*self.encoder.encode_text(reply), self.encoder.eos_token_id], "stop"
        else:
            ids, finish = list(reply), "length"
        ids = ids[:max_tokens]
        logprobs = [-0.25 - 0.001 * i for i in range(len(ids))]
        return Generation(ids, logprobs, finish, self.engine_id, self.version)


def run(encoder: ChatEncoder, env: FakeEnv, engine: ScriptedEngine, settings: AgentLoopSettings = NO_SLEEP,
        task: dict[str, Any] | None = None, pick=None, on_step=None) -> Rollout:
    ticks = itertools.count()
    return asyncio.run(run_agent_loop(
        task or make_task(), {"q": "1 + 2"}, env, encoder, pick or (lambda pool: (pool, engine)), settings,
        worker_id="worker-a", clock=lambda: 1_700_000_000 + next(ticks) * 0.01, on_step=on_step,
        sleep=lambda s: asyncio.sleep(0),
    ))


def arrays(rollout: Rollout) -> tuple[list[int], list[int], list[float]]:
    t = rollout.trajectory
    return (unpack_ids(t["input_ids"]).tolist(), unpack_mask(t["loss_mask"]).tolist(),
            unpack_logprobs(t["rollout_logprobs"]).tolist())


def generated_positions(rollout: Rollout) -> list[int]:
    return [i for turn in rollout.trajectory["turns"] for i in range(turn["start"], turn["start"] + turn["length"])]


def test_reencoding_the_final_history_reproduces_input_ids(encoder):
    engine = ScriptedEngine(encoder, [f"Let me add.\n{CALL}", CALL, "The answer is 3."])
    rollout = run(encoder, FakeEnv(rounds=3), engine)
    ids, _, _ = arrays(rollout)
    assert len(rollout.trajectory["turns"]) == 3
    assert encoder.encode(rollout.messages, rollout.tools, add_generation_prompt=False) == ids


def test_loss_mask_is_one_on_exactly_the_generated_tokens_with_their_logprobs(encoder):
    engine = ScriptedEngine(encoder, [CALL, CALL])
    rollout = run(encoder, FakeEnv(rounds=2), engine)
    ids, mask, logprobs = arrays(rollout)
    positions = generated_positions(rollout)
    assert [i for i, m in enumerate(mask) if m == 1] == positions
    assert all(logprobs[i] == 0.0 for i in range(len(ids)) if mask[i] == 0)
    for turn, step in zip(rollout.trajectory["turns"], rollout.steps):
        span = slice(turn["start"], turn["start"] + turn["length"])
        assert ids[span] == unpack_ids(step["output_ids"]).tolist()
        assert logprobs[span] == pytest.approx(unpack_logprobs(step["output_logprobs"]).tolist())


def test_each_engine_call_gets_the_whole_record_so_far(encoder):
    engine = ScriptedEngine(encoder, [CALL, CALL, CALL])
    rollout = run(encoder, FakeEnv(rounds=3), engine)
    ids, _, _ = arrays(rollout)
    assert engine.prompts[0] == tuple(ids[:rollout.trajectory["prompt_tokens"]])
    for prompt, turn in zip(engine.prompts, rollout.trajectory["turns"]):
        assert prompt == tuple(ids[:turn["start"]])


def test_prompt_is_the_chat_template_encoding_with_tools_and_generation_prompt(encoder):
    rollout = run(encoder, FakeEnv(rounds=1), ScriptedEngine(encoder, [CALL]))
    ids, _, _ = arrays(rollout)
    expected = encoder.encode(rollout.messages[:2], TOOLS, add_generation_prompt=True)
    assert ids[:len(expected)] == expected and rollout.trajectory["prompt_tokens"] == len(expected)
    assert encoder.decode(expected).endswith("<|im_start|>assistant\n")


def test_environment_receives_the_parsed_message_while_history_keeps_the_raw_text(encoder):
    env = FakeEnv(rounds=1)
    rollout = run(encoder, env, ScriptedEngine(encoder, [f"Adding.\n{CALL}"]))
    assert env.seen[0]["content"] == "Adding."
    assert json.loads(env.seen[0]["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert rollout.messages[2] == {"role": "assistant", "content": f"Adding.\n{CALL}"}


def test_completed_trajectory_keeps_the_environment_reward(encoder):
    rollout = run(encoder, FakeEnv(rounds=2, final_reward=1.0), ScriptedEngine(encoder, [CALL]))
    t = rollout.trajectory
    assert (t["status"], t["termination"], t["reward"], t["env_reward"]) == ("completed", "env_finished", 1.0, 1.0)
    assert t["score"] == 0.5 and t["metrics"]["rounds"] == 2.0


def test_incomplete_status_gets_the_incomplete_punishment(encoder):
    env = FakeEnv(rounds=2, final_status="task_limit_reached", final_reward=0.0)
    t = run(encoder, env, ScriptedEngine(encoder, [CALL])).trajectory
    assert (t["status"], t["reward"], t["env_reward"]) == ("task_limit_reached", -0.2, 0.0)


DEFAULT_PUNISHED = {Status.TASK_LIMIT_REACHED, Status.AGENT_CONTEXT_LIMIT}
WIDE = AgentLoopSettings(engine_retry_backoff_s=0.0, punished_statuses=WIDE_PUNISHED_STATUSES)
END = AgentLoopSettings(engine_retry_backoff_s=0.0, noncanonical_turns="end")
WIDE_END = AgentLoopSettings(engine_retry_backoff_s=0.0, punished_statuses=WIDE_PUNISHED_STATUSES,
                             noncanonical_turns="end")


@pytest.mark.parametrize("status", list(Status), ids=str)
def test_by_default_only_the_turn_and_length_limits_are_punished(encoder, status):
    # An environment reward no rule produces (not 0, not the punishment) shows which one applied.
    env = FakeEnv(rounds=1, final_status=status, final_reward=0.25)
    t = run(encoder, env, ScriptedEngine(encoder, [CALL])).trajectory
    assert t["status"] == status and t["env_reward"] == 0.25
    assert t["reward"] == (-0.2 if status in DEFAULT_PUNISHED else 0.25)


@pytest.mark.parametrize("status", list(Status), ids=str)
def test_the_wide_set_punishes_every_status_but_completed_and_task_error(encoder, status):
    t = run(encoder, FakeEnv(rounds=1, final_status=status, final_reward=0.25), ScriptedEngine(encoder, [CALL]),
            WIDE).trajectory
    assert t["status"] == status
    assert t["reward"] == (0.25 if status in (Status.COMPLETED, Status.TASK_ERROR) else -0.2)


def test_punished_statuses_default_to_the_limits_and_a_listing_in_any_order_is_the_same_setting():
    assert set(AgentLoopSettings().punished_statuses) == DEFAULT_PUNISHED == set(LIMIT_STATUSES)
    listed = AgentLoopSettings(punished_statuses=["task_limit_reached", "agent_context_limit", "task_limit_reached"])
    assert listed == AgentLoopSettings() and hash(listed) == hash(AgentLoopSettings())


@pytest.mark.parametrize("status", ["completed", "task_error"])
def test_success_and_infrastructure_failure_cannot_be_punished(status):
    with pytest.raises(ValueError, match=f"{status} cannot be punished"):
        AgentLoopSettings(punished_statuses=["task_limit_reached", status])


def test_punished_statuses_survive_a_child_process_settings_file():
    written = json.loads(settings_json(WIDE))
    assert written["punished_statuses"] == sorted(s.value for s in WIDE_PUNISHED_STATUSES)
    assert AgentLoopSettings(**written) == WIDE


def test_max_turns_ends_with_task_limit_reached_and_the_last_answer_unrecorded(encoder):
    settings = AgentLoopSettings(max_turns=3, engine_retry_backoff_s=0.0)
    rollout = run(encoder, FakeEnv(rounds=100), ScriptedEngine(encoder, [CALL]), settings)
    t = rollout.trajectory
    assert (t["status"], t["termination"], t["reward"], len(t["turns"])) == ("task_limit_reached", "max_turns", -0.2, 3)
    assert rollout.steps[-1]["env_tokens"] == 0
    assert encoder.encode(rollout.messages, TOOLS, False) == arrays(rollout)[0]


def test_a_benchmark_workload_draws_the_turn_budget_new_tokens_and_delays_of_the_tasks_family(encoder):
    shape = FamilyWorkload(family="calc", step_latency=StepLatency(median_s=0.5),
                           turns=LogNormalCount(median=4, sigma=0.5),
                           new_tokens=LogNormalCount(median=16, sigma=1.0))
    settings = AgentLoopSettings(max_turns=20, max_new_tokens=64, engine_retry_backoff_s=0.0, workload=[shape])
    tid = trajectory_id("run-1", "g-7", 3)
    budget = turn_budget(shape.turns, tid, 20)
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    engine = ScriptedEngine(encoder, [CALL])
    rollout = asyncio.run(run_agent_loop(make_task(), {"q": "1 + 2"}, FakeEnv(rounds=100), encoder,
                                         lambda pool: (pool, engine), settings, worker_id="worker-a",
                                         clock=lambda: 1_700_000_000.0, sleep=sleep))
    assert 1 < budget < 20
    assert (rollout.trajectory["status"], len(rollout.trajectory["turns"])) == ("task_limit_reached", budget)
    assert engine.max_tokens == [new_tokens_cap(shape.new_tokens, tid, turn, 64) for turn in range(budget)]
    assert slept == [step_delay_s(shape.step_latency, tid, turn) for turn in range(budget)]
    db = run(encoder, FakeEnv(rounds=100), ScriptedEngine(encoder, [CALL]), settings,
             task={**make_task(), "request": {**make_task()["request"], "task": "db"}})
    assert len(db.trajectory["turns"]) == 20  # no shape for db: the loop's own limits


def test_malformed_tool_call_becomes_an_error_message_the_policy_sees_and_is_counted(encoder):
    env = FakeEnv(rounds=1)
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'
    rollout = run(encoder, env, ScriptedEngine(encoder, [bad, CALL]))
    t = rollout.trajectory
    assert t["status"] == "completed" and t["metrics"]["parse_errors"] == 1.0
    assert len(env.seen) == 1  # the malformed turn never reached the environment
    assert rollout.messages[3]["role"] == "user" and "could not be parsed" in rollout.messages[3]["content"]
    assert rollout.steps[0]["parse_error"] and rollout.steps[0]["tool_calls"] == []
    assert encoder.encode(rollout.messages, TOOLS, False) == arrays(rollout)[0]


SAME_CALL_REORDERED = '<tool_call>\n{"arguments": {"b": 2, "a": 1}, "name": "add"}\n</tool_call>'
DANGEROUS_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2, "note": "rm -rf /"}}\n</tool_call>'


def test_repeated_and_dangerous_calls_are_counted_per_trajectory(encoder):
    env = FakeEnv(rounds=4)
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'
    rollout = run(encoder, env, ScriptedEngine(encoder, [CALL, SAME_CALL_REORDERED, bad, DANGEROUS_CALL, CALL]))
    m = rollout.trajectory["metrics"]
    # calls: add(1,2), the same with its keys reordered (a repeat), none (unparsable), the dangerous one, add(1,2) again
    assert (m["parsed_calls"], m["repeated_calls"], m["dangerous_calls"]) == (4.0, 2.0, 1.0)
    assert m["dangerous_calls:recursive_delete"] == 1.0
    assert m["parsed_calls"] == sum(len(step["tool_calls"]) for step in rollout.steps)


def test_a_dangerous_call_still_reaches_the_environment_unchanged(encoder):
    env = FakeEnv(rounds=1)
    rollout = run(encoder, env, ScriptedEngine(encoder, [DANGEROUS_CALL]))
    assert json.loads(env.seen[0]["tool_calls"][0]["function"]["arguments"])["note"] == "rm -rf /"
    assert rollout.trajectory["status"] == "completed" and rollout.trajectory["reward"] == 1.0


def test_behaviour_metrics_are_present_and_zero_in_a_rollout_without_repeats_or_danger(encoder):
    rollout = run(encoder, FakeEnv(rounds=2), ScriptedEngine(encoder, [CALL, "The answer is 3."]))
    m = rollout.trajectory["metrics"]
    assert (m["parsed_calls"], m["repeated_calls"], m["dangerous_calls"]) == (1.0, 0.0, 0.0)
    assert not [key for key in m if key.startswith("dangerous_calls:")]
    empty = run(encoder, FakeEnv(crash_on_start=True), ScriptedEngine(encoder, [CALL])).trajectory["metrics"]
    assert (empty["parsed_calls"], empty["repeated_calls"], empty["dangerous_calls"]) == (0.0, 0.0, 0.0)


def test_engine_error_is_retried_with_the_same_prompt_tokens_without_touching_the_record(encoder):
    clean = run(encoder, FakeEnv(rounds=2), ScriptedEngine(encoder, [CALL, CALL]))
    flaky_engine = ScriptedEngine(encoder, [CALL, EngineError("connection reset"), EngineError("timeout"), CALL])
    flaky = run(encoder, FakeEnv(rounds=2), flaky_engine)
    assert arrays(flaky) == arrays(clean)
    assert flaky_engine.prompts[1] == flaky_engine.prompts[2] == flaky_engine.prompts[3]
    assert flaky.trajectory["metrics"]["engine_retries"] == 2.0 and flaky.trajectory["status"] == "completed"


def test_engine_unreachable_after_retries_is_a_task_error_that_is_not_punished(encoder):
    settings = AgentLoopSettings(engine_retries=2, engine_retry_backoff_s=0.0)
    engine = ScriptedEngine(encoder, [CALL, EngineError("refused")])
    env = FakeEnv(rounds=5)
    rollout = run(encoder, env, engine, settings)
    t = rollout.trajectory
    assert (t["status"], t["termination"], t["reward"]) == ("task_error", "engine_error", 0.0)
    assert len(engine.prompts) == 1 + 3 and "refused" in rollout.error
    assert encoder.encode(rollout.messages, TOOLS, True) == arrays(rollout)[0]  # nothing half-appended
    assert env.ended == 1


def test_non_retryable_engine_error_is_not_retried(encoder):
    engine = ScriptedEngine(encoder, [EngineError("HTTP 400: prompt too long", retryable=False)])
    t = run(encoder, FakeEnv(), engine).trajectory
    assert t["status"] == "task_error" and len(engine.prompts) == 1


def test_environment_exception_is_a_task_error_and_the_session_is_ended(encoder):
    env = FakeEnv(rounds=5, crash_on=2)
    rollout = run(encoder, env, ScriptedEngine(encoder, [CALL]))
    t = rollout.trajectory
    assert (t["status"], t["termination"], t["reward"]) == ("task_error", "env_error", 0.0)
    assert rollout.steps[-1]["env_status"] == "task_error" and env.ended == 1


def test_environment_that_cannot_start_gives_an_empty_task_error_trajectory(encoder):
    t = run(encoder, FakeEnv(crash_on_start=True), ScriptedEngine(encoder, [CALL])).trajectory
    assert (t["status"], t["termination"], t["num_tokens"], t["turns"]) == ("task_error", "env_error", 0, [])


def test_context_limit_ends_with_agent_context_limit_within_max_total_len(encoder):
    prompt_len = len(encoder.encode(run(encoder, FakeEnv(rounds=1), ScriptedEngine(encoder, [CALL])).messages[:2],
                                    TOOLS, True))
    settings = AgentLoopSettings(max_total_len=prompt_len + 120, engine_retry_backoff_s=0.0)
    rollout = run(encoder, FakeEnv(rounds=100), ScriptedEngine(encoder, [CALL]), settings)
    t = rollout.trajectory
    assert (t["status"], t["termination"], t["reward"]) == ("agent_context_limit", "max_total_len", -0.2)
    assert t["num_tokens"] <= settings.max_total_len
    assert encoder.encode(rollout.messages, TOOLS, False) == arrays(rollout)[0]


def test_max_new_tokens_is_capped_by_the_remaining_length(encoder):
    engine = ScriptedEngine(encoder, [CALL])
    prompt_len = len(encoder.encode(run(encoder, FakeEnv(rounds=1), engine).messages[:2], TOOLS, True))
    engine = ScriptedEngine(encoder, [[ord("x")] * 5000])
    settings = AgentLoopSettings(max_total_len=prompt_len + 300, max_new_tokens=1024, engine_retry_backoff_s=0.0)
    rollout = run(encoder, FakeEnv(rounds=100), engine, settings)
    # 2 tokens stay free for the template's "<|im_end|>\n" after a length-truncated turn.
    assert engine.max_tokens[0] == 300 - len(encoder.assistant_close)
    assert rollout.trajectory["num_tokens"] == settings.max_total_len
    assert rollout.trajectory["status"] == "agent_context_limit"


def test_length_truncated_turn_is_closed_by_the_template_with_mask_zero(encoder):
    engine = ScriptedEngine(encoder, [[ord(c) for c in "abc"], CALL])
    rollout = run(encoder, FakeEnv(rounds=2), engine)
    ids, mask, _ = arrays(rollout)
    first = rollout.trajectory["turns"][0]
    end = first["start"] + first["length"]
    assert encoder.decode(ids[end:end + 2]) == "<|im_end|>\n" and mask[end:end + 2] == [0, 0]
    assert rollout.steps[0]["finish_reason"] == "length"
    assert encoder.encode(rollout.messages, TOOLS, False) == ids


@pytest.mark.parametrize("bad_ids", [[0xFF, 0xFE], [ord(c) for c in "<tool_call>"]],
                         ids=["invalid-utf8", "tag-spelled-in-bytes"])
def test_with_end_non_canonical_output_ends_as_agent_validation_failed_and_keeps_its_tokens(encoder, bad_ids):
    eos = encoder.eos_token_id
    engine = ScriptedEngine(encoder, [CALL, [*bad_ids, eos]])
    rollout = run(encoder, FakeEnv(rounds=5), engine, END)
    t = rollout.trajectory
    ids, mask, _ = arrays(rollout)
    last = t["turns"][-1]
    # Not a limit: by default it keeps the environment's reward (0 here), the wide set punishes it.
    assert (t["status"], t["termination"], t["reward"]) == ("agent_validation_failed", "invalid_output", 0.0)
    assert ids[last["start"]:] == [*bad_ids, eos] and mask[last["start"]:] == [1] * (len(bad_ids) + 1)
    # The invariant holds up to the start of the invalid turn.
    assert encoder.encode(rollout.messages[:-1], TOOLS, True) == ids[:last["start"]]
    assert run(encoder, FakeEnv(rounds=5), ScriptedEngine(encoder, [CALL, [*bad_ids, eos]]), WIDE_END).trajectory[
        "reward"] == -0.2


def test_with_end_a_valid_tool_call_sampled_in_non_canonical_tokens_is_ended_and_counted(encoder):
    spelled_out = [ord(c) for c in CALL]  # the call's text byte by byte: a valid call, not its canonical ids
    assert spelled_out != encoder.encode_text(CALL)
    rollout = run(encoder, FakeEnv(rounds=5), ScriptedEngine(encoder, [CALL, [*spelled_out, encoder.eos_token_id]]),
                  END)
    t = rollout.trajectory
    assert t["status"] == "agent_validation_failed" and t["metrics"]["noncanonical_valid_calls"] == 1.0
    assert rollout.steps[-1]["tool_calls"] == [] and rollout.steps[-1]["parse_error"] is None


def test_non_canonical_output_that_is_no_valid_call_is_not_counted(encoder):
    unknown_tool = [ord(c) for c in CALL.replace('"add"', '"mul"')]
    for output in ([0xFF, 0xFE], unknown_tool):
        rollout = run(encoder, FakeEnv(rounds=5), ScriptedEngine(encoder, [[*output, encoder.eos_token_id]]), END)
        t = rollout.trajectory
        assert t["status"] == "agent_validation_failed" and t["metrics"]["noncanonical_valid_calls"] == 0.0
        assert t["metrics"]["noncanonical_turns"] == 1.0


def test_by_default_a_valid_call_in_non_canonical_tokens_goes_on_with_its_sampled_ids_kept(encoder):
    eos = encoder.eos_token_id
    spelled_out = [ord(c) for c in CALL]  # a well-formed call whose ids are not the tokenizer's own
    env = FakeEnv(rounds=2)
    rollout = run(encoder, env, ScriptedEngine(encoder, [[*spelled_out, eos], CALL]))
    t = rollout.trajectory
    ids, mask, _ = arrays(rollout)
    assert (t["status"], t["reward"]) == ("completed", 1.0)
    assert t["metrics"]["noncanonical_turns"] == 1.0 and t["metrics"]["noncanonical_valid_calls"] == 1.0
    assert len(env.seen) == 2 and rollout.steps[0]["tool_calls"][0]["name"] == "add"  # the environment got the call
    first = t["turns"][0]
    span = slice(first["start"], first["start"] + first["length"])
    assert ids[span] == [*spelled_out, eos] and mask == [1 if i in generated_positions(rollout) else 0
                                                         for i in range(len(ids))]
    # Token in, token out: the record is encode(history) with the kept turn's canonical ids replaced by the sampled ones.
    canonical = encoder.encode_text(CALL) + [eos]
    assert encoder.encode(rollout.messages, TOOLS, False) == [*ids[:span.start], *canonical, *ids[span.stop:]]


@pytest.mark.parametrize("bad_ids", [[0xFF, 0xFE], [ord(c) for c in "<tool_call>"]],
                         ids=["invalid-utf8", "tag-spelled-in-bytes"])
def test_by_default_non_canonical_output_that_is_no_call_is_answered_and_goes_on(encoder, bad_ids):
    eos = encoder.eos_token_id
    env = FakeEnv(rounds=1)
    rollout = run(encoder, env, ScriptedEngine(encoder, [[*bad_ids, eos], CALL]))
    t = rollout.trajectory
    assert t["status"] == "completed" and t["metrics"]["noncanonical_turns"] == 1.0
    assert len(env.seen) == 1 or rollout.steps[0]["parse_error"] is not None  # the turn reached the environment


def test_a_turn_stopped_on_length_in_non_canonical_ids_is_closed_by_the_template(encoder):
    spelled_out = [ord(c) for c in "hello there"]  # no eos: the engine stopped on length
    rollout = run(encoder, FakeEnv(rounds=1), ScriptedEngine(encoder, [spelled_out, CALL]))
    ids, mask, _ = arrays(rollout)
    first = rollout.trajectory["turns"][0]
    end = first["start"] + first["length"]
    assert ids[first["start"]:end] == spelled_out
    assert encoder.decode(ids[end:end + 2]) == "<|im_end|>\n" and mask[end:end + 2] == [0, 0]
    assert rollout.trajectory["status"] == "completed"


def test_turn_provenance_records_planned_and_actual_pool_engine_and_version(encoder):
    current = ScriptedEngine(encoder, [CALL], engine_id="engine-c0", version=9)
    stale = ScriptedEngine(encoder, [CALL], engine_id="engine-s0", version=0)

    def pick(pool: str):  # the stale pool is down on the second turn: fall back to current
        if pool == "stale" and len(stale.prompts) < 1:
            return "stale", stale
        return "current", current

    rollout = run(encoder, FakeEnv(rounds=3), current, task=make_task(["stale", "stale", "current"]), pick=pick)
    turns, steps = rollout.trajectory["turns"], rollout.steps
    assert [(t["pool"], t["engine_id"], t["weight_version"]) for t in turns] == [
        ("stale", "engine-s0", 0), ("current", "engine-c0", 9), ("current", "engine-c0", 9)]
    assert [(s["planned_pool"], s["pool"]) for s in steps] == [("stale", "stale"), ("stale", "current"),
                                                                ("current", "current")]
    assert rollout.trajectory["metrics"]["pool_fallbacks"] == 1.0
    assert all(t["generate_ms"] > 0 and t["env_ms"] > 0 for t in turns)


def test_each_turn_entry_agrees_with_its_step_event(encoder):
    rollout = run(encoder, FakeEnv(rounds=3), ScriptedEngine(encoder, [CALL]), task=make_task(["stale", "current"]))
    for turn, step in zip(rollout.trajectory["turns"], rollout.steps, strict=True):
        assert (turn["turn"], turn["pool"], turn["engine_id"], turn["weight_version"], turn["start"]) == (
            step["turn"], step["pool"], step["engine_id"], step["weight_version"], step["prompt_tokens"])
        assert (turn["length"], turn["generate_ms"], turn["env_ms"]) == (
            len(unpack_ids(step["output_ids"])), step["generate_ms"], step["env_ms"])
        assert type(step["env_status"]) is str


def test_steps_are_reported_as_each_turn_finishes(encoder):
    seen: list[int] = []
    rollout = run(encoder, FakeEnv(rounds=3), ScriptedEngine(encoder, [CALL]), on_step=lambda s: seen.append(s["turn"]))
    assert seen == [0, 1, 2] and [s["turn"] for s in rollout.steps] == seen
    assert rollout.steps[-1]["finish"] and rollout.steps[-1]["env_status"] == "completed"
    assert [s["env_tokens"] > 0 for s in rollout.steps] == [True, True, False]


def test_trajectory_and_step_events_validate_against_the_avro_schemas(encoder):
    rollout = run(encoder, FakeEnv(rounds=2), ScriptedEngine(encoder, [CALL]))
    events = codec()
    decoded = events.decode(events.encode("trajectory", rollout.trajectory), "trajectory")
    assert decoded["trajectory_id"] == trajectory_id("run-1", "g-7", 3)
    assert decoded["template_fingerprint"] == encoder.fingerprint
    for step in rollout.steps:
        assert events.decode(events.encode("step", step), "step")["trajectory_id"] == decoded["trajectory_id"]


def test_trajectory_id_is_deterministic_per_member(encoder):
    first = run(encoder, FakeEnv(rounds=1), ScriptedEngine(encoder, [CALL])).trajectory["trajectory_id"]
    again = run(encoder, FakeEnv(rounds=1), ScriptedEngine(encoder, ["done"])).trajectory["trajectory_id"]
    other = run(encoder, FakeEnv(rounds=1), ScriptedEngine(encoder, [CALL]), task=make_task(member=4))
    assert first == again == trajectory_id("run-1", "g-7", 3) != other.trajectory["trajectory_id"]


class _ForgetfulTokenizer:
    """A template that drops earlier assistant turns (as Qwen3's drops old reasoning): no prefix property."""

    def __init__(self) -> None:
        self._inner = build_tokenizer()
        self.chat_template, self.eos_token_id = self._inner.chat_template, self._inner.eos_token_id

    def apply_chat_template(self, conversation, **kwargs):
        last = max((i for i, m in enumerate(conversation) if m["role"] == "assistant"), default=-1)
        kept = [m for i, m in enumerate(conversation) if m["role"] != "assistant" or i == last]
        return self._inner.apply_chat_template(kept, **kwargs)

    def encode(self, text, **kwargs):
        return self._inner.encode(text, **kwargs)

    def decode(self, ids, **kwargs):
        return self._inner.decode(ids, **kwargs)

    def get_added_vocab(self):
        return self._inner.get_added_vocab()


def test_template_that_breaks_the_prefix_property_raises_and_still_ends_the_session():
    encoder = ChatEncoder(_ForgetfulTokenizer())
    env = FakeEnv(rounds=5)
    with pytest.raises(TemplatePrefixError, match="prefix property"):
        run(encoder, env, ScriptedEngine(encoder, [CALL]))
    assert env.ended == 1


def test_sampled_text_that_merges_with_the_template_before_it_is_no_crash():
    # Merges learned from text full of blank lines: "\n\n\n" is one token, so a turn that starts
    # with two newlines re-encodes the template's "assistant\n" before it differently.
    merged = ChatEncoder(build_tokenizer(["a\n\n\nb", "c\n\n\n\nd", "<|im_start|>assistant\n\n\nx"] * 50, 300))
    env = FakeEnv(rounds=5)
    rollout = run(merged, env, ScriptedEngine(merged, ["\n\nhello"]), END)
    assert rollout.trajectory["status"] == "agent_validation_failed"
    assert env.ended == 1
    kept = run(merged, FakeEnv(rounds=1), ScriptedEngine(merged, ["\n\nhello", CALL]))  # by default it goes on
    assert kept.trajectory["status"] == "completed" and kept.trajectory["metrics"]["noncanonical_turns"] == 1.0


def test_record_arrays_have_one_entry_per_token(encoder):
    t = run(encoder, FakeEnv(rounds=3), ScriptedEngine(encoder, [CALL])).trajectory
    sizes = {len(unpack_ids(t["input_ids"])), len(unpack_mask(t["loss_mask"])), len(unpack_logprobs(t["rollout_logprobs"]))}
    assert sizes == {t["num_tokens"]}
    assert np.all(unpack_logprobs(t["rollout_logprobs"]) <= 0.0)


# --- the engine client's request and response handling (pure parts) ---------------------------

def test_completion_request_asks_vllm_for_token_ids_and_sampled_logprobs():
    body = completion_request("m", [1, 2, 3], 64, 0.8, [258])
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 64 and body["temperature"] == 0.8
    assert (body["logprobs"], body["return_token_ids"], body["return_tokens_as_token_ids"]) == (0, True, True)
    assert body["stop_token_ids"] == [258] and (body["top_p"], body["top_k"]) == (1.0, 0)
    assert "allowed_token_ids" not in body


def test_completion_response_gives_ids_logprobs_and_finish_reason():
    body = {"choices": [{"token_ids": [5, 258], "finish_reason": "stop",
                         "logprobs": {"token_logprobs": [-0.5, -1.0], "tokens": ["token_id:5", "token_id:258"]}}]}
    assert parse_completion(body, "e") == ([5, 258], [-0.5, -1.0], "stop")


def test_completion_response_without_token_ids_falls_back_to_token_id_names():
    body = {"choices": [{"finish_reason": "length",
                         "logprobs": {"token_logprobs": [-0.5], "tokens": ["token_id:42"]}}]}
    assert parse_completion(body, "e") == ([42], [-0.5], "length")


@pytest.mark.parametrize("body", [
    {"choices": []},
    {"choices": [{"token_ids": [1], "finish_reason": "stop"}]},
    {"choices": [{"token_ids": [1, 2], "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.1]}}]},
    {"choices": [{"token_ids": [], "finish_reason": "stop", "logprobs": {"token_logprobs": []}}]},
], ids=["no-choice", "no-logprobs", "length-mismatch", "empty"])
def test_malformed_completion_response_is_a_retryable_engine_error(body):
    with pytest.raises(EngineError) as raised:
        parse_completion(body, "engine-x")
    assert raised.value.retryable and raised.value.engine_id == "engine-x"
