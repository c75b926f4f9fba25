"""A collective the ranks disagree on, made for real on 2 gloo processes (helpers/collective_mismatch.py:
rank 1's all-reduce of step 3 sums one value more): the job ends with one line that names the
collective, the step and the rank that did not arrive, and a debug file per surviving rank.
debug_distributed, which DDP on gloo cannot run, is refused before anything is written."""

import json
import time

import pytest

from {{ cookiecutter.project_slug }}.config import ConfigError, load_config

from conftest import ROOT, SLUG, Run, error_lines, free_port, one_error_line, run_entry

FLAGS = {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 6, "collective_timeout_s": 30}


def mismatched(out, env) -> tuple[Run, float]:
    start = time.monotonic()
    run = run_entry("pytorch", 2, out, env, FLAGS,
                    script=(ROOT / "tests" / "helpers" / "collective_mismatch.py", "1:3", f"{SLUG}.train_pytorch"))
    return run, time.monotonic() - start


def test_debug_distributed_is_a_boolean_key_off_by_default():
    assert load_config([]).debug_distributed is False
    assert load_config(["--debug_distributed", "true"]).debug_distributed is True


@pytest.mark.slow
def test_a_collective_of_another_shape_ends_the_job_naming_the_collective_and_the_silent_rank(env, tmp_path):
    """gloo aborts the rank that receives more bytes than its own all-reduce holds (rank 0, in C++:
    no line, no file); rank 1 loses contact, waits 10 s for rank 0's word, and says what it knows."""
    out = tmp_path / "out"
    proc, seconds = mismatched(out, env)
    assert seconds < 60, (seconds, proc.stderr[-3000:])
    assert "Received data size doesn't match expected size" in proc.stderr  # gloo's abort of rank 0
    # torchrun's report holds a traceback (workers=2); rank 0, aborted in C++, says nothing (one line)
    line = one_error_line(proc, "error: lost contact with the other processes (", code=1, workers=2)
    assert len(error_lines(proc.stderr)) == 1
    assert ("rank 1 was in all_reduce of float64[5] (step 3); rank 0 did not arrive (no word within 10 s); what each "
            f"rank was doing: {out / 'debug' / 'rank_<r>.json'}") in line, line
    report = json.loads((out / "debug" / "rank_1.json").read_text())
    assert report["step"] == 3 and report["collective"] == {"name": "all_reduce", "shape": [5], "dtype": "float64"}
    assert report["others"] == {"0": "no word"} and report["debug_level"] == "OFF"
    assert "sum_and_read" in "".join(report["stack"])
    entries = report["flight_recorder"]["entries"]
    assert entries[-1]["profiling_name"] == "gloo:all_reduce" and entries[-1]["input_sizes"] == [[5]]


def refused(cfg_args: list[str]):
    with pytest.raises(ConfigError, match="^debug_distributed with DDP on gloo "):
        load_config(cfg_args)


def test_debug_distributed_with_ddp_on_gloo_is_refused_up_front(monkeypatch):
    """torch 2.13's DDP constructor crashes the process under TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo
    (2 processes, a Linear layer, nothing of ours): several processes on gloo are refused; one
    process (no DDP) is not."""
    monkeypatch.setenv("DIST_BACKEND", "gloo")
    assert load_config(["--debug_distributed", "true"]).debug_distributed is True  # WORLD_SIZE unset: 1 process
    monkeypatch.setenv("WORLD_SIZE", "2")
    refused(["--debug_distributed", "true"])
    assert load_config(["--debug_distributed", "false"]).debug_distributed is False


def test_debug_distributed_on_gloo_is_one_line_exit_2_and_no_lock(env, tmp_path):
    """A worker of a job of 2 on gloo: one line and exit 2, before output_dir (and its lock) exists."""
    out = tmp_path / "out"
    worker = {**env, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
              "MASTER_PORT": str(free_port()), "DIST_BACKEND": "gloo"}
    proc = run_entry("pytorch", 1, out, worker, {**FLAGS, "debug_distributed": "true"})
    one_error_line(proc, "error: debug_distributed with DDP on gloo (no GPU here, or DIST_BACKEND=gloo): torch ")
    assert not out.exists()
