"""One config, typed: YAML keys and flags map one to one, and mistakes are ConfigErrors."""

import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from {{ cookiecutter.project_slug }}.config import ConfigError, TrainConfig, load_config, render_yaml
from {{ cookiecutter.project_slug }}.tracking import check_wandb

from conftest import ROOT

CONFIG = ROOT / "configs" / "train.yaml"


def test_config_file_holds_every_field_and_nothing_else():
    keys = set(yaml.safe_load(CONFIG.read_text()))
    assert keys == {f.name for f in fields(TrainConfig)}
    assert all(f.metadata.get("help") for f in fields(TrainConfig))


def test_every_default_lives_once_in_the_dataclass(tmp_path, capsys):
    """configs/train.yaml is written from TrainConfig (`python -m <slug>.config`), and an empty
    config file, that file and --help all give TrainConfig's defaults."""
    assert CONFIG.read_text() == render_yaml(), "configs/train.yaml is stale: python -m <slug>.config > it"
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(["--config", str(empty)]) == TrainConfig() == load_config(["--config", str(CONFIG)])
    with pytest.raises(SystemExit):
        load_config(["--config", str(CONFIG), "--help"])
    options = " ".join(capsys.readouterr().out.split()).partition("options:")[2]
    for key, value in TrainConfig().to_dict().items():  # each option's text ends with its default
        shown = re.search(r"\(default: ([^)]*)\)", options[options.index(f"--{key} "):])[1]
        assert shown == (str(value).lower() if isinstance(value, bool) else str(value)), key


def test_later_config_files_win_and_the_merge_is_printed(tmp_path):
    """--config A --config B: B's keys over A's, flags over both; `python -m <slug>.config` with
    them prints the merged config as YAML (what a run records); every shipped overlay loads."""
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("learning_rate: 1.0e-4\nmax_steps: 7\nseed: 3\n")
    second.write_text("max_steps: 11\noptimizer: sgd\n")
    argv = ["--config", str(CONFIG), "--config", str(first), "--config", str(second), "--seed", "5"]
    cfg = load_config(argv)
    assert (cfg.learning_rate, cfg.max_steps, cfg.optimizer, cfg.seed) == (1e-4, 11, "sgd", 5)
    printed = subprocess.run([sys.executable, "-m", "{{ cookiecutter.project_slug }}.config", *argv], cwd=ROOT,
                             capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": "src"})
    assert printed.returncode == 0, printed.stderr
    assert yaml.safe_load(printed.stdout) == cfg.to_dict()
    for overlay in sorted((ROOT / "configs" / "experiments").glob("*.yaml")):
        values = yaml.safe_load(overlay.read_text())
        merged = load_config(["--config", str(CONFIG), "--config", str(overlay)]).to_dict()
        assert {key: merged[key] for key in values} == values, overlay.name


def test_flags_override_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1.0e-4\nmax_steps: 7\ngradient_checkpointing: true\n")
    cfg = load_config(["--config", str(path), "--max_steps", "9", "--optimizer", "sgd"])
    assert (cfg.learning_rate, cfg.max_steps, cfg.optimizer, cfg.gradient_checkpointing) == (1e-4, 9, "sgd", True)
    assert load_config(["--config", str(path), "--gradient_checkpointing", "false"]).gradient_checkpointing is False


@pytest.mark.parametrize("text,message", [
    ("max_step: 3\n", "unknown key(s) max_step"),
    ("max_steps: three\n", "invalid int value: 'three'"),
    ("max_steps: 1.5\n", "invalid int value: '1.5'"),
    ("learning_rate: fast\n", "invalid float value: 'fast'"),
    ("task: translation\n", "invalid choice: 'translation'"),
    ("micro_batch_size: 0\n", "micro_batch_size must be >= 1"),  # the whole line: max_steps 0
    ("max_steps: 0\n", "max_steps must be -1 (train num_epochs) or >= 1, got 0"),
    ("- a list\n", "must hold a mapping"),
    ("seed: [1, 2]\n", "must be a single value"),
    ("seed: 1\n  bad indent: 2\n", "is not valid YAML at line 2, column 13: mapping values are not allowed here"),
    ("learning_rate: .inf\n", "learning_rate must be a finite number, got inf"),
    ("max_grad_norm: .nan\n", "max_grad_norm must be a finite number"),  # the whole line: learning_rate .inf
    ("task: yes\n", "key 'task' got the YAML boolean true; quote the value you mean"),
    ("seed: no\n", "key 'seed' got the YAML boolean false"),
    ("report_to:\n", "key(s) report_to in {path} have no value (YAML null); give one, or leave the key out"),
    ("seed: 3\nreport_to: null\nwandb_project: ~\n", "key(s) report_to, wandb_project in {path} have no value"),
])
def test_bad_config_files(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(["--config", str(path)])
    assert message.format(path=path) in str(err.value)


@pytest.mark.parametrize("argv,message", [
    (["--max_stepz", "3"], "unknown flag(s) ['--max_stepz', '3']"),
    (["--seed", "x"], "argument --seed: invalid int value: 'x'"),
    (["--seed", "-1"], "seed must be a whole number from 0 to 4294967295, got -1"),
    (["--seed", str(2**32)], "seed must be a whole number from 0 to 4294967295"),  # the whole line: -1
    (["--optimizer", "lion"], "invalid choice: 'lion'"),
    (["--warmup_steps", "-1"], "warmup_steps must be >= 0"),  # a whole line: max_nonfinite_steps
    (["--config", "missing.yaml"], "config file missing.yaml not found"),
    (["--config", str(ROOT / "configs")], f"config file {ROOT / 'configs'} is a folder, not a file; pass --config "
                                          "PATH to a YAML file"),
    (["--weight_decay", "inf"], "weight_decay must be a finite number"),  # the whole line: in test_bad_config_files
    (["--learning_rate", "nan"], "learning_rate must be a finite number"),
    (["--learning-rat", "1"], "unknown flag(s) ['--learning-rat', '1']"),  # no abbreviations
    (["--max_nonfinite_steps", "0"], "max_nonfinite_steps must be >= 1, got 0"),
    (["--min_lr_ratio", "1.5"], "min_lr_ratio must be in [0, 1], got 1.5"),
    (["--min_lr_ratio", "-0.1"], "min_lr_ratio must be in [0, 1]"),  # the whole line: 1.5
    (["--output_dir", ""], "output_dir is empty; name the folder the run writes"),
    (["--output_dir", "  "], "output_dir is empty"),  # the whole line: ""
])
def test_bad_flags(argv, message):
    with pytest.raises(ConfigError) as err:
        load_config(["--config", str(CONFIG)] + argv)
    assert message in str(err.value)


def test_a_tilde_in_a_path_is_the_home_folder_from_a_file_or_a_flag(tmp_path):
    overlay = tmp_path / "paths.yaml"
    overlay.write_text("output_dir: ~/runs/x\ndata_cache_dir: ~/cache\ndataset: ~user_that_is_not/data\n")
    cfg = load_config(["--config", str(CONFIG), "--config", str(overlay), "--deepspeed", "~/ds.json"])
    home = str(Path.home())
    assert (cfg.output_dir, cfg.data_cache_dir, cfg.deepspeed) == (f"{home}/runs/x", f"{home}/cache", f"{home}/ds.json")
    assert cfg.dataset == "~user_that_is_not/data"  # no such user: left as written, as a shell leaves it
    assert load_config(["--config", str(CONFIG), "--resume_from_checkpoint", "auto"]).resume_from_checkpoint == "auto"


def test_unquoted_no_means_no(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("mixed_precision: no\n")  # YAML 1.1 reads an unquoted no as false
    assert load_config(["--config", str(path)]).mixed_precision == "no"


def test_help_shows_the_config_files_values(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 0.25\nwarmup_steps: 7\n")
    with pytest.raises(SystemExit):
        load_config(["--config", str(path), "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "Peak learning rate. (default: 0.25)" in shown
    assert "(default: 7)" in shown


@pytest.mark.parametrize("mode,key,refused", [("online", "", True), ("ONLINE", "", True), ("online", "k" * 40, False),
                                              ("offline", "", False), ("", "", False)])
def test_wandb_told_to_upload_without_a_key_is_one_line(monkeypatch, tmp_path, mode, key, refused):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("WANDB_MODE", mode)
    monkeypatch.setenv("WANDB_API_KEY", key)
    cfg = load_config(["--config", str(CONFIG), "--report_to", "wandb"])
    if not refused:
        check_wandb(cfg)
        return
    with pytest.raises(ConfigError) as err:
        check_wandb(cfg)
    assert str(err.value) == (f"WANDB_MODE={mode}, but there is no W&B key (WANDB_API_KEY, or `wandb login`); log in, "
                              "or set WANDB_MODE=offline and upload later with `wandb sync`")
