"""The Accelerate entry point: every launch config loads and launches, DeepSpeed ZeRO-2/3 train
with the same parameters as DDP, and accumulation settings that disagree with train.yaml are
refused before any process waits on another."""

import json
import subprocess
import sys

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from conftest import (
    ROOT,
    SLUG,
    accelerate_launch,
    free_port,
    max_abs_diff,
    one_error_line,
    report,
    run_entry,
    worker_error_lines,
)

CONFIGS = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))
DEEPSPEED = sorted((ROOT / "configs" / "deepspeed").glob("*.json"))
ACCUM = {"micro_batch_size": 2, "global_batch_size": 16, "max_steps": 4}
# SGD moves parameters by exactly lr x gradient: a mis-scaled gradient cannot hide behind Adam.
SGD = {"optimizer": "sgd", "learning_rate": 0.1, "max_grad_norm": 0, **ACCUM}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_accelerate_config_loads(path):
    config = load_config_from_file(str(path))
    assert config.num_processes >= 1
    if path.stem.startswith("deepspeed_zero"):
        stage = path.stem[-1]
        ds_file = ROOT / config.deepspeed_config["deepspeed_config_file"]
        assert ds_file.name == f"zero{stage}.json" and ds_file.is_file()

{%- if cookiecutter.deepspeed_stage != 'none' %}


@pytest.mark.parametrize("path", DEEPSPEED, ids=lambda p: p.stem)
def test_deepspeed_accumulates_gradients_in_fp32(path, monkeypatch):
    """bf16 would otherwise be the gradient accumulation's dtype: DeepSpeed's own parser reads
    fp32 from every shipped file, filled as a bf16 run fills it."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    from {{ cookiecutter.project_slug }}.batch import plan_batches
    from {{ cookiecutter.project_slug }}.config import load_config
    from {{ cookiecutter.project_slug }}.launch import deepspeed_config

    cfg = load_config(["--config", str(ROOT / "configs" / "train.yaml"), "--mixed_precision", "bf16"])
    filled = deepspeed_config(cfg, plan_batches(16, 2, 1), str(path))
    parsed = DeepSpeedConfig(filled)
    assert (parsed.grad_accum_dtype, filled["bf16"]["enabled"]) == ("fp32", True)
{%- endif %}


@pytest.mark.slow
@pytest.mark.parametrize("config,nproc", [("single", 1), ("multi_gpu", 2), ("deepspeed_zero2", 2)])
def test_accelerate_launch_runs(config, nproc, env, tmp_path):
    if (ROOT / "configs" / "accelerate" / f"{config}.yaml").exists() is False:
        pytest.skip(f"{config}.yaml not generated (deepspeed_stage: none)")
    run = accelerate_launch(config, nproc, env, tmp_path / "out", "--max_steps", "2",
                            "--micro_batch_size", "2", "--global_batch_size", "8")
    assert run.returncode == 0, run.stderr[-3000:]
    assert [(r["step"], r["world_size"]) for r in run.steps] == [(1, nproc), (2, nproc)]
    assert (tmp_path / "out" / "final_model" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.skipif(not DEEPSPEED, reason="no DeepSpeed configs generated (deepspeed_stage: none)")
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_trains_like_ddp(runs, stage):
    ddp = runs("accelerate", 2, **SGD)
    ds = runs("accelerate", 2, deepspeed=f"configs/deepspeed/{stage}.json", **SGD)
    assert [r["step"] for r in ds.steps] == [1, 2, 3, 4]  # the engine stepped once per window
    assert "grad_sync_calls" not in ds.steps[0]  # DeepSpeed, not DDP, reduced the gradients
    assert ds.steps[-1]["loss"] < ds.steps[0]["loss"]
    for a, b in zip(ddp.steps, ds.steps, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    diff = max_abs_diff(ddp.params(), ds.params())
    report(f"DeepSpeed {stage} vs DDP (accelerate, 2x4, SGD): max |param diff| {diff:.3g}")
    assert diff <= 1e-5


@pytest.mark.slow
@pytest.mark.skipif(not DEEPSPEED, reason="no DeepSpeed configs generated (deepspeed_stage: none)")
def test_deepspeed_boundary_follows_short_windows(runs, small_dataset):
    # 37 examples, 2 processes, micro 4, global 24: accumulation 3, and each epoch ends in a short
    # window of 13 examples (2 micro-steps), where DeepSpeed's boundary must follow ours. ZeRO-3:
    # every forward gathers the parameters from all ranks, so evaluation (9 examples: 2 batches on
    # one rank, 1 on the other) must run the same number of batches everywhere or it waits forever.
    flags = {**SGD, "micro_batch_size": 4, "global_batch_size": 24, "max_steps": -1, "num_epochs": 2,
             "dataset": small_dataset}
    ddp = runs("accelerate", 2, **flags)
    ds = runs("accelerate", 2, deepspeed="configs/deepspeed/zero3.json", **flags)
    assert [r["micro_steps"] for r in ds.steps] == [r["micro_steps"] for r in ddp.steps] == [3, 2, 3, 2]
    assert [r["tokens"] for r in ds.steps] == [r["tokens"] for r in ddp.steps]
    assert [e["step"] for e in ds.evals] == [e["step"] for e in ddp.evals] == [2, 4]
    for a, b in zip(ds.evals, ddp.evals, strict=True):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], abs=1e-5)
    diff = max_abs_diff(ddp.params(), ds.params())
    report(f"DeepSpeed zero3 vs DDP with short windows and uneven evaluation shards (accelerate): "
           f"max |param diff| {diff:.3g}")
    assert diff <= 1e-5


def mismatch_json(tmp_path, **keys):
    config = json.loads((ROOT / "configs" / "deepspeed" / "zero2.json").read_text()) if DEEPSPEED else {}
    config.update(keys)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("key,value", [("gradient_accumulation_steps", 8), ("train_batch_size", 32),
                                       ("train_micro_batch_size_per_gpu", 4)])
def test_deepspeed_json_that_disagrees_is_refused(env, tmp_path, key, value):
    path = mismatch_json(tmp_path, **{key: value})
    run = run_entry("accelerate", 2, tmp_path / "out", env, {**ACCUM, "deepspeed": path})
    assert run.returncode == 1  # torchrun: workers exited with 2
    expected = {"gradient_accumulation_steps": 4, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}[key]
    line = f"error: DeepSpeed config {path} sets {key} {value!r} but this run derives {expected}"
    worker_error_lines(run.stderr, line)
    assert "exitcode  : 2" in run.stderr


@pytest.mark.slow
def test_accelerate_yaml_that_disagrees_is_refused(env, tmp_path):
    yaml_path = tmp_path / "acc.yaml"
    yaml_path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
                         "deepspeed_config:\n  gradient_accumulation_steps: 8\n  zero_stage: 2\n"
                         "machine_rank: 0\nnum_machines: 1\nnum_processes: 2\nuse_cpu: false\n")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(yaml_path),
           "--main_process_port", str(free_port()), "-m", f"{SLUG}.train_accelerate", "--report_to", "none",
           "--output_dir", str(tmp_path / "out"), "--micro_batch_size", "2", "--global_batch_size", "16"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    line = ("error: the accelerate config sets gradient_accumulation_steps 8, but global_batch_size 16 / "
            "(micro_batch_size 2 x world_size 2) gives 4")
    worker_error_lines(proc.stdout + proc.stderr, line)
    assert "exitcode  : 2" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not DEEPSPEED, reason="no DeepSpeed configs generated (deepspeed_stage: none)")
def test_deepspeed_json_that_is_not_an_object_is_one_line(env, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("[1, 2]")
    run = run_entry("accelerate", 1, tmp_path / "out", env, {**ACCUM, "deepspeed": path})
    one_error_line(run, f"error: DeepSpeed config {path} must hold a JSON object of settings, got list")


@pytest.mark.slow
@pytest.mark.skipif(not DEEPSPEED, reason="no DeepSpeed configs generated (deepspeed_stage: none)")
def test_deepspeed_runs_without_a_launcher(env, tmp_path):
    """`python -m ...train_accelerate --deepspeed ...` on one process: DeepSpeed would look for MPI
    (mpi4py) to find its world; the entry point gives it a group of one instead."""
    run = run_entry("accelerate", 1, tmp_path / "out", env, {**SGD, "deepspeed": "configs/deepspeed/zero2.json"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in run.steps] == [1, 2, 3, 4] and "mpi4py" not in run.stderr
