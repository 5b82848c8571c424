"""`rollstream proxy` end to end: the openai-client agent (examples/openai_agent.py) rolls out calc and db
episodes through the proxy against a real vLLM CPU engine on a tiny policy; the trajectories and steps reach
Kafka, pass `rollstream replay verify`'s checks, and are grouped by the stream processor's aggregation and
batched (their pure functions) as the built-in loop's are, and the learner takes a training step on them whose
recomputed log-probs agree with the recorded ones (on-policy: the proxy recorded what the policy sampled)."""

from __future__ import annotations

import asyncio
import copy
import sys
import time
import uuid
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from env_workers.engine_client import served_model
from env_workers.proxy_settings import ProxySettings
from env_workers.settings import AgentLoopSettings
from learner.microbatch import make_micro_batches
from learner.process import batch_items
from learner.settings import LearnerSettings
from learner.step import make_optimizer, train_step
from pipeline.analysis.replay_records import ReplayRecord
from pipeline.analysis.replay_verify import verify
from pipeline.policy.model_init import PolicyModelSettings, init_model
from pipeline.run.config import REPO_ROOT
from pipeline.run.proxy import serve
from schemas import topics
from schemas.topic_reader import TopicReader
from streams.aggregation import add_member, decide
from streams.batching import build_batch
from streams.settings import StreamsSettings

from helpers.vllm import serving_engine

sys.path.insert(0, str(REPO_ROOT / "examples"))
import openai_agent  # noqa: E402: the example is a script, not a package

pytestmark = pytest.mark.integration

TINY = PolicyModelSettings(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256)
LOOP = AgentLoopSettings(max_turns=2, max_total_len=3072, max_new_tokens=12, engine_retry_backoff_s=0.5)
GROUP_SIZE = 2


def test_openai_agent_through_the_proxy_publishes_trainable_trajectories(infra, tmp_path: Path):
    started = time.monotonic()
    model_dir = tmp_path / "policy"
    init_model(TINY, model_dir)
    run = f"proxy-{uuid.uuid4().hex[:8]}"
    reader = TopicReader(infra.kafka, [topics.TRAJECTORIES, topics.STEPS], run=run)
    with serving_engine(model_dir, tmp_path / "engines", args=("--max-model-len", "4096")) as (engine, _):
        name = served_model(engine.url)

        async def scenario() -> list[dict]:
            ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            stop = asyncio.Event()
            proxy = asyncio.create_task(serve(
                ProxySettings(port=0, worker_id="proxy-test"), LOOP, infra.kafka, model_dir, run,
                engine_urls={"current": [engine.url]}, served_name=name, on_ready=ready.set_result, stop=stop))
            try:
                url = await asyncio.wait_for(ready, 60)
                results = []
                for task in ("calc", "db"):
                    results += await openai_agent.main(openai_agent.parse([
                        "--proxy", url, "--task", task, "--split", "dev", "--samples", "0",
                        "--group-size", str(GROUP_SIZE), "--max-turns", "2", "--max-tokens", "12"]))
                return results
            finally:
                stop.set()
                await proxy

        results = asyncio.run(scenario())
    assert len(results) == 2 * GROUP_SIZE and all(r["turns"] >= 1 for r in results), results
    reader.wait_for(lambda: len(reader.events[topics.TRAJECTORIES]) >= len(results), 30, "the trajectories")
    reader.poll(0.5)  # the last steps
    trajectories, steps = reader.events[topics.TRAJECTORIES], reader.events[topics.STEPS]
    reader.close()
    assert {t["trajectory_id"] for t in trajectories} == {r["episode_id"] for r in results}
    assert len(steps) == sum(len(t["turns"]) for t in trajectories)

    # `rollstream replay verify`: token invariants, each turn's tokens are its steps event's
    records = {topic: [ReplayRecord(topic, 0, i, 0, None, value) for i, value in enumerate(values)]
               for topic, values in ((topics.TRAJECTORIES, trajectories), (topics.STEPS, steps))}
    checks = {c.name: c for c in verify(records, run=run).checks}
    for name in ("token_invariants", "steps_match_trajectories", "trajectory_ids_unique"):
        assert checks[name].checked > 0 and not checks[name].mismatches, (name, checks[name].mismatches[:3])

    # The stream processor's grouping (both members of each task) and the learner's batch building.
    settings = StreamsSettings()
    states: dict[str, dict] = {}
    for t in trajectories:
        states[t["group_id"]] = add_member(states.get(t["group_id"]), t, now_ms=1).state
    groups = [decide(state, 2, 0, settings) for state in states.values()]
    assert [g.action for g in groups] == ["emit", "emit"], [g.reason for g in groups]
    batch = build_batch(run, 0, 0, [g.group for g in groups], settings, now_ms=3)
    items = batch_items(batch, fetch=lambda uri: pytest.fail(f"arrays not inline: {uri}"))
    assert len(items) == 2 * GROUP_SIZE
    micro = make_micro_batches(items, max_tokens=8192)
    assert sum(len(m.indices) for m in micro) == len(items)
    assert all(m.loss_mask.sum() > 0 for m in micro)
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    learner = LearnerSettings()  # temperature 0.8, the loop's
    metrics = train_step(policy, copy.deepcopy(policy), make_optimizer(policy, learner), items, learner)
    assert metrics["actor/action_tokens"] == sum(int(mask.sum()) for _, mask, _, _ in items)
    assert abs(metrics["actor/ppo_kl"]) < 1e-3, metrics  # the recorded log-probs are the policy's own
    print(f"\ntest_proxy wall time {time.monotonic() - started:.1f} s", file=sys.stderr)
