"""The GPU check (`python -m benchmarks.gpu_check`, `make gpu-check`), in every bake: without a GPU
it says so in one line; `--device cpu`, its self-test, runs every section on the tiny model and
writes each section's result the moment it is measured; a section whose budget is spent stops its run and
says so."""

import json
import re
import subprocess
import sys
import time

import pytest
import torch

from benchmarks import gpu_check
from benchmarks.common import entry_points
from {{ cookiecutter.project_slug }}.extras import BAKED

from conftest import LAUNCH_TIMEOUT_S, ROOT, report


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the check runs for real (make gpu-check)")
def test_the_gpu_check_says_in_one_line_that_there_is_no_gpu(env):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=ROOT, env={**env, "PYTHONPATH": "src:."},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines() == ["gpu_check: no GPU here (torch.cuda.is_available() is False): "
                                                "nothing to measure"]


# memory and auto_micro_batch are the sections of the extra auto_batch
GPU_CHECK_SECTIONS = ["speed", *(["memory", "auto_micro_batch"] if "auto_batch" in BAKED else []),
                      "two_ranks_on_one_gpu"]


@pytest.mark.slow
def test_the_gpu_checks_cpu_self_test_runs_every_section_and_writes_each_as_it_is_measured(env, tmp_path):
    """`--device cpu`: the tiny model through every section; bench/gpu_check.json holds each
    section's key from the moment it is measured, before the next section starts."""
    results = tmp_path / "bench" / "results.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--results", str(results)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, "PYTHONPATH": "src:."}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen, deadline = [], time.monotonic() + 3 * LAUNCH_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        written = results.parent / "gpu_check.json"
        keys = [k for k in GPU_CHECK_SECTIONS if k in json.loads(written.read_text())] if written.is_file() else []
        if keys and keys not in seen:
            seen.append(keys)
        time.sleep(0.1)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    sections = len(GPU_CHECK_SECTIONS)  # each written before the next ran:
    assert seen[:sections - 1] == [GPU_CHECK_SECTIONS[:n] for n in range(1, sections)], seen
    result = json.loads((results.parent / "gpu_check.json").read_text())
    assert list(result)[-sections:] == GPU_CHECK_SECTIONS and result["device"] == "cpu"
    assert {row["loop"] for row in result["speed"]} == {"bare", *entry_points()}
    assert all(row["tokens_per_s"] > 0 and row["mfu"] is None for row in result["speed"])  # no known CPU peak
    if "auto_batch" in BAKED:
        peaks = [row["peak_mib"] for row in result["memory"]]
        assert peaks == sorted(peaks) and peaks[0] < peaks[-1]
        auto = result["auto_micro_batch"]
        assert re.fullmatch(r"micro_batch_size\s+4\s+\(auto: .*", auto), auto
    parity = result["two_ranks_on_one_gpu"]
    assert parity["max_param_diff"] <= 1e-5 and parity["max_loss_diff"] <= 1e-5 and parity["micro_steps"] == 4
    assert (results.parent / "gpu_check.md").read_text().startswith("# GPU check: the CPU (self-test)")
    speeds = ", ".join(f"{row['loop']} {row['tokens_per_s']:,} tokens/s" for row in result["speed"])
    auto = result.get("auto_micro_batch", "no auto_batch")
    report(f"gpu_check --device cpu: {speeds}; {auto}; 2 ranks: max |param diff| "
           f"{parity['max_param_diff']:.3g}")


def test_a_section_whose_budget_is_spent_stops_its_run_keeps_its_rows_and_says_so(tmp_path):
    budget = gpu_check.Budget("speed", 2)
    start = time.monotonic()
    with pytest.raises(gpu_check.BudgetSpent, match=r"^speed: stopped, its budget of 2 s is spent$"):
        gpu_check.run("benchmarks.bare_loop", {"max_steps": 10_000}, tmp_path / "bare", budget)  # killed at 2 s
    assert time.monotonic() - start < 10
    rows = [{"loop": "bare", "compile": False, "tokens_per_s": 100, "mfu": None},
            {"loop": "pytorch", "compile": False, "tokens_per_s": 90, "mfu": None},
            {"loop": "pytorch", "compile": True, "tokens_per_s": 120, "mfu": None}]  # the compiled bare loop: stopped
    assert [r["vs_bare"] for r in gpu_check.with_vs_bare(rows)] == [1.0, 0.9, None]
    text = gpu_check.markdown({"machine": {}, "speed": rows, "two_ranks_on_one_gpu": None,
                               "stopped": ["speed: stopped, its budget of 2 s is spent"]})
    assert "| pytorch | on | 120 | - | - |" in text and text.endswith("\nspeed: stopped, its budget of 2 s is spent\n")
