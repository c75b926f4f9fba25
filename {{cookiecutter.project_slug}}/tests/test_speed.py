"""The speed levers with accumulation: torch.compile trains as eager does, still all-reduces once
per bucket per optimizer step, and compiles once (no_sync() toggling, padded lengths, a short
last window and a filler micro-batch recompile nothing); the MFU every record carries; and each
optimizer step waits on the device once (helpers/sync_counting.py counts)."""

import json
from collections import Counter

import numpy as np
import pytest
import torch

from {{ cookiecutter.project_slug }}.config import load_config
from {{ cookiecutter.project_slug }}.model import build_model, load_tokenizer, model_config
from {{ cookiecutter.project_slug }}.prepare import prepare
from {{ cookiecutter.project_slug }}.speed import (
    PEAK_TFLOPS,
    flop_counts,
    flops_per_token,
    peak_flops,
    peak_tflops_for,
    training_flops,
)
from {{ cookiecutter.project_slug }}.windows import WindowSampler, plan_batches

from conftest import (
    ACCUM,
    ENTRIES,
    ROOT,
    SLUG,
    TASK,
    TOL,
    cell,
    flag_args,
    max_abs_diff,
    max_loss_diff,
    report,
    run_entry,
    short_windows,
)
from helpers import sync_counting

CONFIG = str(ROOT / "configs" / "train.yaml")


# 1 MiB DDP buckets: torch.compile's DDPOptimizer refuses smaller ones (the tiny model's gradient then
# fills one bucket: "once per optimizer step" is one all-reduce, not one per micro-step)
COMPILED = {**ACCUM, "ddp_bucket_cap_mb": 1, "compile": "true"}


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_compiled_training_is_eager_training(runs, entry):
    """Compiled at 2 processes x 4 micro-steps against the eager big batch (the parity matrix's
    1x1 reference, one process, 16 examples per micro-step: compile and accumulation together)."""
    compiled, eager = runs(entry, 2, **COMPILED), cell(runs, entry, 1, 1)
    assert [r["grad_sync_calls"] for r in compiled.steps] == [1] * 8  # one bucket, once per optimizer step
    graphs = [r["compiled_graphs"] for r in compiled.steps]
    assert graphs[0] >= 1 and len(set(graphs)) == 1, graphs  # compiled at step 1, never again
    param_diff, loss_diff = max_abs_diff(compiled.params(), eager.params()), max_loss_diff(compiled, eager)
    report(f"compile ({entry}, 2 x 4 vs eager 1 x 1): max |param diff| {param_diff:.3g}, max |loss diff| "
           f"{loss_diff:.3g}; graphs per step {graphs}; all-reduces per step "
           f"{[r['grad_sync_calls'] for r in compiled.steps]}")
    assert param_diff <= TOL.param and loss_diff <= TOL.loss


@pytest.mark.slow
def test_a_short_last_window_and_a_filler_recompile_nothing(runs, small_dataset):
    """37 examples in windows of 16, 16 and 5: the short one has 2 micro-steps, one of them a
    filler on one rank (1 example), other sizes than the full windows' 2 x 2 examples. Against the
    eager big batch of test_parity's short-window test."""
    compiled = runs(ENTRIES[0], 2, micro_batch_size=2, compile="true", ddp_bucket_cap_mb=1,
                    **short_windows(small_dataset))
    assert [r["micro_steps"] for r in compiled.steps] == [4, 4, 2] * 2
    graphs = [r["compiled_graphs"] for r in compiled.steps]
    assert len(set(graphs)) == 1, graphs
    eager = runs(ENTRIES[0], 1, micro_batch_size=16, **short_windows(small_dataset))
    assert max_abs_diff(compiled.params(), eager.params()) <= TOL.param


def test_flops_per_token_counts_weights_and_attention():
    cfg = load_config(["--config", CONFIG, "--task", "causal_lm"])
    model = build_model(cfg, model_config(cfg, load_tokenizer(cfg)))
    config = model.config
    # every weight but the input embedding (which the tied output projection counts back)
    weights = sum(p.numel() for p in model.parameters())
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * 64
    assert flops_per_token(model, 64) == 6 * weights + attention


def test_flops_per_token_counts_parameters_that_zero3_partitioned():
    """Under ZeRO-3 a parameter's local tensor is empty and DeepSpeed keeps its size in ds_numel."""
    cfg = load_config(["--config", CONFIG, "--task", "causal_lm"])
    model = build_model(cfg, model_config(cfg, load_tokenizer(cfg)))
    whole = flops_per_token(model, 64)
    for parameter in model.parameters():
        parameter.ds_numel = parameter.numel()
        parameter.data = torch.empty(0)
    assert flops_per_token(model, 64) == whole


def test_the_peak_comes_from_the_table_or_the_flag(monkeypatch):
    cfg = load_config(["--config", CONFIG, "--mixed_precision", "bf16"])
    assert peak_flops(cfg, torch.device("cpu")) == 0  # no mfu on CPU unless given
    assert peak_flops(load_config(["--config", CONFIG, "--peak_tflops", "2.5"]), torch.device("cpu")) == 2.5e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(cfg, torch.device("cuda", 0)) == PEAK_TFLOPS["H100 SXM"]["bf16"] * 1e12
    fp32 = load_config(["--config", CONFIG])
    assert peak_flops(fp32, torch.device("cuda", 0)) == PEAK_TFLOPS["H100 SXM"]["tf32"] * 1e12  # TF32 on by default
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 NVL")
    assert peak_flops(cfg, torch.device("cuda", 0)) == 835e12  # not the SXM's 989, whose name it contains


@pytest.mark.parametrize("name,precision,tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989), ("NVIDIA H100 PCIe", "bf16", 756), ("NVIDIA H100 NVL", "bf16", 835),
    ("NVIDIA H200", "bf16", 989), ("NVIDIA H200 NVL", "bf16", 835), ("NVIDIA GH200 480GB", "tf32", 494),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312), ("NVIDIA A100-SXM4-40GB", "tf32", 156),
    ("NVIDIA A100-PCIE-40GB", "fp16", 312), ("NVIDIA A100 80GB PCIe", "fp32", 19.5), ("NVIDIA L40S", "bf16", 362),
    ("NVIDIA L40", "bf16", 181), ("NVIDIA L4", "bf16", 121), ("NVIDIA A10", "bf16", 125),
    ("NVIDIA GeForce RTX 4090", "bf16", 165), ("Tesla V100-SXM2-32GB", "fp16", 125),
    ("Tesla V100-PCIE-16GB", "fp16", 112), ("Tesla T4", "fp16", 65), ("NVIDIA  H200 ", "bf16", 989),
    ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 on a V100
    ("NVIDIA H100", "bf16", None), ("NVIDIA H100 NVL 2", "bf16", None), ("NVIDIA L4 Super", "bf16", None),
    ("NVIDIA B300", "bf16", None), ("", "bf16", None),
])
def test_the_peak_table_matches_whole_device_names(name, precision, tflops):
    assert peak_tflops_for(name, precision) == tflops


def test_attention_flops_grow_with_each_sequences_own_length():
    cfg = load_config(["--config", CONFIG, "--task", "causal_lm"])
    model = build_model(cfg, model_config(cfg, load_tokenizer(cfg)))
    per_token, per_position = flop_counts(model)
    assert training_flops((per_token, per_position), [10, 30]) == per_token * 40 + per_position * (10**2 + 30**2)
    assert training_flops((per_token, per_position), [64]) == flops_per_token(model, 64) * 64


def test_every_record_carries_its_mfu_where_the_peak_is_known(env, tmp_path):
    """The mfu of each step: the FLOPs of its examples at their real lengths (the attention term too,
    not max_seq_len's) over the step's time, over the peak."""
    flags = {**ACCUM, "max_steps": 3}
    run = run_entry(ENTRIES[0], 1, tmp_path / "out", env, {**flags, "peak_tflops": 0.01})
    assert run.returncode == 0, run.stderr[-3000:]
    cfg = load_config(["--config", CONFIG, *flag_args(flags)])
    tokenizer = load_tokenizer(cfg)
    prepared = prepare(cfg, tokenizer)
    model = build_model(cfg, model_config(cfg, tokenizer, prepared.num_labels or 2))
    lengths = np.array([len(ids) for ids in prepared.data["train"]["input_ids"]])
    sampler = WindowSampler(len(lengths), plan_batches(cfg.global_batch_size, cfg.micro_batch_size, 1), 0, cfg.seed)
    previous, shares = 0.0, []
    for done, record in enumerate(run.steps):
        seconds, previous = record["elapsed_s"] - previous, record["elapsed_s"]
        window = lengths[sampler.window_at(done).examples]
        assert record["input_tokens"] == window.sum()
        achieved = training_flops(flop_counts(model), window)
        # the step's own seconds lie within 1 ms of those of the records' elapsed_s (each rounded to
        # 1 ms), the mfu within 5e-5 of its own (rounded to 4 decimals)
        lowest, highest = achieved / (seconds + 1e-3) / 1e10, achieved / max(seconds - 1e-3, 1e-6) / 1e10
        assert lowest - 5e-5 <= record["mfu"] <= highest + 5e-5, (record["mfu"], lowest, highest)
        shares.append(achieved / (flops_per_token(model, cfg.max_seq_len) * window.sum()))
        # the model reads every token; a causal LM's loss has one target fewer per sequence
        examples = record["global_batch_size"]
        assert record["input_tokens"] == record["tokens"] + examples if TASK == "causal_lm" else \
            record["input_tokens"] > 5 * examples
    (last,) = [line for line in run.stdout.splitlines() if line.startswith("step 3/3 ")]
    assert " | mfu " in last  # the progress line shows it too
    report(f"mfu's FLOPs at the examples' own lengths vs max_seq_len {cfg.max_seq_len}'s: "
           f"{', '.join(f'{share:.3f}' for share in shares)} of it")


# What the libraries read of the device in each step of a default run, and why it stays theirs.
LIBRARY_READS = {
    # the optimizer's step counters: host tensors on a GPU too (AdamW neither fused nor capturable)
    "torch/optim/optimizer.py:_get_value",
}
# The Trainer's own per-step reads and collectives: its logged loss and grad_norm (.item()), its
# FLOP count's all-gather (not num_items_in_batch: WindowTrainer counts it on the host)
TRAINER_READS = {"transformers/trainer.py:_maybe_log_save_evaluate", "transformers/trainer.py:store_flos"}
TRAINER_COLLECTIVES = {"transformers/trainer_pt_utils.py:distributed_concat",
                       "transformers/trainer_pt_utils.py:distributed_broadcast_scalars"}


def counted_steps(entry: str, out, env: dict, flags: dict) -> list[dict]:
    """Rank 0's per-step counts of 2 processes of `entry` under helpers/sync_counting.py."""
    proc = run_entry(entry, 2, out / "run", env, flags, script=(ROOT / "tests" / "helpers" / "sync_counting.py",
                                                                 out / "counts", f"{SLUG}.train_{entry}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "counts.rank0.json").read_text())


def test_the_counter_sees_a_planted_list_index_and_a_blocking_copy(monkeypatch):
    """The negative control of sync_counting: a list index of a device tensor and a blocking copy of a
    host tensor to the device are each counted once, at their line's function; slices, tensor indices,
    dtype casts, a device tensor's move to its own device, a host tensor's list index and a non-blocking
    copy are not."""
    reads, collectives = Counter(), Counter()
    loader = iter(torch.utils.data.DataLoader([torch.ones(2)]))  # (its start reads its seed)
    sync_counting.count(reads, collectives, monkeypatch.setattr)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = next(loader)  # a host tensor, as a loader yields it
    x = torch.arange(6.0, device=device)
    x[1:3], x[torch.tensor([0, 1], device=device)], x.to(torch.float64), x.to(device), batch[[0]]
    batch.to(device, non_blocking=True)
    x[[0, 2]]  # planted: a list index
    batch.to(device)  # planted: a blocking copy
    here = "test_speed.py:test_the_counter_sees_a_planted_list_index_and_a_blocking_copy"
    assert {site.rpartition("/")[2]: n for site, n in reads.items()} == {here + sync_counting.LIST_INDEX: 1,
                                                                          here + sync_counting.BLOCKING_COPY: 1}


def ours(counts: dict) -> int:
    return sum(n for site, n in counts.items() if site.startswith(f"{SLUG}/"))


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_each_optimizer_step_reads_the_device_once_and_runs_one_small_collective(entry, env, tmp_path):
    """2 processes, accumulation 4, DDP: from the third step on (the first two build DDP's buckets),
    each step's loss, gradient norm, preemption flag and (batch_schedule) noise-scale norms travel
    in one blocking all-reduce and come back in one read; the targets are counted on the
    host. Everything else that reads the device or waits on the ranks is named as the library's."""
    steps = counted_steps(entry, tmp_path, env, {**ACCUM, "eval_every": 1000})
    assert len(steps) == ACCUM["max_steps"]
    for step in steps[2:]:
        reads, collectives = step["reads"], step["collectives"]
        assert (ours(reads), ours(collectives)) == (1, 1), step
        library_reads = {site for site in reads if not site.startswith(f"{SLUG}/")}
        library_collectives = {site for site in collectives if not site.startswith(f"{SLUG}/")}
        assert library_reads <= LIBRARY_READS | (TRAINER_READS if entry == "trainer" else set()), step
        assert library_collectives <= (TRAINER_COLLECTIVES if entry == "trainer" else set()), step
    report(f"syncs per step {entry}: " + json.dumps(steps[-1], sort_keys=True))
