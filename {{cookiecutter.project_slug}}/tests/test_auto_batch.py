"""The auto_batch extra at run time: --micro_batch_size auto surviving an out-of-memory error
mid-run (the window taken again with a smaller micro batch) and in a synchronising micro-step (the
job stops, its restart goes on smaller).

The out-of-memory errors are injected (helpers/oom_injection.py: torch.OutOfMemoryError from the model's
forward pass on one rank above a bound of rows), since this machine has no GPU to fill."""

import json
import math
import textwrap

import pytest
import torch
import torch.distributed as dist
from test_levers import DEVICE, config_for
from test_speed import counted_steps, ours

from {{ cookiecutter.project_slug }}.distributed import DistEnv, dist_env, init_distributed
from {{ cookiecutter.project_slug }}.errors import ConfigError
from {{ cookiecutter.project_slug }}.launch import Launch
from {{ cookiecutter.project_slug }}.memory import MIB, check_auto_micro_batch, training_step_peak

from conftest import (
    ACCUM,
    ENTRIES,
    ROOT,
    SLUG,
    TOL,
    Run,
    assert_same_training,
    max_abs_diff,
    report,
    run_entry,
)

LOOPS = [e for e in ENTRIES if e != "trainer"]  # the loops that are ours (the Trainer's is the library's)
needs_a_loop = pytest.mark.skipif(not LOOPS, reason="only train_trainer generated: it keeps micro_batch_size "
                                  "auto a start-up search")


AUTO = {"micro_batch_size": "auto", "memory_budget_mb": 100000, "global_batch_size": 16, "max_steps": 6,
        "ddp_bucket_cap_mb": 0.05, "collective_timeout_s": 60}


def injected(entry: str, spec: str, out, env, flags: dict) -> Run:
    """2 processes of `entry` under torchrun, out-of-memory errors injected on rank 1 (`spec`)."""
    return run_entry(entry, 2, out, env, flags,
                     script=(ROOT / "tests" / "helpers" / "oom_injection.py", spec, f"{SLUG}.train_{entry}"))


# Rank 1: more than 4 rows do not fit (the start-up search settles on 4: accumulation 2), and after
# 9 forward passes (the search's 5: micro 8 fails in its first, micro 4 fits in the probe's two
# windows of 2; then steps 1-2) not more than 2: step 3's first micro-step fails.
MID_WINDOW = "1:4:9:2"


@pytest.mark.slow
@pytest.mark.parametrize("entry", LOOPS)
def test_out_of_memory_mid_run_retries_the_window_with_half_the_micro_batch(runs, entry, tmp_path):
    run = injected(entry, MID_WINDOW, tmp_path / "auto", runs.env, AUTO)
    assert run.returncode == 0, run.stderr[-3000:]
    shapes = [(r["micro_batch_size"], r["grad_accum_steps"], r["micro_steps"]) for r in run.steps]
    assert shapes == [(4, 2, 2)] * 2 + [(2, 4, 4)] * 4
    assert [r.get("oom_retries", 0) for r in run.steps] == [0, 0, 1, 0, 0, 0]
    assert "batch 16 = micro 2 after out of memory x accum 4 x world 2" in run.stdout
    fixed = runs(entry, 2, **{**AUTO, "micro_batch_size": 2, "memory_budget_mb": 0})
    assert [r["tokens"] for r in run.steps] == [r["tokens"] for r in fixed.steps]
    diff = max_abs_diff(run.params(), fixed.params())
    report(f"out of memory {entry}: micro batch 4 -> 2 at step 3, vs micro batch 2 from the start: "
           f"max |param diff| {diff:.3g}, max |loss diff| "
           f"{max(abs(a['loss'] - b['loss']) for a, b in zip(run.steps, fixed.steps, strict=True)):.3g}")
    assert diff <= TOL.param
    # a job stopped after the change resumes with the smaller micro batch, exactly
    out = tmp_path / "stopped"
    stopped = injected(entry, MID_WINDOW, out, runs.env, {**AUTO, "save_steps": 2, "stop_after_steps": 4})
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    resumed = run_entry(entry, 2, out, runs.env, {**AUTO, "resume_from_checkpoint": "auto"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["micro_batch_size"] for r in resumed.steps[4:]] == [2, 2]
    assert_same_training(resumed, run)


@pytest.mark.slow
@needs_a_loop
@pytest.mark.parametrize("spec,checkpoints", [
    ("1:4:10:2", ["step_1", "step_2"]),  # step 3's second micro-step: the window's synchronising one
    ("1:4:7:2", ["step_1"]),  # step 2's first: the job's second window, whose forward rebuilds DDP's buckets
])
def test_out_of_memory_in_a_synchronising_micro_step_ends_the_job_and_its_restart_goes_on(runs, tmp_path, spec,
                                                                                        checkpoints):
    """There nothing can be agreed (rank 0 waits in a collective): one line, and the restart
    resumes from the newest checkpoint at the next smaller micro batch."""
    entry, out = LOOPS[0], tmp_path / "run"
    flags = {**AUTO, "save_steps": 1}
    failed = injected(entry, spec, out, runs.env, flags)
    assert failed.returncode == 1
    lines = [line for line in failed.stderr.splitlines() if line.startswith("error: rank 1 ran out of memory")]
    assert len(lines) == 1, failed.stderr[-3000:]
    assert "continues from the newest checkpoint with micro batch 2" in lines[0]
    assert (out / "auto_micro_batch_size").read_text() == "2\n"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == checkpoints
    restarted = run_entry(entry, 2, out, runs.env, {**flags, "resume_from_checkpoint": "auto"})
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert [r["micro_batch_size"] for r in restarted.steps[len(checkpoints):]] == [2] * (6 - len(checkpoints))
    fixed = runs(entry, 2, **{**AUTO, "micro_batch_size": 2, "memory_budget_mb": 0})
    assert max_abs_diff(restarted.params(), fixed.params()) <= TOL.param
    assert math.isfinite(restarted.steps[-1]["loss"])


# --- the start-up search ---------------------------------------------------------------------

def test_gradient_checkpointing_lowers_the_peak():
    peaks = {on: training_step_peak(*config_for("--gradient_checkpointing", on), 8, DEVICE) for on in ("false", "true")}
    report(f"peak of one training step, micro batch 8 x 48 tokens on {DEVICE.type}: {peaks['false'] / MIB:.2f} MiB, "
           f"with gradient checkpointing {peaks['true'] / MIB:.2f} MiB")
    assert peaks["true"] < peaks["false"]


@pytest.mark.parametrize("launch,named", [(Launch("accelerate", "configs/deepspeed/zero3.json", False), "DeepSpeed"),
                                         (Launch("trainer", "", True), "FSDP")])
def test_auto_is_refused_in_one_line_where_the_model_is_sharded(launch, named):
    cfg, _ = config_for("--micro_batch_size", "auto", "--memory_budget_mb", "64")
    with pytest.raises(ConfigError, match=f"^micro_batch_size auto measures a whole model per process, not the "
                                          f"shards of {named}; give micro_batch_size$"):
        check_auto_micro_batch(cfg, dist_env(), launch)


def test_the_probe_counts_the_logits_in_the_dtype_the_loss_gets_them():
    """Under bf16 Accelerate's model hands the loss fp32 logits: the probe counts that copy (at least its
    extra 2 bytes per logit over the bf16 logits) for the entry points on Accelerate. A vocabulary of
    8,192, where the logits make the peak."""
    cfg, config = config_for("--mixed_precision", "bf16")
    config.vocab_size = 8192
    bf16, fp32 = (training_step_peak(cfg, config, 8, DEVICE, fp32_logits=on) for on in (False, True))
    assert fp32 - bf16 >= 8 * 48 * config.vocab_size * 2, (fp32, bf16)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_auto_micro_batch_is_the_largest_that_fits(runs, entry):
    """A budget between the peaks of micro batches 4 and 8: global 32 on 2 processes trains with
    micro 4 x accumulation 4, exactly as a run told micro 4 (the first entry point's: the entry
    points train bitwise alike, test_parity.py)."""
    cfg, config = config_for()
    flags = {"global_batch_size": 32, "max_steps": 3}
    # as the search on 2 processes measures them: DDP's buckets, the window's micro-batches
    peak4, peak8 = (training_step_peak(cfg, config, size, DEVICE, ddp=True, accumulation=32 // 2 // size)
                    for size in (4, 8))
    budget_mb = (peak4 + peak8) / 2 / MIB
    auto = runs(entry, 2, micro_batch_size="auto", memory_budget_mb=f"{budget_mb:.6f}", **flags)
    told = runs(ENTRIES[0], 2, micro_batch_size=4, **flags)
    assert [(r["grad_accum_steps"], r["micro_steps"]) for r in auto.steps] == [(4, 4)] * 3
    assert "(auto: largest within the budget" in auto.stdout
    diff = max_abs_diff(auto.params(), told.params())
    report(f"micro_batch_size auto ({entry}), budget {budget_mb:.2f} MiB (peaks: micro 4 {peak4 / MIB:.2f} MiB, "
           f"micro 8 {peak8 / MIB:.2f} MiB): chose 4; vs {ENTRIES[0]} told 4: max |param diff| {diff:.3g}")
    assert diff == 0



# The entry point with its optimizer steps 2-4 measured as the probe measures one (memory.peak_bytes:
# on CPU LiveBytes over the parameters, gradients, optimizer state and whatever the step allocates).
MEASURED_STEPS = textwrap.dedent("""
    import importlib, json, os, sys
    import torch
    from {{ cookiecutter.project_slug }}.memory import peak_bytes

    entry_name = sys.argv.pop(1)
    entry = importlib.import_module("{{ cookiecutter.project_slug }}.train_" + entry_name)
    original, peaks = entry.train_step, {}

    def measured(*args, **kwargs):
        model, window, optimizer = args[0 if entry_name == "pytorch" else 1], args[2], args[3]
        if not 2 <= window.step <= 4:
            return original(*args, **kwargs)
        values = []
        device = next(model.parameters()).device
        peaks[window.step] = peak_bytes(lambda: values.append(original(*args, **kwargs)), device, model, optimizer)
        with open(os.environ["PEAKS_FILE"], "w") as f:
            json.dump(peaks, f)
        return values[0]

    entry.train_step = measured
    entry.main()
""")


@pytest.mark.slow
@pytest.mark.parametrize("entry", [e for e in ("pytorch", "accelerate") if e in ENTRIES])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_micro_batch_probe_sees_the_peak_of_real_steps(env, tmp_path, entry, optimizer):
    """The probe behind --micro_batch_size auto against the peak of the entry point's own optimizer
    steps 2-4 (optimizer state, accumulated gradients): never below it, at most 15 % above."""
    flags = {"optimizer": optimizer, "micro_batch_size": 4, "global_batch_size": 16, "max_steps": 4}
    script, peaks_file = tmp_path / "measured_steps.py", tmp_path / "peaks.json"
    script.write_text(MEASURED_STEPS)
    proc = run_entry(entry, 1, tmp_path / "out", {**env, "PEAKS_FILE": str(peaks_file)}, flags, script=(script, entry))
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = max(json.loads(peaks_file.read_text()).values())
    cfg, config = config_for("--optimizer", optimizer)
    probe = training_step_peak(cfg, config, 4, DEVICE, accumulation=4)  # as the auto search calls it here
    report(f"micro batch probe ({entry}, {optimizer}, micro 4, accumulation 4): probe {probe / MIB:.3f} MiB, "
           f"real steps 2-4 at most {real / MIB:.3f} MiB ({probe / real:.3f}x)")
    assert real <= probe <= 1.15 * real

@pytest.mark.parametrize("backend,bound", [(None, True), ("gloo", False)], ids=["nccl", "gloo_by_DIST_BACKEND"])
def test_a_gpu_rank_joins_nccl_bound_to_its_gpu(monkeypatch, backend, bound):
    """On a GPU the group is nccl, bound to the rank's GPU from the start (`device_id`); gloo
    (DIST_BACKEND=gloo: several ranks on one GPU) is not bound. Recorded here without a GPU."""
    joined = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "rendezvous", lambda *args, **kwargs: iter([(dist.HashStore(), 1, 2)]))
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: joined.update(kwargs))
    monkeypatch.delenv("DIST_BACKEND", raising=False)
    if backend:
        monkeypatch.setenv("DIST_BACKEND", backend)
    device = torch.device("cuda", 1)
    init_distributed(DistEnv(1, 1, 2, 2, device), 60, 60)
    assert joined["backend"] == (backend or "nccl") and joined["device_id"] == (device if bound else None)


@pytest.mark.slow
@pytest.mark.parametrize("entry", [e for e in ENTRIES if e != "trainer"][:1])  # the retry is the hand loops'
def test_the_out_of_memory_retry_adds_one_collective_before_the_synchronising_micro_step(entry, env, tmp_path):
    """micro_batch_size auto: the ranks agree that no micro-step ran out of memory before the
    window's synchronising one (so that a failed window is dropped before it can fail there): one
    more all-reduce and read per step, from the retry, and nothing else."""
    flags = {**ACCUM, "eval_every": 1000, "micro_batch_size": "auto", "memory_budget_mb": 100000}
    for step in counted_steps(entry, tmp_path, env, flags)[2:]:
        reads, collectives = step["reads"], step["collectives"]
        assert (ours(reads), ours(collectives)) == (2, 2), step
        assert reads.get(f"{SLUG}/distributed.py:ranks_with") == 1, step
