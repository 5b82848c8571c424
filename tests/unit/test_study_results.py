"""`rollstream study`: the aggregation of per-seed summaries, the variant table, the seed reaching
the dispatcher, the engines' request seeds and the learner, and the study loop around its runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from env_workers.engines import sampling_key, turn_seed
from env_workers.envs.base import EnvSettings
from env_workers.worker_settings import EnvWorkerSettings
from pipeline.analysis.study import aggregate, plot_study, study_document, table_rows
from pipeline.cli import app
from pipeline.dispatch.logic import (
    Cursor,
    TaskSource,
    cursor_from_dispatched,
    next_slots,
    position_of,
    slot_at,
)
from pipeline.run.config import REPO_ROOT, ConfigError, RollstreamConfig, load_config, write_config
from pipeline.run.plan import env_worker_children
from pipeline.run.study import (
    VARIANTS,
    StudyExists,
    env_conflicts,
    parse_variants,
    run_id,
    run_study,
    variant_config,
)

PNG = b"\x89PNG"


def _summary(**changes: tuple[float, float, float] | None) -> dict[str, Any]:
    """A summary.json with, per family, a paired change (mean, lo, hi) or none."""
    tasks = {}
    for family, change in changes.items():
        tasks[family] = {"before": {"round": 0, "rate": 0.5}, "after": {"round": 1, "rate": 0.5},
                         "change": None if change is None else {"mean": change[0], "ci95": [change[1], change[2]],
                                                                "samples": 10, "up": 1, "down": 1}}
    return {"run": "r", "tasks": tasks}


def _record(variant: str, seed: int, summary: dict[str, Any] | None = None, error: str | None = None) -> dict:
    record = {"variant": variant, "seed": seed, "run": run_id("st", variant, seed), "duration_s": 1.0}
    return record | ({"summary": summary} if summary is not None else {"error": error or "boom"})


RUNS = [
    _record("base", 0, _summary(calc=(0.2, 0.05, 0.35), db=(-0.1, -0.3, 0.1))),
    _record("base", 1, _summary(calc=(0.1, -0.05, 0.25), db=(-0.2, -0.35, -0.05))),
    _record("base", 2, _summary(calc=(0.3, 0.1, 0.5), db=None)),
    _record("no-cross", 0, error="exit 1: run failed"),
    _record("no-cross", 1, _summary(calc=(0.0, -0.1, 0.1))),
]


def test_seeds_count_as_improved_or_worse_only_when_their_interval_excludes_zero():
    results = aggregate(RUNS, ["base", "no-cross"])
    calc = results["base"]["calc"]
    assert (calc["seeds"], calc["seeds_improved"], calc["seeds_worse"]) == (3, 2, 0)
    assert calc["mean_change"] == pytest.approx(0.2)
    assert [c["seed"] for c in calc["changes"]] == [0, 1, 2]
    assert calc["changes"][0] == {"seed": 0, "run": "st-base-s0", "mean": 0.2, "ci95": [0.05, 0.35], "samples": 10,
                                  "p_sign_flip": None}
    db = results["base"]["db"]  # seed 2 has no paired change for db: it does not count
    assert (db["seeds"], db["seeds_improved"], db["seeds_worse"]) == (2, 0, 1)
    assert db["mean_change"] == pytest.approx(-0.15)


def test_a_seed_whose_interval_excludes_zero_but_whose_sign_flip_test_does_not_is_not_counted_improved():
    few_changed = _summary(calc=(0.05, 0.01, 0.09))
    few_changed["tasks"]["calc"]["change"]["p_sign_flip"] = 0.0625  # five samples up, none down
    agreed = _summary(calc=(0.05, 0.01, 0.09))
    agreed["tasks"]["calc"]["change"]["p_sign_flip"] = 0.01
    calc = aggregate([_record("base", 0, few_changed), _record("base", 1, agreed)], ["base"])["base"]["calc"]
    assert (calc["seeds"], calc["seeds_improved"], calc["seeds_worse"]) == (2, 1, 0)
    assert [c["p_sign_flip"] for c in calc["changes"]] == [0.0625, 0.01]


def test_a_failed_run_is_left_out_of_its_variants_results_and_listed_as_failed():
    document = study_document("st", "c.yaml", range(2), {"base": {}, "no-cross": VARIANTS["no-cross"]}, RUNS)
    assert document["results"]["no-cross"]["calc"]["seeds"] == 1
    assert document["failed"] == [{"variant": "no-cross", "seed": 0, "run": "st-no-cross-s0", "outcome": None,
                                   "duration_s": 1.0, "error": "exit 1: run failed"}]
    assert len(document["runs"]) == 5 and "summary" not in document["runs"][0]
    assert document["variants"]["no-cross"] == {"streams": {"stale_ratio": 0.0}}


def test_a_variant_whose_runs_all_failed_has_no_families_and_says_so_in_the_table():
    results = aggregate([_record("base", 0, error="x")], ["base"])
    assert results == {"base": {}}
    assert table_rows(results) == [["base", "—", "no run with a paired change", "—"]]
    assert table_rows(aggregate(RUNS, ["base"]))[0] == ["base", "calc", "2 / 0 of 3", "+20.0 pp"]


def test_the_figure_is_a_png_and_is_skipped_without_any_change(tmp_path):
    assert plot_study(aggregate(RUNS, ["base", "no-cross"]), tmp_path / "study.png", dpi=50)
    assert (tmp_path / "study.png").read_bytes().startswith(PNG)
    assert not plot_study({"base": {}}, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_validates_and_reaches_its_child_through_the_config_file(variant, tmp_path):
    cfg = variant_config(RollstreamConfig(), variant, 3)
    path = tmp_path / "run.json"
    write_config(cfg, path)
    child = load_config(path)
    assert child.seed == 3 and child.learner_settings().seed == 3
    for section, fields in VARIANTS[variant].items():
        for name, value in fields.items():
            assert getattr(getattr(child, section), name) == value
    others = RollstreamConfig().streams.model_dump()
    assert {k: v for k, v in child.streams.model_dump().items() if v != others[k]} == VARIANTS[variant].get("streams", {})


def test_the_ablation_variants_switch_what_the_paper_switches():
    assert variant_config(RollstreamConfig(), "no-task-norm", 0).streams.task_adv_norm is False
    assert variant_config(RollstreamConfig(), "no-cross", 0).streams.stale_ratio == 0
    assert variant_config(RollstreamConfig(), "trajectory-mix", 0).streams.routing_mode == "trajectory"


def test_the_ablation_configuration_is_make_runs_with_fewer_held_out_calc_samples():
    # the study's figures stand for make run's configuration only while nothing else differs
    ablation = load_config(REPO_ROOT / "configs" / "ablation.yaml").as_data()
    cpu = load_config(REPO_ROOT / "configs" / "cpu.yaml").as_data()
    assert ablation["mix"].pop("val_samples") == {"calc": 100, "os": 4, "db": 4}
    assert cpu["mix"].pop("val_samples")["calc"] == 200
    assert ablation == cpu


def test_an_unknown_variant_is_refused_in_one_line_with_exit_2():
    with pytest.raises(ConfigError, match="unknown variant nope"):
        parse_variants("base,nope")
    assert parse_variants(" base,no-cross,base ") == ("base", "no-cross")
    result = CliRunner().invoke(app, ["study", "--seeds", "1", "--variants", "base,nope"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "rollstream study: unknown variant nope; variants: base, no-task-norm, no-cross, trajectory-mix, "
        "variance-filter, erpo-norm, fifo-window, positive-first, turn-schedule, cispo, decoupled-tis, icepop, ipa, "
        "updates-3, sao, float32, bfloat16"]


def test_environment_variables_that_would_override_the_study_are_named():
    environ = {"ROLLSTREAM_SEED": "4", "ROLLSTREAM_STREAMS__STALE_RATIO": "0.5", "rollstream_streams": "{}",
               "ROLLSTREAM_STREAMS__GROUP_SIZE": "2", "ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS": "x"}
    assert env_conflicts(["no-cross"], environ) == ["ROLLSTREAM_SEED", "ROLLSTREAM_STREAMS__STALE_RATIO",
                                                    "rollstream_streams"]
    assert env_conflicts(["base"], {"ROLLSTREAM_STREAMS__STALE_RATIO": "0.5"}) == []


def _fake_run(outcomes: dict[str, str | None]):
    """A study's run step that writes the summary a run would (or fails), without starting one."""
    calls = []

    def run(cfg: RollstreamConfig, run: str, study_dir: Path) -> tuple[dict[str, Any], bool]:
        calls.append((run, cfg.seed, cfg.streams.task_adv_norm))
        if outcomes.get(run) == "fail":
            return {"run": run, "duration_s": 0.5, "outcome": None, "error": "exit 1: boom"}, False
        return {"run": run, "duration_s": 0.5, "outcome": "finished",
                "summary": _summary(calc=(0.1 * (cfg.seed + 1), 0.01, 0.5))}, outcomes.get(run) == "interrupt"

    return run, calls


def test_a_study_runs_every_seed_under_every_variant_and_goes_on_after_a_failed_run(tmp_path):
    cfg = RollstreamConfig(runs_dir=tmp_path)
    run, calls = _fake_run({"st-no-task-norm-s0": "fail"})
    lines: list[str] = []
    document = run_study(cfg, "st", 2, ["base", "no-task-norm"], say=lines.append, run=run)
    assert calls == [("st-base-s0", 0, True), ("st-no-task-norm-s0", 0, False),
                     ("st-base-s1", 1, True), ("st-no-task-norm-s1", 1, False)]
    written = json.loads((tmp_path / "st" / "study.json").read_text())
    assert written["results"]["base"]["calc"]["seeds"] == 2
    assert written["results"]["no-task-norm"]["calc"]["seeds"] == 1
    assert [f["run"] for f in written["failed"]] == ["st-no-task-norm-s0"]
    assert written["figure"] == "study.png" and (tmp_path / "st" / "study.png").read_bytes().startswith(PNG)
    assert document["folder"] == str(tmp_path / "st") and not document["interrupted"]
    assert any("failed: exit 1: boom" in line for line in lines)
    with pytest.raises(StudyExists):  # its run ids are taken
        run_study(cfg, "st", 1, ["base"], run=run)


def test_a_study_can_start_at_a_later_seed_to_continue_another_on_the_same_policy(tmp_path):
    run, calls = _fake_run({})
    document = run_study(RollstreamConfig(runs_dir=tmp_path), "st", 2, ["base"], first_seed=3, run=run)
    assert calls == [("st-base-s3", 3, True), ("st-base-s4", 4, True)]
    assert document["seeds"] == [3, 4] and document["results"]["base"]["calc"]["seeds"] == 2
    with pytest.raises(ConfigError, match="first seed -1"):
        run_study(RollstreamConfig(runs_dir=tmp_path), "st2", 1, ["base"], first_seed=-1, run=run)


def test_an_interrupted_run_ends_the_study_with_what_it_measured(tmp_path):
    run, calls = _fake_run({"st-base-s0": "interrupt"})
    document = run_study(RollstreamConfig(runs_dir=tmp_path), "st", 3, ["base"], run=run)
    assert [c[0] for c in calls] == ["st-base-s0"]
    assert document["interrupted"] and document["results"]["base"]["calc"]["seeds"] == 1


SOURCES = (TaskSource(task="calc", split="rl", count=5), TaskSource(task="db", split="train", count=3, weight=2))


def test_seed_0_keeps_the_dispatch_order_and_another_seed_shuffles_each_epoch():
    assert [slot_at(SOURCES, k).sample_index for k in range(0, 15, 3)] == [0, 1, 2, 3, 4]
    order = {seed: [slot_at(SOURCES, k, seed) for k in range(60)] for seed in (0, 1, 2)}
    assert order[1] != order[0] and order[1] != order[2]
    for seed in (1, 2):
        calc = [s for s in order[seed] if s.task == "calc"]
        for epoch in range(4):  # every epoch still visits each sample once
            assert sorted(s.sample_index for s in calc if s.epoch == epoch) == list(range(5))
        assert [s.task for s in order[seed]] == [s.task for s in order[0]]  # the interleave stays


def test_a_seeded_dispatcher_resumes_where_it_stopped():
    assert all(position_of(SOURCES, slot_at(SOURCES, k, 7), 7) == k for k in range(200))
    first, cursor = next_slots(SOURCES, Cursor(), 7, 7)
    assert cursor_from_dispatched(SOURCES, first, 7) == cursor
    again, _ = next_slots(SOURCES, cursor, 5, 7)
    assert again == next_slots(SOURCES, Cursor(), 12, 7)[0][7:]


REQUEST = {"run": "r1", "group_id": "g", "task": "calc", "split": "rl", "sample_index": 3, "epoch": 1, "member": 2}


def test_request_seeds_follow_the_run_seed_and_the_member_not_the_run_id():
    same = sampling_key(5, REQUEST) == sampling_key(5, {**REQUEST, "run": "r2", "group_id": "h"})
    assert same
    keys = {sampling_key(seed, {**REQUEST, **change}) for seed in (0, 5)
            for change in ({}, {"member": 1}, {"epoch": 2}, {"sample_index": 4})}
    assert len(keys) == 8
    assert turn_seed(sampling_key(5, REQUEST), 10) != turn_seed(sampling_key(6, REQUEST), 10)


def test_the_run_seed_reaches_the_env_workers_and_the_learner(tmp_path):
    cfg = RollstreamConfig(seed=4, env_workers={"count": 1})
    [child] = env_worker_children(cfg, "r", tmp_path, tmp_path / "model", {}, EnvSettings())
    assert EnvWorkerSettings.model_validate_json(next(iter(child.files.values()))).seed == 4
    assert cfg.learner_settings().seed == 4 and RollstreamConfig().learner_settings().seed == 0
