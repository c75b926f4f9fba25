"""The Accelerate entry point: every launch config loads and launches, DeepSpeed ZeRO-2/3 train
with the same parameters as DDP, ZeRO-3 builds each process's partition only (here and in the
Trainer), and accumulation settings that disagree with train.yaml are refused before any process
waits on another. (Its FSDP, which the Trainer runs too:
tests/test_accelerate_fsdp.py.)"""

import json
import subprocess
import sys
import textwrap

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from {{ cookiecutter.project_slug }}.config import ConfigError, load_config
from {{ cookiecutter.project_slug }}.launch import deepspeed_config
from {{ cookiecutter.project_slug }}.windows import plan_batches

from conftest import (
    ENTRIES,
    ROOT,
    SLUG,
    Run,
    accelerate_launch,
    free_port,
    max_abs_diff,
    one_error_line,
    report,
    run_entry,
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
    fp32 from every shipped file, filled as a bf16 run fills it, and buckets sized for big models."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = load_config(["--config", str(ROOT / "configs" / "train.yaml"), "--mixed_precision", "bf16"])
    filled = deepspeed_config(cfg, plan_batches(16, 2, 1), str(path))
    parsed = DeepSpeedConfig(filled)
    assert (parsed.grad_accum_dtype, filled["bf16"]["enabled"]) == ("fp32", True)
    # buckets of 5e7 elements, not DeepSpeed's 5e8 (docs/memory.md: at 8B, 0.2 GB each in fp32, not 2 GB)
    zero = parsed.zero_config
    buckets = (zero.reduce_bucket_size, zero.allgather_bucket_size if zero.stage < 3 else zero.prefetch_bucket_size)
    assert buckets == (50_000_000, 50_000_000)
{%- endif %}


@pytest.mark.parametrize("settings", [{}, {"zero_optimization": {"stage": 0}}, {"zero_optimization": {}},
                                      {"zero_optimization": None}, {"zero_optimization": [2]},
                                      {"zero_optimization": {"stage": "auto"}}, {"zero_optimization": {"stage": True}}])
def test_a_deepspeed_config_without_a_zero_stage_is_refused(settings, tmp_path):
    """Without ZeRO, DeepSpeed reports no gradient norm (train_accelerate's step would fail) and Accelerate
    refuses a config without zero_optimization: both are one line up front."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(settings))
    cfg = load_config(["--config", str(ROOT / "configs" / "train.yaml")])
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage is .*, not 1, 2 or 3; .* drop --deepspeed"):
        deepspeed_config(cfg, plan_batches(16, 2, 1), str(path))


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



# The entry point, its model built whole where BUILD_WHOLE is set (as when the model exists before
# the Accelerator: no DeepSpeed config in sight), and where RECORD_DIR is set grown to 308M
# parameters (6 layers of width 2048): each process then records its resident memory just after
# the imports and its peak once the model is built, and stops there.
MODEL_START = textwrap.dedent("""
    import importlib, json, os, re, sys
    import torch.distributed as dist
    from transformers import LlamaConfig
    from transformers.integrations import unset_hf_deepspeed_config

    def kib(field):
        return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))

    entry = importlib.import_module("{{ cookiecutter.project_slug }}.train_" + sys.argv.pop(1))
    after_imports = kib("VmRSS")
    build_model = entry.build_model

    def build(cfg, config):
        if os.environ.get("BUILD_WHOLE"):
            unset_hf_deepspeed_config()
        if "RECORD_DIR" not in os.environ:
            return build_model(cfg, config)
        big = LlamaConfig(vocab_size=config.vocab_size, hidden_size=2048, intermediate_size=5632,
                          num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=16,
                          max_position_embeddings=128, tie_word_embeddings=True)
        model = build_model(cfg, big)
        numel = sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters())
        with open(os.path.join(os.environ["RECORD_DIR"], f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"after_imports": after_imports, "peak": kib("VmHWM"), "numel": numel}, f)
        dist.barrier()
        os._exit(0)

    entry.build_model = build
    entry.main()
""")


def zero3_start(entry: str, env: dict, tmp_path, name: str, flags: dict, **extra_env) -> Run:
    """The entry point on 2 processes under ZeRO-3 through MODEL_START, into tmp_path/name.
    Tensors of 1 MiB and more are given back to the system when freed (MALLOC_MMAP_THRESHOLD_; glibc
    would otherwise keep them, which resident memory cannot tell from live ones)."""
    script = tmp_path / "model_start.py"
    script.write_text(MODEL_START)
    proc = run_entry(entry, 2, tmp_path / name, {**env, "MALLOC_MMAP_THRESHOLD_": "1048576", **extra_env},
                     {"deepspeed": "configs/deepspeed/zero3.json", **flags}, script=(script, entry))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def big_model_memory(entry: str, env: dict, tmp_path, name: str, **extra_env) -> list[dict]:
    """Each process's memory record (KiB) of a start of the 308M-parameter model."""
    records = tmp_path / f"{name}_memory"
    records.mkdir()
    zero3_start(entry, env, tmp_path, name, ACCUM, RECORD_DIR=str(records), **extra_env)
    return [json.loads((records / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.skipif(not DEEPSPEED, reason="no DeepSpeed configs generated (deepspeed_stage: none)")
@pytest.mark.parametrize("entry", [e for e in ("accelerate", "trainer") if e in ENTRIES])
def test_zero3_builds_each_ranks_partition_not_the_whole_model(runs, env, tmp_path, entry):
    """ZeRO-3 on 2 processes, a 308M-parameter model (1.15 GiB in fp32): each process builds only
    its partition, so the largest rise of resident memory from the imports to the built model stays
    below the whole model's size, where a model built whole first goes above it. A partitioned start
    trains the same as a whole one (the tiny model, 4 steps)."""
    partitioned = big_model_memory(entry, env, tmp_path, "partitioned")
    whole = big_model_memory(entry, env, tmp_path, "whole", BUILD_WHOLE="1")
    numel = partitioned[0]["numel"]
    assert numel >= 300e6 and all(r["numel"] == numel for r in partitioned + whole)
    model_kib = numel * 4 / 1024
    rise = {name: max(r["peak"] - r["after_imports"] for r in records)
            for name, records in (("partitioned", partitioned), ("whole", whole))}
    report(f"ZeRO-3 start of a {numel / 1e6:.0f}M-parameter model ({model_kib / 1024**2:.2f} GiB fp32) on 2 "
           f"processes ({entry}): largest resident-memory rise {rise['partitioned'] / 1024**2:.2f} GiB "
           f"partitioned, {rise['whole'] / 1024**2:.2f} GiB built whole first")
    assert rise["partitioned"] < model_kib < rise["whole"]
    partitioned_run = runs(entry, 2, deepspeed="configs/deepspeed/zero3.json", **SGD)
    zero3_start(entry, env, tmp_path, "whole_run", SGD, BUILD_WHOLE="1")
    whole_run = Run(0, "", "", tmp_path / "whole_run")
    assert [r["loss"] for r in whole_run.steps] == [r["loss"] for r in partitioned_run.steps]
    assert max_abs_diff(partitioned_run.params(), whole_run.params()) <= 1e-6

def mismatch_json(tmp_path, **keys):
    zero2 = ROOT / "configs" / "deepspeed" / "zero2.json"
    config = json.loads(zero2.read_text()) if DEEPSPEED else {"zero_optimization": {"stage": 2}}
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
    expected = {"gradient_accumulation_steps": 4, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}[key]
    line = f"error: DeepSpeed config {path} sets {key} {value!r} but this run derives {expected}"
    one_error_line(run, line, code=1, workers=2)  # 1: torchrun's, for workers that exited with 2
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
    assert proc.returncode != 0  # accelerate launch's own code
    line = ("error: the accelerate config sets gradient_accumulation_steps 8, but global_batch_size 16 / "
            "(micro_batch_size 2 x world_size 2) gives 4")
    one_error_line(proc, line, code=proc.returncode, workers=2)
    assert "exitcode  : 2" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not DEEPSPEED, reason="no DeepSpeed configs generated (deepspeed_stage: none)")
def test_deepspeed_json_that_is_not_an_object_is_one_line(env, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("[1, 2]")
    run = run_entry("accelerate", 1, tmp_path / "out", env, {**ACCUM, "deepspeed": path})
    one_error_line(run, f"error: DeepSpeed config {path} must hold a JSON object of settings, got list", exact=True)


@pytest.mark.slow
@pytest.mark.skipif(not DEEPSPEED, reason="no DeepSpeed configs generated (deepspeed_stage: none)")
def test_a_deepspeed_checkpoint_continues_only_on_as_many_processes(env, tmp_path):
    flags = {**SGD, "deepspeed": "configs/deepspeed/zero2.json", "save_steps": 2, "stop_after_steps": 2}
    first = run_entry("accelerate", 1, tmp_path / "out", env, flags)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_entry("accelerate", 2, tmp_path / "out", env, {**flags, "resume_from_checkpoint": "auto"})
    one_error_line(resumed, f"error: {tmp_path / 'out' / 'checkpoints' / 'step_2'} holds DeepSpeed ZeRO's optimizer "
                            "state split for world size 1, this run's is 2; continue it at world size 1",
                   code=1, workers=2)
    assert "exitcode  : 2" in resumed.stderr  # torchrun's 1, for workers that exited with 2


@pytest.mark.slow
@pytest.mark.skipif(not DEEPSPEED, reason="no DeepSpeed configs generated (deepspeed_stage: none)")
def test_deepspeed_runs_without_a_launcher(env, tmp_path):
    """`python -m ...train_accelerate --deepspeed ...` on one process: DeepSpeed would look for MPI
    (mpi4py) to find its world; the entry point gives it a group of one instead."""
    run = run_entry("accelerate", 1, tmp_path / "out", env, {**SGD, "deepspeed": "configs/deepspeed/zero2.json"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in run.steps] == [1, 2, 3, 4] and "mpi4py" not in run.stderr
