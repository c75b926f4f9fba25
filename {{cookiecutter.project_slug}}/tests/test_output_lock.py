"""One job per run folder: output_dir/.lock names the holder; a second job is refused, the same job
restarted takes over at once, a holder that is gone is taken over with one line."""

import contextlib
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
    c10d_agent,
    error_lines,
    free_port,
    one_error_line,
    read_logs,
    run_entry,
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
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "north")  # two clusters may share a disk and a job number
    assert job_identity() == "slurm job 17 step batch on north"


def test_single_node_jobs_on_two_hosts_are_two_jobs(tmp_path, alone, monkeypatch):
    """`scripts/train_local.sh` on two hosts with one MASTER_PORT: the same loopback rendezvous, not
    the same job; the second is refused while the first beats."""
    for name, value in {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert job_identity() == f"torchrun at 127.0.0.1:29500 on {socket.gethostname()}"
    hold(tmp_path, host="node-7", pid=1, job="torchrun at 127.0.0.1:29500 on node-7")
    with pytest.raises(ConfigError, match="in use by another job"):
        OutputLock(str(tmp_path)).check()


def test_a_paused_holder_taken_over_stops_before_its_next_write(tmp_path, alone, monkeypatch):
    """Paused past the stale time (a suspended job), the folder taken over by another host's job:
    the holder's heartbeat no longer writes its lock, and its next record or checkpoint is one line
    instead (JobFailed, exit 1); leaving, it keeps the other job's lock."""
    from {{ cookiecutter.project_slug }} import output_lock
    from {{ cookiecutter.project_slug }}.errors import JobFailed

    lock = OutputLock(str(tmp_path))
    lock.take(dist_env())
    try:
        output_lock.check_held()  # its own lock, freshly beaten: nothing read, nothing raised
        other = hold(tmp_path, host="node-7", pid=1, job="slurm job 18 step 0")
        lock.beat_at -= 3 * HEARTBEAT_S  # no beat for three periods: the process was stopped
        with pytest.raises(JobFailed, match=rf"^output_dir {tmp_path} was taken over by another job \(host node-7, "
                           r"pid 1, slurm job 18 step 0, .*\) while this one was paused; this job stops"):
            output_lock.check_held()
    finally:
        output_lock.release_held()
    assert json.loads((tmp_path / ".lock").read_text()) == other

    (tmp_path / "beaten").mkdir()
    beaten = OutputLock(str(tmp_path / "beaten"))  # its heartbeat finds the other job's lock first
    monkeypatch.setattr(output_lock, "HEARTBEAT_S", 0.05)
    beaten.take(dist_env())
    try:
        other = hold(tmp_path / "beaten", host="node-7", pid=1)
        time.sleep(0.5)
        assert json.loads((tmp_path / "beaten" / ".lock").read_text()) == other and beaten.lost == other
        with pytest.raises(JobFailed, match="was taken over by another job"):
            output_lock.check_held()
    finally:
        output_lock.release_held()
    assert json.loads((tmp_path / "beaten" / ".lock").read_text()) == other


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
    with run_entry(ENTRIES[0], 1, out, env, {**LONG, "max_steps": 5000}, background=True) as first:
        wait_for_step(out, first, 2)
        holder = json.loads((out / ".lock").read_text())
        second = run_entry(ENTRIES[0], 1, out, env, {**LONG, "max_steps": 3})
        one_error_line(second, f"error: output_dir {out} is in use by another job (host {socket.gethostname()}, "
                               f"pid {holder['pid']}, since ")
        steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2
        assert first.poll() is None  # the first job trains on
        signal_process_tree(first.pid, 9)
        first.wait(timeout=LAUNCH_TIMEOUT_S)
    assert json.loads((out / ".lock").read_text())["pid"] == holder["pid"]
    third = run_entry(ENTRIES[0], 1, out, env, {**LONG, "max_steps": 3})
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"note: output_dir {out} was held by a job that is gone (host {socket.gethostname()}, pid " \
           f"{holder['pid']}" in third.stdout
    assert not (out / ".lock").exists()


@pytest.mark.slow
@pytest.mark.skipif(subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0,
                    reason="no mount namespace here (unshare -m) to give one node its own output_dir")
def test_an_output_dir_the_nodes_do_not_share_is_one_line_on_each(env, tmp_path):
    """Two nodes (two torchrun agents), the second seeing its own folder at output_dir (a bind mount
    in a mount namespace, as a node-local disk): each process stops at the start with one line."""
    out, local = tmp_path / "out", tmp_path / "node_local"
    out.mkdir(), local.mkdir()
    port = free_port()
    local_mount = ("unshare", "-m", "sh", "-c", f'mount --bind {local} {out} && exec "$@"', "sh")
    with contextlib.ExitStack() as agents:
        for node_rank, under in enumerate(((), local_mount)):
            agent = c10d_agent(port, 2, "--node_rank", str(node_rank), "--rdzv_id", "local")
            agents.enter_context(run_entry(ENTRIES[0], 1, out, env, {"max_steps": 2}, agent=agent, under=under,
                                           background=True, logs=tmp_path / f"node{node_rank}"))
    for node_rank in (0, 1):
        log = read_logs(tmp_path / f"node{node_rank}")[1]
        assert error_lines(log) == [f"error: output_dir {out} is not shared between the nodes of this job: 1 of 2 "
                                    "processes do not see rank 0's files in it; use a folder on a file system "
                                    "every node mounts"], log[-3000:]
    assert not list(out.glob(".shared_*")) and not list(local.iterdir())
