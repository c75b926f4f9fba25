"""Faults a long job meets, made for real on 2 gloo processes: a training that diverges, a disk
that fills while a checkpoint is written (RLIMIT_FSIZE: the kernel refuses the write), a process
that stops answering (SIGSTOP). Each stops the job cleanly with one line per process and keeps
what was good; a restart continues from the newest complete checkpoint."""

import errno
import json
import mmap
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from {{ cookiecutter.project_slug }}.checkpoint import STATE_FILE
from {{ cookiecutter.project_slug }}.distributed import DistEnv, keep_flight_recorder
from {{ cookiecutter.project_slug }}.errors import JobFailed, disk_full
from {{ cookiecutter.project_slug }}.tracking import append_line

from conftest import (
    ACCUM,
    ENTRIES,
    LONG,
    Run,
    assert_same_training,
    c10d_agent,
    error_lines,
    fault_one_worker,
    free_port,
    last_records,
    max_abs_diff,
    one_error_line,
    read_logs,
    report,
    run_entry,
    run_with_publish_hook,
    strict_records,
)

# lr 1e30: the first step applies, after it every gradient is NaN (the loss itself stays finite).
DIVERGING = {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 10, "learning_rate": 1e30,
             "save_steps": 1, "save_total_limit": 0}
STATE_FILES = {"optimizer": ("training_state.pt", "optimizer.bin", "optimizer.pt"),
               "scheduler": ("training_state.pt", "scheduler.bin", "scheduler.pt")}


def saved_state(checkpoint, part: str):
    """The optimizer (or scheduler) state a checkpoint holds, whatever the entry point's format."""
    name = next(n for n in STATE_FILES[part] if (checkpoint / n).is_file())
    state = torch.load(checkpoint / name, weights_only=True)
    if name == "training_state.pt":  # train_pytorch keeps both in one file
        return state["optimizer" if part == "optimizer" else "lr_scheduler"]
    return state


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.equal(b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    return a == b


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_diverging_run_skips_its_steps_then_stops_keeping_what_was_good(entry, env, tmp_path):
    out = tmp_path / "diverged"
    run = run_entry(entry, 2, out, env, DIVERGING)
    one_error_line(run, "error: training diverged: steps 2-4 in a row had a non-finite gradient norm (nan), each "
                   f"skipped; the newest complete checkpoint is {out / 'checkpoints' / 'step_3'}, no model saved",
                   code=1, workers=2)  # 1: torchrun's, for workers that exited with 3
    assert "exitcode  : 3" in run.stderr, run.stderr[-3000:]
    records = [r for r in strict_records(out / "metrics.jsonl") if "loss" in r]  # strict JSON: no NaN
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r.get("step_skipped", False) for r in records] == [False, True, True, True]
    assert [r["grad_norm"] for r in records[1:]] == [None] * 3
    lrs = [r["lr"] for r in records]
    assert lrs[1] < lrs[0] and lrs[1] == lrs[2] == lrs[3]  # the schedule stood still on the skipped steps
    assert not (out / "final_model").exists()
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1", "step_2", "step_3"]
    first = load_file(checkpoints / "step_1" / "model.safetensors")
    for skipped in ("step_2", "step_3"):  # parameters, optimizer state and schedule as after step 1
        assert max_abs_diff(load_file(checkpoints / skipped / "model.safetensors"), dict(first)) == 0
        for part in ("optimizer", "scheduler"):
            assert same(saved_state(checkpoints / skipped, part), saved_state(checkpoints / "step_1", part)), part
        assert all(torch.isfinite(t).all() for t in load_file(checkpoints / skipped / "model.safetensors").values())


def test_how_many_nonfinite_steps_stop_the_job_is_a_setting(env, tmp_path):
    run = run_entry(ENTRIES[0], 1, tmp_path / "out", env, {**DIVERGING, "max_nonfinite_steps": 1, "save_steps": 0})
    one_error_line(run, "error: training diverged: steps 2-2 in a row had a non-finite gradient norm (nan)", code=3)
    assert [r["step"] for r in run.steps] == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(runs, entry, tmp_path):
    flags, out = {**ACCUM, "save_steps": 2}, tmp_path / "out"
    proc = run_with_publish_hook(entry, """
        done = publish(cfg, env, written, final, state)
        if state["step"] == 2:  # from now on no file may grow past 100 kB: the next model does not fit
            import time, transformers
            own_writes = transformers.Trainer._save_rng_state  # rank 1's, still going when rank 0 fails
            transformers.Trainer._save_rng_state = lambda *a: (env.rank and time.sleep(1), own_writes(*a))
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG, as a full disk with ENOSPC
            resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
        return done""", flags, out, runs.env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = error_lines(proc.stderr)
    written = re.compile(r"error: could not write (step_4|a checkpoint) \(.*File too large.*\); the newest complete "
                         f"checkpoint is {re.escape(str(out / 'checkpoints' / 'step_2'))}: free space")
    others = ("error: could not write step_4 (1 other process(es) failed)", "error: lost contact with the other")
    assert any(written.match(line) for line in lines), proc.stderr[-3000:]
    assert all(written.match(line) or line.startswith(others) for line in lines) and len(lines) <= 2, lines
    assert not re.search(r"\[rank\d\]: Traceback", proc.stderr)  # the workers' (torchrun prints its own)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]  # partial writes removed
    if entry != ENTRIES[0]:
        return  # the resume from step_2 is the same for every entry point (test_resume.py shows each)
    resumed = runs.run(entry, 2, out, {**flags, "resume_from_checkpoint": "auto"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming after step 2" in resumed.stdout
    assert_same_training(resumed, runs(entry, 2, **ACCUM))


def full_under(*roots: Path):
    """A write of a model file: under `roots` it fails with the kernel's ENOSPC (/dev/full), elsewhere it writes."""
    def write(folder: Path) -> None:
        with open("/dev/full" if set(roots) & set(folder.parents) else folder / "model.safetensors", "wb") as f:
            f.write(b"weights" * 1000)
    return write


def test_a_finished_model_that_output_dir_has_no_room_for_is_kept_elsewhere(tmp_path, monkeypatch):
    from {{ cookiecutter.project_slug }}.checkpoint import resume_point, room_elsewhere, write_final
    from {{ cookiecutter.project_slug }}.config import load_config
    from {{ cookiecutter.project_slug }}.distributed import dist_env

    out = tmp_path / "out"
    cfg, env = load_config(["--output_dir", str(out)]), dist_env()
    kept = room_elsewhere(str(out))
    assert kept is not None and kept.parent.stat().st_dev != tmp_path.stat().st_dev, kept
    try:
        with pytest.raises(JobFailed) as failed:
            write_final(cfg, env, full_under(out), {"step": 4})
        assert str(failed.value) == (f"could not write {out / 'final_model'} (OSError: [Errno 28] No space left on "
                                     f"device); the trained model is kept in {kept}: move it there once output_dir "
                                     f"can hold it (mv {kept} {out / 'final_model'})")
        assert not (out / ".tmp_final_model").exists() and not (out / "final_model").exists()
        shutil.move(kept, out / "final_model")
        assert (out / "final_model" / "model.safetensors").read_bytes() == b"weights" * 1000
        assert resume_point(load_config(["--output_dir", str(out), "--resume_from_checkpoint", "auto"])) == \
            out / "final_model"  # a finished run
    finally:
        shutil.rmtree(kept, ignore_errors=True)
    lost = "no checkpoint was completed before: free space and start the run again"
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # no other writable file system
    with pytest.raises(JobFailed, match=re.escape(f"could not write final_model (OSError: [Errno 28] No space left "
                                                  f"on device); {lost}")):
        write_final(cfg, env, full_under(out), {"step": 4})
    monkeypatch.undo()
    with pytest.raises(JobFailed, match=re.escape(f"could not write final_model (OSError: [Errno 28] No space left "
                                                  f"on device); {lost}")):  # no room there either
        write_final(cfg, env, full_under(out, kept.parent), {"step": 4})
    assert not kept.exists() and not kept.with_name(f".tmp_{kept.name}").exists()


@pytest.mark.parametrize("error", [AttributeError("'Net' object has no attribute 'save_pretrained'"),
                                   PermissionError(errno.EACCES, os.strerror(errno.EACCES), "model.safetensors")])
def test_a_write_that_fails_for_another_reason_than_a_full_disk_names_the_exception_and_the_file(tmp_path, error):
    from {{ cookiecutter.project_slug }}.checkpoint import checkpoints_dir, write_atomically, write_final
    from {{ cookiecutter.project_slug }}.config import load_config
    from {{ cookiecutter.project_slug }}.distributed import dist_env

    out = tmp_path / "out"
    cfg, env = load_config(["--output_dir", str(out)]), dist_env()

    def write(folder: Path) -> None:
        raise error

    reason = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    for name, written in (("step_2", lambda: write_atomically(cfg, env, checkpoints_dir(str(out)) / "step_2", write,
                                                               {"step": 2})),
                          ("final_model", lambda: write_final(cfg, env, write, {"step": 2}))):
        with pytest.raises(JobFailed) as failed:
            written()
        assert str(failed.value) == (f"could not write {name} ({reason}); no checkpoint was completed before: fix "
                                     "what the error names and start the run again")
    assert sorted(p.name for p in out.rglob("*")) == ["checkpoints"]  # nothing half written is left


def test_a_full_disk_is_told_by_its_errno_wherever_a_library_wrapped_it():
    wrapped = RuntimeError("the serialiser's own error")
    wrapped.__cause__ = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    rust = Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on '
                     'device" })')
    assert [disk_full(err).errno for err in (wrapped, rust)] == [errno.EDQUOT, errno.ENOSPC]
    assert disk_full(PermissionError(errno.EACCES, os.strerror(errno.EACCES))) is None
    assert disk_full(AttributeError("'Net' object has no attribute 'save_pretrained'")) is None


def test_a_metrics_write_that_fails_for_another_reason_than_a_full_disk_names_it(tmp_path, monkeypatch):
    def broken(fd, data):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "write", broken)
    with pytest.raises(JobFailed) as err:
        append_line(tmp_path / "metrics.jsonl", "{}")
    monkeypatch.undo()
    # the start and the advice; the whole line of the family: the full disk's, below
    assert str(err.value).startswith(f"could not write {tmp_path / 'metrics.jsonl'} (Input/output error); ")
    assert "free space" not in str(err.value)


@pytest.mark.slow
def test_a_full_disk_under_the_final_model_keeps_the_trained_weights_elsewhere(runs, tmp_path):
    """The finished model, which the disk had no room for after the checkpoint of step 2, is not
    lost: it is kept on another file system, and moved into final_model/ it is the finished run."""
    entry, out = ENTRIES[0], tmp_path / "out"
    flags = {**ACCUM, "save_steps": 2}
    proc = run_with_publish_hook(entry, f"""
        done = publish(cfg, env, written, final, state)
        import errno, transformers.modeling_utils as saving
        save = saving.safe_save_file
        def full_under_output_dir(tensors, filename, **kwargs):  # the disk of output_dir fills after step 2
            if filename.startswith({str(out)!r}):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            save(tensors, filename, **kwargs)
        saving.safe_save_file = full_under_output_dir
        return done""", flags, out, runs.env)
    kept = re.search(r"the trained model is kept in (\S+): move it there once output_dir can hold it \(mv \S+ (\S+)\)",
                     proc.stderr)
    assert proc.returncode == 1 and kept and kept[2] == str(out / "final_model"), proc.stderr[-3000:]
    lines = error_lines(proc.stderr)  # one per process: the other's reason is "1 other process(es) failed"
    assert len(lines) == 2 and all(line.endswith(kept[0]) for line in lines), lines
    assert not re.search(r"\[rank\d\]: Traceback", proc.stderr)
    try:
        shutil.move(kept[1], out / "final_model")
    finally:
        shutil.rmtree(kept[1], ignore_errors=True)
    straight = runs(entry, 2, **ACCUM)
    weights, expected = (load_file(d / "final_model" / "model.safetensors") for d in (out, straight.output_dir))
    assert max_abs_diff(weights, expected) == 0
    again = runs.run(entry, 2, out, {**flags, "resume_from_checkpoint": "auto"})
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == (
        f"already done at step {ACCUM['max_steps']}: {out / 'final_model'} (nothing changed)"), again.stderr[-3000:]
    assert again.stdout.count("already done") == 1  # said once by the job, not once per process


@pytest.mark.slow
def test_a_stopped_process_fails_the_job_within_the_collective_timeout_and_it_resumes(runs, tmp_path):
    """SIGSTOP of one rank under `torchrun --max_restarts 1 ... --resume_from_checkpoint auto`
    (as the sbatch scripts launch): the other rank's collective times out after 5 s, the job
    fails instead of hanging, torchrun restarts it, and it continues from its newest checkpoint."""
    entry = ENTRIES[0]
    flags = {**LONG, "max_steps": 80, "save_steps": 10, "resume_from_checkpoint": "auto"}
    straight = runs(entry, 2, **flags)  # the killed-rank test's uninterrupted run
    out = tmp_path / "stopped"
    agent = c10d_agent(free_port(), 1, "--max_restarts", "1")
    with run_entry(entry, 2, out, runs.env, flags, ["--collective_timeout_s", "5"], agent=agent,
                   background=True) as proc:
        stopped_step, redone, resumed_after = fault_one_worker(out, proc, signal.SIGSTOP)
    stdout, stderr = read_logs(out)
    assert proc.returncode == 0, stderr[-3000:]
    lost = [line for line in stderr.splitlines() if line.startswith("error: lost contact with the other processes (")]
    assert len(lost) == 1 and "Timed out waiting 5000ms" in lost[0], stderr[-3000:]
    resumed_from = int(re.search(r"resuming after step (\d+)", stdout)[1])
    assert redone["step"] == resumed_from + 1 and resumed_after > 5  # not before the collective timeout
    job = Run(0, stdout, stderr, out)
    assert [r["step"] for r in last_records(job)] == list(range(1, 81))
    diff = assert_same_training(job, straight)
    report(f"stopped rank ({entry}): SIGSTOP after step {stopped_step}, collective timeout 5 s, torchrun "
           f"restarted the job, which resumed from step_{resumed_from}: {resumed_after:.1f} s from the stop to the "
           f"first resumed step; max |param diff| vs uninterrupted {diff:.3g}")


def test_under_nccl_each_process_dumps_its_flight_recorder_into_output_dir(monkeypatch, tmp_path):
    """Under nccl torch dumps each process's latest collectives to output_dir/debug/flight_recorder/rank_<r>
    when one times out or fails (its own default is outside the run); a value already set wins; gloo, which
    has no such dump, is left as it is. The Flight Recorder's names are the ones this torch reads."""
    names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("DIST_BACKEND", raising=False)
    keep_flight_recorder(DistEnv(0, 0, 2, 2, torch.device("cpu")), str(tmp_path / "gloo"))
    assert not any(name in os.environ for name in names) and not (tmp_path / "gloo").exists()
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "50")
    keep_flight_recorder(DistEnv(1, 1, 2, 2, torch.device("cuda", 1)), str(tmp_path / "out"))
    folder = tmp_path / "out" / "debug" / "flight_recorder"
    assert folder.is_dir() and [os.environ[name] for name in names] == ["50", "1", str(folder / "rank_")]
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"  # the Flight Recorder's code
    with library.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as code:
        assert code.find(b"TORCH_FR_BUFFER_SIZE\0") >= 0 and code.find(b"TORCH_FR_DUMP_TEMP_FILE\0") >= 0


def test_strict_records_refuse_nan(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"loss": float("nan")}) + "\n")
    with pytest.raises(ValueError, match="NaN"):
        strict_records(path)


def test_metrics_hold_each_step_once_and_nothing_is_lost(tmp_path, capsys):
    from {{ cookiecutter.project_slug }}.tracking import set_aside

    path, aside = tmp_path / "metrics.jsonl", tmp_path / "metrics.dropped.jsonl"
    rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 7)] + [{"step": 4, "eval_loss": 2.0}]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '\n{"step": 7, "lo'  # a crash cut the last line short
    path.write_text(text)
    set_aside(path, 4)  # a resume from the checkpoint of step 4
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:4] + rows[6:]
    assert aside.read_text() == "".join(json.dumps(r) + "\n" for r in rows[4:6]) + '{"step": 7, "lo\n'
    assert capsys.readouterr().out.strip() == (f"note: 3 records of {path} after step 4 (logged before the job "
                                               f"stopped) moved to {aside}")
    set_aside(path, 4)  # the same resume again: nothing more to set aside, nothing said
    assert capsys.readouterr().out == "" and len(path.read_text().splitlines()) == 5
    set_aside(path, 0)  # a fresh run in the folder of a run that left no checkpoint
    assert path.read_text() == "" and len(aside.read_text().splitlines()) == 8


def test_a_full_disk_under_metrics_jsonl_stops_the_job_with_one_line_and_leaves_no_part_of_a_record(
        tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n')
    write = os.write

    def half_then_full(fd, data):  # the disk fills up halfway through the record
        if not data.startswith(b'{"step": 2'):
            return write(fd, data)
        write(fd, data[:len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(JobFailed) as err:
        append_line(path, '{"step": 2, "loss": 0.5}')
    monkeypatch.undo()
    assert str(err.value) == (f"could not write {path} (No space left on device); no checkpoint was completed before: "
                              "free space and start the run again")
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n'  # strict JSON lines still
    (tmp_path / "checkpoints" / "step_4").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_4" / STATE_FILE).write_text("{}")
    (tmp_path / "full.jsonl").symlink_to("/dev/full")  # a real ENOSPC
    with pytest.raises(JobFailed, match=r"\(No space left on device\); the newest complete checkpoint is "):
        append_line(tmp_path / "full.jsonl", "{}")
