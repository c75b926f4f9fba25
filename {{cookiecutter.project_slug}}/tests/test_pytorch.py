"""What is particular to the plain-PyTorch entry point (the shared behaviour is in test_parity)."""

import subprocess

import pytest

from conftest import ROOT, launch_cmd


@pytest.mark.slow
def test_pytorch_entry_refuses_deepspeed(env, tmp_path):
    cmd = launch_cmd("pytorch", 1) + ["--deepspeed", "configs/deepspeed/zero2.json", "--output_dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: train_pytorch does not run DeepSpeed; use train_accelerate or train_trainer with "
        "--deepspeed, or drop --deepspeed")
