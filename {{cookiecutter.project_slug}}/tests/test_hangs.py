"""A collective the ranks disagree on, made for real on 2 gloo processes (collective_mismatch.py:
rank 1's all-reduce of step 3 sums one value more): the job ends with one line that names the
collective, the step and the rank that did not arrive, and a debug file per surviving rank."""

import json
import subprocess
import sys
import time

import pytest

from {{ cookiecutter.project_slug }}.config import load_config

from conftest import ROOT, SLUG, error_lines, flag_args, free_port

FLAGS = {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 6, "collective_timeout_s": 30}


def mismatched(out, env, debug: bool) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(ROOT / "tests" / "collective_mismatch.py"), "1:3",
           f"{SLUG}.train_pytorch", *flag_args({**FLAGS, "debug_distributed": str(debug).lower()}),
           "--output_dir", str(out)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - start


def test_debug_distributed_is_a_boolean_key_off_by_default():
    assert load_config([]).debug_distributed is False
    assert load_config(["--debug_distributed", "true"]).debug_distributed is True


@pytest.mark.slow
def test_a_collective_of_another_shape_ends_the_job_naming_the_collective_and_the_silent_rank(env, tmp_path):
    """gloo aborts the rank that receives more bytes than its own all-reduce holds (rank 0, in C++:
    no line, no file); rank 1 loses contact, waits 10 s for rank 0's word, and says what it knows."""
    out = tmp_path / "out"
    proc, seconds = mismatched(out, env, debug=False)
    assert proc.returncode == 1 and seconds < 60, (seconds, proc.stderr[-3000:])
    assert "Received data size doesn't match expected size" in proc.stderr  # gloo's abort of rank 0
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: lost contact with the other processes (") and (
        "rank 1 was in all_reduce of float64[5] (step 3); rank 0 did not arrive (no word within 10 s); what each "
        f"rank was doing: {out / 'debug' / 'rank_<r>.json'}") in lines[0], proc.stderr[-3000:]
    report = json.loads((out / "debug" / "rank_1.json").read_text())
    assert report["step"] == 3 and report["collective"] == {"name": "all_reduce", "shape": [5], "dtype": "float64"}
    assert report["others"] == {"0": "no word"} and report["debug_level"] == "OFF"
    assert "sum_and_read" in "".join(report["stack"])
    entries = report["flight_recorder"]["entries"]
    assert entries[-1]["profiling_name"] == "gloo:all_reduce" and entries[-1]["input_sizes"] == [[5]]


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="torch 2.13 (CPU, gloo): DistributedDataParallel's constructor segfaults "
                   "under TORCH_DISTRIBUTED_DEBUG=DETAIL (2 processes, a Linear layer, nothing of ours)")
def test_with_debug_distributed_the_ranks_name_the_shapes_they_disagree_on(env, tmp_path):
    out = tmp_path / "out"
    proc, seconds = mismatched(out, env, debug=True)
    lines = error_lines(proc.stderr)
    assert proc.returncode == 1 and seconds < 60 and len(lines) == 2, proc.stderr[-3000:]
    assert all(line.startswith("error: the processes ran different collectives (Tensor Tensor shapes: ")
               for line in lines), lines
    for rank in (0, 1):
        report = json.loads((out / "debug" / f"rank_{rank}.json").read_text())
        assert report["debug_level"] == "DETAIL" and "Detected mismatch" in report["error"]
