"""The run report (pipeline/analysis/report.py, pipeline/cli/report.py) on a small synthetic run whose numbers
are worked out by hand. Every event goes through the real Avro codec first, so the report reads
exactly the field names and types the topics carry."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from pipeline.analysis.evaluation import before_after
from pipeline.analysis.report import (
    ReportSettings,
    _sentence,
    build_report,
    group_staleness,
    learner_series,
    run_events,
    run_span_ms,
    stale_share_over_time,
    throughput_over_time,
    training_turns,
    trajectory_versions,
)
from pipeline.analysis.run_report import events_from_records, print_summary
from pipeline.cli.report import app as report_app
from pipeline.analysis.replay_records import ReplayRecord
from schemas import arrays, codec, samples, topics
from schemas.ids import batch_id, group_id, trajectory_id
from streams.alerts import resume_event

RUN = "synthetic"
T0 = 1_700_000_000_000  # first event of the run: the first task request
END = T0 + 600_000      # last event of the run: the last learner metric
FIGURES = ["evaluation.png", "success_reward.png", "staleness.png", "stale_share.png", "throughput.png", "learner.png"]
SPLITS = {"calc": ("train", "dev"), "db": ("standard", "dev")}


def event(event_type: str, value: dict[str, Any]) -> dict[str, Any]:
    """`value` as a consumer decodes it, after checking it names exactly the schema's fields."""
    assert set(value) == {f["name"] for f in codec.codec().schema(event_type)["fields"]}
    return codec.decode(codec.encode(event_type, value))


def trajectory(task: str, split: str, sample: int, epoch: int, member: int, success: bool, *,
               versions: tuple[int, ...] = (0, 0), pools: tuple[str, ...] = ("current", "current"),
               validation: bool = False, finished_at_ms: int = T0 + 60_000, status: str | None = None,
               run: str = RUN) -> dict[str, Any]:
    gid = group_id(run, task, split, sample, epoch)
    status = status or ("completed" if success else "task_limit_reached")
    env_reward = 1.0 if success else 0.0
    return event("trajectory", {
        "trajectory_id": trajectory_id(run, gid, member), "run": run, "group_id": gid, "member": member,
        "group_size": 4, "task": task, "split": split, "sample_index": sample, "validation": validation,
        "input_ids": arrays.pack_ids([1, 2, 3]), "loss_mask": arrays.pack_mask([0, 1, 1]),
        "rollout_logprobs": arrays.pack_logprobs([0.0, -0.5, -0.5]), "arrays_uri": None, "num_tokens": 100,
        "prompt_tokens": 40,
        "turns": [{"turn": i, "pool": pool, "engine_id": f"{pool}-0", "weight_version": v, "start": 1 + i,
                   "length": 1, "generate_ms": 5.0, "env_ms": 1.0} for i, (v, pool) in enumerate(zip(versions, pools))],
        "status": status, "reward": env_reward if status == "completed" else -0.2, "env_reward": env_reward,
        "termination": "env_finished", "template_fingerprint": "f" * 64, "worker_id": "w0",
        "started_at_ms": finished_at_ms - 10_000, "finished_at_ms": finished_at_ms, "score": None, "metrics": {},
    })


def step_of(t: dict[str, Any], turn: dict[str, Any]) -> dict[str, Any]:
    return event("step", {
        "run": t["run"], "trajectory_id": t["trajectory_id"], "group_id": t["group_id"], "member": t["member"],
        "task": t["task"], "turn": turn["turn"], "planned_pool": turn["pool"], "pool": turn["pool"],
        "engine_id": turn["engine_id"], "weight_version": turn["weight_version"], "prompt_tokens": 40,
        "output_ids": arrays.pack_ids([2]), "output_logprobs": arrays.pack_logprobs([-0.5]), "finish_reason": "stop",
        "tool_calls": [], "parse_error": None, "env_status": t["status"], "reward": t["reward"],
        "finish": turn["turn"] == 1,
        "env_tokens": 0, "started_at_ms": t["started_at_ms"] + 1000 * turn["turn"], "generate_ms": 5.0, "env_ms": 1.0,
    })


def group_of(members: list[dict[str, Any]]) -> dict[str, Any]:
    first = members[0]
    return event("group", {
        "group_id": first["group_id"], "run": RUN, "task": first["task"], "split": first["split"],
        "sample_index": first["sample_index"], "group_size": 4, "validation": False, "completion": "complete",
        "members": [{"trajectory": m, "advantage": 0.0, "masked": False} for m in members],
        "reward_mean": 0.0, "reward_std": 0.0, "all_equal": False,
        "min_weight_version": min(turn["weight_version"] for m in members for turn in m["turns"]),
        "first_arrival_ms": first["finished_at_ms"], "last_arrival_ms": first["finished_at_ms"],
        "ready_at_ms": first["finished_at_ms"] + 1000,
    })


def batch_of(index: int, groups: list[dict[str, Any]]) -> dict[str, Any]:
    gids = [g["group_id"] for g in groups]
    return event("batch", {
        "batch_id": batch_id(RUN, gids), "run": RUN, "index": index, "credit_version": index, "group_ids": gids,
        "items": [{"trajectory": m["trajectory"], "group_advantage": 0.0, "advantage": 0.0}
                  for g in groups for m in g["members"]],
        "task_stats": [], "created_at_ms": T0 + 200_000 + 100_000 * index,
        "payload_uri": None, "payload_sha256": None, "payload_bytes": None,
    })


def weights(version: int, batch: str | None) -> dict[str, Any]:
    return event("weight_version", {
        "run": RUN, "version": version, "step": version, "batch_id": batch, "manifest_uri": f"s3://w/{version}",
        "shards": [], "broadcast_pools": ["current"], "published_at_ms": T0 + 250_000 + 100_000 * version,
    })


def metric(name: str, value: float, step: int | None, at_ms: int, run: str = RUN) -> dict[str, Any]:
    return event("metric", {"run": run, "name": name, "value": value, "step": step, "labels": {},
                            "source": "learner", "at_ms": at_ms})


def requested(t: dict[str, Any], epoch: int) -> dict[str, Any]:
    return event("task_requested", {
        "run": RUN, "group_id": t["group_id"], "member": t["member"], "group_size": 4, "task": t["task"],
        "split": t["split"], "sample_index": t["sample_index"], "epoch": epoch, "validation": t["validation"],
        "policy_version": 0, "dispatched_at_ms": T0,
    })


def validation_round(task: str, epoch: int, successes: int, finished_at_ms: int) -> list[dict[str, Any]]:
    """20 episodes: 5 samples x 4 members, the first `successes` of them successful."""
    return [trajectory(task, SPLITS[task][1], k // 4, epoch, k % 4, k < successes, validation=True,
                       finished_at_ms=finished_at_ms) for k in range(20)]


def synthetic_run(with_validation: bool = True) -> dict[str, list[dict[str, Any]]]:
    """Four training groups of 4 in two batches (-> versions 1 and 2) and two validation rounds:
    calc 2/20 -> 18/20 (improved), db 5/20 -> 6/20 (no clear change).
    Staleness: batch 0 (became v1, trained from v0): calc0 and db0 rolled out with v0 -> 0, 0;
    batch 1 (became v2, trained from v1): calc1 on v1 -> 0; db1 has a stale turn on v0 -> 1."""
    calc0 = [trajectory("calc", "train", 0, 0, m, m == 0) for m in range(4)]
    db0 = [trajectory("db", "standard", 0, 0, m, False, status="agent_invalid_action" if m == 3 else None)
           for m in range(4)]
    calc1 = [trajectory("calc", "train", 1, 0, m, m < 2, versions=(1, 1), finished_at_ms=T0 + 180_000)
             for m in range(4)]
    db1 = [trajectory("db", "standard", 1, 0, m, m == 0, versions=(0, 1), pools=("stale", "current"),
                      finished_at_ms=T0 + 180_000) for m in range(4)]
    train = calc0 + db0 + calc1 + db1
    groups = [group_of(g) for g in (calc0, db0, calc1, db1)]
    batches = [batch_of(0, groups[:2]), batch_of(1, groups[2:])]
    val = (validation_round("calc", 0, 2, T0 + 30_000) + validation_round("db", 0, 5, T0 + 30_000)
           + validation_round("calc", 2, 18, T0 + 400_000) + validation_round("db", 2, 6, T0 + 400_000))
    trajs = train + (val if with_validation else [])
    learner = [metric(name, value * step, step, T0 + 250_000 + 100_000 * step)
               for step in (1, 2) for name, value in (("actor/loss", 0.5), ("actor/pg_loss", 0.4),
                                                      ("actor/kl_loss", 1e-4), ("actor/ppo_kl", 2e-3),
                                                      ("actor/pg_clipfrac", 0.05))]
    return {
        topics.TRAJECTORIES: trajs + [calc0[0], trajectory("calc", "train", 0, 0, 0, True, run="other-run")],
        topics.STEPS: [step_of(t, turn) for t in train for turn in t["turns"]],
        topics.GROUPS: groups,
        topics.BATCHES: batches,
        topics.WEIGHTS: [weights(0, None), weights(1, batches[0]["batch_id"]), weights(2, batches[1]["batch_id"])],
        topics.METRICS: learner + [metric("streams/queue_depth", 3.0, None, END),
                                   metric("actor/loss", 9.0, 1, T0, "other-run")],
        topics.TASKS_REQUESTED: [requested(t, 0) for t in train]
        + ([requested(t, 0) for t in val[:40]] if with_validation else []),  # round 2 found from the group ids
    }


@pytest.fixture(scope="module")
def full_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The synthetic run's report, drawn once (figures cost about a second each on a busy 2-core machine)."""
    out = tmp_path_factory.mktemp("report")
    return out, build_report(synthetic_run(), out, RUN)


def test_report_of_a_synthetic_run_has_every_file_and_the_hand_computed_summary(
        full_report: tuple[Path, dict[str, Any]]) -> None:
    tmp_path, summary = full_report
    for name in ["report.md", "summary.json", *FIGURES]:
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "evaluation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert sorted(summary["figures"]) == sorted(FIGURES)
    assert summary["run"] == RUN and summary["duration_s"] == 600.0 and summary["learner_steps"] == 2
    assert summary["trajectories"] == 16 + 80  # the duplicate and the other run's trajectory are not counted
    calc, db = summary["tasks"]["calc"], summary["tasks"]["db"]
    assert calc["before"]["round"] == 0 and (calc["before"]["episodes"], calc["before"]["successes"]) == (20, 2)
    assert calc["before"]["rate"] == 0.1 and calc["before"]["ci95"] == pytest.approx([0.0279, 0.3010], abs=1e-4)
    assert calc["after"]["round"] == 2 and (calc["after"]["episodes"], calc["after"]["successes"]) == (20, 18)
    assert calc["after"]["ci95"] == pytest.approx([0.6990, 0.9721], abs=1e-4)
    assert calc["verdict"] == "improved"
    assert db["before"]["ci95"] == pytest.approx([0.1119, 0.4687], abs=1e-4)
    assert db["after"]["ci95"] == pytest.approx([0.1455, 0.5190], abs=1e-4)
    assert db["verdict"] == "no clear change"
    report = (tmp_path / "report.md").read_text()
    for name in FIGURES:
        assert f"]({name})" in report
    assert "- **calc**: improved" in report and "- **db**: no clear change" in report
    assert "Wilson intervals" in report and "paired per held-out sample" in report
    assert calc["criterion"] == "disjoint intervals"  # too few samples to pair: the conservative rule decides
    assert "| db | 8 |" in report  # training termination table: 8 db trajectories
    assert summary["behaviour"]["calc"]["steps"] == 16 and summary["behaviour"]["db"]["mean_token_nll"] == 0.5


def test_run_without_validation_still_builds_and_says_so(tmp_path: Path) -> None:
    summary = build_report(synthetic_run(with_validation=False), tmp_path, RUN, settings=ReportSettings(dpi=50))
    assert "evaluation.png" not in summary["figures"] and not (tmp_path / "evaluation.png").exists()
    assert summary["tasks"]["calc"] == {"before": None, "after": None, "change": None, "criterion": None,
                                        "intervals_disjoint": False,
                                        "p_value": None, "verdict": "no validation"}
    report = (tmp_path / "report.md").read_text()
    assert "No validation rollouts yet" in report and "- **calc**: no validation rollouts" in report
    assert (tmp_path / "staleness.png").stat().st_size > 0


def test_report_has_a_behaviour_table_per_task_with_its_calls_per_tool(tmp_path: Path) -> None:
    ok, loop = (trajectory("calc", "train", k, 0, 0, k == 0) for k in range(2))
    loop["metrics"] = {"parsed_calls": 2.0, "repeated_calls": 1.0, "dangerous_calls": 1.0,
                       "dangerous_calls:network": 1.0, "tool_calls": 2.0, "tool_errors": 1.0}
    add = {"name": "add", "arguments_json": '{"a": 1, "b": 2}'}
    steps = [{**step_of(ok, ok["turns"][0]), "tool_calls": [add]},
             {**step_of(ok, ok["turns"][1]), "tool_calls": [], "parse_error": "no call", "finish_reason": "length"},
             {**step_of(loop, loop["turns"][0]), "tool_calls": [add], "env_status": "task_error"},
             {**step_of(loop, loop["turns"][1]), "tool_calls": [add]}]
    summary = build_report({topics.TRAJECTORIES: [ok, loop], topics.STEPS: steps}, tmp_path, RUN,
                           settings=ReportSettings(dpi=50))
    calc = summary["behaviour"]["calc"]
    assert (calc["steps"], calc["invalid_output_share"], calc["truncation_share"], calc["calls"]) == (4, 0.25, 0.25, 3)
    assert (calc["call_success_rate"], calc["tool_error_share"], calc["repeated_call_share"]) == (2 / 3, 0.5, 0.5)
    assert calc["dangerous_by_pattern"] == {"network": 1}
    assert json.loads((tmp_path / "summary.json").read_text())["behaviour"] == summary["behaviour"]
    report = (tmp_path / "report.md").read_text()
    assert "## Behaviour" in report
    assert "| calc | 4 | 25.0% | 25.0% | 1.0 | 0.500 | 3 | 66.7% | 50.0% | 50.0% | 1 (network 1) |" in report
    assert "| calc | add | 3 | 66.7% |" in report


def test_run_with_no_events_builds_an_empty_report(tmp_path: Path) -> None:
    summary = build_report({}, tmp_path / "empty", RUN)
    assert summary == {"run": RUN, "duration_s": 0.0, "learner_steps": 0, "tasks": {}, "trajectories": 0,
                       "figures": [], "learning_signal": {}, "behaviour": {},
                       "alerts": {"events": [], "paused_by": None, "stopped_by": None}}
    assert "No trajectories in this run yet" in (tmp_path / "empty" / "report.md").read_text()


def test_duration_comes_from_record_timestamps_when_known() -> None:
    run = synthetic_run()
    assert run_span_ms(run) == (T0, END)
    # a benchmark's fixed event times must not stretch the run: the broker's record times win
    stamped = {topic: [{**e, "_timestamp_ms": T0 + 5_000 + 1_000 * i} for i, e in enumerate(evs[:3])]
               for topic, evs in run.items()}
    assert run_span_ms(stamped) == (T0 + 5_000, T0 + 7_000)


def test_staleness_is_trained_from_version_minus_oldest_behaviour_version() -> None:
    run = synthetic_run()
    assert sorted(group_staleness(run[topics.BATCHES], run[topics.WEIGHTS], run[topics.GROUPS])) == [0, 0, 0, 1]
    # without the groups topic the batch's own trajectories tell the oldest version
    assert sorted(group_staleness(run[topics.BATCHES], run[topics.WEIGHTS], [])) == [0, 0, 0, 1]
    # a batch no weights event names was not trained
    assert group_staleness(run[topics.BATCHES], run[topics.WEIGHTS][:2], []) == [0, 0]


def test_trajectory_version_is_its_newest_turn_else_its_group_minimum() -> None:
    run = synthetic_run()
    db1 = [t for t in run[topics.TRAJECTORIES] if t["task"] == "db" and t["sample_index"] == 1 and not t["validation"]]
    assert set(trajectory_versions(db1, run[topics.STEPS], []).values()) == {1}
    no_turns = [{**t, "turns": []} for t in db1]
    assert set(trajectory_versions(no_turns, [], run[topics.GROUPS]).values()) == {0}


def test_stale_share_counts_training_turns_per_minute_from_steps_else_trajectories() -> None:
    run = run_events(synthetic_run(), RUN)  # without the duplicate and the other run's trajectory
    trajs = run[topics.TRAJECTORIES]
    train = [t for t in trajs if not t["validation"]]
    val_groups = {t["group_id"] for t in trajs if t["validation"]}
    val_traj = next(t for t in trajs if t["validation"])
    source, turns = training_turns(run[topics.STEPS] + [step_of(val_traj, val_traj["turns"][0])], train, val_groups)
    assert source == "steps" and len(turns) == 32  # the validation step is left out
    # minute 0: calc0 + db0, 16 current turns; minute 2: calc1 + db1, 4 of 16 turns stale
    assert stale_share_over_time(turns, T0, 60.0) == {"minute": [0.0, 2.0], "share": [0.0, 0.25], "turns": [16, 16]}
    source, turns = training_turns([], train, val_groups)
    assert source == "trajectories"
    assert stale_share_over_time(turns, T0, 60.0) == {"minute": [1.0, 3.0], "share": [0.0, 0.25], "turns": [16, 16]}


def test_throughput_is_per_second_within_each_bucket_with_empty_buckets_as_zero() -> None:
    trajs = [{"finished_at_ms": T0 + 10_000, "num_tokens": 300}, {"finished_at_ms": T0 + 20_000, "num_tokens": 300},
             {"finished_at_ms": T0 + 130_000, "num_tokens": 60}]
    assert throughput_over_time(trajs, T0, 60.0) == {"minute": [0.0, 1.0, 2.0],
                                                     "trajectories_per_s": [2 / 60, 0.0, 1 / 60],
                                                     "tokens_per_s": [10.0, 0.0, 1.0]}


def test_learner_series_keeps_stepped_metrics_and_the_last_value_of_a_step() -> None:
    metrics = [metric("actor/pg_clipfrac", 0.1, 2, T0), metric("actor/pg_clipfrac", 0.2, 1, T0),
               metric("actor/pg_clipfrac", 0.3, 2, T0 + 1), metric("actor/pg_clipfrac", 0.9, None, T0)]
    assert learner_series(metrics, ["actor/pg_clipfrac"]) == {"actor/pg_clipfrac": ([1, 2], [0.2, 0.3])}


def test_replayed_records_become_events_with_their_record_time() -> None:
    value = metric("actor/loss", 1.0, 1, T0)
    events = events_from_records({topics.METRICS: [ReplayRecord(topics.METRICS, 0, 5, T0 + 7, b"actor/loss", value)],
                                  topics.STEPS: []})
    assert events == {topics.METRICS: [{**value, "_timestamp_ms": T0 + 7}], topics.STEPS: []}


def test_summary_table_shows_each_task_with_its_interval_and_verdict(full_report: tuple[Path, dict[str, Any]]) -> None:
    out_dir, summary = full_report
    out = io.StringIO()
    print_summary(summary, out_dir, Console(file=out, width=200))
    text = out.getvalue()
    assert "run synthetic: 600 s, 2 learner steps, 96 trajectories" in text
    assert "r0: 2/20 = 10.0% [2.8, 30.1]" in text and "r2: 18/20 = 90.0% [69.9, 97.2]" in text
    assert "improved" in text and "no clear change" in text
    assert " pts [" in text and " samples)" in text  # the paired change beside the rounds


def test_a_change_the_interval_sees_and_the_sign_flip_test_does_not_is_reported_as_too_few_samples_changed() -> None:
    def round_of(epoch: int, wins: list[int]) -> list[dict[str, Any]]:
        trajs = []
        for sample, won in enumerate(wins):
            gid = group_id("r", "db", "dev", sample, epoch)
            trajs.append({"trajectory_id": trajectory_id("r", gid, 0), "run": "r", "group_id": gid, "member": 0,
                          "task": "db", "split": "dev", "sample_index": sample, "validation": True,
                          "status": "completed", "env_reward": float(won), "reward": float(won)})
        return trajs

    row = before_after(round_of(0, [0] * 100) + round_of(1, [1] * 5 + [0] * 95))["db"]
    sentence = _sentence("db", row)
    assert row["verdict"] == "no clear change"
    assert "the interval excludes zero but the sign-flip test does not (sign-flip p = 0.062)" in sentence


def test_report_help_shows_an_example() -> None:
    result = CliRunner().invoke(report_app, ["--help"])
    assert result.exit_code == 0
    assert "rollstream report --run r1" in result.output


def test_learning_signal_counts_training_groups_whose_rewards_were_all_equal():
    from pipeline.analysis.report import learning_signal

    groups = [{"task": "calc", "validation": False, "all_equal": True},
              {"task": "calc", "validation": False, "all_equal": False},
              {"task": "calc", "validation": True, "all_equal": True},
              {"task": "os", "validation": False, "all_equal": True}]
    assert learning_signal(groups) == {"calc": {"groups": 2, "all_equal": 1, "filtered": 0},
                                       "os": {"groups": 1, "all_equal": 1, "filtered": 0}}


def test_groups_filtered_out_as_all_equal_count_as_equal_groups_once_and_validation_ones_not_at_all():
    from pipeline.analysis.report import learning_signal
    from schemas.topics import GROUP_DROPPED_METRIC

    def dropped(gid, reason="all_equal", task="calc"):
        return {"name": GROUP_DROPPED_METRIC, "labels": {"group_id": gid, "reason": reason, "task": task}}

    groups = [{"task": "calc", "validation": False, "all_equal": False}]
    metrics = [dropped("g1"), dropped("g1"), dropped("g2", task="os"), dropped("g3", reason="stale"),
               dropped("v1"), {"name": "actor/pg_loss", "labels": {}}]
    assert learning_signal(groups, metrics, validation_groups={"v1"}) == {
        "calc": {"groups": 2, "all_equal": 1, "filtered": 1}, "os": {"groups": 1, "all_equal": 1, "filtered": 1}}


def test_report_lists_the_runs_alerts_once_each_and_says_the_run_was_stopped(tmp_path: Path) -> None:
    base = {**samples.alert(), "run": RUN}
    pause = event("alert", {**base, "alert_id": f"{RUN}/looping/os/1", "at_ms": T0 + 90_000})
    resume = event("alert", resume_event(RUN, "rollstream alerts resume", T0 + 120_000))
    stop = event("alert", {**base, "alert_id": f"{RUN}/truncating/db/1", "rule": "truncating", "task": "db",
                           "figure": "truncation_share", "value": 0.97, "threshold": 0.5, "action": "stop",
                           "steps": 8, "trajectories": 4, "at_ms": T0 + 180_000})
    other = event("alert", {**base, "run": "other-run", "action": "stop"})
    summary = build_report({topics.ALERTS: [pause, pause, resume, stop, other],
                            topics.TASKS_REQUESTED: [requested(trajectory("calc", "train", 0, 0, 0, True), 0)]},
                           tmp_path, RUN, settings=ReportSettings(dpi=50))
    alerts = summary["alerts"]
    assert [(a["action"], a["rule"]) for a in alerts["events"]] == [("pause", "looping"), ("resume", ""),
                                                                   ("stop", "truncating")]
    assert (alerts["stopped_by"], alerts["paused_by"]) == ("truncating", None)
    assert json.loads((tmp_path / "summary.json").read_text())["alerts"] == alerts
    report = (tmp_path / "report.md").read_text()
    assert "**The run was stopped by alert `truncating`.**" in report
    assert "| 3.0 | stop | truncating | db | truncation_share | 0.97 | above 0.5 | 8 | 4 |" in report
    assert "| 2.0 | resume | — | * | — | — | — | 0 | 0 |" in report


def test_a_run_without_alerts_says_none_fired(full_report: tuple[Path, dict[str, Any]]) -> None:
    out_dir, summary = full_report
    assert summary["alerts"] == {"events": [], "paused_by": None, "stopped_by": None}
    assert "_No alert fired._" in (out_dir / "report.md").read_text()
