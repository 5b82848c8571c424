"""The live run picture folds events in any order, duplicates included."""

from __future__ import annotations

from pipeline.run.live_view import RunView, render
from schemas import samples, topics
from rich.console import Console


def _requested(group: str, member: int, validation: bool = False, epoch: int = 0) -> dict:
    return {**samples.example("task_requested"), "run": "r", "group_id": group, "member": member,
            "validation": validation, "epoch": epoch}


def _trajectory(group: str, member: int, *, task: str = "calc", reward: float = 1.0, validation: bool = False,
                finished_ms: int = 1_000) -> dict:
    return {**samples.example("trajectory"), "run": "r", "trajectory_id": f"{group}-{member}", "group_id": group,
            "member": member, "task": task, "status": "completed", "reward": reward, "env_reward": reward,
            "validation": validation, "finished_at_ms": finished_ms, "num_tokens": 100}


def test_duplicate_trajectories_count_once_and_other_runs_are_ignored():
    view = RunView("r")
    view.apply(topics.TASKS_REQUESTED, _requested("g", 0), 0)
    view.apply(topics.TASKS_REQUESTED, _requested("g", 1), 0)
    for _ in range(2):
        view.apply(topics.TRAJECTORIES, _trajectory("g", 0), 1_000)
    view.apply(topics.TRAJECTORIES, {**_trajectory("g", 1), "run": "other"}, 1_000)
    snap = view.snapshot(1_000)
    assert snap["tasks"]["calc"]["trajectories"] == 1
    assert snap["queue_depth"] == 1
    assert snap["trajectories_per_s"] == 1 / 60


def test_success_counts_only_completed_full_credit():
    view = RunView("r")
    view.apply(topics.TRAJECTORIES, _trajectory("g", 0, reward=1.0), 0)
    view.apply(topics.TRAJECTORIES, _trajectory("g", 1, reward=0.5), 0)
    assert view.snapshot(0)["tasks"]["calc"]["success_rate"] == 0.5


def test_validation_round_completes_when_every_requested_member_is_back():
    view = RunView("r")
    for m in range(2):
        view.apply(topics.TASKS_REQUESTED, _requested("v", m, validation=True, epoch=3), 0)
    view.apply(topics.TRAJECTORIES, _trajectory("v", 0, validation=True), 0)
    assert not view.validation_complete(3)
    view.apply(topics.TRAJECTORIES, _trajectory("v", 1, validation=True), 0)
    assert view.validation_complete(3)
    assert "calc" not in view.snapshot(0)["tasks"]  # validation is not training


def test_staleness_and_stale_share_come_from_steps():
    view = RunView("r")
    view.apply(topics.WEIGHTS, {**samples.example("weight_version"), "run": "r", "version": 4, "step": 4}, 0)
    view.apply(topics.STEPS, {**samples.example("step"), "run": "r", "pool": "stale", "weight_version": 2}, 0)
    view.apply(topics.STEPS, {**samples.example("step"), "run": "r", "pool": "current", "weight_version": 4}, 0)
    snap = view.snapshot(0)
    assert (snap["learner_version"], snap["mean_staleness"], snap["stale_turn_share"]) == (4, 1.0, 0.5)


def test_behaviour_folds_every_rollouts_steps_and_trajectories_per_task():
    view = RunView("r")
    step = {**samples.example("step"), "run": "r", "task": "os", "parse_error": "no tool call", "tool_calls": []}
    view.apply(topics.STEPS, step, 0)
    view.apply(topics.STEPS, {**step, "parse_error": None}, 0)
    looping = {**_trajectory("v", 0, task="os", validation=True),
               "metrics": {"parsed_calls": 4.0, "repeated_calls": 3.0, "dangerous_calls": 1.0}}
    view.apply(topics.TRAJECTORIES, looping, 0)
    view.apply(topics.TRAJECTORIES, looping, 0)  # an at-least-once duplicate
    b = view.snapshot(0)["behaviour"]["os"]
    assert (b["steps"], b["invalid_output_share"], b["repeated_call_share"], b["dangerous_calls"]) == (2, 0.5, 0.75, 1)


def test_engines_of_other_runs_are_not_shown_and_render_draws_every_table():
    view = RunView("r")
    view.apply(topics.ENGINES, {**samples.example("engine_heartbeat"), "engine_id": "r.current-0"}, 0)
    view.apply(topics.ENGINES, {**samples.example("engine_heartbeat"), "engine_id": "q.current-0"}, 0)
    view.apply(topics.TRAJECTORIES, _trajectory("g", 0), 0)
    assert list(view.snapshot(0)["engines"]) == ["r.current-0"]
    console = Console(record=True, width=160)
    console.print(render(view.snapshot(0), "run r"))
    text = console.export_text()
    assert "r.current-0" in text and "calc" in text and "learner step" in text and "behaviour" in text


def _alert(action: str, n: int, run: str = "r") -> dict:
    return {**samples.example("alert"), "run": run, "alert_id": f"{run}/loops/os/{n}", "action": action}


def test_alerts_are_listed_once_each_and_say_whether_the_run_is_paused_or_stopped():
    view = RunView("r")
    view.apply(topics.ALERTS, _alert("pause", 1), 0)
    view.apply(topics.ALERTS, _alert("pause", 1), 0)  # an at-least-once duplicate
    view.apply(topics.ALERTS, _alert("stop", 1, run="other"), 0)
    snap = view.snapshot(0)
    assert [a["alert_id"] for a in snap["alerts"]] == ["r/loops/os/1"]
    assert (snap["paused_by"], snap["stopped_by"]) == ("looping", None)
    console = Console(record=True, width=200)
    console.print(render(snap, "run r"))
    text = console.export_text()
    assert "paused by looping: rollstream alerts resume --run r" in text and "repeated_call_share" in text
    view.apply(topics.ALERTS, {**_alert("resume", 0), "alert_id": "r/resume/5", "rule": ""}, 0)
    view.apply(topics.ALERTS, _alert("stop", 3), 0)
    snap = view.snapshot(0)
    assert (len(snap["alerts"]), snap["paused_by"], snap["stopped_by"]) == (3, None, "looping")
