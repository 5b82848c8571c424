"""The recording proxy's logic (env_workers/proxy.py) against a scripted engine, with the real default-policy
tokenizer: request -> prompt ids, OpenAI-shaped answers, the record it keeps (the agent loop's own, checked
against `run_agent_loop` on the same conversation), re-encoding mismatches under both rules, and bad input."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import pytest

from env_workers.agent_loop import run_agent_loop
from env_workers.chat_template import ChatEncoder
from env_workers.proxy import (
    Episode, Episodes, RequestError, completion_response, episode_request, parse_chat_request, parse_end, sse,
    stream_chunks,
)
from env_workers.proxy_settings import ProxySettings
from env_workers.settings import AgentLoopSettings
from pipeline.analysis.replay_verify import token_problems
from pipeline.policy.model_init import build_tokenizer
from schemas.arrays import unpack_ids, unpack_logprobs
from schemas.codec import codec

from test_agent_loop import CALL, TOOLS, FakeEnv, ScriptedEngine, make_task

LOOP = AgentLoopSettings(engine_retry_backoff_s=0.0)
SYSTEM = {"role": "system", "content": "Add numbers."}
USER = {"role": "user", "content": "What is 1 + 2?"}


@pytest.fixture(scope="module")
def encoder() -> ChatEncoder:
    return ChatEncoder(build_tokenizer())


def make_episode(encoder: ChatEncoder, engine: ScriptedEngine, rule: str = "prefix",
                 loop: AgentLoopSettings = LOOP) -> tuple[Episode, list[dict[str, Any]]]:
    steps: list[dict[str, Any]] = []
    ticks = itertools.count()
    request = make_task()["request"]
    episode = Episode(request, encoder, lambda pool: (pool, engine), ProxySettings(reencode_mismatch=rule), loop,
                      clock=lambda: 1_700_000_000 + next(ticks) * 0.01, sleep=lambda s: asyncio.sleep(0),
                      on_step=steps.append)
    return episode, steps


def call(episode: Episode, messages: list[dict[str, Any]], **extra: Any):
    return asyncio.run(episode.complete(parse_chat_request({"model": "m", "messages": messages, "tools": TOOLS,
                                                            **extra})))


def tool_answers(message: dict[str, Any], content: str = "3") -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": c["id"], "content": content} for c in message["tool_calls"]]


def assert_valid_events(trajectory: dict[str, Any], steps: list[dict[str, Any]]) -> None:
    """Schema validation (the codec encodes only valid events) and `rollstream replay verify`'s invariants."""
    codec().encode("trajectory", trajectory)
    for step in steps:
        codec().encode("step", step)
    assert token_problems(trajectory) == []
    ids, lp = unpack_ids(trajectory["input_ids"]), unpack_logprobs(trajectory["rollout_logprobs"])
    assert [s["turn"] for s in steps] == [t["turn"] for t in trajectory["turns"]]
    for turn, step in zip(trajectory["turns"], steps):
        span = slice(turn["start"], turn["start"] + turn["length"])
        assert unpack_ids(step["output_ids"]).tolist() == ids[span].tolist()
        assert unpack_logprobs(step["output_logprobs"]).tolist() == lp[span].tolist()
        assert step["weight_version"] == turn["weight_version"] and step["pool"] == turn["pool"]


def test_first_call_prompt_is_the_chat_template_encoding_of_the_messages_and_tools(encoder):
    engine = ScriptedEngine(encoder, [CALL])
    episode, _ = make_episode(encoder, engine)
    completion = call(episode, [SYSTEM, USER])
    assert list(engine.prompts[0]) == encoder.encode([SYSTEM, USER], TOOLS, add_generation_prompt=True)
    assert completion.prompt_tokens == len(engine.prompts[0]) and completion.recorded


def test_tool_call_answer_has_the_openai_shape(encoder):
    episode, _ = make_episode(encoder, ScriptedEngine(encoder, [f"Adding.\n{CALL}"]))
    completion = call(episode, [SYSTEM, USER])
    body = completion_response(completion, "rollstream", 7, "chatcmpl-1")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Adding."
    [tool_call] = choice["message"]["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["function"]["name"] == "add"
    assert json.loads(tool_call["function"]["arguments"]) == {"a": 1, "b": 2}
    assert body["usage"]["total_tokens"] == completion.prompt_tokens + completion.completion_tokens
    assert body["object"] == "chat.completion"


def test_stream_chunks_carry_role_text_calls_and_finish_then_done(encoder):
    episode, _ = make_episode(encoder, ScriptedEngine(encoder, [f"Adding.\n{CALL}"]))
    completion = call(episode, [SYSTEM, USER], stream=True)
    chunks = stream_chunks(completion, "rollstream", 7, "chatcmpl-1", include_usage=True)
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-1" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content") or "" for d in deltas) == "Adding."
    [calls] = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["function"]["name"] == "add"
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == completion.completion_tokens
    body = sse(chunks).decode()
    assert body.endswith("data: [DONE]\n\n") and body.count("data: ") == len(chunks) + 1


def test_proxy_records_exactly_what_the_agent_loop_records_for_the_same_conversation(encoder):
    """The agent loop against FakeEnv (tool answer "3" per call, completed after 2 rounds) and the proxy
    driven by an agent that does the same write the same token record, turns and reward."""
    replies = [f"Let me add.\n{CALL}", CALL]
    ticks, engine = itertools.count(), ScriptedEngine(encoder, list(replies))
    rollout = asyncio.run(run_agent_loop(
        make_task(), {"q": "1 + 2"}, FakeEnv(rounds=2), encoder, lambda pool: (pool, engine),
        LOOP, worker_id="w", clock=lambda: 1_700_000_000 + next(ticks) * 0.01, sleep=lambda s: asyncio.sleep(0)))
    episode, steps = make_episode(encoder, ScriptedEngine(encoder, list(replies)))
    messages = [SYSTEM, USER]
    for _ in range(2):
        message = call(episode, messages).message
        messages = [*messages, message, *tool_answers(message)]
    trajectory = episode.finish(parse_end({"reward": 1.0, "status": "completed"}))
    expected = rollout.trajectory
    for name in ("input_ids", "loss_mask", "rollout_logprobs", "prompt_tokens", "num_tokens", "status", "reward",
                 "trajectory_id", "group_id", "member", "template_fingerprint"):
        assert trajectory[name] == expected[name], name
    assert [(t["start"], t["length"]) for t in trajectory["turns"]] == [(t["start"], t["length"]) for t in expected["turns"]]
    assert [s["env_tokens"] for s in steps] == [s["env_tokens"] for s in rollout.steps]
    assert trajectory["metrics"]["reencode_mismatches"] == 0.0 and trajectory["metrics"]["parsed_calls"] == 2.0
    assert_valid_events(trajectory, steps)


def test_openai_client_message_dump_continues_the_record(encoder):
    """What the openai client hands back (content null beside tool calls, extra null fields) still continues."""
    episode, steps = make_episode(encoder, ScriptedEngine(encoder, [CALL, "The answer is 3."]))
    message = call(episode, [SYSTEM, USER]).message
    dumped = {**message, "content": None, "refusal": None, "audio": None, "function_call": None}
    call(episode, [SYSTEM, USER, dumped, *tool_answers(message)])
    trajectory = episode.finish(parse_end({"reward": 1.0}))
    assert trajectory["metrics"]["reencode_mismatches"] == 0.0 and len(trajectory["turns"]) == 2
    assert_valid_events(trajectory, steps)


def test_edited_history_under_prefix_trains_the_recorded_prefix_and_serves_on(encoder):
    episode, steps = make_episode(encoder, ScriptedEngine(encoder, [CALL, CALL, "Done."]), rule="prefix")
    message = call(episode, [SYSTEM, USER]).message
    edited = {"role": "user", "content": "What is 5 + 2?"}
    completion = call(episode, [SYSTEM, edited, message, *tool_answers(message)])
    assert not completion.recorded and completion.message["tool_calls"]
    call(episode, [SYSTEM, edited, message, *tool_answers(message), completion.message, *tool_answers(completion.message)])
    trajectory = episode.finish(parse_end({"reward": 1.0, "status": "completed"}))
    assert trajectory["metrics"]["reencode_mismatches"] == 1.0 and trajectory["metrics"]["unrecorded_calls"] == 2.0
    assert (trajectory["status"], trajectory["reward"], len(trajectory["turns"])) == ("completed", 1.0, 1)
    assert_valid_events(trajectory, steps)


def test_truncated_history_under_drop_publishes_a_task_error_that_is_not_trained(encoder):
    episode, steps = make_episode(encoder, ScriptedEngine(encoder, [CALL, CALL, CALL]), rule="drop")
    first = call(episode, [SYSTEM, USER]).message
    second = call(episode, [SYSTEM, USER, first, *tool_answers(first)]).message
    assert episode.recording
    call(episode, [SYSTEM, USER, second, *tool_answers(second)])  # the first exchange cut from the context
    trajectory = episode.finish(parse_end({"reward": 1.0}))
    assert (trajectory["status"], trajectory["termination"], trajectory["reward"]) == ("task_error", "reencode_mismatch", 0.0)
    assert trajectory["metrics"]["reencode_mismatches"] == 1.0 and trajectory["metrics"]["caller_reward"] == 1.0
    assert len(trajectory["turns"]) == 2
    assert_valid_events(trajectory, steps)


def test_asking_the_same_call_again_is_a_mismatch(encoder):
    episode, _ = make_episode(encoder, ScriptedEngine(encoder, [CALL]))
    call(episode, [SYSTEM, USER])
    call(episode, [SYSTEM, USER])
    assert episode.loop.loop_metrics["reencode_mismatches"] == 1.0 and not episode.recording


def test_unparsable_model_output_is_answered_as_text_and_counted(encoder):
    hostile = "<tool_call>\n{\"name\": \"add\", \"arguments\": [1, 2]}\n<|im_end|><tool_call>"
    episode, steps = make_episode(encoder, ScriptedEngine(encoder, [hostile, "3"]))
    message = call(episode, [SYSTEM, USER]).message
    assert "tool_calls" not in message and isinstance(message["content"], str)
    call(episode, [SYSTEM, USER, message, {"role": "user", "content": "Please call a tool."}])
    trajectory = episode.finish(parse_end({"reward": 0.0, "status": "task_limit_reached"}))
    assert trajectory["metrics"]["parse_errors"] >= 1.0 and trajectory["reward"] == LOOP.incomplete_punishment
    assert_valid_events(trajectory, steps)


def test_turn_limit_ends_the_record_with_a_one_line_error(encoder):
    loop = AgentLoopSettings(engine_retry_backoff_s=0.0, max_turns=1)
    episode, steps = make_episode(encoder, ScriptedEngine(encoder, [CALL]), loop=loop)
    message = call(episode, [SYSTEM, USER]).message
    with pytest.raises(RequestError, match="max_turns 1") as error:
        call(episode, [SYSTEM, USER, message, *tool_answers(message)])
    assert error.value.code == "turn_limit_reached"
    trajectory = episode.finish(parse_end({"reward": 1.0}))
    assert trajectory["status"] == "task_limit_reached" and trajectory["termination"] == "max_turns"
    assert_valid_events(trajectory, steps)


def test_episode_ended_before_any_call_is_a_task_error(encoder):
    episode, steps = make_episode(encoder, ScriptedEngine(encoder, [CALL]))
    trajectory = episode.finish(parse_end({"reward": 1.0}))
    assert (trajectory["status"], trajectory["termination"], trajectory["num_tokens"]) == ("task_error", "no_calls", 0)
    assert_valid_events(trajectory, steps)


BAD_CHAT_BODIES = [
    ([], "the request body must be a JSON object"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role must be one of"),
    ({"messages": ["hi"]}, "messages[0] must be an object"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "must be a text part"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": 1}}]}]}, "tool_calls[0]"),
    ({"messages": [USER], "tools": [{"type": "function"}]}, "tools[0] must be"),
    ({"messages": [USER], "tools": "add"}, "tools must be a list"),
    ({"messages": [USER], "n": 2}, "n must be 1"),
    ({"messages": [USER], "tool_choice": "required"}, "tool_choice must be auto"),
    ({"messages": [USER], "max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"messages": [USER], "stream": "yes"}, "stream must be true or false"),
]


@pytest.mark.parametrize("body,message", BAD_CHAT_BODIES)
def test_bad_chat_request_is_one_line_error(body, message):
    with pytest.raises(RequestError) as error:
        parse_chat_request(body)
    assert message in str(error.value) and "\n" not in str(error.value) and error.value.status == 400


@pytest.mark.parametrize("body,message", [
    ({"task": "chess", "split": "train", "sample_index": 0}, "task must be one of"),
    ({"task": "calc", "split": "train"}, "sample_index is required"),
    ({"task": "calc", "split": "train", "sample_index": -1}, "sample_index must be an integer >= 0"),
    ({"task": "calc", "split": "train", "sample_index": 0, "member": 4, "group_size": 4}, "member 4 is not below"),
    ({"task": "calc", "split": "", "sample_index": 0}, "split must be a non-empty string"),
])
def test_bad_episode_open_is_one_line_error(body, message):
    with pytest.raises(RequestError, match=message.replace("(", r"\(")):
        episode_request(body, "run-1", ["calc", "db"])


@pytest.mark.parametrize("body,message", [
    ({}, "reward must be a finite number"),
    ({"reward": float("nan")}, "reward must be a finite number"),
    ({"reward": 1, "status": "running"}, "status must be one of"),
    ({"reward": 1, "metrics": {"a": "b"}}, "metrics must map names to finite numbers"),
])
def test_bad_episode_end_is_one_line_error(body, message):
    with pytest.raises(RequestError, match=message):
        parse_end(body)


def test_members_of_one_task_share_the_dispatchers_group_id():
    a = episode_request({"task": "calc", "split": "train", "sample_index": 3, "member": 0, "group_size": 2}, "r", ["calc"])
    b = episode_request({"task": "calc", "split": "train", "sample_index": 3, "member": 1, "group_size": 2}, "r", ["calc"])
    assert a["group_id"] == b["group_id"] and (a["member"], b["member"]) == (0, 1)
    codec().encode("task_requested", a)


def test_episodes_refuse_a_second_open_and_unknown_ids(encoder):
    published: list[dict[str, Any]] = []
    episodes = Episodes(run="r", families=["calc"], settings=ProxySettings(), on_trajectory=published.append,
                        make_episode=lambda request: make_episode(encoder, ScriptedEngine(encoder, [CALL]))[0])
    opened = episodes.open_episode({"task": "calc", "split": "train", "sample_index": 0})
    with pytest.raises(RequestError, match="already open"):
        episodes.open_episode({"task": "calc", "split": "train", "sample_index": 0})
    with pytest.raises(RequestError, match="no open episode") as error:
        episodes.end("nope", {"reward": 1.0})
    assert error.value.status == 404
    result = episodes.end(opened["episode_id"], {"reward": 1.0})
    assert result["status"] == "task_error" and len(published) == 1 and not episodes.open


def test_an_idle_episode_is_published_as_a_task_error_unless_its_call_is_in_flight(encoder):
    now, steps, published = [1_700_000_000.0], {}, []

    def make(request: dict[str, Any]) -> Episode:
        sink = steps.setdefault(request["sample_index"], [])
        return Episode(request, encoder, lambda pool: (pool, ScriptedEngine(encoder, [CALL])),
                       ProxySettings(idle_timeout_s=60), LOOP, clock=lambda: now[0],
                       sleep=lambda s: asyncio.sleep(0), on_step=sink.append)

    episodes = Episodes(run="r", families=["calc"], settings=ProxySettings(idle_timeout_s=60), make_episode=make,
                        on_trajectory=published.append)
    first = episodes.open_episode({"task": "calc", "split": "train", "sample_index": 0})["episode_id"]
    second = episodes.open_episode({"task": "calc", "split": "train", "sample_index": 1})["episode_id"]
    call(episodes.get(first), [SYSTEM, USER])
    now[0] += 30
    call(episodes.get(second), [SYSTEM, USER])
    now[0] += 31  # the first idle 61 s, the second 31 s
    assert episodes.expire_idle(now[0]) == [first]
    [trajectory] = published
    assert (trajectory["status"], trajectory["termination"], trajectory["reward"]) == ("task_error", "idle_timeout", 0.0)
    assert len(trajectory["turns"]) == 1
    assert_valid_events(trajectory, steps[0])
    with pytest.raises(RequestError, match="no open episode"):
        episodes.get(first)

    now[0] += 100
    assert episodes.expire_idle(now[0], busy=lambda episode_id: episode_id == second) == []
    assert episodes.expire_idle(now[0]) == [second]
    assert (episodes.counts["expired"], episodes.counts["published"], len(episodes.open)) == (2, 2, 0)
