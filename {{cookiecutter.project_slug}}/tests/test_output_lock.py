"""One job per run folder: output_dir/.lock names the holder; a second job is refused, the same job
restarted takes over at once, a holder that is gone is taken over with one line."""

import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from {{ cookiecutter.project_slug }}.distributed import dist_env
from {{ cookiecutter.project_slug }}.errors import ConfigError
from {{ cookiecutter.project_slug }}.output_lock import HEARTBEAT_S, STALE_S, OutputLock, job_identity

from conftest import (
    ENTRIES,
    LAUNCH_TIMEOUT_S,
    LONG,
    ROOT,
    background_run,
    flag_args,
    launch_cmd,
    one_error_line,
    signal_process_tree,
    wait_for_step,
)


@pytest.fixture
def alone(monkeypatch):
    """A process started by itself: no SLURM job, no torchrun."""
    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def hold(folder, **holder) -> dict:
    """A lock in `folder` as another job left it: by default a live process of this host."""
    holder = {"host": socket.gethostname(), "pid": os.getppid(), "job": "slurm job 17 step 0",
              "since": time.time() - 3600, "heartbeat": time.time(), **holder}
    folder.mkdir(exist_ok=True)
    (folder / ".lock").write_text(json.dumps(holder))
    return holder


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_live_job_of_this_host_holds_the_folder(tmp_path, alone):
    holder = hold(tmp_path)
    with pytest.raises(ConfigError) as err:
        OutputLock(str(tmp_path)).check()
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
    assert str(err.value) == (f"output_dir {tmp_path} is in use by another job (host {socket.gethostname()}, pid "
                              f"{os.getppid()}, slurm job 17 step 0, since {since} (heartbeat 0 s ago)); wait for it "
                              "to end, or choose another --output_dir")


@pytest.mark.parametrize("holder", [
    {"pid": "dead"},  # the pid of this host no longer runs
    {"started": "1"},  # the pid runs, but it is another process than the one that took the lock
    {"host": "node-7", "heartbeat": time.time() - STALE_S - 5},  # another host, its heartbeat stale
])
def test_a_holder_that_is_gone_is_taken_over_with_one_line(tmp_path, alone, capsys, holder):
    held = hold(tmp_path, **{**holder, "pid": dead_pid() if holder.get("pid") == "dead" else os.getppid()})
    lock = OutputLock(str(tmp_path))
    lock.take(dist_env())
    try:
        out = capsys.readouterr().out.splitlines()
        assert len(out) == 1 and out[0].startswith(f"note: output_dir {tmp_path} was held by a job that is gone "
                                                   f"(host {held['host']}, pid {held['pid']}, slurm job 17 step 0")
        assert out[0].endswith("; taking it over")
        mine = json.loads((tmp_path / ".lock").read_text())
        assert (mine["host"], mine["pid"], mine["job"]) == (socket.gethostname(), os.getpid(), "")
    finally:
        lock.release()
    assert not (tmp_path / ".lock").exists()


def test_another_host_with_a_fresh_heartbeat_holds_the_folder(tmp_path, alone):
    hold(tmp_path, host="node-7", pid=1, heartbeat=time.time() - STALE_S + 10)
    with pytest.raises(ConfigError, match=r"in use by another job \(host node-7, pid 1, slurm job 17 step 0, since "):
        OutputLock(str(tmp_path)).check()


def test_the_same_job_restarted_takes_over_at_once(tmp_path, alone, monkeypatch, capsys):
    """A SLURM requeue or a torchrun restart: the old instance's lock is the job's own, even while
    its heartbeat is fresh; another step of the same job is another job."""
    hold(tmp_path, host="node-7", pid=1)
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert job_identity() == "slurm job 17 step 0"
    lock = OutputLock(str(tmp_path))
    lock.take(dist_env())
    lock.release()
    assert capsys.readouterr().out == ""
    hold(tmp_path, host="node-7", pid=1)
    monkeypatch.setenv("SLURM_STEP_ID", "1")
    with pytest.raises(ConfigError, match="in use by another job"):
        OutputLock(str(tmp_path)).check()


def test_torchrun_names_the_job_by_its_run_id_or_its_rendezvous(alone, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4242")
    assert job_identity() == "torchrun run 4242"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default without --rdzv_id
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert job_identity() == "torchrun at 10.0.0.1:29500"


def test_the_heartbeat_keeps_the_lock_fresh_and_an_unreadable_lock_is_free(tmp_path, alone):
    assert HEARTBEAT_S * 3 < STALE_S  # a beat may be late twice before the lock looks stale
    (tmp_path / ".lock").write_text("{cut sh")
    lock = OutputLock(str(tmp_path))
    assert lock.check() is None
    lock.take(dist_env())
    try:
        written = json.loads((tmp_path / ".lock").read_text())
        assert abs(written["heartbeat"] - time.time()) < 5 and written["since"] <= written["heartbeat"]
    finally:
        lock.release()


def test_a_job_that_took_the_lock_meanwhile_wins(tmp_path, alone, monkeypatch):
    """Two jobs found the folder free at once: the one whose lock lands first holds it."""
    lock, found = OutputLock(str(tmp_path)), []
    holder = lock.holder
    monkeypatch.setattr(lock, "holder", lambda: holder() if found else found.append(None))  # read before it landed
    hold(tmp_path)
    with pytest.raises(ConfigError, match="in use by another job"):
        lock.take(dist_env())
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getppid() and not lock.held


@pytest.mark.parametrize("code,expected", [(errno.ENOSPC, "No space left on device); free space there"),
                                           (errno.EIO, "Input/output error); choose a folder to write to")],
                         ids=["full_disk", "other_error"])
def test_a_lock_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path, alone, monkeypatch, code, expected):
    write_text = Path.write_text

    def failing(path, *args, **kwargs):
        if path.name.startswith(".lock"):
            path.touch()  # as a file the disk had no room to fill
            raise OSError(code, os.strerror(code))
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", failing)
    lock = OutputLock(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        lock.take(dist_env())
    assert str(err.value) == f"output_dir {tmp_path}: cannot write .lock ({expected}"
    assert list(tmp_path.iterdir()) == [] and not lock.held


@pytest.mark.slow
def test_a_second_job_is_refused_and_a_killed_jobs_lock_is_taken_over(env, tmp_path):
    """A real job holds its folder: a second job into it is one line naming the first and changes
    nothing of its records; once the first is killed (kill -9, the lock left behind), the next job
    takes the folder over with one line, and leaves no lock when it ends."""
    out = tmp_path / "run"
    cmd = launch_cmd(ENTRIES[0], 1) + ["--output_dir", str(out)]
    with background_run(cmd + flag_args({**LONG, "max_steps": 5000}), env, tmp_path) as first:
        wait_for_step(out, first, 2)
        holder = json.loads((out / ".lock").read_text())
        second = subprocess.run(cmd + flag_args({**LONG, "max_steps": 3}), cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=LAUNCH_TIMEOUT_S)
        one_error_line(second, f"error: output_dir {out} is in use by another job (host {socket.gethostname()}, "
                               f"pid {holder['pid']}, since ")
        steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2
        assert first.poll() is None  # the first job trains on
        signal_process_tree(first.pid, 9)
        first.wait(timeout=LAUNCH_TIMEOUT_S)
    assert json.loads((out / ".lock").read_text())["pid"] == holder["pid"]
    third = subprocess.run(cmd + flag_args({**LONG, "max_steps": 3}), cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=LAUNCH_TIMEOUT_S)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"note: output_dir {out} was held by a job that is gone (host {socket.gethostname()}, pid " \
           f"{holder['pid']}" in third.stdout
    assert not (out / ".lock").exists()
