"""Which splits SFT demonstrates and evaluates on: settings, `model sft --split/--eval-split`, and the run
configuration's policy.sft_splits (a configuration trained on the easy tiers warm-starts on them)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.policy.demonstrations import split_error
from pipeline.policy.sft import EVAL_SPLITS, TRAIN_SPLITS, EvalSettings, SftSettings
from pipeline.run.config import REPO_ROOT, ConfigError, RollstreamConfig, load_config
from pipeline.run.policy import ensure_policy, sft_arguments
from pipeline.run.supervision import RunFailed


def test_the_default_splits_are_the_ones_sft_always_used():
    assert SftSettings().train_splits == TRAIN_SPLITS
    assert EvalSettings().splits == EVAL_SPLITS


def test_a_split_named_for_one_family_leaves_the_others_at_their_default():
    settings = SftSettings(train_splits={"db": "easy-train"})
    assert settings.train_splits == {**TRAIN_SPLITS, "db": "easy-train"}
    assert EvalSettings(splits={"os": "easy-dev"}).splits == {**EVAL_SPLITS, "os": "easy-dev"}


def test_the_registry_decides_which_family_and_split_exist():
    assert split_error({"db": "easy-train", "kg": "1hop-train", "alfworld": "simple-dev"}) is None
    assert "no split 'easy-tran'" in split_error({"db": "easy-tran"})
    assert "easy-train" in split_error({"db": "easy-tran"})  # the message lists the splits there are
    assert "unknown family 'sql'" in split_error({"sql": "easy-train"})


@pytest.fixture
def checkpoint(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (model / name).write_text("{}")
    return model


def _sft(checkpoint, *args: str):
    return CliRunner().invoke(app, ["model", "sft", "--model", str(checkpoint), "--out",
                                    str(checkpoint.parent / "out"), "--families", "calc,db", *args])


@pytest.mark.parametrize(("args", "needle"), [
    (["--split", "db=easy-tran"], "--split: family 'db' has no split 'easy-tran'"),
    (["--split", "sql=easy-train"], "--split: unknown family 'sql'"),
    (["--split", "db"], "--split: expected FAMILY=SPLIT, got 'db'"),
    (["--split", "kg=1hop-train"], "--split names kg, which --families does not train"),
    (["--eval-split", "db=easy-tran"], "--eval-split: family 'db' has no split 'easy-tran'"),
])
def test_model_sft_refuses_a_split_the_registry_lacks_in_one_line(checkpoint, args, needle):
    result = _sft(checkpoint, *args)
    assert result.exit_code == 2
    assert needle in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_policy_sft_samples_must_name_the_families_of_sft_splits():
    with pytest.raises(ValueError, match="sft_samples"):
        RollstreamConfig(policy={"sft_splits": {"db": "easy-train"}})
    with pytest.raises(ValueError, match="sft_samples"):
        RollstreamConfig(policy={"sft_splits": {"db": "easy-train"}, "sft_samples": {"db": 8, "os": 8}})


def test_the_configured_sft_splits_become_model_sft_options():
    cfg = RollstreamConfig(policy={"sft_splits": {"db": "easy-train", "os": "easy-train"},
                                   "sft_samples": {"db": 40, "os": 20}})
    assert sft_arguments(cfg) == ("--families", "db,os", "--samples", "db=40,os=20",
                                  "--split", "db=easy-train", "--split", "os=easy-train")
    assert sft_arguments(RollstreamConfig()) == ()  # no sft_splits: model sft's own defaults


def test_ensure_policy_refuses_an_unknown_sft_split_before_making_anything(tmp_path):
    cfg = RollstreamConfig(policy={"path": str(tmp_path / "policy"), "sft_splits": {"db": "easy-tran"},
                                   "sft_samples": {"db": 8}})
    with pytest.raises(RunFailed, match="policy.sft_splits: family 'db' has no split 'easy-tran'"):
        ensure_policy(cfg, tmp_path / "logs", lambda line: None)
    assert not (tmp_path / "policy.init").exists()


def test_six_warm_starts_on_the_train_splits_it_trains_on_and_validates_on_held_out_tiers():
    cfg = load_config(REPO_ROOT / "configs" / "six.yaml")
    sources = dict(source.split(":") for source in cfg.mix.families)
    assert sorted(sources) == ["alfworld", "calc", "db", "kg", "os", "webshop"]  # the six of its name
    assert set(sources) <= set(TRAIN_SPLITS)
    assert split_error(cfg.policy.sft_splits) is None
    # calc trains RL on its rl split, made of tasks SFT never demonstrated; the tiers on their train split.
    assert {family: split for family, split in sources.items() if family != "calc"} == \
        {family: split for family, split in cfg.policy.sft_splits.items() if family != "calc"}
    held_out = dict(source.split(":") for source in cfg.mix.val_families if ":" in source)
    assert split_error(held_out) is None
    assert all(split != cfg.policy.sft_splits[family] for family, split in held_out.items())
    assert cfg.policy.path != load_config(REPO_ROOT / "configs" / "cpu.yaml").policy.path


def test_tiers_demonstrates_half_of_each_tiers_train_split_and_validates_on_held_out_tasks():
    cfg = load_config(REPO_ROOT / "configs" / "tiers.yaml")
    sources = dict(source.split(":") for source in cfg.mix.families)
    assert split_error(cfg.policy.sft_splits) is None
    # SFT shows the first half of db's and os's train splits: RL samples the whole split, half of it new.
    assert cfg.policy.sft_samples["db"] * 2 == cfg.envs.db_tier_train_tasks
    assert cfg.policy.sft_samples["os"] * 2 == cfg.envs.os_tier_train_tasks
    assert (sources["db"], sources["os"]) == (cfg.policy.sft_splits["db"], cfg.policy.sft_splits["os"])
    assert sources["calc"] != cfg.policy.sft_splits["calc"]  # calc's rl split: tasks no demonstration came from
    held_out = dict(source.split(":") for source in cfg.mix.val_families if ":" in source)
    assert all(split != cfg.policy.sft_splits[family] for family, split in held_out.items())
    assert len({cfg.policy.path, load_config(REPO_ROOT / "configs" / "cpu.yaml").policy.path,
                load_config(REPO_ROOT / "configs" / "six.yaml").policy.path}) == 3  # policies of their own


def test_a_yaml_sft_split_without_a_count_is_a_configuration_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("policy:\n  sft_splits: {db: easy-train}\n")
    with pytest.raises(ConfigError, match="policy: sft_samples"):
        load_config(path)
