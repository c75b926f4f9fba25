"""The memory levers, with accumulation, in every entry point: fp16 loss scaling, gradient
checkpointing, the optimizers and schedules, FSDP (the micro batch found from memory:
tests/test_auto_batch.py). docs/memory.md, "Memory levers"."""

import subprocess

import pytest
import torch
from accelerate.utils import FullyShardedDataParallelPlugin

from {{ cookiecutter.project_slug }}.config import load_config
from {{ cookiecutter.project_slug }}.model import fsdp_mixed_precision, load_tokenizer, model_config
from {{ cookiecutter.project_slug }}.prepare import prepare

from conftest import (
    ACCUM,
    DATA_CACHE,
    ENTRIES,
    GPUS,
    MIXED_PRECISION,
    ROOT,
    TOL,
    accelerate_launch,
    flag_args,
    launch_cmd,
    max_abs_diff,
    max_loss_diff,
    report,
    run_entry,
)

CONFIG = str(ROOT / "configs" / "train.yaml")
DEVICE = torch.device("cuda", 0) if GPUS else torch.device("cpu")
# fp16 runs: global batch 2 of single examples, 12 steps of a linear schedule after 2 warmup steps;
# the checkpoint of the last step holds the optimizer's and the schedule's own step counts.
FP16 = {"mixed_precision": "fp16", "micro_batch_size": 1, "global_batch_size": 2, "max_steps": 12,
        "warmup_steps": 2, "lr_scheduler_type": "linear", "save_steps": 12}


def linear_lr(peak: float, applied: int, warmup: int, total: int) -> float:
    """The lr of the schedule after `applied` scheduler steps: warmup from 0, then linear to 0."""
    return peak * applied / warmup if applied < warmup else peak * max(0, total - applied) / (total - warmup)


def config_for(*flags: str):
    """The run's TrainConfig and model config, as an entry point builds them."""
    cfg = load_config(["--config", CONFIG, "--max_seq_len", "48", "--mixed_precision", MIXED_PRECISION,
                       "--data_cache_dir", str(DATA_CACHE), *flags])
    tokenizer = load_tokenizer(cfg)
    return cfg, model_config(cfg, tokenizer, prepare(cfg, tokenizer).num_labels or 2)


@pytest.fixture(scope="module")
def fp16_runs(runs):
    """Without accumulation (2 processes x 1 micro-batch) and with it (1 process x 2 micro-batches):
    the same examples in the same micro-batches. The 2-process run multiplies each micro-batch's
    loss by world_size 2 (DDP averages), so its fp16 gradients equal the 1-process run's at twice the
    loss scale: started at 2**24 and 2**25, both overflow in the same fp16 operations, exactly."""
    if "pytorch" not in ENTRIES:
        pytest.skip("fp16 on CPU runs in train_pytorch only (Accelerate has no CPU fp16)")
    return (runs("pytorch", 2, fp16_init_scale=2**24, **FP16),
            runs("pytorch", 1, fp16_init_scale=2**25, **FP16))


@pytest.mark.slow
def test_fp16_with_accumulation_takes_the_decisions_of_one_big_batch(fp16_runs):
    without, within = fp16_runs
    decisions = [r["step_skipped"] for r in without.steps]
    report(f"fp16 steps skipped for overflow (S) or applied (.), without / with accumulation: "
           f"{''.join('S' if d else '.' for d in decisions)} / "
           f"{''.join('S' if r['step_skipped'] else '.' for r in within.steps)}")
    assert any(decisions) and not all(decisions)  # both kinds of step happened
    assert [r["step_skipped"] for r in within.steps] == decisions
    assert [r["lr"] for r in within.steps] == [r["lr"] for r in without.steps]
    assert [r["micro_steps"] for r in within.steps] == [2] * 12


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1], ids=["without_accumulation", "with_accumulation"])
def test_fp16_skipped_step_moves_neither_schedule_nor_optimizer(fp16_runs, which):
    run = fp16_runs[which]
    peak = load_config(["--config", CONFIG]).learning_rate
    applied = 0
    for record in run.steps:
        assert record["lr"] == pytest.approx(linear_lr(peak, applied, 2, 12), rel=1e-12, abs=1e-15)
        applied += not record["step_skipped"]
    state = torch.load(run.output_dir / "checkpoints" / "step_12" / "training_state.pt", weights_only=True)
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {applied}  # AdamW's bias correction
    assert state["lr_scheduler"]["last_epoch"] == applied


@pytest.mark.slow
@pytest.mark.skipif(GPUS > 0, reason="on GPUs Accelerate runs fp16")
@pytest.mark.parametrize("entry", [e for e in ENTRIES if e != "pytorch"])
def test_fp16_on_cpu_is_refused_where_accelerate_would_train_fp32(entry, env, tmp_path):
    run = run_entry(entry, 1, tmp_path / "out", env, {"mixed_precision": "fp16"})
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("error: mixed_precision fp16 on CPU: Accelerate")


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_gradient_checkpointing_trains_the_same(runs, entry):
    """Recomputed activations, 2 processes x accumulation 4 under no_sync: the same gradients (so
    the same parameters) and the same single all-reduce per bucket per optimizer step."""
    plain, checkpointed = runs(entry, 2, **ACCUM), runs(entry, 2, gradient_checkpointing="true", **ACCUM)
    assert [r["grad_sync_calls"] for r in checkpointed.steps] == [r["grad_sync_calls"] for r in plain.steps]
    param_diff, loss_diff = max_abs_diff(checkpointed.params(), plain.params()), max_loss_diff(checkpointed, plain)
    report(f"gradient checkpointing vs none ({entry}, 2 x 4): max |param diff| {param_diff:.3g}, "
           f"max |loss diff| {loss_diff:.3g}")
    assert loss_diff <= TOL.loss
    assert param_diff <= TOL.param


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,schedule", [("sgd", "linear"), ("adafactor", "constant")])
def test_optimizers_and_schedules_are_the_same_in_every_entry(runs, optimizer, schedule):
    """(adamw with cosine is the parity matrix's.) Every entry applies the same lr at every step,
    the schedule's closed form, and trains the same parameters."""
    flags = {"optimizer": optimizer, "lr_scheduler_type": schedule, "micro_batch_size": 4,
             "global_batch_size": 16, "max_steps": 6, "warmup_steps": 2}
    results = {entry: runs(entry, 1, **flags) for entry in ENTRIES}
    peak = load_config(["--config", CONFIG]).learning_rate
    after = [linear_lr(peak, n, 2, 6) if schedule == "linear" else peak * min(1.0, n / 2) for n in range(6)]
    reference = results[ENTRIES[0]]
    assert [r["lr"] for r in reference.steps] == pytest.approx(after, rel=1e-12, abs=1e-15)
    for entry, run in list(results.items())[1:]:
        assert [r["lr"] for r in run.steps] == [r["lr"] for r in reference.steps]
        diff = max_abs_diff(run.params(), reference.params())
        report(f"{optimizer} + {schedule}: {entry} vs {ENTRIES[0]} max |param diff| {diff:.3g}")
        assert diff <= TOL.param


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "configs" / "accelerate" / "fsdp.yaml").exists(), reason="no accelerate configs")
def test_fsdp_is_refused_where_it_would_not_run(env, tmp_path):
    """Accelerate turns on FSDP only on GPUs: on CPU it would train DDP without a word, so every
    entry point refuses; train_pytorch refuses Accelerate's FSDP everywhere (it has its own, --fsdp)."""
    fsdp_env = {**env, "ACCELERATE_USE_FSDP": "true"}
    entries = ENTRIES if GPUS == 0 else ["pytorch"]
    for entry in entries:
        run = run_entry(entry, 1, tmp_path / entry, fsdp_env)
        expected = ("error: train_pytorch shards with its own --fsdp full_shard" if entry == "pytorch"
                    else "error: FSDP needs GPUs")
        assert run.returncode == 2 and run.stderr.strip().splitlines()[-1].startswith(expected), run.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(GPUS < 2 or "accelerate" not in ENTRIES, reason="FSDP runs on GPUs (2 needed)")
def test_fsdp_trains_like_ddp(runs, tmp_path):
    ddp = runs("accelerate", 2, **ACCUM)
    fsdp = accelerate_launch("fsdp", 2, runs.env, tmp_path / "fsdp", *flag_args(ACCUM))
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert "grad_sync_calls" not in fsdp.steps[0]  # FSDP, not DDP, reduced the gradients
    diff = max_abs_diff(fsdp.params(), ddp.params())
    report(f"FSDP vs DDP (2 GPUs x accumulation 4): max |param diff| {diff:.3g}")
    assert diff <= TOL.param



@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fsdp_reduces_and_accumulates_gradients_in_fp32(precision):
    """train_accelerate's FSDP plugin under mixed precision: the forward in bf16/fp16, the gradient
    reduce (and with it the accumulation of unsynchronised micro-steps) in fp32; Accelerate keeps
    the policy when it applies its own mixed precision. (FSDP runs on GPUs only.)"""
    cfg = load_config(["--config", CONFIG, "--mixed_precision", precision])
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=fsdp_mixed_precision(cfg))
    plugin.set_mixed_precision(precision)  # as AcceleratorState does
    policy = plugin.mixed_precision_policy
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (dtype, torch.float32, dtype)
    assert fsdp_mixed_precision(load_config(["--config", CONFIG])) is None

FSDP2_NORM = """
import copy, os, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from {{ cookiecutter.project_slug }}.distributed import full_norm, sum_and_read
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 2))
whole = copy.deepcopy(model)
fully_shard(model)
x = torch.randn(8, 16)  # the same batch on both ranks: the averaged gradients are the whole model's
model(x).sum().backward()
whole(x).sum().backward()
expected = torch.nn.utils.get_total_norm([p.grad for p in whole.parameters()]).item()
local = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
clipped = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
assert isinstance(clipped, DTensor) and isinstance(local, DTensor)
record = sum_and_read([torch.tensor(3.0)], [clipped])[1]  # as Session.read_step reads the record's norm
shards = torch.nn.utils.get_total_norm([p.grad.to_local() for p in model.parameters()]).item()
# one write per line (print writes its parts one by one, and the 2 ranks share torchrun's stdout)
os.write(1, f"{dist.get_rank()} {record} {full_norm(local).item()} {shards} {expected}\\n".encode())
dist.barrier()
os._exit(0)  # not the group's teardown: after FSDP2, gloo's now and then aborts the interpreter's exit
"""


@pytest.mark.slow
def test_fsdp2_gradient_norms_are_the_whole_models(env, tmp_path):
    """Under FSDP2 a gradient norm is a DTensor, which `.tolist()` refuses: the record's grad_norm,
    and the norm the Trainer's callback reads (full_norm), are the whole model's, not a shard's."""
    script = tmp_path / "fsdp2_norm.py"
    script.write_text(FSDP2_NORM)
    proc = subprocess.run(launch_cmd(ENTRIES[0], 2, (script,)), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted(line.split() for line in proc.stdout.splitlines() if line[:1] in "01")
    assert [row[0] for row in rows] == ["0", "1"], proc.stdout
    for _, record, callback, shard, expected in rows:
        assert abs(float(record) - float(expected)) <= 1e-6 * float(expected)
        assert abs(float(callback) - float(expected)) <= 1e-6 * float(expected)
        assert float(shard) < float(expected) * (1 - 1e-3)  # this rank's shards' norm alone would be wrong
    report(f"FSDP2 gradient norm on 2 ranks: record {rows[0][1]}, whole model {rows[0][4]}, "
           f"shard alone {rows[0][3]} / {rows[1][3]}")
