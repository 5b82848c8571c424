"""Behaviour alert rules: validated in the run configuration, fired once per crossing of a task's figure
(streams/alerts.py), published by the metrics job's handler over the task's partitions
(streams/metrics_agent.py on_event), and what a run's alerts say: paused until a resume, stopped for good."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import alerts as alerts_cmd
from pipeline.run.config import ConfigError, load_config
from schemas import samples, topics
from schemas.codec import codec
from streams import alerts
from streams import metrics_agent as met
from streams.settings import AlertRule

TRUNCATING = AlertRule(name="truncating", figure="truncation_share", above=0.5, min_steps=4, action="pause")


def _check(rule: AlertRule, value: float | None, states: alerts.RuleStates, *, task: str = "os", steps: int = 10,
           trajectories: int = 10) -> list[alerts.Change]:
    return alerts.check([rule], task, {rule.figure: value}, steps, trajectories, states)


def _after(changes: list[alerts.Change]) -> alerts.RuleStates:
    return {c.rule.name: (c.fired, c.number) for c in changes}


# -- rules -------------------------------------------------------------------------------------

def test_a_rule_fires_once_while_its_figure_stays_past_the_threshold():
    [fired] = _check(TRUNCATING, 0.9, {})
    assert (fired.fired, fired.value, fired.number) == (True, 0.9, 1)
    assert _check(TRUNCATING, 0.95, _after([fired])) == []
    assert _check(TRUNCATING, 1.0, _after([fired])) == []


def test_a_rule_re_arms_when_its_figure_comes_back_and_fires_again_on_the_next_crossing():
    states = _after(_check(TRUNCATING, 0.9, {}))
    [back] = _check(TRUNCATING, 0.5, states)  # the threshold itself is the safe side
    assert (back.fired, back.number) == (False, 2)
    states = _after([back])
    assert _check(TRUNCATING, 0.4, states) == []
    [again] = _check(TRUNCATING, 0.6, states)
    assert (again.fired, again.number) == (True, 3)


def test_a_rule_waits_for_its_minimum_steps_and_trajectories():
    rule = AlertRule(name="r", figure="invalid_output_share", above=0.5, min_steps=4, min_trajectories=2)
    assert _check(rule, 1.0, {}, steps=3, trajectories=5) == []
    assert _check(rule, 1.0, {}, steps=4, trajectories=1) == []
    assert [c.fired for c in _check(rule, 1.0, {}, steps=4, trajectories=2)] == [True]


def test_a_below_rule_fires_under_its_threshold_only():
    rule = AlertRule(name="exploring", figure="mean_token_nll", below=0.05)
    assert _check(rule, 0.05, {}) == []
    assert [(c.fired, c.value) for c in _check(rule, 0.01, {})] == [(True, 0.01)]


def test_a_share_of_nothing_yet_neither_fires_nor_re_arms():
    rule = AlertRule(name="errors", figure="tool_error_share", above=0.2)
    assert _check(rule, None, {}) == []
    assert _check(rule, None, {"errors": (True, 1)}) == []


def test_a_rule_for_every_task_watches_each_on_its_own_and_a_named_task_only_that_one():
    every = AlertRule(name="every", figure="truncation_share", above=0.5)
    only_db = AlertRule(name="only-db", figure="truncation_share", above=0.5, task="db")
    figures = {"truncation_share": 1.0}
    os_changes = alerts.check([every, only_db], "os", figures, 10, 10, {})
    db_changes = alerts.check([every, only_db], "db", figures, 10, 10, {"every": (True, 1)})
    assert [c.rule.name for c in os_changes] == ["every"]
    assert [c.rule.name for c in db_changes] == ["only-db"]


def test_a_rules_state_is_the_latest_change_whichever_partition_recorded_it():
    records = [{"r": [True, 1]}, None, {"r": [False, 2], "s": [True, 1]}, {"r": [True, 3]}, {"s": [False, 0]}]
    assert alerts.latest(records) == {"r": (True, 3), "s": (True, 1)}


def test_an_alert_is_a_valid_event_whose_id_names_the_change():
    [change] = _check(TRUNCATING, 0.75, {})
    event = alerts.alert_event("run1", "os", change, 12, 3, "rollstream-streams.run1", 1_000)
    assert codec().decode(codec().encode("alert", event), "alert") == event
    assert event["alert_id"] == "run1/truncating/os/1"
    assert (event["action"], event["direction"], event["threshold"], event["steps"]) == ("pause", "above", 0.5, 12)
    assert alerts.describe(event) == ("pause: rule truncating on os, truncation_share 0.75 above 0.5 after 12 steps, "
                                      "3 trajectories")
    resume = alerts.resume_event("run1", "rollstream alerts resume", 2_000)
    assert codec().decode(codec().encode("alert", resume), "alert") == resume


def _config_error(tmp_path: Path, rules: list[dict]) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"streams": {"alerts": rules}}))
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert "\n" not in str(error.value)
    return str(error.value).split(": ", 1)[1]


@pytest.mark.parametrize(("rule", "message"), [
    ({"name": "r", "figure": "loops", "above": 0.5},
     "streams.alerts.0.figure: unknown figure 'loops'; figures: invalid_output_share, truncation_share, "
     "response_tokens_per_step, mean_token_nll, call_success_rate, tool_error_share, repeated_call_share, "
     "dangerous_calls"),
    ({"name": "r", "figure": "truncation_share", "above": 0.5, "below": 0.1},
     "streams.alerts.0: alert rule 'r' has both above and below: give one threshold"),
    ({"name": "r", "figure": "truncation_share"},
     "streams.alerts.0: alert rule 'r' has neither above nor below: give one threshold"),
    ({"name": "r", "figure": "truncation_share", "above": 0.5, "action": "rollback"},
     "streams.alerts.0.action: Input should be 'alert', 'pause' or 'stop'"),
])
def test_a_bad_rule_is_refused_in_one_line_naming_it(tmp_path, rule, message):
    assert _config_error(tmp_path, [rule]) == message


def test_two_rules_of_one_name_are_refused(tmp_path):
    rule = {"name": "r", "figure": "truncation_share", "above": 0.5}
    assert _config_error(tmp_path, [rule, rule]) == "streams: alert rule names must be unique: r given more than once"


def test_by_default_no_rule_is_configured():
    assert load_config().streams.alerts == ()


# -- the metrics job's handler -----------------------------------------------------------------

def _step(finish_reason: str, task: str = "os") -> dict:
    return {**samples.step(), "run": "r", "task": task, "finish_reason": finish_reason}


def _count(tables: met.MetricsTables, event: dict, partition: int, rules=(TRUNCATING,), kind: str = met.STEP):
    outs = met.on_event(tables, kind, event, partition, 8, tuple(rules), "w", 5_000)
    return [codec().decode(value, topics.EVENT_OF_TOPIC[topic]) for topic, _, value in outs
            if topic == topics.ALERTS]


def test_the_metrics_job_alerts_once_per_crossing_over_every_partition_of_the_task():
    tables = met.MetricsTables({}, {})
    assert [_count(tables, _step("length"), p % 2) for p in range(3)] == [[], [], []]  # under min_steps
    [alert] = _count(tables, _step("length"), 1)  # 4 steps over partitions 0 and 1, all truncated
    assert (alert["alert_id"], alert["task"], alert["value"], alert["steps"], alert["action"]) == (
        "r/truncating/os/1", "os", 1.0, 4, "pause")
    assert _count(tables, _step("length"), 0) == []  # still past: no flood
    assert [_count(tables, _step("stop"), 0) for _ in range(5)] == [[]] * 5  # 5 of 10 truncated: re-armed
    assert alerts.latest(tables.rule_states.values()) == {"truncating": (False, 2)}
    [again] = _count(tables, _step("length"), 1)
    assert again["alert_id"] == "r/truncating/os/3"


def test_the_metrics_job_keeps_no_rule_state_without_rules():
    tables = met.MetricsTables({}, {})
    assert _count(tables, _step("length"), 0, rules=()) == []
    assert tables.rule_states == {} and tables.counters["r|os|0"]["steps"] == 1


def test_a_rule_on_trajectories_counts_the_tasks_finished_trajectories():
    rule = AlertRule(name="loops", figure="repeated_call_share", above=0.5, min_trajectories=2, action="stop")
    looping = {**samples.trajectory(), "run": "r", "task": "os",
               "metrics": {"parsed_calls": 4.0, "repeated_calls": 3.0}}
    tables = met.MetricsTables({}, {})
    assert _count(tables, looping, 0, [rule], met.TRAJECTORY) == []
    [alert] = _count(tables, {**looping, "trajectory_id": "t-2"}, 3, [rule], met.TRAJECTORY)
    assert (alert["value"], alert["trajectories"], alert["action"]) == (0.75, 2, "stop")


# -- what a run's alerts say -------------------------------------------------------------------

def _alert(action: str, rule: str = "r", n: int = 1) -> dict:
    return {**samples.alert(), "alert_id": f"run/{rule}/os/{n}", "rule": rule, "action": action}


def test_a_pause_holds_the_run_until_a_resume():
    hold = alerts.RunHold()
    assert hold.apply(_alert("pause", "first")) and hold.apply(_alert("pause", "second"))
    assert (hold.paused_by, hold.held_by) == ("first", "first")
    hold.apply(alerts.resume_event("run", "cli", 1))
    assert hold.held_by is None


def test_a_stop_holds_for_good_and_a_resume_does_not_lift_it():
    hold = alerts.RunHold()
    hold.apply(_alert("stop", "broken"))
    hold.apply(alerts.resume_event("run", "cli", 1))
    assert (hold.stopped_by, hold.held_by) == ("broken", "broken")


def test_an_alert_only_rule_holds_nothing():
    hold = alerts.RunHold()
    assert hold.apply(_alert("alert"))
    assert hold.held_by is None


def test_a_pause_delivered_again_after_a_resume_does_not_pause_the_run_again():
    hold = alerts.RunHold()
    hold.apply(_alert("pause"))
    hold.apply(alerts.resume_event("run", "cli", 1))
    assert not hold.apply(_alert("pause"))  # the same alert id: a redelivery
    assert hold.held_by is None
    assert hold.apply(_alert("pause", n=3))  # the rule's next crossing is a new alert
    assert hold.held_by == "r"


def test_alerts_commands_show_an_example():
    for command in ("list", "resume"):
        result = CliRunner().invoke(alerts_cmd.app, [command, "--help"])
        assert result.exit_code == 0 and f"rollstream alerts {command} --run r1" in result.output
