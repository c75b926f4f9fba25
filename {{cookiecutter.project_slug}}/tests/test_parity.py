"""The parity matrix: every generated entry point, run for real, trains the same whatever the
number of processes and micro-batches, and the entry points agree with each other.

Cells (processes x accumulation) 1x1, 1x4, 2x1 and 2x4 at the same global batch of 16, same seed,
data order, optimizer (AdamW) and schedule (warmup + cosine): each cell matches its entry's 1x1
reference, the entries match each other in every cell, the learning rate of every step is the same
everywhere, DDP syncs once per bucket per optimizer step, a short last window is scaled right, and
a stopped job resumes exactly. Tolerances: conftest.TOLERANCES; measured numbers: the "measured"
section at the end of the pytest output.
"""

import contextlib
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoTokenizer

from {{ cookiecutter.project_slug }}.config import load_config
from {{ cookiecutter.project_slug }}.extras import BAKED
from {{ cookiecutter.project_slug }}.launch import launch_of
from {{ cookiecutter.project_slug }}.session import Session

from conftest import (
    ACCUM,
    DATA_CACHE,
    ENTRIES,
    GLOBAL_BATCH,
    GPUS,
    MATRIX,
    MIXED_PRECISION,
    ROOT,
    SLUG,
    TASK,
    TOL,
    Run,
    c10d_agent,
    cell,
    free_port,
    max_abs_diff,
    max_loss_diff,
    read_logs,
    report,
    run_entry,
    short_windows,
)

NOISE = "batch_schedule" in BAKED  # the gradient noise scale (noise.py)
STEP_KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "micro_steps", "grad_sync_calls",
             "world_size", "grad_accum_steps", "micro_batch_size", "global_batch_size", "elapsed_s", "input_tokens",
             *(["grad_sq_norm", "grad_trace"] if NOISE else [])}  # this step's noise-scale estimates (DDP, 2 processes)
EVAL_KEYS = {"causal_lm": {"step", "eval_loss", "eval_perplexity"},
             "sequence_classification": {"step", "eval_loss", "eval_accuracy", "eval_f1"}}
def cell_id(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


CELLS = [(1, 1), (1, 4), (2, 1), (2, 4)]  # (processes, grad_accum_steps); ACCUM is the 2x4 cell


PACKED = {"task": "causal_lm", "packing": "true"}  # documents joined into full blocks of max_seq_len tokens


def matrix() -> list:
    """(entry, cell, packed): every cell of every entry point; packed, the whole matrix for the
    first entry point and 2x4 for the others (packing is the data's, the same for every loop).
    The fast tier (`make test`) runs the padded 2x4 cells."""
    return [pytest.param(entry, shape, packed, id=f"{entry}-{cell_id(shape)}-{'packed' if packed else 'padded'}",
                         marks=() if shape == (2, 4) and not packed else pytest.mark.slow)
            for packed in (False, True) for entry in ENTRIES for shape in CELLS[1:]
            if not packed or entry == ENTRIES[0] or shape == (2, 4)]


@pytest.mark.parametrize("entry,shape,packed", matrix())
def test_cell_matches_single_process_reference(runs, entry, shape, packed):
    nproc, accum = shape
    flags = PACKED if packed else {}
    run, reference = cell(runs, entry, *shape, **flags), cell(runs, entry, 1, 1, **flags)
    shapes = [(r["world_size"], r["grad_accum_steps"], r["micro_steps"]) for r in run.steps]
    assert shapes == [(nproc, accum, accum)] * 8
    assert "broadcast_buffers" not in run.stderr  # torch 2.13's deprecation of DDP's old argument
    assert [r["tokens"] for r in run.steps] == [r["tokens"] for r in reference.steps]
    if packed:  # no padding: every block of 48 tokens has 47 targets
        assert [r["tokens"] for r in run.steps] == [GLOBAL_BATCH * 47] * 8
    assert run.steps[-1]["loss"] < run.steps[1]["loss"] - 0.01  # it trained (step 1 has lr 0)
    param_diff, loss_diff = max_abs_diff(run.params(), reference.params()), max_loss_diff(run, reference)
    report(f"parity {'causal_lm packed' if packed else TASK} {MIXED_PRECISION} {entry} {cell_id(shape)} vs 1x1: "
           f"max |param diff| {param_diff:.3g}, max |loss diff| {loss_diff:.3g}")
    assert loss_diff <= TOL.loss
    assert param_diff <= TOL.param


@pytest.mark.skipif(len(ENTRIES) < 2, reason="one entry point generated")
@pytest.mark.parametrize("shape,packed", [*(pytest.param(shape, False, id=f"{cell_id(shape)}-padded",
                                                         marks=() if shape == (2, 4) else pytest.mark.slow)
                                            for shape in CELLS),
                                          pytest.param((2, 4), True, id="2x4-packed", marks=pytest.mark.slow)])
def test_entry_points_agree(runs, shape, packed):
    flags = PACKED if packed else {}
    reference = cell(runs, ENTRIES[0], *shape, **flags)
    for entry in ENTRIES[1:]:
        other = cell(runs, entry, *shape, **flags)
        for a, b in zip(reference.steps, other.steps, strict=True):
            assert (a["lr"], a["tokens"], a["micro_steps"]) == (b["lr"], b["tokens"], b["micro_steps"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=max(1e-5, TOL.loss))
            assert ("grad_noise_scale" in a) == ("grad_noise_scale" in b)
            if "grad_noise_scale" in a:  # the same DDP hook reads the same gradients in every entry point
                assert a["grad_noise_scale"] == pytest.approx(b["grad_noise_scale"], rel=max(1e-5, TOL.loss))
        assert ("grad_noise_scale" in reference.steps[-1]) == (shape[0] > 1 and NOISE)  # DDP on 2 processes
        assert reference.evals[0]["eval_loss"] == pytest.approx(other.evals[0]["eval_loss"], abs=TOL.loss)
        param_diff, loss_diff = max_abs_diff(reference.params(), other.params()), max_loss_diff(reference, other)
        report(f"parity {'causal_lm packed' if packed else TASK} {MIXED_PRECISION} {ENTRIES[0]} vs {entry} at "
               f"{cell_id(shape)}: "
               f"max |param diff| {param_diff:.3g}, max |loss diff| {loss_diff:.3g}")
        assert loss_diff <= TOL.loss
        assert param_diff <= TOL.param


@pytest.mark.slow
def test_learning_rate_is_the_same_for_every_entry_and_cell(runs):
    # the lr applied at step s is the schedule's value after s - 1 scheduler steps: linear warmup
    # over 2 steps, then a cosine from the peak (train.yaml's learning_rate) to 0 at step 8
    peak = yaml.safe_load((ROOT / "configs" / "train.yaml").read_text())["learning_rate"]
    expected = [peak * n / 2 if n < 2 else peak * 0.5 * (1 + math.cos(math.pi * (n - 2) / 6)) for n in range(8)]
    lrs = {(entry, c): [r["lr"] for r in cell(runs, entry, *c).steps] for entry in ENTRIES for c in CELLS}
    assert len({tuple(lr) for lr in lrs.values()}) == 1, lrs  # bitwise the same everywhere
    assert lrs[ENTRIES[0], (1, 1)] == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_two_torchrun_agents_train_like_one_node(runs, entry, tmp_path):
    """Two nodes on one machine: two torchrun agents (1 process each) meet through a c10d rendezvous
    on 127.0.0.1, as scripts/slurm/torchrun.sbatch starts them, and train like one node of 2."""
    one_node = cell(runs, entry, 2, 4)
    port, out = free_port(), tmp_path / "two_nodes"
    with contextlib.ExitStack() as stack:
        agents = [stack.enter_context(run_entry(
            entry, 1, out, runs.env, {"micro_batch_size": 2, **MATRIX}, background=True, logs=tmp_path / f"node{rank}",
            agent=c10d_agent(port, 2, "--node_rank", str(rank), "--rdzv_id", "two-nodes"))) for rank in (0, 1)]
    logs = [read_logs(tmp_path / f"node{rank}") for rank in (0, 1)]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(stderr[-2000:] for _, stderr in logs)
    two_nodes = Run(0, *logs[0], out)
    assert [(r["world_size"], r["micro_steps"]) for r in two_nodes.steps] == [(2, 4)] * 8
    diff = max_abs_diff(two_nodes.params(), one_node.params())
    report(f"two torchrun agents x 1 process vs one node x 2 processes ({entry}): max |param diff| {diff:.3g}, "
           f"max |loss diff| {max_loss_diff(two_nodes, one_node):.3g}")
    assert max_loss_diff(two_nodes, one_node) <= TOL.loss
    assert diff <= TOL.param


@pytest.mark.slow
@pytest.mark.skipif(GPUS > 0, reason="with GPUs the cached runs start under torchrun")
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_forked_cell_is_the_cell_torchrun_starts(runs, entry, tmp_path):
    """The cached runs fork from a process that has the entry point imported (helpers/fork_launcher.py):
    the same cell under torchrun logs the same steps and ends with the same parameters, bitwise."""
    forked = cell(runs, entry, 2, 4)
    started = run_entry(entry, 2, tmp_path / "torchrun", runs.env, {"micro_batch_size": 2, **MATRIX})
    assert started.returncode == 0, started.stderr[-3000:]
    timeless = [{k: v for k, v in r.items() if k != "elapsed_s"} for r in started.records]
    assert [{k: v for k, v in r.items() if k != "elapsed_s"} for r in forked.records] == timeless
    assert max_abs_diff(forked.params(), started.params()) == 0.0


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


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_ddp_syncs_gradients_once_per_optimizer_step(runs, entry):
    first, later = ddp_bucket_counts(ACCUM["ddp_bucket_cap_mb"], runs.env)
    assert later > 1
    synced = runs(entry, 2, **ACCUM)
    unsynced = runs(entry, 2, ddp_no_sync="false", **ACCUM)
    calls = [r["grad_sync_calls"] for r in synced.steps]
    report(f"sync {entry}: buckets {first} then {later}; grad_sync_calls per step with no_sync {calls}, "
           f"without {[r['grad_sync_calls'] for r in unsynced.steps]}")
    # Step 1 syncs once, through DDP's initial buckets; afterwards once per rebuilt bucket.
    assert calls == [first] + [later] * (len(calls) - 1)
    k = synced.steps[0]["micro_steps"]
    assert k == 4
    assert [r["grad_sync_calls"] for r in unsynced.steps[1:]] == [k * later] * (len(calls) - 1)
    # Skipping the all-reduce on non-boundary micro-steps changes nothing in the result.
    assert max_abs_diff(synced.params(), unsynced.params()) <= TOL.param


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_partial_final_window_steps_and_matches_big_batch(runs, entry, small_dataset):
    accum = runs(entry, 2, micro_batch_size=2, **short_windows(small_dataset))
    big = runs(entry, 1, micro_batch_size=16, **short_windows(small_dataset))
    # 3 optimizer steps per epoch: 16 + 16 + 5 examples; the last window's 5 split 3 + 2, so one
    # rank runs 2 micro-batches and the other 1 real one plus a fully masked filler
    assert [r["micro_steps"] for r in accum.steps] == [4, 4, 2] * 2
    assert [r["micro_steps"] for r in big.steps] == [1, 1, 1] * 2
    assert [r["tokens"] for r in accum.steps] == [r["tokens"] for r in big.steps]
    if TASK == "sequence_classification":
        assert [r["tokens"] for r in accum.steps] == [16, 16, 5] * 2
    # the gradient of every step, the short ones included, is the big batch's: SGD moves the
    # parameters by lr x gradient, so equal parameters after each epoch's short step say so too
    for a, b in zip(accum.steps, big.steps, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=TOL.loss)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=max(1e-5, TOL.loss))
    diff = max_abs_diff(accum.params(), big.params())
    report(f"parity {TASK} {MIXED_PRECISION} {entry} short last windows, 2x4 vs 1x1 (SGD): max |param diff| {diff:.3g}")
    assert diff <= TOL.param
    # exactly one evaluation per epoch, each of the 9 validation examples counted once
    assert [e["step"] for e in accum.evals] == [3, 6]
    for a, b in zip(accum.evals, big.evals, strict=True):
        assert set(a) == EVAL_KEYS[TASK]
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], abs=TOL.loss)
        if TASK == "sequence_classification":
            assert a["eval_accuracy"] == b["eval_accuracy"]
            assert round(a["eval_accuracy"] * 9, 6).is_integer()


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_metrics_jsonl_and_final_model(runs, entry):
    run = runs(entry, 2, **ACCUM)
    assert [r["step"] for r in run.steps] == list(range(1, 9))
    for record in run.steps:
        assert set(record) - {"grad_noise_scale"} == STEP_KEYS  # the smoothed estimate, once positive
        assert (record["world_size"], record["global_batch_size"], record["micro_steps"]) == (2, 16, 4)
    assert not NOISE or all(r["grad_noise_scale"] > 0 for r in run.steps[-4:])
    # one evaluation, at the end of the (partial) epoch, none extra
    assert [e["step"] for e in run.evals] == [8]
    assert set(run.evals[0]) == EVAL_KEYS[TASK]
    final = run.output_dir / "final_model"
    assert AutoConfig.from_pretrained(final).model_type == "llama"
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.padding_side == "right" and tokenizer.pad_token == "[PAD]"
    assert torch.isfinite(run.params()["model.embed_tokens.weight"]).all()


def test_an_eval_every_beyond_the_run_is_due_at_its_end(tmp_path):
    """Session.eval_due (the hand loops) and the Trainer's eval_steps: every eval_every steps, at the
    run's last step where that comes first."""
    cfg = load_config(["--config", str(ROOT / "configs" / "train.yaml"), "--output_dir", str(tmp_path)])
    for eval_every, total_steps, due in [(100, 3, [3]), (2, 5, [2, 4]), (3, 3, [3])]:
        cfg.eval_every = eval_every
        run = SimpleNamespace(total_steps=total_steps, plan=SimpleNamespace(micro_batch_size=2, grad_accum_steps=1),
                              deepspeed=None, env=SimpleNamespace(device=torch.device("cpu")),
                              launch=launch_of(cfg, "trainer"))
        session = SimpleNamespace(cfg=cfg, run=run)
        windows = [SimpleNamespace(step=step, ends_epoch=False) for step in range(1, total_steps + 1)]
        assert [w.step for w in windows if Session.eval_due(session, w)] == due
        if "trainer" in ENTRIES:
            from {{ cookiecutter.project_slug }}.train_trainer import training_arguments

            eval_steps = training_arguments(cfg, run).eval_steps
            assert [step for step in range(1, total_steps + 1) if step % eval_steps == 0] == due


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_an_eval_every_beyond_the_run_evaluates_once_at_its_end(entry, env, tmp_path):
    run = run_entry(entry, 1, tmp_path / "run", env, {"max_steps": 3, "micro_batch_size": 4, "global_batch_size": 8,
                                                      "eval_every": 100})
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in run.steps] == [1, 2, 3] and [e["step"] for e in run.evals] == [3]


@pytest.mark.slow
def test_each_step_consumes_its_window_of_the_epoch_permutation(runs):
    from {{ cookiecutter.project_slug }}.config import load_config
    from {{ cookiecutter.project_slug }}.model import load_tokenizer
    from {{ cookiecutter.project_slug }}.prepare import prepare
    from {{ cookiecutter.project_slug }}.windows import WindowSampler, plan_batches

    run = runs(ENTRIES[0], 2, **ACCUM, **({} if TASK == "causal_lm" else {"task": "causal_lm"}))
    cfg = load_config(["--config", str(ROOT / "configs" / "train.yaml"), "--max_seq_len", "48",
                       "--data_cache_dir", str(DATA_CACHE),
                       "--task", "causal_lm"])
    train = prepare(cfg, load_tokenizer(cfg)).data["train"]
    lengths = [len(ids) for ids in train["input_ids"]]
    assert len(set(lengths)) > 5  # varied lengths: padding is real
    order = WindowSampler(len(train), plan_batches(16, 16, 1), 0, cfg.seed).permutation(0)
    # a causal LM example of n tokens has n - 1 real targets
    expected = [sum(lengths[i] - 1 for i in order[s * 16:(s + 1) * 16]) for s in range(8)]
    assert [r["tokens"] for r in run.steps] == expected


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_default_run_learns(runs, entry):
    run = runs(entry, 2)
    first, last = run.evals[0], run.evals[-1]
    accuracy = [e.get("eval_accuracy") for e in run.evals]
    report(f"default run {TASK} {entry}: eval_loss per epoch {[round(e['eval_loss'], 4) for e in run.evals]}"
           + (f", eval_accuracy {accuracy}" if TASK == "sequence_classification" else ""))
    assert len(run.evals) == 3  # num_epochs: 3, one evaluation each
    assert last["eval_loss"] < first["eval_loss"]
    if TASK == "sequence_classification":
        assert last["eval_accuracy"] >= 0.9  # chance is about 0.5
