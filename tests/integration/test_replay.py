"""`rollstream replay` against the real broker: a small synthetic run on every topic is replayed to
Parquet and JSONL twice (identical bytes, the documented columns), verified clean, a planted bad
event is reported, and --from/--to by offset and by time select exactly the right records.

The topics are shared with other tests and hold old events, so every replay is filtered by a fresh
run id and starts at the time this module began producing (which also keeps it fast)."""

from __future__ import annotations

import base64
import json
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from pipeline.cli.replay import app
from pipeline.analysis.replay_columns import columns, flatten
from pipeline.analysis.replay_records import ReplayRecord
from schemas import arrays, ids, samples, topics
from schemas.bus import EventProducer, now_ms
from streams import aggregation, batching
from streams.settings import StreamsSettings

pytestmark = pytest.mark.integration

STREAMS = StreamsSettings(group_size=2, batch_size=2)


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def rollout(run: str, gid: str, member: int, reward: float) -> tuple[dict, list[dict]]:
    """A consistent trajectory (4-token prompt, two turns each followed by one environment token) and its steps."""
    tid = ids.trajectory_id(run, gid, member)
    tokens, mask, lps, turns, steps = [1, 2, 3, 4], [0] * 4, [0.0] * 4, [], []
    for k in range(2):
        out, out_lp = [50 + k + member, 60 + k], [-0.5, -1.25]
        turns.append({"turn": k, "pool": "current", "engine_id": "e0", "weight_version": 0, "start": len(tokens),
                      "length": 2, "generate_ms": 1.0, "env_ms": 1.0})
        steps.append({**samples.step(), "run": run, "trajectory_id": tid, "group_id": gid, "member": member,
                      "turn": k, "planned_pool": "current", "pool": "current", "engine_id": "e0", "weight_version": 0,
                      "prompt_tokens": len(tokens), "output_ids": arrays.pack_ids(out),
                      "output_logprobs": arrays.pack_logprobs(out_lp)})
        tokens, mask, lps = tokens + out + [9], mask + [1, 1, 0], lps + out_lp + [0.0]
    return {**samples.trajectory(), "trajectory_id": tid, "run": run, "group_id": gid, "member": member,
            "group_size": STREAMS.group_size, "input_ids": arrays.pack_ids(tokens), "loss_mask": arrays.pack_mask(mask),
            "rollout_logprobs": arrays.pack_logprobs(lps), "num_tokens": len(tokens), "prompt_tokens": 4,
            "turns": turns, "reward": reward, "env_reward": reward}, steps


def run_events(run: str, *, bad_advantage: bool = False) -> list[tuple[str, dict, str]]:
    """(topic, event, key) of a small consistent run on every topic: two groups in one batch, versions 0 and 1."""
    out: list[tuple[str, dict, str]] = []
    groups = []
    for g, rewards in (("a", [1.0, 0.0]), ("b", [0.5, 1.0])):
        gid = ids.group_id(run, "db", "dev", ord(g), 0)
        state = None
        for member, reward in enumerate(rewards):
            request = {**samples.task_requested(member), "run": run, "group_id": gid, "group_size": 2}
            out += [(topics.TASKS_REQUESTED, request, gid), (topics.TASKS, {**samples.task(), "request": request}, gid)]
            trajectory, steps = rollout(run, gid, member, reward)
            out += [(topics.STEPS, s, gid) for s in steps] + [(topics.TRAJECTORIES, trajectory, gid)]
            state = aggregation.add_member(state, trajectory, now_ms()).state
        group = aggregation.decide(state, now_ms(), 0, STREAMS).group
        if bad_advantage:
            group["members"][0]["advantage"] += 1.0
        groups.append(group)
        out.append((topics.GROUPS, group, gid))
    batch = batching.build_batch(run, 0, 0, groups, STREAMS, now_ms())
    out.append((topics.BATCHES, batch, batch["batch_id"]))
    for version, batch_id in ((0, None), (1, batch["batch_id"])):
        out.append((topics.WEIGHTS, {**samples.weight_version(), "run": run, "version": version, "step": version,
                                     "batch_id": batch_id}, run))
    out.append((topics.METRICS, {**samples.metric(), "run": run}, "actor/pg_loss"))
    out.append((topics.ENGINES, {**samples.engine_heartbeat(), "engine_id": f"engine-{run}", "run": run},
                f"engine-{run}"))
    out.append((topics.DLQ, {**samples.dead_letter(), "key": groups[0]["group_id"].encode()}, groups[0]["group_id"]))
    return out


@dataclass
class Produced:
    run: str
    bad_run: str
    since: str
    events: list[tuple[str, dict, str]]
    bounded: list[tuple[int, int, int]]  # (partition, offset, timestamp ms) of the bounded metrics, in order
    junk: tuple[int, int]  # (partition, offset) of an undecodable record


@pytest.fixture(scope="module")
def produced(infra) -> Produced:
    run, bad_run = f"replay-{uuid.uuid4().hex}", f"replay-bad-{uuid.uuid4().hex}"
    since = iso(now_ms() - 1)
    events = run_events(run)
    bounded: list[tuple[int, int, int]] = []
    junk: list[tuple[int, int]] = []
    with EventProducer(infra.kafka) as producer:
        for topic, event, key in events + run_events(bad_run, bad_advantage=True):
            producer.send(topic, event, key=key)
        producer.flush()
        # Three bursts of metrics on one key (one partition), 30 ms apart, so each burst's first
        # record has a timestamp of its own.
        def delivered(err, msg) -> None:
            bounded.append((msg.partition(), msg.offset(), msg.timestamp()[1]))

        for burst in range(3):
            for i in range(3):
                metric = {**samples.metric(), "run": run, "name": "bounded", "value": 3.0 * burst + i}
                producer.send(topics.METRICS, metric, key=f"bounded-{run}", on_delivery=delivered)
            producer.flush()
            time.sleep(0.03)
        producer.send_raw(topics.METRICS, b"\x00not avro", key=f"junk-{run}",
                          on_delivery=lambda err, msg: junk.append((msg.partition(), msg.offset())))
    return Produced(run, bad_run, since, events, sorted(bounded, key=lambda b: b[1]), junk[0])


def replay(*args: str) -> dict:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _comparable(rows: list[dict]) -> list[str]:
    """Rows without their Kafka position, as canonical JSON, to compare replayed with produced events."""
    return sorted(json.dumps({k: v for k, v in r.items() if not k.startswith("_")}, sort_keys=True) for r in rows)


@pytest.mark.parametrize("topic", topics.ALL_TOPICS)
def test_replay_of_each_topic_twice_gives_identical_files_with_the_documented_columns(produced, tmp_path, topic):
    first = [tmp_path / "1.parquet", tmp_path / "1.jsonl"]
    second = [tmp_path / "2.parquet", tmp_path / "2.jsonl"]
    for paths in (first, second):
        replay(topic, "--run", produced.run, "--from", produced.since, *(f"--out={p}" for p in paths))
    for a, b in zip(first, second):
        assert a.read_bytes() == b.read_bytes()
    table = pq.read_table(first[0])
    assert table.schema.names == [c.name for c in columns(topic)]
    rows = [json.loads(line) for line in first[1].read_text().splitlines()]
    assert len(rows) == table.num_rows and all(list(r) == sorted(r) for r in rows)
    # Every event produced comes back with the same content. The replay may hold more: events of
    # no run (heartbeats, dead letters) from others, and whatever a streams worker running on the
    # same broker derived from ours (routed tasks, groups, batches).
    ours = [flatten(ReplayRecord(topic, 0, 0, 0, key.encode(), e)) for t, e, key in produced.events if t == topic]
    expected = _comparable([json.loads(json.dumps(r, default=lambda b: base64.b64encode(b).decode())) for r in ours])
    replayed = _comparable(rows)
    assert all(replayed.count(e) >= expected.count(e) for e in expected)


def test_verify_of_the_synthetic_run_is_clean(produced):
    result = CliRunner().invoke(app, ["verify", "--run", produced.run, "--from", produced.since, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] and report["pending_groups"] == []
    assert report["counts"]["trajectories"] == 4 and report["dead_letters"]["run"] >= 1
    assert all(c["checked"] > 0 for c in report["checks"])


def test_verify_reports_a_planted_bad_advantage_and_exits_1(produced):
    result = CliRunner().invoke(app, ["verify", "--run", produced.bad_run, "--from", produced.since, "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    planted = {ids.trajectory_id(produced.bad_run, ids.group_id(produced.bad_run, "db", "dev", ord(g), 0), 0)
               for g in "ab"}
    grpo = next(c for c in report["checks"] if c["name"] == "grpo_advantages")
    assert {m["ids"]["trajectory_id"] for m in grpo["mismatches"]} == planted
    # The batcher copied the wrong advantages into the batch: reported there too.
    batch = next(c for c in report["checks"] if c["name"] == "batch_group_advantages")
    assert {m["ids"]["trajectory_id"] for m in batch["mismatches"]} == planted


def test_from_and_to_by_offset_select_exactly_that_offset_range(produced, tmp_path):
    offsets = [o for _, o, _ in produced.bounded]
    out = tmp_path / "m.jsonl"
    summary = replay("metrics", "--run", produced.run, "--from", str(offsets[2]), "--to", str(offsets[6]),
                     f"--out={out}")
    rows = [json.loads(line) for line in out.read_text().splitlines() if json.loads(line)["name"] == "bounded"]
    assert [r["value"] for r in rows] == [2.0, 3.0, 4.0, 5.0]
    assert summary["rows"][str(out)] == len(out.read_text().splitlines())


def test_from_and_to_by_time_select_exactly_one_burst(produced, tmp_path):
    stamps = [ts for _, _, ts in produced.bounded]
    out = tmp_path / "m.jsonl"
    replay("metrics", "--run", produced.run, "--from", iso(stamps[3]), "--to", iso(stamps[6]), f"--out={out}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["value"] for r in rows if r["name"] == "bounded"] == [3.0, 4.0, 5.0]


def test_undecodable_record_is_counted_and_named_not_written(produced, tmp_path):
    partition, offset = produced.junk
    out = tmp_path / "junk.parquet"
    result = CliRunner().invoke(app, ["metrics", "--from", str(offset), "--to", str(offset + 1), f"--out={out}",
                                      "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["undecodable"] >= 1
    assert f"undecodable: metrics[{partition}]@{offset}: not an Avro single-object encoding" in result.stderr
