"""Elastic node counts: `NNODES=MIN:MAX scripts/train_local.sh` on two "nodes" of this machine (one
CPU process each, the c10d rendezvous on 127.0.0.1). A node that is lost leaves the job on the
other one, which restarts from the newest complete checkpoint with twice the accumulation and
ends as a straight 2-process run; losing the node that holds the rendezvous ends the job in one
line, and a new start resumes."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (
    ENTRIES,
    LAUNCH_TIMEOUT_S,
    ROOT,
    SLUG,
    TOL,
    Run,
    children_of,
    error_lines,
    flag_args,
    free_port,
    last_records,
    max_abs_diff,
    report,
    signal_process_tree,
)

# 24 optimizer steps of 8 examples (2 per micro-batch: accumulation 2 on 2 nodes, 4 on one), a
# checkpoint every 4; a restart resumes by itself (the script adds --resume_from_checkpoint auto).
FLAGS = {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 24, "save_steps": 4,
         "resume_from_checkpoint": "auto"}
# The rendezvous completes 5 s after the first node joins (torchrun's last_call_timeout: 30 s),
# so the job after a loss starts sooner; the second node starts well within them.
RDZV_CONF = "last_call_timeout=5"
# The difference to a straight run: the same examples, summed in other groups (fp32 on CPU).
PARAM_TOL = 1e-6


def listening(port: int) -> bool:
    """Whether a socket of this machine listens on `port` (the rendezvous' store: its node holds it)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                return True
    return False


class Nodes:
    """Two nodes of an elastic job, NNODES=1:2 scripts/train_local.sh each: the first one started
    holds the rendezvous (torchrun's guess: both are 127.0.0.1; the second finds the port taken)."""

    def __init__(self, env: dict, out: Path, tmp_path: Path, join_after: int | None):
        self.port, self.out, self.tmp = free_port(), out, tmp_path
        self.env = {**env, "PYTHON": sys.executable, "NNODES": "1:2", "NPROC_PER_NODE": "1",
                    "MASTER_PORT": str(self.port), "RUN_ID": "elastic", "RDZV_CONF": RDZV_CONF}
        self.host = self.start("host")
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not listening(self.port):
            assert self.host.poll() is None and time.monotonic() < deadline, self.logs("host")
            time.sleep(0.05)
        if join_after is not None:  # the host first trains alone, up to checkpoint step `join_after`
            self.wait_for_checkpoint(join_after)
            worker = self.host_worker()
            os.kill(worker, signal.SIGSTOP)  # paused until the join asked it to stop: the join comes before the end
        self.guest = self.start("guest")
        if join_after is not None:
            while not int(re.search(r"ShdPnd:\s*(\w+)", Path(f"/proc/{worker}/status").read_text())[1], 16) & (
                    1 << signal.SIGTERM - 1):  # the host's torchrun has seen the guest and sent its SIGTERM
                assert self.guest.poll() is None and time.monotonic() < deadline, self.logs("guest")
                time.sleep(0.05)
            os.kill(worker, signal.SIGCONT)

    def start(self, name: str) -> subprocess.Popen:
        return subprocess.Popen(["scripts/train_local.sh", *flag_args(FLAGS), "--output_dir", str(self.out)],
                                cwd=ROOT, env=self.env, stdout=(self.tmp / f"{name}.stdout").open("w"),
                                stderr=(self.tmp / f"{name}.stderr").open("w"))

    def logs(self, name: str) -> str:
        return (self.tmp / f"{name}.stdout").read_text() + (self.tmp / f"{name}.stderr").read_text()

    def host_worker(self) -> int:
        """The host's training process (under its torchrun)."""
        tree, todo = children_of(), [self.host.pid]
        while todo:
            pid = todo.pop()
            todo += tree.get(pid, [])
            command = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if f"{SLUG}.train_{ENTRIES[0]}" in command and f"{SLUG}.torchrun" not in command:
                return pid
        raise AssertionError(self.logs("host"))

    def wait_for_checkpoint(self, step: int) -> None:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not (self.out / "checkpoints" / f"step_{step}" / "state.json").is_file():
            assert self.host.poll() is None and time.monotonic() < deadline, self.logs("host")
            time.sleep(0.02)

    def lose(self, node: subprocess.Popen) -> list[int]:
        """Once checkpoints/step_4 is complete, SIGKILL `node`: its torchrun and its worker (in a
        session of its own, which a lost machine takes with it). The complete checkpoints then."""
        self.wait_for_checkpoint(4)
        signal_process_tree(node.pid, signal.SIGKILL)
        return sorted(int(p.parent.name[5:]) for p in (self.out / "checkpoints").glob("step_*/state.json"))

    def close(self) -> None:
        for node in (self.host, self.guest):
            if node.poll() is None:
                signal_process_tree(node.pid, signal.SIGKILL)


@pytest.fixture
def nodes(env, tmp_path):
    started = []

    def start(out: Path, join_after: int | None = None) -> Nodes:
        started.append(Nodes(env, out, tmp_path, join_after))
        return started[-1]

    yield start
    for job in started:
        job.close()


@pytest.mark.slow
def test_a_lost_node_leaves_the_job_on_the_other_with_twice_the_accumulation(runs, nodes, tmp_path):
    entry = ENTRIES[0]
    straight = runs(entry, 2, **FLAGS)
    job = nodes(tmp_path / "out")
    complete = job.lose(job.guest)
    lost_at = time.monotonic()
    assert job.host.wait(timeout=LAUNCH_TIMEOUT_S) == 0, job.logs("host")[-3000:]
    seconds = time.monotonic() - lost_at
    resumed_from = int(re.search(r"resuming after step (\d+)", job.logs("host"))[1])
    assert resumed_from >= complete[-1] >= 4, (resumed_from, complete)
    records = last_records(Run(0, "", "", job.out))  # each step once
    assert [r["step"] for r in records] == list(range(1, 25))
    shapes = [(r["world_size"], r["grad_accum_steps"], r["global_batch_size"]) for r in records]
    assert shapes == [(2, 2, 8)] * resumed_from + [(1, 4, 8)] * (24 - resumed_from), shapes
    diff = max_abs_diff(Run(0, "", "", job.out).params(), straight.params())
    assert diff <= PARAM_TOL, diff
    report(f"elastic 1:2, the node without the rendezvous lost after step_{complete[-1]}: the other resumed from "
           f"step_{resumed_from} at world size 1 (accumulation 2 -> 4) and finished {seconds:.1f} s after the loss; "
           f"max |param diff| vs a straight 2-process run {diff:.3g}")


@pytest.mark.slow
def test_a_node_that_joins_restarts_the_job_at_the_new_size(runs, nodes, tmp_path):
    """A second node joins a job that runs alone: torchrun stops the processes (they checkpoint on its
    SIGTERM), both nodes meet again, and the job goes on at world size 2 with half the accumulation,
    ending as a straight 2-process run."""
    straight = runs(ENTRIES[0], 2, **FLAGS)
    job = nodes(tmp_path / "out", join_after=4)
    joined_at = time.monotonic()
    assert [node.wait(timeout=LAUNCH_TIMEOUT_S) for node in (job.host, job.guest)] == [0, 0], job.logs("host")[-3000:]
    seconds = time.monotonic() - joined_at
    resumed_from = int(re.search(r"resuming after step (\d+)", job.logs("host"))[1])
    records = last_records(Run(0, "", "", job.out))
    assert [r["step"] for r in records] == list(range(1, 25))
    shapes = [(r["world_size"], r["grad_accum_steps"], r["global_batch_size"]) for r in records]
    assert shapes == [(1, 4, 8)] * resumed_from + [(2, 2, 8)] * (24 - resumed_from) and resumed_from >= 4, shapes
    assert not error_lines((tmp_path / "host.stderr").read_text() + (tmp_path / "guest.stderr").read_text())
    diff = max_abs_diff(Run(0, "", "", job.out).params(), straight.params())
    assert diff <= TOL.param, diff  # its first steps ran on one process: the parity bound of 1 against 2 processes
    report(f"elastic 1:2, a node joined after step_4: the job resumed from step_{resumed_from} at world size 2 "
           f"(accumulation 4 -> 2) and finished {seconds:.1f} s after the join; max |param diff| vs a straight "
           f"2-process run {diff:.3g}")


@pytest.mark.slow
def test_losing_the_rendezvous_node_ends_the_other_in_one_line_and_a_new_start_resumes(runs, nodes, env,
                                                                                         tmp_path):
    entry = ENTRIES[0]
    straight = runs(entry, 2, **FLAGS)
    job = nodes(tmp_path / "out")
    complete = job.lose(job.host)
    lost_at = time.monotonic()
    code = job.guest.wait(timeout=LAUNCH_TIMEOUT_S)
    seconds = time.monotonic() - lost_at
    stderr = (tmp_path / "guest.stderr").read_text()
    said = [line for line in error_lines(stderr) if line.startswith("error: torchrun")]
    assert code == 1 and said == [f"error: torchrun lost the rendezvous at 127.0.0.1:{job.port}: the node that "
                                  "holds it stopped or cannot be reached; the job stops: start every node again "
                                  "(with --resume_from_checkpoint auto it resumes from the newest checkpoint)"], stderr
    assert "Traceback" not in stderr and not re.search(r"exitcode  :", stderr), stderr[-3000:]
    # its worker, if it got as far as a collective before torchrun stopped it, said so in a line of its own
    assert all(line.startswith("error: lost contact with the other processes") for line in error_lines(stderr)
               if line not in said), stderr[-3000:]
    again = subprocess.run(["scripts/train_local.sh", *flag_args(FLAGS), "--output_dir", str(job.out)], cwd=ROOT,
                           env={**env, "PYTHON": sys.executable, "NPROC_PER_NODE": "2"}, capture_output=True,
                           text=True, timeout=LAUNCH_TIMEOUT_S)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed_from = int(re.search(r"resuming after step (\d+)", again.stdout)[1])
    assert resumed_from >= complete[-1] >= 4, (resumed_from, complete)
    assert [r["step"] for r in last_records(Run(0, "", "", job.out))] == list(range(1, 25))
    diff = max_abs_diff(Run(0, "", "", job.out).params(), straight.params())
    assert diff <= PARAM_TOL, diff
    report(f"elastic 1:2, the rendezvous node lost after step_{complete[-1]}: the other ended in one line, exit "
           f"{code}, {seconds:.1f} s after the loss; a new start resumed from step_{resumed_from}, max |param diff| "
           f"vs a straight 2-process run {diff:.3g}")
