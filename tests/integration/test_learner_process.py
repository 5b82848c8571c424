"""The learner process against the real Kafka and MinIO: batches in, verified versions out."""

from __future__ import annotations

import functools
import hashlib
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from confluent_kafka import Consumer, TopicPartition
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner import checkpoint, publish, sao
from learner.manifest import read_version
from learner.process import LearnerLoop, ReferenceMismatch, ResumeError, batch_items
from learner.settings import LearnerSettings
from learner.step import make_optimizer, steps_taken, train_step
from pipeline.engine.updates import download_version
from pipeline.policy.loading import load_policy
from schemas import arrays, eventref, objectstore, samples, topics
from schemas.bus import EventConsumer, EventProducer
from schemas.eventref import EventFetcher, EventMissing
from streams.aggregator_agent import without_arrays

pytestmark = pytest.mark.integration

SETTINGS = LearnerSettings(lr=1e-3, max_tokens_per_micro_batch=64, checkpoint_interval=2)


def save_tiny_model(directory: Path) -> Path:
    """The brief's tiny random Qwen2, saved as a Hugging Face checkpoint; lm_head tied to the
    embedding, as the default policy's is."""
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, vocab_size=300, max_position_embeddings=128,
                         tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def make_batch(run: str, index: int, members: int = 4) -> dict:
    """A batches event (schemas/avro/batch.avsc) with packed arrays, deterministic in `index`."""
    rng = np.random.default_rng(index)
    items = []
    for member in range(members):
        t = samples.trajectory(member=member, num_tokens=int(rng.integers(12, 24)))
        n = t["num_tokens"]
        mask = np.zeros(n, dtype=np.uint8)
        mask[t["prompt_tokens"]:] = 1
        t.update(run=run, group_id=f"{run}-g{index}", trajectory_id=f"{run}-t{index}-{member}",
                 input_ids=arrays.pack_ids(rng.integers(0, 300, n)), loss_mask=arrays.pack_mask(mask),
                 rollout_logprobs=arrays.pack_logprobs(-rng.exponential(1.0, n) * mask))
        t["turns"][0]["weight_version"] = max(0, index - 1)
        items.append({"trajectory": t, "group_advantage": 0.0, "advantage": float(rng.normal())})
    batch = samples.batch()
    batch_id = hashlib.sha256(f"{run}/{index}".encode()).hexdigest()[:16]
    batch.update(batch_id=batch_id, run=run, index=index, credit_version=index, group_ids=[f"{run}-g{index}"],
                 items=items)
    return batch


def produce(infra, batches: list[dict]) -> None:
    with EventProducer(infra.kafka) as producer:
        for b in batches:
            producer.send(topics.BATCHES, b, key=b["batch_id"])


def weight_events(infra, run: str, expected: int, timeout: float = 60.0) -> list[dict]:
    """The run's weights events, read from the start, once `expected` of them are there."""
    consumer = EventConsumer(infra.kafka, group_id=f"check-{uuid.uuid4().hex}", topic_names=[])
    consumer.assign({topics.WEIGHTS: {p: 0 for p in consumer.end_offsets(topics.WEIGHTS)}})
    found: list[dict] = []
    deadline = time.monotonic() + timeout
    while len(found) < expected and time.monotonic() < deadline:
        e = consumer.poll(0.5)
        if e is not None and e.value["run"] == run:
            found.append(e.value)
    consumer.close()
    return found


def staged_tensors(mc, event: dict) -> dict[str, torch.Tensor]:
    """Downloads a version as an engine does, verifying every sha256 (a delta version is rebuilt on
    its chain, every result tensor checked; pipeline/engine/updates.py)."""
    with tempfile.TemporaryDirectory(prefix="staged-") as tmp:
        download_version(mc, event, Path(tmp) / f"v{event['version']:06d}")
        return read_version(Path(tmp) / f"v{event['version']:06d}")[1]


def make_loop(infra, run: str, model_dir: Path, settings: LearnerSettings = SETTINGS, **loop) -> LearnerLoop:
    model, ref, config = load_policy(model_dir)
    optimizer = make_optimizer(model, settings)
    critic = sao.make_critic(model, settings) if settings.sao else None
    return LearnerLoop(run=run, settings=settings, model=model, optimizer=optimizer, critic=critic,
                       step_fn=functools.partial(train_step, model, ref, optimizer, settings=settings, critic=critic),
                       model_config=config, **loop,
                       kafka=infra.kafka, mc=objectstore.client(infra.object_store),
                       producer=EventProducer(infra.kafka), broadcaster=lambda tensors, version: ["current"])


def test_learner_publishes_one_verified_version_per_batch_and_skips_repeats(infra, tmp_path):
    run = f"learner-{uuid.uuid4().hex[:10]}"
    model_dir = save_tiny_model(tmp_path / "model")
    batches = [make_batch(run, i) for i in range(4)]
    other_run = make_batch(f"other-{run}", 0)
    produce(infra, [batches[0], other_run, batches[1], batches[0], batches[2], batches[3]])  # batch 0 twice
    probe = EventConsumer(infra.kafka, group_id=f"check-{uuid.uuid4().hex}", topic_names=[])
    produced_end = probe.end_offsets(topics.BATCHES)[0]  # other runs may append after this
    probe.close()

    metrics_consumer = EventConsumer(infra.kafka, group_id=f"check-{uuid.uuid4().hex}", topic_names=[])
    metrics_consumer.assign({topics.METRICS: metrics_consumer.end_offsets(topics.METRICS)})
    settings = LearnerSettings(**{**SETTINGS.model_dump(), "keep_versions": 2, "stale_step": 2,
                                  "keep_stale_versions": 1, "poll_timeout_s": 0.2, "snapshot_interval": 2})
    loop = make_loop(infra, run, model_dir, settings, max_steps=4, idle_exit_s=30)
    state = loop.loop(loop.start(resume=False))

    events = weight_events(infra, run, 5)
    assert [e["version"] for e in events] == [0, 1, 2, 3, 4]
    assert [e["batch_id"] for e in events] == [None] + [b["batch_id"] for b in batches]
    assert [e["broadcast_pools"] for e in events] == [["current"]] * 5
    assert state.step == 4 and state.version == 4
    mc = loop.mc
    newest = staged_tensors(mc, events[-1])
    # the tied lm_head is published once, as the embedding it is
    assert "lm_head.weight" not in newest and "model.embed_tokens.weight" in newest
    for name, tensor in loop.model.state_dict().items():
        assert torch.equal(newest[name.replace("lm_head.", "model.embed_tokens.")], tensor), name
    # retention: the 2 newest, the newest multiple of stale_step (4), the checkpoints' versions (2, 4),
    # and the chain each is built on (3 is a delta on the snapshot 2; 0, 2 and 4 are full)
    assert [e["shards"][0]["uri"].rsplit("/", 1)[1][:5] for e in events] == ["model", "delta", "model", "delta", "model"]
    assert publish.staged_versions(mc, run) == [2, 3, 4]
    # every batch offset, the duplicate and the other run's included, is committed
    raw = Consumer(infra.kafka.as_confluent(**{"group.id": f"learner-{run}"}))
    committed = raw.committed([TopicPartition(topics.BATCHES, 0)], timeout=10)[0].offset
    raw.close()
    assert committed >= produced_end
    expected = {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/entropy",
                "actor/grad_norm", "perf/tokens_per_s", "timing/wait_s", "timing/ref_s", "timing/actor_s",
                "timing/publish_s", "rollout/behaviour_lag"}
    names = set()
    deadline = time.monotonic() + 20
    while not expected <= names and time.monotonic() < deadline:  # 4 partitions: any order
        e = metrics_consumer.poll(0.5)
        if e is not None and e.value["run"] == run:
            names.add(e.value["name"])
    metrics_consumer.close()
    assert expected <= names


def make_sao_batch(run: str, index: int, members: int = 4) -> dict:
    """A batches event as the streams send it with streams.advantage "none" (SAO): groups of one, advantage 0,
    each trajectory two assistant turns with the environment's answer between them, and its reward."""
    rng = np.random.default_rng(100 + index)
    batch = make_batch(run, index, members)
    for member, item in enumerate(batch["items"]):
        t = item["trajectory"]
        prompt, turn, env = int(rng.integers(3, 6)), int(rng.integers(3, 7)), int(rng.integers(2, 5))
        mask = np.array([0] * prompt + [1] * turn + [0] * env + [1] * turn, dtype=np.uint8)
        n = len(mask)
        t.update(group_id=f"{run}-g{index}-{member}", group_size=1, member=0, num_tokens=n, prompt_tokens=prompt,
                 reward=float(rng.choice([1.0, 0.0, -0.2])), input_ids=arrays.pack_ids(rng.integers(0, 300, n)),
                 loss_mask=arrays.pack_mask(mask), rollout_logprobs=arrays.pack_logprobs(-rng.exponential(1.0, n) * mask))
        item.update(group_advantage=0.0, advantage=0.0)
    batch["group_ids"] = [i["trajectory"]["group_id"] for i in batch["items"]]
    return batch


def test_the_learner_trains_with_sao_checkpoints_its_critic_and_publishes_the_policy_alone(infra, tmp_path):
    run = f"learner-sao-{uuid.uuid4().hex[:10]}"
    model_dir = save_tiny_model(tmp_path / "model")
    produce(infra, [make_sao_batch(run, i) for i in range(3)])
    settings = LearnerSettings(**{**SETTINGS.model_dump(), "advantage_estimator": "sao", "critic_lr": 1e-2,
                                  "poll_timeout_s": 0.2})
    loop = make_loop(infra, run, model_dir, settings, max_steps=3, idle_exit_s=30)
    head_before = loop.critic.head.linear.weight.detach().clone()
    state = loop.loop(loop.start(resume=False))

    assert state.step == 3
    events = weight_events(infra, run, 4)
    assert [e["version"] for e in events] == [0, 1, 2, 3]
    # engines get the policy's tensors and nothing else (the tied lm_head once, as the embedding)
    newest = staged_tensors(loop.mc, events[-1])
    policy = loop.model.state_dict()
    assert set(newest) == set(policy) - {"lm_head.weight"}
    for name, tensor in newest.items():
        assert torch.equal(tensor, policy[name]), name
    # the checkpoint (steps 2 and 3) keeps the critic beside the policy, trained twice per step
    assert not torch.equal(loop.critic.head.linear.weight, head_before)
    saved = checkpoint.load_latest(loop.mc, run)
    assert saved.state.step == 3 and set(saved.model) == set(policy)
    assert torch.equal(saved.critic["head"]["linear.weight"], loop.critic.head.linear.weight.detach())
    assert steps_taken(loop.critic.optimizer) == 2 * 3
    # a resumed learner continues with that critic, not a zero one
    resumed = make_loop(infra, run, model_dir, settings, max_steps=3, idle_exit_s=30)
    assert not resumed.critic.head.linear.weight.detach().abs().sum() > 0
    resumed.start(resume=True)
    assert torch.equal(resumed.critic.head.linear.weight, loop.critic.head.linear.weight)
    assert steps_taken(resumed.critic.optimizer) == 2 * 3


def test_a_fresh_start_on_a_run_with_versions_is_refused(infra, tmp_path):
    run = f"learner-{uuid.uuid4().hex[:10]}"
    model_dir = save_tiny_model(tmp_path / "model")
    first = make_loop(infra, run, model_dir, max_steps=1)
    first.start(resume=False)
    assert [e["version"] for e in weight_events(infra, run, 1)] == [0]
    with pytest.raises(ResumeError, match="already has versions up to 0"):
        make_loop(infra, run, model_dir, max_steps=1).start(resume=False)


def test_learner_command_refuses_a_directory_without_a_model_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import learner as learner_cmd

    result = CliRunner().invoke(learner_cmd.app, ["--run", "r", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip() == f"rollstream learner: {tmp_path} is not a Hugging Face checkpoint directory (no config.json)"


def test_bench_learner_refuses_an_empty_batch_in_one_line():
    from typer.testing import CliRunner

    from pipeline.cli import app

    result = CliRunner().invoke(app, ["bench", "learner", "--sequences", "0"])
    assert result.exit_code == 1
    assert result.output.strip() == "rollstream bench learner: --sequences and --repeats must be >= 1"


def refer_to_produced_trajectories(infra, batch: dict) -> dict:
    """The batch as the stream processor sends it: each item's trajectory produced to `trajectories`
    and carried on without its arrays, arrays_uri referring to that event."""
    where: dict[str, str] = {}

    def delivered(err, msg) -> None:
        assert err is None, err
        where[msg.key().decode()] = eventref.uri(msg.topic(), msg.partition(), msg.offset())

    with EventProducer(infra.kafka) as producer:
        for item in batch["items"]:
            t = item["trajectory"]
            producer.send(topics.TRAJECTORIES, t, key=t["trajectory_id"], on_delivery=delivered)
    items = [{**item, "trajectory": {**without_arrays(item["trajectory"]),
                                     "arrays_uri": where[item["trajectory"]["trajectory_id"]]}}
             for item in batch["items"]]
    return {**batch, "items": items}


def test_learner_trains_on_the_arrays_a_batch_refers_to_and_refuses_a_reference_to_another_trajectory(infra, tmp_path):
    run = f"learner-ref-{uuid.uuid4().hex[:10]}"
    model_dir = save_tiny_model(tmp_path / "model")
    inline = make_batch(run, 0)
    referring = refer_to_produced_trajectories(infra, inline)
    assert all(i["trajectory"]["input_ids"] == b"" for i in referring["items"])
    # the same content either way: what the learner trains on is read back from `trajectories`
    loop = make_loop(infra, run, model_dir)
    assert [[a.tolist() if hasattr(a, "tolist") else a for a in item]
            for item in batch_items(referring, lambda uri: loop._fetcher.fetch(uri))] == \
        [[a.tolist() if hasattr(a, "tolist") else a for a in item] for item in batch_items(inline, lambda uri: b"")]

    crossed = refer_to_produced_trajectories(infra, make_batch(run, 1))
    first, second = crossed["items"][0]["trajectory"], crossed["items"][1]["trajectory"]
    first["arrays_uri"], second["arrays_uri"] = second["arrays_uri"], first["arrays_uri"]
    produce(infra, [referring, crossed])
    state = loop.start(resume=False)
    with pytest.raises(ReferenceMismatch, match=f"refers to .* an event of trajectory {second['trajectory_id']}"):
        loop.loop(state)
    assert [e["batch_id"] for e in weight_events(infra, run, 2)] == [None, referring["batch_id"]]


def test_a_reference_past_the_end_of_its_partition_is_reported_missing(infra):
    with EventConsumer(infra.kafka, group_id=f"check-{uuid.uuid4().hex}", topic_names=[]) as probe:
        end = probe.end_offsets(topics.TRAJECTORIES)[0]
    with EventFetcher(infra.kafka) as fetcher:
        with pytest.raises(EventMissing, match="partition 0 of trajectories holds offsets"):
            fetcher.fetch(eventref.uri(topics.TRAJECTORIES, 0, end + 1000))
