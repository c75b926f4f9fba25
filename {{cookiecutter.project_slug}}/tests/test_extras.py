"""The seam between the core and the extras: every config key declares what a resume and the data
cache do with it, and a key of an extra this project was baked without is one line naming it."""

import json
import os
import subprocess
import sys
from dataclasses import fields

import pytest

from {{ cookiecutter.project_slug }} import extras
from {{ cookiecutter.project_slug }}.config import ConfigError, TrainConfig, keys_where, load_config
from {{ cookiecutter.project_slug }}.data_cache import cache_folder

from conftest import ROOT, one_error_line

CONFIG = str(ROOT / "configs" / "train.yaml")
# A value that switches each extra's key on (each extra's keys and their "off" values: extras.EXTRAS).
ON = {"fsdp": "full_shard", "fsdp_replicas": "2", "fsdp_layer_classes": "LlamaDecoderLayer",
      "async_checkpoint": "true", "memory_budget_mb": "64",
      "global_batch_size_schedule": "0:16,2:32", "lr_batch_scaling": "sqrt", "debug_distributed": "true",
      "lora_r": "8", "lora_alpha": "32", "lora_dropout": "0.1", "lora_target_modules": "q_proj"}
NOT_BAKED = [(name, key) for name, (_, _, keys) in extras.EXTRAS.items() if name not in extras.BAKED for key in keys]


def test_every_key_declares_what_a_resume_and_the_data_cache_do_with_it():
    """A key added without saying whether a resume must match it, or whether it changes the
    prepared data, fails here (extras.key requires both)."""
    for f in fields(TrainConfig):
        assert f.metadata.get("resume") in extras.RESUME, f.name
        assert isinstance(f.metadata.get("data"), bool), f.name
        assert f.metadata.get("help"), f.name
    assert set(keys_where(resume="length")) == {"max_steps", "num_epochs"}
    assert {"task", "dataset", "model_name_or_path", "max_seq_len", "packing"} <= set(keys_where(data=True))
    with pytest.raises(TypeError):
        extras.key("a key that does not say what a resume does with it", 0, data=False)


def test_the_baked_extras_are_the_answer_and_own_their_keys():
    answer = json.loads((ROOT / ".cookiecutter.json").read_text())["extras"].replace(" ", "").lower().split(",")
    assert extras.BAKED == (set(extras.EXTRAS) if "all" in answer else set(answer) - {"none"})
    baked_keys = {f.name for f in fields(TrainConfig)}
    for name, (_, _, keys) in extras.EXTRAS.items():
        assert set(keys) & baked_keys == (set(keys) if name in extras.BAKED else set()), name
    assert set(ON) == {key for _, _, keys in extras.EXTRAS.values() for key in keys}


@pytest.mark.skipif(not NOT_BAKED, reason="every extra is baked")
@pytest.mark.parametrize("extra,key", NOT_BAKED)
def test_a_key_of_an_extra_not_baked_is_one_line_naming_it(extra, key, tmp_path):
    expected = f"belongs to the extra '{extra}'"
    with pytest.raises(ConfigError, match=f"^flag --{key} {expected}"):
        load_config(["--config", CONFIG, f"--{key}", ON[key]])
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(f"{key}: {ON[key]}\n")
    with pytest.raises(ConfigError, match=f"key {key} in {overlay} {expected}"):
        load_config(["--config", CONFIG, "--config", str(overlay)])
    with pytest.raises(ConfigError, match=f"^the run was trained with {key} .* {expected}"):
        extras.recorded_off({key: "on"})
    extras.recorded_off({key: extras.EXTRAS[extra][2][key]})  # recorded off: continues


def test_micro_batch_size_auto_needs_its_extra():
    if "auto_batch" in extras.BAKED:
        assert load_config(["--config", CONFIG, "--micro_batch_size", "auto"]).micro_batch_size == "auto"
    else:
        with pytest.raises(ConfigError, match="^micro_batch_size auto belongs to the extra 'auto_batch'"):
            load_config(["--config", CONFIG, "--micro_batch_size", "auto"])


def test_a_flag_of_an_extra_not_baked_exits_2_with_one_line():
    if not NOT_BAKED:
        pytest.skip("every extra is baked")
    extra, key = NOT_BAKED[0]
    proc = subprocess.run([sys.executable, "-m", "{{ cookiecutter.project_slug }}.config", f"--{key}", ON[key]],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": "src"})
    line = one_error_line(proc, f"belongs to the extra '{extra}'", alone=True)
    assert "docs/extending.md" in line


class _Source:
    name, files = "data", ()


def test_the_data_cache_key_follows_the_keys_declared_as_data(monkeypatch):
    """A key declared data=True changes the cache's folder; one declared data=False does not."""
    monkeypatch.setattr("{{ cookiecutter.project_slug }}.data_cache.source_fingerprint", lambda source: "files")
    monkeypatch.setattr("{{ cookiecutter.project_slug }}.data_cache.tokenizer_fingerprint", lambda tok: "tokenizer")
    base = load_config(["--config", CONFIG])
    folder = cache_folder(base, _Source(), None)
    assert cache_folder(load_config(["--config", CONFIG, "--max_seq_len", "17"]), _Source(), None) != folder
    assert cache_folder(load_config(["--config", CONFIG, "--learning_rate", "0.5"]), _Source(), None) == folder
