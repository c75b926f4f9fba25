"""Accelerate's FSDP, which train_accelerate and train_trainer run: where it is refused (launch.py), the
Accelerator each entry point builds under configs/accelerate/fsdp.yaml (model.py's accelerate_fsdp_plugin),
training like DDP on GPUs, and gradient norms of FSDP2's sharded gradients (distributed.py's full_norm).
docs/memory.md, "Memory levers"."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from accelerate.utils import FullyShardedDataParallelPlugin

from {{ cookiecutter.project_slug }}.config import load_config
from {{ cookiecutter.project_slug }}.launch import Launch
from {{ cookiecutter.project_slug }}.model import fsdp_mixed_precision

from conftest import (
    ACCUM,
    ENTRIES,
    GPUS,
    LAUNCH_TIMEOUT_S,
    ROOT,
    TOL,
    accelerate_launch,
    flag_args,
    free_port,
    launch_cmd,
    max_abs_diff,
    one_error_line,
    report,
    run_entry,
)

CONFIG = str(ROOT / "configs" / "train.yaml")


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "configs" / "accelerate" / "fsdp.yaml").exists(), reason="no accelerate configs")
def test_fsdp_is_refused_where_it_would_not_run(env, tmp_path):
    """Accelerate turns on FSDP only on GPUs: on CPU it would train DDP without a word, so every
    entry point refuses; train_pytorch refuses Accelerate's FSDP everywhere (it has its own, --fsdp)."""
    fsdp_env = {**env, "ACCELERATE_USE_FSDP": "true"}
    entries = ENTRIES if GPUS == 0 else ["pytorch"]
    for entry in entries:
        run = run_entry(entry, 1, tmp_path / entry, fsdp_env)
        one_error_line(run, "error: train_pytorch shards with its own --fsdp full_shard" if entry == "pytorch"
                       else "error: FSDP needs GPUs")


@pytest.mark.slow
@pytest.mark.skipif(GPUS < 2 or "accelerate" not in ENTRIES, reason="FSDP runs on GPUs (2 needed)")
def test_fsdp_trains_like_ddp(runs, tmp_path):
    ddp = runs("accelerate", 2, **ACCUM)
    fsdp = accelerate_launch("fsdp", 2, runs.env, tmp_path / "fsdp", *flag_args(ACCUM))
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert "grad_sync_calls" not in fsdp.steps[0]  # FSDP, not DDP, reduced the gradients
    diff = max_abs_diff(fsdp.params(), ddp.params())
    report(f"FSDP vs DDP (2 GPUs x accumulation 4): max |param diff| {diff:.3g}")
    assert diff <= TOL.param



@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fsdp_reduces_and_accumulates_gradients_in_fp32(precision):
    """train_accelerate's FSDP plugin under mixed precision: the forward in bf16/fp16, the gradient
    reduce (and with it the accumulation of unsynchronised micro-steps) in fp32; Accelerate keeps
    the policy when it applies its own mixed precision. (FSDP runs on GPUs only.)"""
    cfg = load_config(["--config", CONFIG, "--mixed_precision", precision])
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=fsdp_mixed_precision(cfg))
    plugin.set_mixed_precision(precision)  # as AcceleratorState does
    policy = plugin.mixed_precision_policy
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (dtype, torch.float32, dtype)
    assert fsdp_mixed_precision(load_config(["--config", CONFIG])) is None

FSDP2_NORM = """
import copy, os, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from {{ cookiecutter.project_slug }}.distributed import full_norm, sum_and_read
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 2))
whole = copy.deepcopy(model)
fully_shard(model)
x = torch.randn(8, 16)  # the same batch on both ranks: the averaged gradients are the whole model's
model(x).sum().backward()
whole(x).sum().backward()
expected = torch.nn.utils.get_total_norm([p.grad for p in whole.parameters()]).item()
local = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
clipped = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
assert isinstance(clipped, DTensor) and isinstance(local, DTensor)
record = sum_and_read([torch.tensor(3.0)], [clipped])[1]  # as Session.read_step reads the record's norm
shards = torch.nn.utils.get_total_norm([p.grad.to_local() for p in model.parameters()]).item()
# one write per line (print writes its parts one by one, and the 2 ranks share torchrun's stdout)
os.write(1, f"{dist.get_rank()} {record} {full_norm(local).item()} {shards} {expected}\\n".encode())
dist.barrier()
os._exit(0)  # not the group's teardown: after FSDP2, gloo's now and then aborts the interpreter's exit
"""


@pytest.mark.slow
def test_fsdp2_gradient_norms_are_the_whole_models(env, tmp_path):
    """Under FSDP2 a gradient norm is a DTensor, which `.tolist()` refuses: the record's grad_norm,
    and the norm the Trainer's callback reads (full_norm), are the whole model's, not a shard's."""
    script = tmp_path / "fsdp2_norm.py"
    script.write_text(FSDP2_NORM)
    proc = subprocess.run(launch_cmd(ENTRIES[0], 2, (script,)), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted(line.split() for line in proc.stdout.splitlines() if line[:1] in "01")
    assert [row[0] for row in rows] == ["0", "1"], proc.stdout
    for _, record, callback, shard, expected in rows:
        assert abs(float(record) - float(expected)) <= 1e-6 * float(expected)
        assert abs(float(callback) - float(expected)) <= 1e-6 * float(expected)
        assert float(shard) < float(expected) * (1 - 1e-3)  # this rank's shards' norm alone would be wrong
    report(f"FSDP2 gradient norm on 2 ranks: record {rows[0][1]}, whole model {rows[0][4]}, "
           f"shard alone {rows[0][3]} / {rows[1][3]}")


# An entry point under `accelerate launch --config_file configs/accelerate/fsdp.yaml` on CPU: its start
# checked as on GPUs (where Accelerate enables FSDP; on CPU the entry points refuse it), then each process
# records the Accelerator the entry point builds and stops. On GPUs Accelerate takes the FSDP plugin given,
# else builds one from the launch config, and sets its precision (AcceleratorState): that plugin is recorded.
FSDP_ACCELERATOR = textwrap.dedent("""
    import dataclasses, importlib, json, os, sys
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import trainer
    from {{ cookiecutter.project_slug }} import startup

    checked = startup.check_back_end

    def on_gpus(cfg, env, launch):
        checked(cfg, dataclasses.replace(env, device=torch.device("cuda")), launch)

    class Recorded(Accelerator):
        def __init__(self, *args, fsdp_plugin=None, **kwargs):
            super().__init__(*args, fsdp_plugin=fsdp_plugin, **kwargs)
            plugin = fsdp_plugin or FullyShardedDataParallelPlugin()
            plugin.set_mixed_precision(self.mixed_precision)
            policy = plugin.mixed_precision_policy
            record = {"world_size": self.num_processes, "fsdp_version": plugin.fsdp_version,
                      "sync_each_batch": self.gradient_state.plugin_kwargs.get("sync_each_batch", False),
                      "param_dtype": str(policy.param_dtype), "reduce_dtype": str(policy.reduce_dtype)}
            with open(os.path.join(os.environ["RECORD_DIR"], f"rank{dist.get_rank()}.json"), "w") as f:
                json.dump(record, f)
            dist.barrier()
            os._exit(0)

    startup.check_back_end = on_gpus
    entry = importlib.import_module("{{ cookiecutter.project_slug }}.train_" + sys.argv.pop(1))
    entry.Accelerator = trainer.Accelerator = Recorded
    entry.main()
""")


@pytest.mark.parametrize("entry", [entry for entry in ("accelerate", "trainer") if entry in ENTRIES])
def test_accelerates_fsdp_reduce_scatters_every_micro_step_in_fp32(entry, env, tmp_path):
    """Accelerate's FSDP2 (configs/accelerate/fsdp.yaml) in bf16 on 2 processes: the Accelerator that
    train_accelerate and the Trainer build syncs every micro-batch (FSDP2 then reduce-scatters each
    micro-step and keeps sharded gradients, as fsdp_grad_sync micro_step says) and its plugin reduces
    in fp32; fsdp_grad_sync window, and DDP without ddp_no_sync, as Launch.sync_each_batch says."""
    script, records = tmp_path / "fsdp_accelerator.py", tmp_path / "records"
    script.write_text(FSDP_ACCELERATOR)
    records.mkdir()
    flags = {"micro_batch_size": 2, "global_batch_size": 16, "max_steps": 4, "mixed_precision": "bf16"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/fsdp.yaml",
           "--num_processes", "2", "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
           str(script), entry, *flag_args(flags), "--output_dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "RECORD_DIR": str(records)}, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = [json.loads((records / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert built == [{"world_size": 2, "fsdp_version": 2, "sync_each_batch": True, "param_dtype": "torch.bfloat16",
                      "reduce_dtype": "torch.float32"}] * 2
    cfg = load_config(["--config", CONFIG, "--fsdp_grad_sync", "window"])
    assert [Launch(entry, "", fsdp).sync_each_batch(cfg) for fsdp in (True, False)] == [False, False]
    cfg.ddp_no_sync = False
    assert [Launch(entry, "", fsdp).sync_each_batch(cfg) for fsdp in (True, False)] == [False, True]
