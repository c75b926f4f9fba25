"""The doctor (`python -m {{ cookiecutter.project_slug }}.doctor`, `make doctor`): real processes on loopback. Two
that agree print one table and a checked, timed all-reduce; a process made to differ
(helpers/doctor_faults.py: another library version, a wrong all-reduce result) or one that never comes is
one line and exit code 2; the launch scripts start the doctor in place of training with ENTRY=doctor."""

import re
import socket
import subprocess
import sys
import time

import pytest
import torch

from {{ cookiecutter.project_slug }}.config import load_config
from {{ cookiecutter.project_slug }}.doctor import doctor
from {{ cookiecutter.project_slug }}.errors import ConfigError
from {{ cookiecutter.project_slug }}.extras import BAKED

from conftest import GPUS, ROOT, SLUG, error_lines, free_port, one_error_line, report

TIMEOUT_S = 120
HOST = socket.gethostname()


def needs_two_devices() -> None:
    if 0 < GPUS < 2:
        pytest.skip(f"2 processes need 2 GPUs (nccl: one process per GPU); this machine has {GPUS}")


def rank_env(env: dict, rank: int, world_size: int, port: int) -> dict:
    """The variables torchrun sets for one of its processes, for a process started by hand."""
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_PORT": str(port)}


def two_ranks(env: dict, *args: str) -> list[subprocess.CompletedProcess]:
    """`args` (after the interpreter) as rank 0 and rank 1 of a job of 2, each with its own exit code."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, *args], cwd=ROOT, env=rank_env(env, rank, 2, port), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]
    try:
        outputs = [proc.communicate(timeout=TIMEOUT_S) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    return [subprocess.CompletedProcess(proc.args, proc.returncode, *output)
            for proc, output in zip(procs, outputs, strict=True)]


def test_two_processes_that_agree_print_one_table_and_a_checked_all_reduce(env):
    """`make doctor`: scripts/train_local.sh with ENTRY=doctor, 2 processes."""
    needs_two_devices()
    start = time.monotonic()
    proc = subprocess.run(["scripts/train_local.sh"], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env={**env, "ENTRY": "doctor", "NPROC_PER_NODE": "2", "PYTHON": sys.executable})
    seconds = time.monotonic() - start
    assert proc.returncode == 0 and not error_lines(proc.stderr), proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("rank ")))
    keys = lines[header].split()
    assert keys == ["rank", "host", "device", "interface", "rendezvous", "torch", "transformers", "accelerate",
                    "deepspeed", "cuda", "nccl", "free", "memory"]
    rows = [line.split() for line in lines[header + 1:header + 3]]
    assert [row[0] for row in rows] == ["0", "1"] and all(row[1] == HOST for row in rows)
    assert all(row[3] == "lo" for row in rows)  # GLOO_SOCKET_IFNAME (or NCCL_SOCKET_IFNAME on GPUs)
    assert rows[0][4] == rows[1][4] and rows[0][4].startswith("127.0.0.1:")
    assert all(row[5] == torch.__version__ for row in rows)
    summary = lines[header + 3]
    bandwidth = float(re.fullmatch(r"all-reduce: 4 MiB float32 on 2 ranks, the exact sum on every rank, median of 5 "
                                   r"[\d.]+ ms \(slowest rank\), bus bandwidth ([\d.]+) GB/s", summary)[1])
    assert lines[header + 4] == "gloo group (background checkpoints): connected, the exact sum on every rank"
    assert bandwidth > 0 and len(lines) == header + 5, proc.stdout
    report(f"doctor, 2 processes: bus bandwidth {bandwidth:.2f} GB/s, {seconds:.1f} s from launch to exit")


@pytest.mark.slow
@pytest.mark.parametrize("fault,expected,exact", [
    ("torch=2.12.0", f"rank 1 (host {HOST}) has torch 2.12.0, rank 0 has {torch.__version__}", True),
    ("transformers=-", f"rank 1 (host {HOST}) has no transformers, rank 0 has ", False),
    ("all_reduce", f"rank 1 (host {HOST}) received 4 from the all-reduce, not 3 (the sum of rank + 1 over 2 ranks)",
     False),
], ids=["other_torch", "no_transformers", "wrong_sum"])
def test_a_rank_that_differs_is_one_line_naming_it_and_exit_2(env, fault, expected, exact):
    needs_two_devices()
    first, second = two_ranks(env, str(ROOT / "tests" / "helpers" / "doctor_faults.py"), "1", fault)
    one_error_line(first, f"error: {expected}", exact=exact)
    # rank 1 stops with the same exit code and leaves the one line to rank 0
    assert second.returncode == 2 and not error_lines(second.stderr) and "Traceback" not in second.stderr, second.stderr
    assert "rank " not in first.stdout  # no table


@pytest.mark.slow
def test_a_failed_check_under_train_local_is_exit_2_and_the_doctors_line_alone(env, tmp_path):
    """torchrun passes the doctor's exit code 2 on and adds no report of its own: the line says it.
    Rank 1 reports another torch (helpers/doctor_faults.py, loaded at start-up through sitecustomize)."""
    needs_two_devices()
    (tmp_path / "sitecustomize.py").write_text(
        f"import os, sys\nif os.environ.get('RANK') == '1':\n    sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "    from helpers.doctor_faults import inject\n    inject(1, 'torch=2.12.0')\n")
    proc = subprocess.run(["scripts/train_local.sh"], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env={**env, "ENTRY": "doctor", "NPROC_PER_NODE": "2", "PYTHON": sys.executable,
                               "PYTHONPATH": str(tmp_path)})
    one_error_line(proc, f"error: rank 1 (host {HOST}) has torch 2.12.0")
    assert not re.search(r"Traceback|FAILED|exitcode|failed \(", proc.stderr), proc.stderr[-3000:]


@pytest.mark.slow
def test_a_rank_that_never_joins_is_one_line_within_the_rendezvous_timeout(env):
    """Rank 0 of a job of 2, alone: it holds the rendezvous and counts who joined."""
    port, timeout_s = free_port(), 3
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", f"{SLUG}.doctor", "--rendezvous_timeout_s", str(timeout_s)],
                          cwd=ROOT, env=rank_env(env, 0, 2, port), capture_output=True, text=True, timeout=TIMEOUT_S)
    seconds = time.monotonic() - start
    line = one_error_line(proc, "error: only rank 0 of 2 joined, rank 1 is missing; ")
    assert f"127.0.0.1:{port}" in line and "--rendezvous_timeout_s" in line
    assert seconds < timeout_s + 30, seconds  # the wait, and the start-up of a process on a busy machine
    report(f"doctor, a rank missing: one line after {seconds:.1f} s (rendezvous_timeout_s {timeout_s}, "
           "start-up included)")


PLAN = "global_batch_size 64 is not divisible by micro_batch_size 8 x world_size 3 = 24"


@pytest.mark.parametrize("world_size,flags,expected", [
    (3, {"global_batch_size": 64, "micro_batch_size": 8}, PLAN),
    pytest.param(2, {"global_batch_size": 8, "micro_batch_size": 2, "fsdp": "hybrid_shard", "fsdp_replicas": 3},
                 "fsdp_replicas 3 does not divide the world size 2", id="fsdp_replicas",
                 marks=pytest.mark.skipif("fsdp" not in BAKED, reason="the fsdp extra is not baked")),
], ids=["batch", "fsdp_replicas"])
def test_a_world_size_that_training_refuses_the_doctor_refuses_before_the_ranks_meet(env, monkeypatch, world_size,
                                                                                   flags, expected):
    """Training's own checks (the batch plan, FSDP's mesh), on each rank before it joins: no rank waits."""
    for name, value in rank_env(env, 0, world_size, free_port()).items():
        monkeypatch.setenv(name, value)
    args = [arg for key, value in flags.items() for arg in (f"--{key}", str(value))]
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}"):
        doctor(load_config(args))


def test_the_doctor_of_a_world_size_that_training_refuses_is_one_line_and_exit_2(env):
    """Rank 0 of 3, alone: it says the batch cannot be shared before it waits for anyone."""
    proc = subprocess.run([sys.executable, "-m", f"{SLUG}.doctor", "--global_batch_size", "64", "--micro_batch_size",
                           "8"], cwd=ROOT, env=rank_env(env, 0, 3, free_port()), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    one_error_line(proc, f"error: {PLAN}")


@pytest.mark.parametrize("backend", ["gloo", "nccl"])  # nccl: the gloo group of background checkpoints
def test_an_interface_the_host_lacks_is_the_doctors_one_line_and_exit_2(env, backend):
    """Rank 0 of 2, alone: GLOO_SOCKET_IFNAME misspelt is said before it waits for anyone."""
    variables = {"GLOO_SOCKET_IFNAME": "eht9", "DIST_BACKEND": backend}
    proc = subprocess.run([sys.executable, "-m", f"{SLUG}.doctor"], cwd=ROOT, capture_output=True, text=True,
                          env={**rank_env(env, 0, 2, free_port()), **variables}, timeout=TIMEOUT_S)
    one_error_line(proc, f"error: GLOO_SOCKET_IFNAME=eht9 names 'eht9', which host {HOST} lacks; it has "
                         f"{', '.join(name for _, name in socket.if_nameindex())}: name one of them")


# the scripts that take the entry point's flags (sweep.sbatch, of the sweeps extra, takes a sweep file first:
# tests/test_sweep.py)
SBATCH = sorted(path for path in (ROOT / "scripts" / "slurm").glob("*.sbatch") if path.stem != "sweep")


def test_train_local_dry_run_starts_the_doctor(env):
    proc = subprocess.run(["scripts/train_local.sh", "--rendezvous_timeout_s", "60"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**env, "ENTRY": "doctor", "DRY_RUN": "1", "NPROC_PER_NODE": "2",
                                                      "PYTHON": "python3"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(f" -m {SLUG}.doctor --rendezvous_timeout_s 60"), proc.stdout


@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.stem)
def test_sbatch_dry_run_starts_the_doctor_on_each_node(env, script):
    proc = subprocess.run(["bash", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**env, "ENTRY": "doctor", "DRY_RUN": "1", "SLURM_NNODES": "2", "NPROC_PER_NODE": "2"})
    nodes = [line for line in proc.stdout.splitlines() if line.startswith("node")]
    assert proc.returncode == 0 and len(nodes) == 2, proc.stdout + proc.stderr
    assert all(f" -m {SLUG}.doctor --config configs/train.yaml " in line for line in nodes), nodes


@pytest.mark.skipif(not (ROOT / "scripts" / "node_launch.sh").is_file(), reason="generated without Kubernetes or "
                    "SkyPilot files")
def test_node_launch_dry_run_starts_the_doctor(env):
    proc = subprocess.run(["scripts/node_launch.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**env, "ENTRY": "doctor", "DRY_RUN": "1", "PYTHON": "python3", "NNODES": "2",
                               "JOB_COMPLETION_INDEX": "1", "NPROC_PER_NODE": "4", "MASTER_ADDR": "js-node-0-0.js"})
    assert proc.returncode == 0, proc.stderr
    assert f" -m {SLUG}.doctor --config configs/train.yaml " in proc.stdout.splitlines()[-1]
