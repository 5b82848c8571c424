"""Behaviour alert rules on the real stack: `rollstream up` of configs/faults.yaml's scaled-down run (calc only,
one engine) on a scripted policy that loops (tests/helpers/looping_policy.py: every turn it samples is the
same call, add(a=1, b=1)), with two rules on the share of repeated tool calls, and the run's alerts acted on:

- `tool-call-loops` (calc's repeated_call_share above 0.5 once 4 trajectories finished, action pause): four
  turns of one call repeat it three times of four (0.75). The alert reaches `alerts` and the dispatcher sends
  nothing more, while what was in flight finishes;
- `rollstream alerts resume` lifts the pause: requests flow again;
- `loops-persist` (the same share once a task has 16 trajectories, action stop): more than were dispatched
  when the pause came (the in-flight bound, 2 x batch_size groups of 2, is 8 trajectories; 12 if the pause
  came after the first learner step), so it fires only after the resume; `up` then stops the run in order,
  says which alert stopped it, exits 1, and the report lists the alerts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from helpers.looping_policy import ensure_looping_policy
from helpers.topics import TopicReader
from pipeline.run.config import REPO_ROOT
from schemas import topics

pytestmark = pytest.mark.integration

TURNS = 4
PAUSE_RULE = {"name": "tool-call-loops", "figure": "repeated_call_share", "task": "calc", "above": 0.5,
              "min_trajectories": 4, "action": "pause"}
STOP_RULE = {"name": "loops-persist", "figure": "repeated_call_share", "above": 0.5, "min_trajectories": 16,
             "action": "stop"}
SETTLE_S = 10   # the dispatcher reads `alerts` every second; the router forwards what was already requested
HELD_S = 20     # how long nothing new may go out while paused
RUN_LIMIT_S = 900


def _config(tmp: Path) -> Path:
    cfg = yaml.safe_load((REPO_ROOT / "configs" / "faults.yaml").read_text())
    cfg["policy"] = {"path": str(ensure_looping_policy(tmp / "looping-policy", turns=TURNS))}
    cfg["engines"] = {**cfg["engines"], "current": 1, "stale": 0}
    cfg["env_workers"] = {"count": 1, "concurrency": 8}
    # Room for the call (about 50 byte-level tokens) and for four of them: three repeats in four calls.
    cfg["agent_loop"] = {**cfg["agent_loop"], "max_turns": TURNS, "max_new_tokens": 96}
    cfg["streams"] = {**cfg["streams"], "max_turns": TURNS}
    cfg["mix"] = {"families": ["calc"], "val_families": [], "val_interval": 1}
    cfg["streams"] = {**cfg["streams"], "alerts": [PAUSE_RULE, STOP_RULE]}
    cfg.update(max_steps=1000, runs_dir=str(tmp / "runs"))  # the stop rule, not max_steps, ends this run
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _left_running(run: str) -> list[str]:
    found = subprocess.run(["pgrep", "-af", run], capture_output=True, text=True).stdout.splitlines()
    return [line for line in found if "pgrep" not in line]


def _follow(reader: TopicReader, seconds: float, alive) -> None:
    """Reads what arrives for `seconds`, failing as soon as `up` has exited."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        reader.poll(1.0)
        alive()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.timeout(RUN_LIMIT_S + 300)
def test_a_pause_alert_holds_the_dispatcher_a_resume_lifts_it_and_a_stop_alert_ends_the_run(infra, tmp_path):
    # A broker set up before the `alerts` topic existed lacks it: create what infra/topics.yaml declares and it lacks.
    created = _cli("infra", "init")
    assert created.returncode == 0, created.stderr
    run = f"alerts-{uuid.uuid4().hex[:8]}"
    config = _config(tmp_path)
    reader = TopicReader(infra.kafka, [topics.ALERTS, topics.TASKS_REQUESTED, topics.TASKS], run=run)
    stderr_path = tmp_path / "up.stderr"
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "up", "--config", str(config), "--run", run,
                                 "--json", "--no-live"], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr,
                                text=True)
    log = lambda: stderr_path.read_text()[-4000:]  # noqa: E731
    alive = lambda: None if proc.poll() is None else pytest.fail(f"up exited with {proc.returncode}:\n{log()}")  # noqa: E731
    try:
        alerts = reader.events[topics.ALERTS]
        reader.wait_for(lambda: alerts, RUN_LIMIT_S - 300, "the pause alert", on_poll=alive, log=log)
        [pause] = alerts
        assert (pause["rule"], pause["task"], pause["figure"], pause["action"]) == (
            "tool-call-loops", "calc", "repeated_call_share", "pause")
        assert pause["value"] > 0.5 and pause["trajectories"] >= 4
        assert pause["alert_id"] == f"{run}/tool-call-loops/calc/1"

        # Paused: once what was already requested is routed, nothing new goes out.
        _follow(reader, SETTLE_S, alive)
        held = (len(reader.events[topics.TASKS_REQUESTED]), len(reader.events[topics.TASKS]))
        _follow(reader, HELD_S, alive)
        assert (len(reader.events[topics.TASKS_REQUESTED]), len(reader.events[topics.TASKS])) == held, \
            "the dispatcher sent tasks while paused"
        assert "paused by alert tool-call-loops" in (tmp_path / "runs" / run / "logs" / "dispatcher.log").read_text()
        assert len(alerts) == 1, alerts  # the stop rule waits for more trajectories than were in flight

        # Resumed: requests flow again, until the stop rule's task has its 16 trajectories.
        resumed = _cli("alerts", "resume", "--run", run)
        assert resumed.returncode == 0, resumed.stderr
        reader.wait_for(lambda: len(reader.events[topics.TASKS_REQUESTED]) > held[0], 300,
                        "requests after the resume", on_poll=alive, log=log)
        reader.wait_for(lambda: any(a["action"] == "stop" for a in alerts), 400, "the stop alert", on_poll=alive,
                        log=log)
        out, _ = proc.communicate(timeout=400)
    finally:
        reader.close()
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=300)
    assert proc.returncode == 1, log()
    summary = json.loads(out)
    assert summary["outcome"] == "stopped by alert loops-persist"
    assert [a["action"] for a in summary["progress"]["alerts"]] == ["pause", "resume", "stop"]
    assert "alert loops-persist stops the run" in stderr_path.read_text()
    assert _left_running(run) == []

    report = json.loads((Path(summary["run_dir"]) / "summary.json").read_text())
    assert report["alerts"]["stopped_by"] == "loops-persist" and report["alerts"]["paused_by"] is None
    assert "stopped by alert `loops-persist`" in (Path(summary["run_dir"]) / "report.md").read_text()
    listed = _cli("alerts", "list", "--run", run, "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["stopped_by"] == "loops-persist"
