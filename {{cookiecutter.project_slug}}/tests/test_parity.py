"""Every generated entry point, run for real with 2 gloo processes: accumulation is exact, DDP
syncs once per optimizer step, the last partial window is scaled right, the entry points agree
with each other, the record is as promised, and a stopped job resumes exactly."""

import json
import math
import subprocess
import sys

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoTokenizer

from conftest import ENTRIES, ROOT, SLUG, TASK, free_port, max_abs_diff, run_entry, worker_error_lines

TOL = 1e-5
STEP_KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "micro_steps", "grad_sync_calls",
             "world_size", "grad_accum_steps", "global_batch_size", "elapsed_s"}
EVAL_KEYS = {"causal_lm": {"step", "eval_loss", "eval_perplexity"},
             "sequence_classification": {"step", "eval_loss", "eval_accuracy", "eval_f1"}}
# 8 optimizer steps with 2 of warmup and a cosine decay: the schedule shows in every logged lr
SCHEDULE = {"max_steps": 8, "warmup_steps": 2, "lr_scheduler_type": "cosine"}
# 0.05 MiB DDP buckets: the tiny model then has several, so sync counts mean something
ACCUM = {"micro_batch_size": 2, "global_batch_size": 16, "ddp_bucket_cap_mb": 0.05, **SCHEDULE}  # accumulation 4
BIG = {"micro_batch_size": 16, "global_batch_size": 16, **SCHEDULE}   # 1 proc: no accumulation


@pytest.mark.parametrize("entry", ENTRIES)
def test_accumulation_on_two_processes_equals_one_big_batch(runs, entry):
    accum = runs(entry, 2, **ACCUM)
    big = runs(entry, 1, **BIG)
    assert {r["grad_accum_steps"] for r in accum.steps} == {4}
    assert {r["grad_accum_steps"] for r in big.steps} == {1}
    assert [r["tokens"] for r in accum.steps] == [r["tokens"] for r in big.steps]
    for a, b in zip(accum.steps, big.steps, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=TOL)
        assert a["lr"] == b["lr"]  # one scheduler step per optimizer step, whatever the world size
    assert accum.steps[-1]["loss"] < accum.steps[1]["loss"] - 0.01  # it trained (step 1 has lr 0)
    diff = max_abs_diff(accum.params(), big.params())
    print(f"{entry} {TASK}: max |param(2 procs x accum 4) - param(1 proc, batch 16)| = {diff:.3g}")
    assert diff <= TOL


@pytest.mark.skipif(len(ENTRIES) < 2, reason="one entry point generated")
def test_entry_points_agree(runs):
    reference = runs(ENTRIES[0], 2, **ACCUM)
    for entry in ENTRIES[1:]:
        other = runs(entry, 2, **ACCUM)
        for a, b in zip(reference.steps, other.steps, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
            assert (a["lr"], a["tokens"], a["micro_steps"]) == (b["lr"], b["tokens"], b["micro_steps"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert reference.evals[0]["eval_loss"] == pytest.approx(other.evals[0]["eval_loss"], abs=1e-5)
        diff = max_abs_diff(reference.params(), other.params())
        print(f"{ENTRIES[0]} vs {entry}: max |param diff| = {diff:.3g}")
        assert diff <= TOL


def ddp_bucket_counts(bucket_cap_mb: float, env: dict) -> tuple[int, int]:
    """All-reduce calls of DDP's first synchronised backward and of later ones (after DDP rebuilds
    its buckets), measured on the same model in a separate 1-process gloo group."""
    probe = f"""
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from {SLUG}.config import load_config
from {SLUG}.distributed import GradSyncCounter
from {SLUG}.model import build_model, load_tokenizer, model_config
cfg = load_config(["--config", "configs/train.yaml"])
tok = load_tokenizer(cfg)
dist.init_process_group("gloo", rank=0, world_size=1)
model = DDP(build_model(cfg, model_config(cfg, tok)), bucket_cap_mb={bucket_cap_mb})
counter = GradSyncCounter(model)
ids = torch.randint(4, len(tok), (2, 12))
counts = []
for _ in range(3):
    model(input_ids=ids).logits.sum().backward()
    counts.append(counter.take())
print(counts[0], counts[2])
dist.destroy_process_group()
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env={**env, "MASTER_PORT": str(free_port())},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    return int(out[-2]), int(out[-1])


@pytest.mark.parametrize("entry", ENTRIES)
def test_ddp_syncs_gradients_once_per_optimizer_step(runs, entry):
    first, later = ddp_bucket_counts(ACCUM["ddp_bucket_cap_mb"], runs.env)
    assert later > 1
    synced = runs(entry, 2, **ACCUM)
    unsynced = runs(entry, 2, ddp_no_sync="false", **ACCUM)
    calls = [r["grad_sync_calls"] for r in synced.steps]
    print(f"{entry}: buckets {first} then {later}; grad_sync_calls with no_sync {calls}, "
          f"without {[r['grad_sync_calls'] for r in unsynced.steps]}")
    # Step 1 syncs once, through DDP's initial buckets; afterwards once per rebuilt bucket.
    assert calls == [first] + [later] * (len(calls) - 1)
    k = synced.steps[0]["micro_steps"]
    assert k == 4
    assert [r["grad_sync_calls"] for r in unsynced.steps[1:]] == [k * later] * (len(calls) - 1)
    # Skipping the all-reduce on non-boundary micro-steps changes nothing in the result.
    assert max_abs_diff(synced.params(), unsynced.params()) <= 1e-6


@pytest.mark.parametrize("entry", ENTRIES)
def test_partial_final_window_steps_and_matches_big_batch(runs, entry, small_dataset):
    # Plain SGD: parameters move by exactly lr x gradient, so a mis-scaled window shows (Adam
    # divides by sqrt(v) and turns float noise in near-zero gradients into update noise).
    flags = {"dataset": small_dataset, "num_epochs": 2, "optimizer": "sgd", "learning_rate": 0.1}
    accum = runs(entry, 2, micro_batch_size=2, global_batch_size=16, **flags)
    big = runs(entry, 1, micro_batch_size=16, global_batch_size=16, **flags)
    # 3 optimizer steps per epoch: 16 + 16 + 5 examples; the last window's 5 split 3 + 2, so one
    # rank runs 2 micro-batches and the other 1 real one plus a fully masked filler
    assert [r["micro_steps"] for r in accum.steps] == [4, 4, 2] * 2
    assert [r["micro_steps"] for r in big.steps] == [1, 1, 1] * 2
    assert [r["tokens"] for r in accum.steps] == [r["tokens"] for r in big.steps]
    if TASK == "sequence_classification":
        assert [r["tokens"] for r in accum.steps] == [16, 16, 5] * 2
    for a, b in zip(accum.steps, big.steps, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=TOL)
    diff = max_abs_diff(accum.params(), big.params())
    print(f"{entry} partial windows: max |param diff| = {diff:.3g}")
    assert diff <= TOL
    # exactly one evaluation per epoch, each of the 11 validation examples counted once
    assert [e["step"] for e in accum.evals] == [3, 6]
    for a, b in zip(accum.evals, big.evals, strict=True):
        assert set(a) == EVAL_KEYS[TASK]
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], abs=TOL)
        if TASK == "sequence_classification":
            assert a["eval_accuracy"] == b["eval_accuracy"]
            assert round(a["eval_accuracy"] * 11, 6).is_integer()


@pytest.mark.parametrize("entry", ENTRIES)
def test_metrics_jsonl_and_final_model(runs, entry):
    run = runs(entry, 2, **ACCUM)
    assert [r["step"] for r in run.steps] == list(range(1, 9))
    for record in run.steps:
        assert set(record) == STEP_KEYS
        assert (record["world_size"], record["global_batch_size"], record["micro_steps"]) == (2, 16, 4)
    # the lr applied at step s is the schedule's value after s - 1 scheduler steps: linear warmup
    # over 2 steps, then a cosine from the peak (train.yaml's learning_rate) to 0 at step 8
    peak = yaml.safe_load((ROOT / "configs" / "train.yaml").read_text())["learning_rate"]
    expected = [peak * n / 2 if n < 2 else peak * 0.5 * (1 + math.cos(math.pi * (n - 2) / 6)) for n in range(8)]
    assert [r["lr"] for r in run.steps] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # one evaluation, at the end of the (partial) epoch, none extra
    assert [e["step"] for e in run.evals] == [8]
    assert set(run.evals[0]) == EVAL_KEYS[TASK]
    final = run.output_dir / "final_model"
    assert AutoConfig.from_pretrained(final).model_type == "llama"
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.padding_side == "right" and tokenizer.pad_token == "[PAD]"
    assert torch.isfinite(run.params()["model.embed_tokens.weight"]).all()


def test_each_step_consumes_its_window_of_the_epoch_permutation(runs):
    from {{ cookiecutter.project_slug }}.batch import plan_batches
    from {{ cookiecutter.project_slug }}.config import load_config
    from {{ cookiecutter.project_slug }}.data import WindowSampler, load_raw_dataset, tokenize
    from {{ cookiecutter.project_slug }}.model import load_tokenizer

    run = runs(ENTRIES[0], 2, task="causal_lm", **ACCUM)
    cfg = load_config(["--config", str(ROOT / "configs" / "train.yaml"), "--max_seq_len", "48",
                       "--task", "causal_lm"])
    train = tokenize(load_raw_dataset(cfg), load_tokenizer(cfg), cfg)["train"]
    lengths = [len(ids) for ids in train["input_ids"]]
    assert len(set(lengths)) > 5  # varied lengths: padding is real
    order = WindowSampler(len(train), plan_batches(16, 16, 1), 0, cfg.seed).permutation(0)
    # a causal LM example of n tokens has n - 1 real targets
    expected = [sum(lengths[i] - 1 for i in order[s * 16:(s + 1) * 16]) for s in range(8)]
    assert [r["tokens"] for r in run.steps] == expected


@pytest.mark.parametrize("entry", ENTRIES)
def test_stop_and_resume_is_exact(runs, entry, tmp_path):
    straight = runs(entry, 2, **ACCUM)
    out = tmp_path / "resumed"
    first = run_entry(entry, 2, out, runs.env, {**ACCUM, "stop_after_steps": 4})
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((out / "checkpoints" / "step_4" / "state.json").read_text())["step"] == 4
    assert not (out / "final_model").exists()
    assert [r["step"] for r in first.steps] == [1, 2, 3, 4] and first.evals == []

    if entry == ENTRIES[0]:  # the refusal is Session.start's, shared by every entry point
        again = run_entry(entry, 2, out, runs.env, ACCUM)
        assert again.returncode == 1  # torchrun's code for workers that exited with 2
        worker_error_lines(again.stderr, f"error: output_dir {out} already holds checkpoints (step_4); pass "
                                         "--resume_from_checkpoint auto to continue")

    second = run_entry(entry, 2, out, runs.env, {**ACCUM, "resume_from_checkpoint": "auto"})
    assert second.returncode == 0, second.stderr[-3000:]
    assert [r["step"] for r in second.steps] == list(range(1, 9))
    assert [r["loss"] for r in second.steps] == [r["loss"] for r in straight.steps]
    assert [e["step"] for e in second.evals] == [8]
    assert max_abs_diff(second.params(), straight.params()) == 0.0


@pytest.mark.parametrize("entry", ENTRIES)
def test_default_run_learns(runs, entry):
    run = runs(entry, 2)
    first, last = run.evals[0], run.evals[-1]
    print(f"{entry} {TASK} default run, per epoch:", [round(e["eval_loss"], 4) for e in run.evals])
    assert len(run.evals) == 3  # num_epochs: 3, one evaluation each
    assert last["eval_loss"] < first["eval_loss"]
    if TASK == "sequence_classification":
        assert last["eval_accuracy"] >= 0.9  # chance is about 0.5
