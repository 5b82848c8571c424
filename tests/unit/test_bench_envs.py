"""`rollstream bench envs`: a small real run over the fast families, and families that cannot run;
the held phase (N sessions open at once) on real families and on fake ones."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from typing import Any

import pytest
from typer.testing import CliRunner

from env_workers.envs.base import Environment, Opened, Outcome, Policy, Session, Status, ToolCall, assistant_call, tool
from pipeline.bench import envs_logic
from pipeline.bench.envs_logic import Held, Memory
from pipeline.cli import app

RUNNER = CliRunner()


def test_json_reports_each_family_beside_the_bare_process_and_their_ratio() -> None:
    result = RUNNER.invoke(app, ["bench", "envs", "--families", "calc,webshop", "--sessions", "3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) == {"bare_process", "families", "median_family_p50_ms", "ratio"}
    bare = report["bare_process"]
    assert bare["command"] == "/bin/true" and bare["p50_ms"] > 0 and bare["per_s"] > 0
    assert set(report["families"]) == {"calc", "webshop"}
    for figures in report["families"].values():
        assert figures["measured"] and figures["sessions"] == 3
        assert 0 < figures["p50_ms"] <= figures["p99_ms"] and figures["sessions_per_s"] > 0
    p50s = sorted(f["p50_ms"] for f in report["families"].values())
    assert report["median_family_p50_ms"] == pytest.approx(sum(p50s) / 2)
    assert report["ratio"] == pytest.approx(report["median_family_p50_ms"] / bare["p50_ms"])


def test_held_phase_keeps_n_sessions_open_steps_each_and_leaves_nothing_behind() -> None:
    result = RUNNER.invoke(app, ["bench", "envs", "--families", "calc,webshop", "--sessions", "2", "--held", "20",
                                 "--held-concurrency", "8", "--json"])
    assert result.exit_code == 0, result.output
    for label, figures in json.loads(result.stdout)["families"].items():
        held = figures["held"]
        assert (held["sessions"], held["reached"], held["stopped_by"]) == (20, 20, None), label
        assert held["steps"] == 20 and held["step_task_errors"] == 0
        for name in ("start_p50_ms", "start_p99_ms", "steps_per_s", "step_p50_ms", "open_s", "end_s"):
            assert math.isfinite(held[name]) and held[name] > 0, (label, name)
        assert held["start_p50_ms"] <= held["start_p99_ms"]
        assert all(math.isfinite(v) for v in held["memory"].values()) and held["memory"]["rss_mib_held"] > 0
        assert held["cleanup"] == {"sessions_open": 0, "processes": 0, "fds": 0} and held["clean"]


def test_held_count_defaults_to_sessions_and_zero_skips_it() -> None:
    result = RUNNER.invoke(app, ["bench", "envs", "--families", "calc", "--sessions", "3", "--json"])
    assert json.loads(result.stdout)["families"]["calc"]["held"]["reached"] == 3
    result = RUNNER.invoke(app, ["bench", "envs", "--families", "calc", "--sessions", "3", "--held", "0", "--json"])
    assert "held" not in json.loads(result.stdout)["families"]["calc"]


def test_table_is_the_default_output() -> None:
    result = RUNNER.invoke(app, ["bench", "envs", "--families", "calc", "--sessions", "2"])
    assert result.exit_code == 0
    assert "bare /bin/true" in result.output and "calc" in result.output and "ratio" in result.output
    assert "held open at once" in result.output


def test_unknown_family_is_one_line_and_a_nonzero_exit() -> None:
    result = RUNNER.invoke(app, ["bench", "envs", "--families", "calc,chess"])
    assert result.exit_code == 2 and "unknown families ['chess']" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_os_is_measured_once_per_sandbox_backend() -> None:
    assert [label for label, _, _ in envs_logic.labels(["calc", "os"])] == ["calc", "os/docker", "os/bwrap"]


class _SlowEnvironment(Environment):
    family = "slow"

    async def open(self, sample: Mapping[str, Any]) -> Opened:
        await asyncio.sleep(5)
        return Opened([], [])

    async def call_tool(self, session: Session, call: ToolCall) -> Outcome:
        raise AssertionError("not called")


def _missing() -> tuple[Environment, list[dict[str, Any]]]:
    raise ModuleNotFoundError("No module named 'env_workers.envs.os_env'")


def test_a_family_that_cannot_start_or_takes_too_long_is_reported_not_measured() -> None:
    missing = asyncio.run(envs_logic.measure(_missing, 2, 1, 10.0))
    assert missing == {"measured": False,
                       "reason": "ModuleNotFoundError: No module named 'env_workers.envs.os_env'"}
    slow = asyncio.run(envs_logic.measure(lambda: (_SlowEnvironment(1), [{"id": 0}]), 2, 1, 0.2))
    assert slow == {"measured": False, "reason": "did not finish within 0.2 s"}


# --- the held phase on fake families ------------------------------------------------------------

_CALL = tool("poke", "Poke.", {})


class _CountingEnvironment(Environment):
    """Tracks what is open (as a sandbox's mounts would be), the most open at once, and can fail a
    start after `fail_after` or keep one session's resources on close (a leak)."""

    family = "counting"

    def __init__(self, fail_after: int | None = None, leak: bool = False) -> None:
        super().__init__(max_rounds=5)
        self.fail_after, self.leak = fail_after, leak
        self.open_ids: set[str] = set()
        self.starts = self.most_open = 0

    async def open(self, sample: Mapping[str, Any]) -> Opened:
        self.starts += 1
        state = f"s{self.starts}"
        if self.fail_after is not None and self.starts > self.fail_after:
            raise OSError("Resource temporarily unavailable")
        await asyncio.sleep(0.001)
        self.open_ids.add(state)
        self.most_open = max(self.most_open, len(self.open_ids))
        return Opened([{"role": "user", "content": "poke"}], [_CALL], state)

    async def call_tool(self, session: Session, call: ToolCall) -> Outcome:
        return Outcome("poked")

    async def close(self, session: Session) -> None:
        if session.state is not None and not (self.leak and session.state == "s1"):
            self.open_ids.discard(session.state)


class _FakeHost:
    """MemAvailable that drops by `per_start` with every session open; leftovers: what the env still holds."""

    def __init__(self, env: _CountingEnvironment, available: int = 1000, per_start: int = 0) -> None:
        self.env, self.start_available, self.per_start = env, available, per_start

    def available(self) -> int:
        return self.start_available - self.per_start * len(self.env.open_ids)

    def memory(self) -> Memory:
        return Memory(rss=100 * 1024 + 2 * 1024 * len(self.env.open_ids), children_rss=0, available=self.available())

    def leftovers(self) -> dict[str, frozenset[str]]:
        return {"sandboxes": frozenset(self.env.open_ids)}


def _poke(_: Mapping[str, Any]) -> Policy:
    return lambda history: assistant_call("poke", {})


def _held(env: _CountingEnvironment, n: int, *, steps: int = 1, guard: float = 0.8, per_start: int = 0,
          policy: Any = _poke) -> dict[str, Any]:
    spec = Held(n, concurrency=4, steps=steps, guard=guard, policy=policy,
                host=lambda e: _FakeHost(env, per_start=per_start))
    return asyncio.run(envs_logic.held_sessions(env, [{"id": "a"}, {"id": "b"}], spec, timeout_s=60))


def test_all_held_sessions_are_open_at_the_same_time_then_all_ended() -> None:
    env = _CountingEnvironment()
    held = _held(env, 10, steps=2)
    assert env.most_open == 10 and env.open_ids == set()
    assert (held["reached"], held["stopped_by"], held["steps"], held["step_task_errors"]) == (10, None, 20, 0)
    assert held["memory"]["rss_kib"] == pytest.approx(2.0)  # the fake host's 2 KiB per open session
    assert held["cleanup"] == {"sessions_open": 0, "sandboxes": 0} and held["clean"]


def test_a_failing_start_stops_the_family_short_and_says_so_and_what_opened_is_ended() -> None:
    env = _CountingEnvironment(fail_after=6)
    held = _held(env, 10)
    assert held["reached"] == 6 and held["stopped_by"].startswith("a start failed: TaskError")
    assert "Resource temporarily unavailable" in held["stopped_by"]
    assert env.open_ids == set() and held["clean"]


def test_memory_guard_stops_opening_before_the_host_runs_short() -> None:
    env = _CountingEnvironment()
    held = _held(env, 100, guard=0.5, per_start=100)  # 1000 available, each open session takes 100
    assert 5 <= held["reached"] <= 5 + 4  # at the guard, plus at most the starts already in flight
    assert held["stopped_by"].startswith("memory guard:") and "(limit 50%)" in held["stopped_by"]
    assert env.open_ids == set() and held["clean"]


def test_a_session_the_family_does_not_release_shows_in_the_cleanup_check() -> None:
    held = _held(_CountingEnvironment(leak=True), 4)
    assert held["cleanup"] == {"sessions_open": 0, "sandboxes": 1} and not held["clean"]


def test_an_oracle_that_cannot_act_leaves_the_other_figures_and_ends_every_session() -> None:
    env = _CountingEnvironment()

    def broken(_: Mapping[str, Any]) -> Policy:
        raise KeyError("walkthrough")

    spec = Held(5, 2, 1, 0.8, broken, host=lambda e: _FakeHost(env))
    figures = asyncio.run(envs_logic.measure(lambda: (env, [{"id": "a"}]), 2, 1, 10.0, spec))
    assert figures["measured"] and figures["sessions"] == 2
    assert figures["held"]["reached"] == 0 and figures["held"]["stopped_by"] == "KeyError: 'walkthrough'"
    assert env.open_ids == set()


def test_steps_stop_in_sessions_that_finished() -> None:
    class _Finishing(_CountingEnvironment):
        async def call_tool(self, session: Session, call: ToolCall) -> Outcome:
            return Outcome("done", Status.COMPLETED, 1.0)

    held = _held(_Finishing(), 3, steps=4)
    assert held["steps"] == 3


def test_memory_guard_counts_what_was_used_since_the_start() -> None:
    assert envs_logic.guard_stop(1000, 201, 0.8) is None
    assert envs_logic.guard_stop(1000, 200, 0.8) is not None
    assert envs_logic.guard_stop(1000, 1100, 0.8) is None  # memory freed elsewhere meanwhile


def test_memory_per_session_is_growth_over_sessions_in_kib() -> None:
    before, held = Memory(10 * 2**20, 0, 8 * 2**30), Memory(12 * 2**20, 4 * 2**20, 8 * 2**30 - 8 * 2**20)
    assert envs_logic.memory_per_session(before, held, 1024) == {
        "rss_kib": 2.0, "children_rss_kib": 4.0, "available_drop_kib": 8.0, "rss_mib_before": 10.0,
        "rss_mib_held": 12.0}
    assert envs_logic.memory_per_session(before, held, 0)["rss_kib"] is None


def test_leftovers_are_what_is_new_since_before_the_sessions() -> None:
    before = {"fds": frozenset({"0", "1", "2"}), "mounts": frozenset()}
    after = {"fds": frozenset({"0", "1", "7"}), "mounts": frozenset({"/tmp/rollstream-os-1-x"})}
    assert envs_logic.leftover_counts(before, after) == {"fds": 1, "mounts": 1}


def test_a_family_that_opened_nothing_reports_no_latencies_rather_than_nan() -> None:
    held = envs_logic.held_summary(10, "a start failed: x", [], 0.1, [], 0.0, 0, 0.0, {}, 0, {})
    assert held["reached"] == 0 and held["start_p50_ms"] is None and held["steps_per_s"] is None
    json.dumps(held, allow_nan=False)
