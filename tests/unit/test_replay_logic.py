"""Replay's pure half: flat columns of every topic, deterministic files, and `verify` on a consistent
synthetic run (built with streams' own aggregation and batching, as a cross-check of the independent
re-implementation) and on every kind of planted mismatch. Also the CLI's errors and help."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from pipeline.analysis.replay import write_records
from pipeline.cli.replay import app
from pipeline.analysis.replay_columns import COMMON_COLUMNS, COLUMNS, arrow_schema, columns, flatten
from pipeline.analysis.replay_records import Bound, ReplayRecord
from pipeline.analysis.replay_verify import VerifySettings, verify
from schemas import arrays, ids, samples, topics
from streams import aggregation, batching
from streams.settings import StreamsSettings

RUN = "unit-replay"
STREAMS = StreamsSettings(group_size=4, batch_size=2)
REPLAY_MD = Path(__file__).resolve().parents[2] / "pipeline" / "analysis" / "REPLAY.md"


# -- a consistent synthetic run ----------------------------------------------------------------

def rollout(gid: str, member: int, reward: float, *, task: str, status: str = "completed",
            turns: tuple[int, ...] = (3, 2), validation: bool = False) -> tuple[dict, list[dict]]:
    """A trajectory and its steps: a 5-token prompt, then per turn its generated tokens (mask 1)
    followed by two environment tokens (mask 0)."""
    tid = ids.trajectory_id(RUN, gid, member)
    tokens, mask, logprobs, records, steps = list(range(5)), [0] * 5, [0.0] * 5, [], []
    for k, n in enumerate(turns):
        out = [100 + 10 * k + member + i for i in range(n)]
        out_lp = [-0.5 - 0.25 * i for i in range(n)]
        records.append({"turn": k, "pool": "current", "engine_id": "engine-0", "weight_version": 0,
                        "start": len(tokens), "length": n, "generate_ms": 1.0, "env_ms": 1.0})
        steps.append({**samples.step(), "run": RUN, "trajectory_id": tid, "group_id": gid, "member": member,
                      "task": task, "turn": k, "planned_pool": "current", "pool": "current", "engine_id": "engine-0",
                      "weight_version": 0, "prompt_tokens": len(tokens), "output_ids": arrays.pack_ids(out),
                      "output_logprobs": arrays.pack_logprobs(out_lp), "env_tokens": 2})
        tokens += out + [7, 8]
        mask += [1] * n + [0, 0]
        logprobs += out_lp + [0.0, 0.0]
    trajectory = {**samples.trajectory(), "trajectory_id": tid, "run": RUN, "group_id": gid, "member": member,
                  "group_size": STREAMS.group_size, "task": task, "split": "train", "sample_index": 0,
                  "validation": validation, "input_ids": arrays.pack_ids(tokens), "loss_mask": arrays.pack_mask(mask),
                  "rollout_logprobs": arrays.pack_logprobs(logprobs), "num_tokens": len(tokens), "prompt_tokens": 5,
                  "turns": records, "status": status, "reward": reward, "env_reward": reward}
    return trajectory, steps


def group_event(trajectories: list[dict], ready_ms: int, streams: StreamsSettings = STREAMS) -> dict:
    state = None
    for t in trajectories:
        state = aggregation.add_member(state, t, ready_ms - 10).state
    decision = aggregation.decide(state, ready_ms, 0, streams)
    assert decision.action == "emit"
    return decision.group


def synthetic_run(streams: StreamsSettings = STREAMS) -> dict[str, list[ReplayRecord]]:
    """Groups g0 (db), g1 (os, one task_error member), g2 (db) trained in two batches; g3 ready after
    the last batch (pending); gv a validation group; versions 0, 1, 2."""
    plan = {"g0": ("db", [1.0, 0.0, 0.5, 1.0], 500, False), "g1": ("os", [1.0, 0.0, 0.0, -0.2], 600, False),
            "g2": ("db", [0.0, 0.0, 1.0, 1.0], 1500, False), "g3": ("os", [1.0, 0.0, 1.0, 0.0], 2500, False),
            "gv": ("db", [1.0, 0.0, 1.0, 1.0], 700, True)}
    trajectories, steps, groups = [], [], {}
    for gid, (task, rewards, ready, validation) in plan.items():
        members = []
        for m, r in enumerate(rewards):
            status = "task_error" if (gid, m) == ("g1", 3) else "completed"
            t, s = rollout(gid, m, r, task=task, status=status, turns=(2 + m, 1 + m % 2), validation=validation)
            members.append(t)
            steps += s
        trajectories += members
        groups[gid] = group_event(members, ready, streams)
    batches = [batching.build_batch(RUN, 0, 0, [groups["g0"], groups["g1"]], streams, 1000),
               batching.build_batch(RUN, 1, 1, [groups["g2"]], streams, 2000)]
    weights = [{**samples.weight_version(), "run": RUN, "version": v, "step": v, "batch_id": b}
               for v, b in enumerate([None, batches[0]["batch_id"], batches[1]["batch_id"]])]
    events = {topics.TRAJECTORIES: trajectories, topics.STEPS: steps, topics.GROUPS: list(groups.values()),
              topics.BATCHES: batches, topics.WEIGHTS: weights, topics.DLQ: []}
    key = {topics.BATCHES: "batch_id", topics.WEIGHTS: "run"}
    return {topic: [ReplayRecord(topic, 0, i, 1000 + i, e[key.get(topic, "group_id")].encode(), e)
                    for i, e in enumerate(values)] for topic, values in events.items()}


@pytest.fixture(scope="module")
def clean_run() -> dict[str, list[ReplayRecord]]:
    return synthetic_run()


@pytest.fixture
def run(clean_run) -> dict[str, list[ReplayRecord]]:
    return copy.deepcopy(clean_run)


def failing(records: dict[str, list[ReplayRecord]], settings: VerifySettings | None = None) -> dict[str, list]:
    report = verify(records, settings, run=RUN)
    return {c.name: c.mismatches for c in report.checks if c.mismatches}


def value(records, topic: str, index: int) -> dict:
    return records[topic][index].value


def every_copy(records, trajectory_id: str) -> list[dict]:
    """The trajectory as the trajectories, groups and batches events each carry it."""
    found = [r.value for r in records[topics.TRAJECTORIES] if r.value["trajectory_id"] == trajectory_id]
    for r in records[topics.GROUPS]:
        found += [m["trajectory"] for m in r.value["members"] if m["trajectory"]["trajectory_id"] == trajectory_id]
    for r in records[topics.BATCHES]:
        found += [i["trajectory"] for i in r.value["items"] if i["trajectory"]["trajectory_id"] == trajectory_id]
    return found


# -- verify ------------------------------------------------------------------------------------

def test_consistent_synthetic_run_verifies_clean(run):
    report = verify(run, run=RUN)
    assert report.ok, [(c.name, c.mismatches) for c in report.checks if c.mismatches]
    assert {c.name: c.checked for c in report.checks} == {
        "trajectory_ids_unique": 20, "token_invariants": 20, "steps_match_trajectories": 20,
        "grpo_advantages": 20, "group_members_match_trajectories": 20, "batch_members": 3,
        "batch_group_advantages": 11, "task_normalized_advantages": 11, "batches_trained_once": 2,
        "learner_versions_continuous": 3, "groups_reach_batches": 4}
    assert report.pending_groups == ["g3"]
    assert report.counts == {"batches": 2, "groups": 5, "steps": 40, "trajectories": 20, "weights": 3}


def test_report_is_json_serializable_and_says_ok(run):
    data = json.loads(json.dumps(verify(run, run=RUN).as_dict()))
    assert data["ok"] is True and data["mismatches"] == 0
    assert data["settings"] == {"std": "bessel", "eps": 1e-6, "tolerance": 1e-4, "task_adv_norm": True,
                                "advantage": "group", "task_advantage_scale": {}, "logprob_tolerance": 1e-4}
    assert data["checks"][0]["name"] == "trajectory_ids_unique"


def test_batch_whose_stored_payload_expired_is_not_checked_but_its_groups_count_as_batched(run):
    batch = value(run, topics.BATCHES, 0)
    batch.update(items=[], payload_uri=f"s3://rollstream-payloads/{RUN}/batches/{batch['batch_id']}.avro",
                 payload_sha256="0" * 64, payload_bytes=1)
    report = verify(run, run=RUN)
    assert report.ok, [(c.name, c.mismatches) for c in report.checks if c.mismatches]
    assert report.not_checked == {"batches_without_payload": 1}
    assert {c.name: c.checked for c in report.checks}["batch_members"] == 1  # the other batch's one group
    assert report.pending_groups == ["g3"]


def test_wrong_grpo_advantage_is_reported_with_its_ids(run):
    value(run, topics.GROUPS, 0)["members"][1]["advantage"] += 0.5
    found = failing(run)
    assert set(found) == {"grpo_advantages"}
    assert found["grpo_advantages"][0].ids == {"group_id": "g0", "trajectory_id": ids.trajectory_id(RUN, "g0", 1),
                                               "member": 1}


def test_masked_flag_that_disagrees_with_the_status_is_reported(run):
    value(run, topics.GROUPS, 1)["members"][3]["masked"] = False
    found = failing(run)
    assert found["grpo_advantages"][0].detail == "masked is False but status is task_error"
    assert set(found) == {"grpo_advantages", "batch_members"}  # the batch lacks the member the group calls trainable


def test_population_std_setting_disagrees_with_a_bessel_run():
    found = failing(synthetic_run(), VerifySettings(std="population"))
    assert {"grpo_advantages", "task_normalized_advantages", "batch_group_advantages"} <= set(found)


def test_run_without_task_normalization_verifies_only_when_told_so():
    plain = synthetic_run(STREAMS.model_copy(update={"task_adv_norm": False}))
    assert failing(plain, VerifySettings(task_adv_norm=False)) == {}
    assert set(failing(plain)) == {"task_normalized_advantages"}
    assert set(failing(synthetic_run(), VerifySettings(task_adv_norm=False))) == {"task_normalized_advantages"}


def test_run_with_a_family_scale_verifies_only_when_told_the_scale():
    scaled = synthetic_run(STREAMS.model_copy(update={"task_advantage_scale": {"db": 0.5}}))
    assert failing(scaled, VerifySettings(task_advantage_scale={"db": 0.5})) == {}
    assert set(failing(scaled)) == {"task_normalized_advantages"}
    assert set(failing(synthetic_run(), VerifySettings(task_advantage_scale={"db": 0.5}))) == {
        "task_normalized_advantages"}


def test_run_whose_streams_left_the_advantages_to_the_learner_verifies_only_when_told_so():
    sao = synthetic_run(STREAMS.model_copy(update={"advantage": "none"}))
    assert failing(sao, VerifySettings(advantage="none")) == {}
    assert {"grpo_advantages", "batch_group_advantages"} <= set(failing(sao))
    assert "grpo_advantages" in failing(synthetic_run(), VerifySettings(advantage="none"))


def test_wrong_normalized_advantage_is_reported(run):
    value(run, topics.BATCHES, 0)["items"][2]["advantage"] += 0.01
    found = failing(run)
    assert set(found) == {"task_normalized_advantages"}
    assert found["task_normalized_advantages"][0].ids["batch_id"] == value(run, topics.BATCHES, 0)["batch_id"]


def test_normalized_advantage_within_tolerance_passes(run):
    value(run, topics.BATCHES, 0)["items"][2]["advantage"] += 5e-5
    assert failing(run) == {}


def test_batch_group_advantage_that_is_not_its_groups_is_reported(run):
    item = value(run, topics.BATCHES, 1)["items"][0]
    item["group_advantage"] += 0.3
    found = failing(run)
    assert "batch_group_advantages" in found


def test_logprob_where_mask_is_zero_is_reported(run):
    tid = ids.trajectory_id(RUN, "g0", 0)
    for t in every_copy(run, tid):
        lp = arrays.unpack_logprobs(t["rollout_logprobs"]).copy()
        lp[0] = -1.0
        t["rollout_logprobs"] = arrays.pack_logprobs(lp)
    found = failing(run)
    assert set(found) == {"token_invariants"}
    assert "log-prob not 0 where loss_mask is 0" in found["token_invariants"][0].detail


def test_arrays_of_different_lengths_are_reported(run):
    tid = ids.trajectory_id(RUN, "g2", 1)
    for t in every_copy(run, tid):
        t["loss_mask"] = t["loss_mask"][:-1]
    found = failing(run)
    assert "lengths differ" in found["token_invariants"][0].detail


def test_mask_outside_the_turns_spans_is_reported(run):
    tid = ids.trajectory_id(RUN, "g0", 2)
    for t in every_copy(run, tid):
        mask = arrays.unpack_mask(t["loss_mask"]).copy()
        mask[-1] = 1
        lp = arrays.unpack_logprobs(t["rollout_logprobs"]).copy()
        lp[-1] = -0.5
        t["loss_mask"], t["rollout_logprobs"] = arrays.pack_mask(mask), arrays.pack_logprobs(lp)
    found = failing(run)
    assert [m.detail for m in found["token_invariants"]] == ["loss_mask 1 is not exactly the turns' generated spans"]


def test_step_whose_tokens_are_not_the_trajectorys_span_is_reported(run):
    step = value(run, topics.STEPS, 0)
    step["output_ids"] = arrays.pack_ids([1] * len(arrays.unpack_ids(step["output_ids"])))
    found = failing(run)
    assert set(found) == {"steps_match_trajectories"}
    assert found["steps_match_trajectories"][0].ids["trajectory_id"] == step["trajectory_id"]


def test_trajectory_id_with_two_contents_is_reported(run):
    first = run[topics.TRAJECTORIES][0]
    changed = copy.deepcopy(first.value)
    changed["reward"] = 0.25
    run[topics.TRAJECTORIES].append(ReplayRecord(topics.TRAJECTORIES, 0, 99, 0, first.key, changed))
    found = failing(run)
    assert set(found) == {"trajectory_ids_unique"}
    assert found["trajectory_ids_unique"][0].ids == {"trajectory_id": first.value["trajectory_id"]}


def _rerolled(records, first: ReplayRecord, offset: int, shift: float) -> None:
    """A re-rollout of `first` on the same weights whose log-probs are `shift` away, with its steps events."""
    again = copy.deepcopy(first.value)
    logprobs = arrays.unpack_logprobs(again["rollout_logprobs"])
    mask = arrays.unpack_mask(again["loss_mask"]) == 1
    again["rollout_logprobs"] = arrays.pack_logprobs(np.where(mask, logprobs + shift, logprobs).astype(np.float32))
    records[topics.TRAJECTORIES].append(ReplayRecord(topics.TRAJECTORIES, 0, offset, 0, first.key, again))
    for step in [r for r in records[topics.STEPS] if r.value["trajectory_id"] == again["trajectory_id"]]:
        copied = copy.deepcopy(step.value)
        copied["output_logprobs"] = arrays.pack_logprobs(
            (arrays.unpack_logprobs(copied["output_logprobs"]) + shift).astype(np.float32))
        records[topics.STEPS].append(ReplayRecord(topics.STEPS, 0, offset, 0, step.key, copied))


def test_copies_whose_logprobs_differ_by_batching_noise_are_the_same_but_not_by_more(run):
    first = run[topics.TRAJECTORIES][0]
    _rerolled(run, first, 98, 5e-7)
    assert failing(run) == {}
    _rerolled(run, first, 99, -0.01)
    assert set(failing(run)) == {"trajectory_ids_unique"}


def test_rerollout_on_newer_weights_may_differ_and_is_counted(run):
    first = run[topics.TRAJECTORIES][0]
    later = copy.deepcopy(first.value)
    later["reward"] = 0.25
    later["turns"] = [{**u, "weight_version": u["weight_version"] + 1} for u in later["turns"]]
    assert later["turns"], "the fixture's trajectory has turns"
    run[topics.TRAJECTORIES].append(ReplayRecord(topics.TRAJECTORIES, 0, 99, 0, first.key, later))
    for i, step in enumerate([r for r in run[topics.STEPS] if r.value["trajectory_id"] == first.value["trajectory_id"]]):
        again = {**copy.deepcopy(step.value), "weight_version": step.value["weight_version"] + 1}
        run[topics.STEPS].append(ReplayRecord(topics.STEPS, 0, 99 + i, 0, step.key, again))
    report = verify(run, run=RUN)
    assert {c.name: c.mismatches for c in report.checks if c.mismatches} == {}
    assert report.not_checked["rerolled_on_newer_weights"] == 1


def test_duplicate_with_equal_content_but_other_worker_is_fine(run):
    first = run[topics.TRAJECTORIES][0]
    again = {**copy.deepcopy(first.value), "worker_id": "env-worker-9", "started_at_ms": 5}
    run[topics.TRAJECTORIES].append(ReplayRecord(topics.TRAJECTORIES, 0, 99, 0, first.key, again))
    assert failing(run) == {}


def test_group_member_that_differs_from_its_trajectory_event_is_reported(run):
    value(run, topics.GROUPS, 2)["members"][0]["trajectory"]["reward"] = 0.75
    assert "group_members_match_trajectories" in failing(run)


def test_batch_trained_twice_is_reported(run):
    again = {**value(run, topics.WEIGHTS, 2), "version": 3, "step": 3,
             "batch_id": value(run, topics.BATCHES, 0)["batch_id"]}
    run[topics.WEIGHTS].append(ReplayRecord(topics.WEIGHTS, 0, 3, 0, RUN.encode(), again))
    found = failing(run)
    assert set(found) == {"batches_trained_once"}
    assert found["batches_trained_once"][0].detail == "trained into versions [1, 3]"


def test_reannounced_version_with_the_same_batch_is_fine(run):
    run[topics.WEIGHTS].append(copy.deepcopy(run[topics.WEIGHTS][1]))
    assert failing(run) == {}


def test_version_gap_is_reported(run):
    del run[topics.WEIGHTS][1]
    found = failing(run)
    assert set(found) == {"learner_versions_continuous"}
    assert found["learner_versions_continuous"][0].detail == "versions [1] missing between 0 and 2"


def test_group_passed_over_by_two_batches_is_lost_not_pending(run):
    value(run, topics.GROUPS, 3)["ready_at_ms"] = 100
    report = verify(run, run=RUN)
    lost = next(c for c in report.checks if c.name == "groups_reach_batches")
    assert [m.ids for m in lost.mismatches] == [{"group_id": "g3"}]
    assert report.pending_groups == []


def test_batch_missing_an_unmasked_member_is_reported(run):
    batch = value(run, topics.BATCHES, 1)
    batch["items"] = batch["items"][1:]
    assert "batch_members" in failing(run)


def test_dead_letters_of_the_run_are_matched_by_source_topic_and_key(run):
    ours = {**samples.dead_letter(), "source_topic": topics.TRAJECTORIES, "key": b"g1"}
    other = {**samples.dead_letter(), "source_topic": topics.TRAJECTORIES, "key": b"someone-else"}
    run[topics.DLQ] = [ReplayRecord(topics.DLQ, 0, i, 0, d["key"], d) for i, d in enumerate([ours, other])]
    report = verify(run, run=RUN)
    assert report.dead_letters == {"total": 2, "run": 1}
    assert report.ok


# -- flat columns --------------------------------------------------------------------------------

@pytest.mark.parametrize("topic", topics.ALL_TOPICS)
def test_flattening_each_topics_example_gives_exactly_its_columns(topic):
    record = ReplayRecord(topic, 2, 7, samples.T0, b"k", samples.example(topics.EVENT_OF_TOPIC[topic]))
    row = flatten(record)
    schema = arrow_schema(topic)
    assert list(row) == schema.names
    assert row["_partition"] == 2 and row["_offset"] == 7 and row["_key"] == "k"
    assert pa.Table.from_pylist([row], schema=schema).num_rows == 1


def test_trajectory_arrays_become_list_columns():
    t = samples.trajectory(num_tokens=6)
    row = flatten(ReplayRecord(topics.TRAJECTORIES, 0, 0, 0, None, t))
    assert row["input_ids"] == arrays.unpack_ids(t["input_ids"]).tolist()
    assert row["loss_mask"] == [0, 0, 0, 1, 1, 1]
    assert row["rollout_logprobs"] == [0.0, 0.0, 0.0, -0.25, -0.25, -0.25]
    assert row["action_tokens"] == 3 and row["turn_lengths"] == [3] and row["_key"] is None
    assert row["metrics_json"] == '{"invalid_calls": 0.0}'


def test_group_members_become_parallel_lists():
    row = flatten(ReplayRecord(topics.GROUPS, 0, 0, 0, b"g-0001", samples.group()))
    assert row["member_trajectory_ids"] == ["t-0000", "t-0001"]
    assert row["member_advantages"] == [0.7071, -0.7071]
    assert row["member_action_tokens"] == [8, 8] and row["num_masked"] == 0


def test_task_events_are_flattened_with_their_requests_fields():
    row = flatten(ReplayRecord(topics.TASKS, 0, 0, 0, None, samples.task()))
    assert row["run"] == "example" and row["group_id"] == "g-0001" and row["stale_turns"] == 1


def test_every_column_has_a_description_in_the_schema():
    for topic in topics.ALL_TOPICS:
        for f in arrow_schema(topic):
            assert f.metadata[b"description"].strip(), (topic, f.name)


def _documented(section: str) -> dict[str, str]:
    return dict(re.findall(r"^\| `([^`]+)` \| ([^|]+?) \| \S", section, flags=re.M))


def _type(column) -> str:
    text = str(column.type).replace("list<item: ", "list<")
    return f"{text} (nullable)" if column.nullable else text


def test_replay_md_lists_every_column_with_its_type():
    text = REPLAY_MD.read_text()
    sections = dict(re.findall(r"^## `?([^`\n]+)`?\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))
    assert _documented(sections["Columns of every topic"]) == {c.name: _type(c) for c in COMMON_COLUMNS}
    for topic in topics.ALL_TOPICS:
        assert _documented(sections[topic]) == {c.name: _type(c) for c in COLUMNS[topic]}, topic


# -- files ---------------------------------------------------------------------------------------

def _records() -> list[ReplayRecord]:
    return [ReplayRecord(topics.DLQ, 0, i, samples.T0 + i, b"g-0001", samples.dead_letter()) for i in range(3)]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_writing_the_same_records_twice_gives_identical_bytes(tmp_path, suffix):
    a, b = tmp_path / f"a{suffix}", tmp_path / f"b{suffix}"
    assert write_records(_records(), topics.DLQ, [a]) == 3
    assert write_records(_records(), topics.DLQ, [b]) == 3
    assert a.read_bytes() == b.read_bytes()


def test_jsonl_rows_have_sorted_keys_and_base64_binary(tmp_path):
    path = tmp_path / "dlq.jsonl"
    write_records(_records()[:1], topics.DLQ, [path])
    line = path.read_text().splitlines()[0]
    row = json.loads(line)
    assert list(row) == sorted(row) and row["value"] == "AG5vdCBhdnJv" and row["key"] == "g-0001"


def test_empty_replay_still_writes_every_column(tmp_path):
    path = tmp_path / "empty.parquet"
    assert write_records([], topics.BATCHES, [path]) == 0
    schema = pq.read_schema(path)
    assert schema.names == [c.name for c in columns(topics.BATCHES)]
    assert schema.field("item_advantages").metadata[b"description"].startswith(b"Per batch item")


# -- bounds and CLI --------------------------------------------------------------------------------

def test_bound_parses_offsets_and_iso_times():
    assert Bound.parse("42") == Bound(offset=42)
    assert Bound.parse("2025-11-24T16:00:00Z") == Bound(timestamp_ms=1_764_000_000_000)
    assert Bound.parse("2025-11-24T16:00:00") == Bound(timestamp_ms=1_764_000_000_000)
    assert Bound.parse("2025-11-24T17:00:00.250+01:00") == Bound(timestamp_ms=1_764_000_000_250)
    for bad in ("-1", "yesterday"):
        with pytest.raises(ValueError):
            Bound.parse(bad)


def test_unknown_topic_is_one_line_and_exit_2(tmp_path):
    result = CliRunner().invoke(app, ["trajectory", "--out", str(tmp_path / "t.parquet")])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0 and "unknown topic 'trajectory'" in result.stderr


def test_output_that_is_neither_parquet_nor_jsonl_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["trajectories", "--out", str(tmp_path / "t.csv")])
    assert result.exit_code == 2 and "--out must end in .parquet or .jsonl" in result.stderr


def test_unreadable_bound_is_one_line_and_exit_2(tmp_path):
    result = CliRunner().invoke(app, ["steps", "--from", "soon", "--out", str(tmp_path / "s.jsonl")])
    assert result.exit_code == 2
    assert result.stderr == "rollstream replay steps: --from: 'soon' is neither an offset nor an ISO-8601 time\n"


@pytest.mark.parametrize("args, example", [
    (["--help"], "rollstream replay verify --run r1 --json"),
    (["trajectories", "--help"], "rollstream replay trajectories --run r1 --from"),
    (["verify", "--help"], "rollstream replay verify --run r1 --json"),
])
def test_help_shows_an_example(args, example):
    result = CliRunner().invoke(app, args, terminal_width=200)
    assert result.exit_code == 0 and example in result.stdout


def test_steps_of_an_attempt_cut_short_are_not_read_as_turns_the_re_rollout_lacks(run):
    """A worker killed after turn 2 of a three-turn attempt; the re-rollout on newer weights ended after
    two turns. The abandoned attempt's steps started before the trajectory's own attempt began."""
    t = next(r.value for r in run[topics.TRAJECTORIES] if len(r.value["turns"]) >= 2)
    tid = t["trajectory_id"]
    earlier = t["started_at_ms"] - 60_000
    for turn in range(len(t["turns"]) + 1):  # one turn more than the trajectory has
        step = copy.deepcopy(value(run, topics.STEPS, 0))
        step.update(trajectory_id=tid, turn=turn, started_at_ms=earlier + turn, weight_version=0)
        run[topics.STEPS].append(ReplayRecord(topics.STEPS, 0, 10_000 + turn, 0, tid.encode(), step))
    report = verify(run, VerifySettings(), run=RUN)
    assert failing(run) == {}
    assert report.not_checked["steps_of_abandoned_attempts"] == len(t["turns"]) + 1


def test_a_step_of_the_trajectory_s_own_attempt_for_a_turn_it_lacks_is_still_reported(run):
    t = next(r.value for r in run[topics.TRAJECTORIES] if len(r.value["turns"]) >= 2)
    step = copy.deepcopy(value(run, topics.STEPS, 0))
    step.update(trajectory_id=t["trajectory_id"], turn=len(t["turns"]), started_at_ms=t["finished_at_ms"] - 1)
    run[topics.STEPS].append(ReplayRecord(topics.STEPS, 0, 10_000, 0, t["trajectory_id"].encode(), step))
    found = failing(run)
    assert set(found) == {"steps_match_trajectories"}
    assert found["steps_match_trajectories"][0].detail == \
        f"steps events for turns [{len(t['turns'])}] that the trajectory does not have"
