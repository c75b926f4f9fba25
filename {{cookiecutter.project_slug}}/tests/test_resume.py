"""Losing nothing: a stopped, preempted or crashed job continues exactly from its last checkpoint,
a crash while a checkpoint is written leaves the previous one usable, and a run with a W&B key
leaves no copy of it behind. Every run is real: 2 gloo processes, under torchrun or forked as torchrun starts them."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (
    ACCUM,
    ENTRIES,
    IGNORING_USR1,
    LONG,
    TOL,
    Run,
    assert_same_training,
    background_run,
    c10d_agent,
    children_of,
    dropped_steps,
    fault_one_worker,
    flag_args,
    free_port,
    last_records,
    max_abs_diff,
    max_loss_diff,
    one_error_line,
    read_logs,
    report,
    run_entry,
    run_with_publish_hook,
    short_windows,
    signal_process_tree,
    successful_run,
    wait_for_step,
)

pytestmark = pytest.mark.slow  # the fast tier (`make test`) leaves this module to `make test-all`


@pytest.mark.parametrize("entry", ENTRIES)
def test_stop_and_resume_is_exact(runs, entry, tmp_path):
    straight = runs(entry, 2, **ACCUM)
    out = tmp_path / "resumed"
    first = runs.run(entry, 2, out, {**ACCUM, "stop_after_steps": 4})
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((out / "checkpoints" / "step_4" / "state.json").read_text())["step"] == 4
    assert not (out / "final_model").exists()
    assert [r["step"] for r in first.steps] == [1, 2, 3, 4] and first.evals == []
    shutil.copytree(out, tmp_path / "on_one_process")

    if entry == ENTRIES[0]:  # the refusal is startup.start's, shared by every entry point
        again = run_entry(entry, 2, out, runs.env, ACCUM)
        one_error_line(again, f"error: output_dir {out} already holds checkpoints (step_4); pass "
                       "--resume_from_checkpoint auto to continue", code=1, workers=2)  # 1: torchrun's

    second = runs.run(entry, 2, out, {**ACCUM, "resume_from_checkpoint": "auto"})
    assert second.returncode == 0, second.stderr[-3000:]
    assert [r["step"] for r in second.steps] == list(range(1, 9))
    assert [e["step"] for e in second.evals] == [8]
    assert_same_training(second, straight)

    # The same checkpoint continued on 1 process: accumulation re-derived (8 instead of 4), the
    # global batch and its examples the same, only the order of the sums differs.
    single = runs.run(entry, 1, tmp_path / "on_one_process", {**ACCUM, "resume_from_checkpoint": "auto"})
    assert single.returncode == 0, single.stderr[-3000:]
    assert [(r["world_size"], r["grad_accum_steps"]) for r in single.steps] == [(2, 4)] * 4 + [(1, 8)] * 4
    assert [r["tokens"] for r in single.steps] == [r["tokens"] for r in straight.steps]
    diff, loss_diff = max_abs_diff(single.params(), straight.params()), max_loss_diff(single, straight)
    report(f"resume {entry}: stop at 4 of 8, resume on 2 processes: bitwise equal; resume on 1 process "
           f"(accumulation 4 -> 8): max |param diff| {diff:.3g}, max |loss diff| {loss_diff:.3g}")
    assert diff <= TOL.param and loss_diff <= TOL.loss


def test_resume_in_the_middle_of_a_packed_epoch_is_exact(runs, tmp_path):
    """Packed blocks (439 blocks: 28 steps of 16 per epoch): stopped after step 4 and resumed, every
    loss and the final parameters are those of the straight packed run. (Packing is the data's:
    every entry point then resumes the same way, test_stop_and_resume_is_exact.)"""
    entry = ENTRIES[0]
    flags = {**ACCUM, "task": "causal_lm", "packing": "true"}
    straight = runs(entry, 2, **flags)
    out = tmp_path / "resumed"
    first = runs.run(entry, 2, out, {**flags, "stop_after_steps": 4})
    assert first.returncode == 0, first.stderr[-3000:]
    second = runs.run(entry, 2, out, {**flags, "resume_from_checkpoint": "auto"})
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming after step 4" in second.stdout and "training blocks of 48 tokens" in second.stdout
    assert_same_training(second, straight)


@pytest.mark.parametrize("entry", ENTRIES)
def test_resume_into_a_new_epoch_is_exact(runs, entry, small_dataset, tmp_path):
    # 3 optimizer steps per epoch: stopping after step 3 ends epoch 1 (with its evaluation); the
    # resumed job starts epoch 2 with that epoch's permutation.
    flags = {"micro_batch_size": 2, **short_windows(small_dataset)}
    straight = runs(entry, 2, **flags)
    out = tmp_path / "resumed"
    first = runs.run(entry, 2, out, {**flags, "stop_after_steps": 3})
    assert first.returncode == 0, first.stderr[-3000:]
    assert [e["step"] for e in first.evals] == [3]
    second = runs.run(entry, 2, out, {**flags, "resume_from_checkpoint": "auto"})
    assert second.returncode == 0, second.stderr[-3000:]
    assert [r["step"] for r in second.steps] == list(range(1, 7))
    assert second.evals == straight.evals  # one per epoch, at steps 3 and 6, the same values
    assert_same_training(second, straight)


@pytest.mark.parametrize("entry", ENTRIES)
def test_preemption_signal_checkpoints_and_the_job_continues(entry, env, tmp_path):
    out = tmp_path / "preempted"
    # As in scripts/slurm/common.sh: the launcher ignores the signal, the training processes handle it.
    with run_entry(entry, 2, out, env, LONG, under=IGNORING_USR1, background=True) as proc:
        wait_for_step(out, proc, 2)
        signal_process_tree(proc.pid, signal.SIGUSR1)  # every process of the job, launcher included
    stdout, stderr = read_logs(out)
    assert proc.returncode == 0, stderr[-3000:]
    steps = [r["step"] for r in Run(0, "", "", out).steps]
    stopped = steps[-1]
    assert steps == list(range(1, stopped + 1)) and stopped < LONG["max_steps"]
    assert f"(step {stopped} of {LONG['max_steps']}), on preemption signal (SIGUSR1)" in stdout
    assert json.loads((out / "checkpoints" / f"step_{stopped}" / "state.json").read_text())["step"] == stopped
    assert not (out / "final_model").exists()

    resumed = successful_run(entry, 2, out, env, {**LONG, "resume_from_checkpoint": "auto"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming after step {stopped}" in resumed.stdout
    assert [r["step"] for r in resumed.steps] == list(range(1, LONG["max_steps"] + 1))
    assert (out / "final_model" / "model.safetensors").is_file()


@pytest.mark.parametrize("entry", ENTRIES)
def test_sigterm_to_the_workers_checkpoints_exits_143_and_the_job_resumes_exactly(runs, entry, tmp_path):
    """Kubernetes' eviction (and a SLURM preemption) is SIGTERM: every worker stops after the same
    optimizer step with a checkpoint and exits 143, and so does scripts/train_local.sh (its
    torchrun); the restarted job ends as an uninterrupted run."""
    flags = {**LONG, "max_steps": 24}
    straight = runs(entry, 2, **flags)
    out = tmp_path / "terminated"
    cmd = ["scripts/train_local.sh", *flag_args(flags), "--output_dir", str(out)]
    env = {**runs.env, "PYTHON": sys.executable, "NPROC_PER_NODE": "2", "ENTRY": entry}
    with background_run(cmd, env, out) as proc:
        wait_for_step(out, proc, 2)
        workers = children_of()[proc.pid]  # train_local.sh execs torchrun: its children are the workers
        for worker in workers:
            os.kill(worker, signal.SIGTERM)
    stdout, stderr = read_logs(out)
    assert len(workers) == 2, stderr[-3000:]
    one_error_line(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), "error: ranks 0, 1 stopped by "
                   "SIGTERM; a restart resumes from the newest checkpoint", code=143, exact=True)
    steps = [r["step"] for r in Run(0, "", "", out).steps]
    stopped = steps[-1]
    assert steps == list(range(1, stopped + 1)) and stopped < flags["max_steps"]
    assert f"(step {stopped} of {flags['max_steps']}), on preemption signal (SIGTERM)" in stdout
    assert json.loads((out / "checkpoints" / f"step_{stopped}" / "state.json").read_text())["step"] == stopped

    resumed = runs.run(entry, 2, out, {**flags, "resume_from_checkpoint": "auto"})
    assert resumed.returncode == 0 and f"resuming after step {stopped}" in resumed.stdout, resumed.stderr[-3000:]
    diff = assert_same_training(resumed, straight)
    report(f"sigterm {entry}: SIGTERM to both workers after step 2, stopped at step {stopped}, exit codes 143 "
           f"(workers and train_local.sh); resumed: max |param diff| vs uninterrupted {diff:.3g}")


@pytest.mark.parametrize("entry", ENTRIES)
def test_killed_rank_restarts_from_the_last_checkpoint(runs, entry, tmp_path):
    """kill -9 of one rank under `torchrun --max_restarts 1`: torchrun restarts the job, which
    resumes from its newest checkpoint by itself and ends as an uninterrupted run."""
    flags = {**LONG, "max_steps": 80, "save_steps": 10, "resume_from_checkpoint": "auto"}
    straight = runs(entry, 2, **flags)
    out = tmp_path / "crashed"
    # c10d rendezvous, as scripts/slurm/torchrun.sbatch uses (the static one works too: the restarted
    # workers' rendezvous keys are kept apart from the killed ones', distributed.init_distributed)
    agent = c10d_agent(free_port(), 1, "--max_restarts", "1")
    with run_entry(entry, 2, out, runs.env, flags, agent=agent, background=True) as proc:
        killed_step, redone, resumed_after = fault_one_worker(out, proc, signal.SIGKILL)
    stdout, stderr = read_logs(out)
    assert proc.returncode == 0, stderr[-3000:]
    resumed_from = int(re.search(r"resuming after step (\d+)", stdout)[1])
    assert resumed_from >= 10 and redone["step"] == resumed_from + 1
    crashed = Run(0, stdout, stderr, out)
    assert [r["step"] for r in last_records(crashed)] == list(range(1, 81))
    # the steps logged after the checkpoint before the kill are set aside, not lost and not twice
    dropped = dropped_steps(out)
    assert dropped == list(range(resumed_from + 1, resumed_from + 1 + len(dropped)))
    assert dropped[-1] >= killed_step
    plural = "s" if len(dropped) > 1 else ""
    assert (f"note: {len(dropped)} record{plural} of {out / 'metrics.jsonl'} after step {resumed_from} (logged before "
            "the job stopped)") in stdout
    # save_total_limit (2 in train.yaml): the newest two, complete; no temporary folder left
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_70", "step_80"]
    diff = assert_same_training(crashed, straight)
    report(f"crash {entry}: kill -9 of one rank after step {killed_step}, torchrun restarted the job, which "
           f"resumed from step_{resumed_from}: {resumed_after:.1f} s from the kill to the first resumed step; "
           f"max |param diff| vs uninterrupted {diff:.3g}")


@pytest.mark.parametrize("entry", ENTRIES)
def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(runs, entry, tmp_path):
    flags, out = {**ACCUM, "save_steps": 4}, tmp_path / "out"
    proc = run_with_publish_hook(entry, """
        if state["step"] == 8 and env.is_main_process:  # every part written, nothing published yet
            os.kill(os.getpid(), signal.SIGKILL)
        return publish(cfg, env, written, final, state)""", flags, out, runs.env)
    assert proc.returncode == 1 and "exitcode  : -9" in proc.stderr, proc.stderr[-3000:]  # rank 0: SIGKILL
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert "step_4" in checkpoints and "step_8" not in checkpoints, checkpoints
    written = [p for p in (out / "checkpoints").iterdir() if p.name not in ("step_4",)]
    assert written and not any((p / "state.json").exists() for p in written)  # the half-done step 8

    resumed = runs.run(entry, 2, out, {**flags, "resume_from_checkpoint": "auto"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming after step 4" in resumed.stdout
    assert_same_training(resumed, runs(entry, 2, **ACCUM))


def test_damaged_checkpoint_is_one_line(env, tmp_path):
    out = tmp_path / "out"
    (out / "checkpoints" / "step_4").mkdir(parents=True)
    (out / "checkpoints" / "step_4" / "state.json").write_text("{not json")
    proc = run_entry(ENTRIES[0], 1, out, env, {"resume_from_checkpoint": "auto"})
    one_error_line(proc, f"error: checkpoint {out / 'checkpoints' / 'step_4'} is unreadable")


@pytest.mark.parametrize("entry", ENTRIES)
def test_no_copy_of_the_wandb_key_is_left(entry, env, tmp_path):
    key = "local-" + os.urandom(20).hex()  # the shape of a W&B key; never sent: WANDB_MODE=offline
    out = tmp_path / "out"
    run = successful_run(entry, 2, out, {**env, "WANDB_API_KEY": key},
                         {**ACCUM, "report_to": "wandb", "save_steps": 4, "max_steps": 6})
    assert run.returncode == 0, run.stderr[-3000:]
    scanned = [p for folder in (out, Path(env["WANDB_DIR"])) for p in folder.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in scanned) and any("checkpoints" in p.parts for p in scanned)
    leaks = [str(p) for p in scanned if key.encode() in p.read_bytes()]
    leaks += [name for name, text in (("stdout", run.stdout), ("stderr", run.stderr)) if key in text]
    report(f"secrets {entry}: {len(scanned)} files scanned (output_dir, W&B dir) plus the logs: "
           f"{len(leaks)} copies of WANDB_API_KEY")
    assert leaks == []
