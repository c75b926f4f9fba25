"""FSDP2 in train_pytorch, run for real on gloo: accumulation under each gradient-sync mode equals
one process taking the whole batch, each step's reduce-scatters and all-reduces are what the mode
promises, and a sharded checkpoint continues on another world size, mesh or without sharding.

Modes: full_shard over 2 processes (accumulation 4), hybrid_shard as 2 replicas x 2 shards (4
processes, accumulation 2); fsdp_grad_sync micro_step (a reduce-scatter every micro-step) or window
(one per window). The fast tier (`make test`) runs one cell of each mode.
"""

import inspect
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
)

from {{ cookiecutter.project_slug }}.config import ConfigError, load_config
from {{ cookiecutter.project_slug }}.distributed import DistEnv
from {{ cookiecutter.project_slug }}.launch import check_back_end, launch_of
from {{ cookiecutter.project_slug }}.model import build_model, load_tokenizer, model_config
from {{ cookiecutter.project_slug }}.sharding import layer_classes

from conftest import (
    ACCUM,
    GLOBAL_BATCH,
    ROOT,
    SLUG,
    TASK,
    TOL,
    Run,
    assert_same_training,
    cell,
    error_lines,
    max_abs_diff,
    max_loss_diff,
    one_error_line,
    report,
    run_entry,
)

CONFIG = str(ROOT / "configs" / "train.yaml")
MODES = {"full_shard": (2, {"fsdp": "full_shard"}),  # processes, flags
         "hybrid_shard": (4, {"fsdp": "hybrid_shard", "fsdp_replicas": 2})}
SYNCS = ("micro_step", "window")


def fsdp_run(runs, mode: str, sync: str):
    nproc, flags = MODES[mode]
    return runs("pytorch", nproc, **ACCUM, **flags, fsdp_grad_sync=sync)


def units(run) -> int:
    """FSDP units of the model: one per decoder layer, and the root."""
    return AutoConfig.from_pretrained(run.output_dir / "final_model").num_hidden_layers + 1


@pytest.mark.parametrize("mode,sync", [
    pytest.param(mode, sync, id=f"{mode}-{sync}", marks=() if (mode, sync) in (
        ("full_shard", "micro_step"), ("full_shard", "window"), ("hybrid_shard", "micro_step")) else pytest.mark.slow)
    for mode in MODES for sync in SYNCS])
def test_fsdp2_accumulation_matches_one_process_and_syncs_as_its_mode_says(runs, mode, sync):
    run, reference = fsdp_run(runs, mode, sync), cell(runs, "pytorch", 1, 1)
    nproc = MODES[mode][0]
    accum = GLOBAL_BATCH // (ACCUM["micro_batch_size"] * nproc)
    assert [(r["world_size"], r["grad_accum_steps"]) for r in run.steps] == [(nproc, accum)] * 8
    assert [r["tokens"] for r in run.steps] == [r["tokens"] for r in reference.steps]
    for ours, theirs in zip(run.steps, reference.steps, strict=True):
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=max(1e-5, TOL.loss))
    param_diff, loss_diff = max_abs_diff(run.params(), reference.params()), max_loss_diff(run, reference)
    # reduce-scatters: one per unit per synchronised micro-step; all-reduces across replicas (HSDP):
    # one per unit per window, on its last micro-step
    n = units(run)
    reduce_scatters = n * (accum if sync == "micro_step" else 1)
    all_reduces = n if mode == "hybrid_shard" else 0
    counts = [(r["reduce_scatters"], r["all_reduces"]) for r in run.steps]
    report(f"fsdp2 {TASK} {mode} {sync} ({nproc} processes x {accum}) vs 1 process: max |param diff| "
           f"{param_diff:.3g}, max |loss diff| {loss_diff:.3g}; reduce-scatters, all-reduces per step {counts[0]}")
    assert counts == [(reduce_scatters, all_reduces)] * 8
    assert "grad_sync_calls" not in run.steps[0]
    assert loss_diff <= TOL.loss
    assert param_diff <= TOL.param


@pytest.mark.slow
def test_an_fsdp2_cell_is_bitwise_the_same_twice(runs, tmp_path):
    first = fsdp_run(runs, "full_shard", "micro_step")
    again = runs.run("pytorch", 2, tmp_path / "again", {**ACCUM, "fsdp": "full_shard", "fsdp_grad_sync": "micro_step"})
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["loss"] for r in again.steps] == [r["loss"] for r in first.steps]
    assert [r["grad_norm"] for r in again.steps] == [r["grad_norm"] for r in first.steps]
    assert max_abs_diff(again.params(), first.params()) == 0.0


def test_the_final_model_of_a_sharded_run_is_one_hugging_face_folder(runs):
    run = fsdp_run(runs, "full_shard", "micro_step")
    folder = run.output_dir / "final_model"
    loader = AutoModelForCausalLM if TASK == "causal_lm" else AutoModelForSequenceClassification
    model = loader.from_pretrained(folder)
    saved = load_file(folder / "model.safetensors")
    assert {name for name, _ in model.named_parameters()} == set(saved)  # whole tensors, the tied head once
    for name, param in model.named_parameters():
        assert param.shape == saved[name].shape and param.detach().equal(saved[name])
    assert (folder / "tokenizer.json").is_file()


@pytest.mark.slow
def test_a_sharded_checkpoint_continues_on_other_world_sizes_meshes_and_unsharded(runs, tmp_path):
    """One run of 8 steps in five jobs, each continuing the one before from its checkpoint:
    full_shard on 2 processes -> HSDP 2x2 on 4 (2 -> 4, FSDP -> HSDP) -> full_shard on 2 (HSDP ->
    FSDP) -> no sharding on 1 process (a sharded checkpoint gathered whole) -> full_shard on 2 (an
    unsharded checkpoint sharded). The global batch, its examples and the schedule stay; the
    parameters match the straight run."""
    straight = fsdp_run(runs, "full_shard", "micro_step")
    out = tmp_path / "run"
    full_shard = {"fsdp": "full_shard", "micro_batch_size": 2}
    hops = [(2, 2, full_shard), (4, 2, {"fsdp": "hybrid_shard", "fsdp_replicas": 2, "micro_batch_size": 2}),
            (2, 1, full_shard), (1, 1, {"fsdp": "none", "micro_batch_size": 4}), (2, 2, full_shard)]
    step = 0
    for nproc, steps, flags in hops:
        job = runs.run("pytorch", nproc, out, {**ACCUM, **flags, "stop_after_steps": steps,
                                                "resume_from_checkpoint": "auto"})
        assert job.returncode == 0, job.stderr[-3000:]
        if step:
            assert f"resuming after step {step}" in job.stdout
        step += steps
        if step < 8:
            checkpoint = out / "checkpoints" / f"step_{step}"
            assert (checkpoint / "dcp").is_dir() == (flags["fsdp"] != "none")
            assert (checkpoint / "model.safetensors").is_file() == (flags["fsdp"] == "none")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert [r["world_size"] for r in steps] == [2, 2, 4, 4, 2, 1, 2, 2]
    assert [r["tokens"] for r in steps] == [r["tokens"] for r in straight.steps]
    assert [r["lr"] for r in steps] == [r["lr"] for r in straight.steps]
    diff = max_abs_diff(load_file(out / "final_model" / "model.safetensors"), straight.params())
    loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(steps, straight.steps, strict=True))
    report(f"fsdp2 resharded resume 2 -> 4 (HSDP) -> 2 -> 1 (unsharded) -> 2: max |param diff| vs straight "
           f"{diff:.3g}, max |loss diff| {loss_diff:.3g}")
    assert diff <= 1e-6 and loss_diff <= TOL.loss

def test_the_layers_to_shard_are_named_or_the_models_and_none_found_is_one_line(runs, tmp_path):
    """fsdp_layer_classes, else the model's _no_split_modules; names that match no module would leave
    FSDP2 one unit, the whole model: one line naming the model and the key, before any waiting."""
    cfg = load_config(["--config", CONFIG, "--fsdp", "full_shard"])
    model = build_model(cfg, model_config(cfg, load_tokenizer(cfg)))
    name = type(model).__name__
    assert layer_classes(model, cfg) == {"LlamaDecoderLayer"}
    model._no_split_modules = ["DecoderLayer"]  # as another version of the model's code might name it
    cfg.fsdp_layer_classes = "LlamaDecoderLayer, LlamaRMSNorm"
    assert layer_classes(model, cfg) == {"LlamaDecoderLayer", "LlamaRMSNorm"}
    cfg.fsdp_layer_classes = ""
    with pytest.raises(ConfigError) as refused:
        layer_classes(model, cfg)
    assert str(refused.value) == (f"fsdp: {name} has no module of a class its _no_split_modules names (DecoderLayer), "
                                  "so FSDP2 would shard only the whole model; set fsdp_layer_classes to the class "
                                  "names of its layers (its repeated blocks: LlamaDecoderLayer)")
    run = run_entry("pytorch", 1, tmp_path / "out", runs.env,
                    {"fsdp": "full_shard", "fsdp_layer_classes": "LlamaDecoderLayr", "max_steps": 1})
    one_error_line(run, f"fsdp: {name} has no module of a class fsdp_layer_classes names (LlamaDecoderLayr), so")


@pytest.mark.parametrize("flags,entry,world_size,expected", [
    (["--fsdp", "full_shard"], "accelerate", 2, "fsdp full_shard is train_pytorch's FSDP2; train_accelerate shards"),
    (["--fsdp", "full_shard"], "trainer", 2, "fsdp full_shard is train_pytorch's FSDP2; train_trainer shards"),
    (["--fsdp", "hybrid_shard", "--fsdp_replicas", "3"], "pytorch", 4,
     "fsdp_replicas 3 does not divide the world size 4"),
    (["--fsdp", "full_shard", "--ddp_no_sync", "false"], "pytorch", 2, "ddp_no_sync false is DDP's"),
    (["--fsdp", "full_shard", "--micro_batch_size", "auto"], "pytorch", 2, "micro_batch_size auto measures DDP's"),
    (["--async_checkpoint", "true"], "pytorch", 2, "async_checkpoint writes sharded checkpoints in the background"),
    (["--fsdp", "full_shard", "--optimizer", "adafactor"], "pytorch", 2, "optimizer adafactor keeps factored"),
])
def test_fsdp_keys_that_cannot_apply_are_one_line(flags, entry, world_size, expected):
    cfg = load_config(["--config", CONFIG, *flags])
    env = DistEnv(0, 0, world_size, world_size, torch.device("cpu"))
    with pytest.raises(ConfigError, match=f"^{expected}"):
        check_back_end(cfg, env, launch_of(cfg, entry))


@pytest.mark.parametrize("flags,expected", [
    (["--fsdp", "full_shard", "--fsdp_replicas", "2"], "fsdp_replicas 2 needs fsdp hybrid_shard"),
    (["--fsdp", "hybrid_shard", "--fsdp_replicas", "0"], "fsdp_replicas must be >= 1, got 0"),
    (["--fsdp", "zero3"], "argument --fsdp: invalid choice: 'zero3'"),
    (["--fsdp_grad_sync", "never"], "argument --fsdp_grad_sync: invalid choice: 'never'"),
])
def test_fsdp_settings_out_of_range_are_one_line(flags, expected):
    with pytest.raises(ConfigError, match=f"^{expected}"):
        load_config(["--config", CONFIG, *flags])


# train_pytorch with DCP's async_save wrapped: rank 0 is killed (SIGKILL) right after it starts
# writing step 8's checkpoint in the background, while the shards are still being written.
KILLED_IN_FLIGHT = f"""import os, signal, sys
import torch.distributed.checkpoint as dcp
from {SLUG} import train_pytorch
started = dcp.async_save

def killing(state, *, checkpoint_id, **kwargs):
    written = started(state, checkpoint_id=checkpoint_id, **kwargs)
    if "step_8" in str(checkpoint_id) and os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    return written

dcp.async_save = killing
train_pytorch.main()
"""


def wrapped_run(script: str, flags: dict, out, env: dict) -> Run:
    """train_pytorch on 2 processes through `script` (train_pytorch with a library call wrapped),
    written beside `out`."""
    path = out.with_name(f"{out.name}_wrapped.py")
    path.write_text(script)
    return run_entry("pytorch", 2, out, env, flags, script=(path,))


@pytest.mark.slow
def test_a_job_killed_while_an_asynchronous_checkpoint_is_written_resumes_from_the_one_before(runs, tmp_path):
    flags, out = {**ACCUM, "fsdp": "full_shard", "async_checkpoint": "true", "save_steps": 4}, tmp_path / "out"
    proc = wrapped_run(KILLED_IN_FLIGHT, flags, out, runs.env)
    assert proc.returncode == 1 and "exitcode  : -9" in proc.stderr, proc.stderr[-3000:]
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == [".tmp_step_8", "step_4"], checkpoints  # step 8's shards half-written, unpublished
    assert (out / "checkpoints" / "step_4" / "dcp" / ".metadata").is_file()
    assert not (out / "checkpoints" / ".tmp_step_8" / "state.json").exists()

    resumed = runs.run("pytorch", 2, out, {**flags, "resume_from_checkpoint": "auto"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming after step 4" in resumed.stdout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_4", "step_8"]
    assert_same_training(resumed, fsdp_run(runs, "full_shard", "micro_step"))


# train_pytorch with async_save wrapped: both processes are killed (SIGKILL) as step 7 begins, once
# step 4's background write is done (rank 0 gives the checkpoint up to 60 s to appear), nothing
# having waited for it in the loop (the next save, step 8, would)
KILLED_AFTER_WRITTEN = f"""import os, signal, time
import torch.distributed.checkpoint as dcp
from {SLUG} import session, train_pytorch
started, writes = dcp.async_save, []

def recorded(state, *, checkpoint_id, **kwargs):
    writes.append(started(state, checkpoint_id=checkpoint_id, **kwargs))
    return writes[-1]

def at_step(step):
    if step == 7:
        writes[-1].exception()  # its write is done (or failed)
        published = time.monotonic() + 60
        while os.environ["RANK"] == "0" and time.monotonic() < published and not os.path.exists(os.path.join(
                os.environ["OUTPUT_DIR"], "checkpoints", "step_4", "state.json")):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

dcp.async_save, session.at_step = recorded, at_step
train_pytorch.main()
"""


@pytest.mark.slow
def test_a_job_killed_after_an_asynchronous_checkpoint_was_written_resumes_from_it(runs, tmp_path):
    flags, out = {**ACCUM, "fsdp": "full_shard", "async_checkpoint": "true", "save_steps": 4}, tmp_path / "out"
    proc = wrapped_run(KILLED_AFTER_WRITTEN, flags, out, {**runs.env, "OUTPUT_DIR": str(out)})
    assert proc.returncode == 1 and "exitcode  : -9" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_4"], proc.stdout[-3000:]
    steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps[-1] == 6  # killed as step 7 began, 2 steps after step 4's checkpoint

    resumed = runs.run("pytorch", 2, out, {**flags, "resume_from_checkpoint": "auto"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming after step 4 from {out / 'checkpoints' / 'step_4'}" in resumed.stdout
    assert_same_training(resumed, fsdp_run(runs, "full_shard", "micro_step"))


# train_pytorch with DCP's host copy recorded: for each background save, the stager and the host
# buffers it copied the state into (the data pointers of every tensor it staged), as JSON per rank
STAGING_RECORDED = f"""import json, os
import torch
from torch.distributed.checkpoint import staging
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves
from {SLUG} import train_pytorch
stage, saves = staging.DefaultStager.stage, []

def recorded(self, state_dict, **kwargs):
    staged = stage(self, state_dict, **kwargs)
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tree_leaves(staged) if isinstance(t, torch.Tensor)]
    saves.append(dict(stager=id(self), buffers=[t.untyped_storage().data_ptr() for t in local]))
    with open(os.path.join(os.environ["OUTPUT_DIR"], "staged_" + os.environ["RANK"] + ".json"), "w") as f:
        json.dump(saves, f)
    return staged

staging.DefaultStager.stage = recorded
train_pytorch.main()
"""


@pytest.mark.slow
def test_background_saves_copy_into_the_host_buffers_of_the_first(runs, tmp_path):
    """One stager for the run: step 8's save copies into step 4's host buffers, and what it writes is
    step 8's state (the final weights); the training is bitwise that of a run without them."""
    flags, out = {**ACCUM, "fsdp": "full_shard", "async_checkpoint": "true", "save_steps": 4}, tmp_path / "out"
    proc = wrapped_run(STAGING_RECORDED, flags, out, {**runs.env, "OUTPUT_DIR": str(out)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        first, second = json.loads((out / f"staged_{rank}.json").read_text())
        assert first["stager"] == second["stager"]
        assert first["buffers"] == second["buffers"] and all(first["buffers"])
    final = load_file(out / "final_model" / "model.safetensors")
    staged = {"model": {name: torch.empty_like(value) for name, value in final.items()}}
    dcp.load(staged, checkpoint_id=out / "checkpoints" / "step_8" / "dcp", no_dist=True)
    assert all(torch.equal(staged["model"][name], value) for name, value in final.items())
    background = Run(proc.returncode, proc.stdout, proc.stderr, out)
    assert_same_training(background, fsdp_run(runs, "full_shard", "micro_step"))


# train_pytorch with DCP's writes wrapped: from step 4's checkpoint on no file may grow past 100 kB
# (write() then fails with EFBIG, as a full disk with ENOSPC): its shards do not fit
FULL_AT_STEP_4 = f"""import resource, signal
import torch.distributed.checkpoint as dcp
from {SLUG} import train_pytorch

def filling(save):
    def save_until_full(state, *, checkpoint_id, **kwargs):
        if "step_4" in str(checkpoint_id):
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
        return save(state, checkpoint_id=checkpoint_id, **kwargs)
    return save_until_full

dcp.save, dcp.async_save = filling(dcp.save), filling(dcp.async_save)
train_pytorch.main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("async_checkpoint", ["false", "true"])
def test_a_full_disk_while_a_sharded_checkpoint_is_written_is_one_line_per_process(runs, tmp_path, async_checkpoint):
    """As DDP's (test_faults.py): DCP's error (a BaseException, every rank alike) is the one line of
    each process, in the background too; the partial folder is removed, the one before kept."""
    flags = {**ACCUM, "fsdp": "full_shard", "save_steps": 2, "async_checkpoint": async_checkpoint}
    out = tmp_path / "out"
    proc = wrapped_run(FULL_AT_STEP_4, flags, out, runs.env)
    one_error_line(proc, "error: could not write step_4 (OSError: [Errno 27] File too large); the newest complete "
                   f"checkpoint is {out / 'checkpoints' / 'step_2'}: free space", code=1, workers=2)
    assert "exitcode  : 1" in proc.stderr and len(error_lines(proc.stderr)) == 2, proc.stderr[-3000:]
    assert not re.search(r"\[rank\d\]: Traceback|CheckpointException", proc.stderr), proc.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]  # partial writes removed


@pytest.mark.slow
def test_a_shard_damaged_in_place_is_one_line_naming_the_checkpoint_that_loads(runs, tmp_path):
    """Bytes overwritten inside a shard, its size kept: the checksums state.json records catch it,
    and the resume stops with one line per process naming the shard and the older checkpoint that loads."""
    flags, out = {**ACCUM, "fsdp": "full_shard", "save_steps": 2}, tmp_path / "out"
    first = runs.run("pytorch", 2, out, {**flags, "stop_after_steps": 4})
    assert first.returncode == 0, first.stderr[-3000:]
    newest, older = out / "checkpoints" / "step_4", out / "checkpoints" / "step_2"
    shard = max((newest / "dcp").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with shard.open("r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(b"\xff" * 4096)
    resumed = run_entry("pytorch", 2, out, runs.env, {**flags, "resume_from_checkpoint": "auto"})  # torchrun
    assert not re.search(r"\[rank\d\]: Traceback", resumed.stderr), resumed.stderr[-3000:]  # (torchrun prints its own)
    line = one_error_line(resumed, f"error: checkpoint {newest} cannot be loaded: {shard} does not hold what was "
                          "written (checksum)", code=1, workers=2)  # 1: torchrun's code for workers that exited 2
    assert line.endswith(f"the older checkpoint {older} loads: --resume_from_checkpoint {older}"), line
    shutil.rmtree(newest)
    again = runs.run("pytorch", 2, out, {**flags, "resume_from_checkpoint": "auto"})
    assert again.returncode == 0 and f"resuming after step 2 from {older}" in again.stdout, again.stderr[-3000:]


class LiveBytes(TorchDispatchMode):
    """The most bytes of storage that ops made (a DTensor's: its local tensor's) alive at once."""

    def __init__(self):
        super().__init__()
        self.alive, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.alive = {ptr: (ref, size) for ptr, (ref, size) in self.alive.items() if not ref.expired()}
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            tensor = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
            if type(tensor) in (torch.Tensor, torch.nn.Parameter) and not tensor.is_meta:  # not a collective's yet
                storage = tensor.untyped_storage()
                self.alive.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(size for _, size in self.alive.values()))
        return out


# train_pytorch's sharded start on its own, on each process: the model as Sharded builds it, each
# parameter's shard with where it lies in the whole tensor, the buffers, the random state after it,
# and the most bytes of host tensors alive at once while it was built (LiveBytes); then its weights
# written as final_model/'s, with the most bytes of host tensors alive at once while they were
SHARDED_START = f"""import os
import sys
from pathlib import Path
from types import SimpleNamespace
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed.tensor import DTensor
from {SLUG}.config import load_config
from {SLUG}.distributed import dist_env
from {SLUG}.model import load_tokenizer, model_config
from {SLUG} import sharding


{inspect.getsource(LiveBytes)}

config_file, *flags = sys.argv[1:]
cfg = load_config(["--config", config_file, "--fsdp", "full_shard", *flags])
out = cfg.output_dir
env = dist_env()
config = model_config(cfg, load_tokenizer(cfg))
with LiveBytes() as live:
    built = sharding.Sharded(SimpleNamespace(cfg=cfg, env=env, model_config=config, resume=None))
model = built.model
shards = dict((name, (param.to_local().clone(), [(s.start, s.stop) for s in sharding.local_slice(param)]))
              for name, param in model.named_parameters())
rng = torch.get_rng_state()
sharding.MAX_WEIGHTS_FILE_BYTES = int(os.environ.get("MAX_WEIGHTS_FILE_BYTES", sharding.MAX_WEIGHTS_FILE_BYTES))
given = []  # what the writer of the rest (save_pretrained, on rank 0) gets: an empty dict where the weights stream


def write(folder, state_dict):
    given.append(state_dict)
    if env.rank == 0:
        model.save_pretrained(folder, state_dict=state_dict)


with LiveBytes() as saving:
    built.write_weights(Path(out) / "final", write)
torch.save(dict(shards=shards, buffers=dict(model.named_buffers()), rng=rng, live_peak=live.peak,
                tied=model.lm_head.weight is model.get_input_embeddings().weight, given=given,
                saving_peak=saving.peak), Path(out) / ("rank%d.pt" % env.rank))
"""


def sharded_start(runs, tmp_path, flags: dict, nproc: int = 2, max_file_bytes: int | None = None) -> list[dict]:
    script = tmp_path / "sharded_start.py"
    script.write_text(SHARDED_START)
    env = {**runs.env, **({"MAX_WEIGHTS_FILE_BYTES": str(max_file_bytes)} if max_file_bytes else {})}
    proc = run_entry("pytorch", nproc, tmp_path, env, flags, script=(script, CONFIG))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(nproc)]


def assert_same_start(ranks: list[dict], whole: torch.nn.Module, final: Path, indexed: bool = False) -> None:
    """Each process's shards are its slices of the unsharded start's parameters, bitwise; they cover
    every parameter once; the buffers are the same; the tied head is the embedding. final_model/'s
    weights are the whole parameters (in several files with their index where `indexed`), as
    save_pretrained names them (a tied one once), written with no process holding them all at
    once; from_pretrained loads them."""
    params = dict(whole.named_parameters())
    for rank in ranks:
        assert set(rank["shards"]) == set(params)
        for name, (local, where) in rank["shards"].items():
            assert torch.equal(local, params[name].detach()[tuple(slice(*span) for span in where)]), name
        for name, buffer in whole.named_buffers():
            assert torch.equal(rank["buffers"][name], buffer), name
        assert rank["tied"] == (whole.lm_head.weight is whole.get_input_embeddings().weight)
    for name, param in params.items():
        assert sum(rank["shards"][name][0].numel() for rank in ranks) == param.numel(), name
    index = final / "model.safetensors.index.json"
    names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if indexed else ["model.safetensors"]
    assert len(names) > 1 if indexed else not index.exists()
    assert not (final / "sharded").exists()
    written = {name: value for file in names for name, value in load_file(final / file).items()}
    assert written.keys() == params.keys() and all(torch.equal(written[name], params[name]) for name in params)
    loaded = dict(type(whole).from_pretrained(final).named_parameters())
    assert all(torch.equal(loaded[name], params[name]) for name in params)
    model_bytes = sum(p.numel() * p.element_size() for p in params.values())
    saving = [rank["saving_peak"] / model_bytes for rank in ranks]
    report(f"final_model/ of a sharded model on {len(ranks)} processes, {len(names)} file(s): host tensors alive "
           f"at once {max(saving):.2f} x the model")
    assert all(rank["given"] == [{}] for rank in ranks) and max(saving) < 0.75


def test_the_sharded_start_is_the_unsharded_start_and_no_process_holds_the_whole_model(runs, tmp_path):
    """tiny, drawn by the model's own init shard by shard: bitwise today's whole start, the random
    state after it too; and each process's host tensors alive at once stay well under the whole
    model's bytes (the unsharded start, measured the same way, holds all of them)."""
    ranks = sharded_start(runs, tmp_path, {})
    cfg = load_config(["--config", CONFIG, "--fsdp", "full_shard"])
    config = model_config(cfg, load_tokenizer(cfg))
    whole = build_model(cfg, config)
    rng = torch.get_rng_state()
    assert_same_start(ranks, whole, tmp_path / "final")
    assert all(torch.equal(rank["rng"], rng) for rank in ranks)
    model_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    live = LiveBytes()
    with live:
        build_model(cfg, config)
    peaks = [rank["live_peak"] / model_bytes for rank in ranks]
    report(f"sharded start, tiny on 2 processes: host tensors alive at once {max(peaks):.2f} x the model "
           f"(the unsharded start: {live.peak / model_bytes:.2f} x)")
    assert live.peak >= model_bytes and max(peaks) < 0.75


def test_a_pretrained_folder_starts_sharded_from_slices_of_its_files(runs, tmp_path):
    """A GPT-2 folder (Conv1D, tied head) written in two safetensors files with an index: each
    process reads its slices only; the same parameters as from_pretrained's whole load. Its
    final_model/ weights, in files of at most 100 kB, come with their index."""
    cfg = load_config(["--config", CONFIG])
    tokenizer = load_tokenizer(cfg)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=128,
                        tie_word_embeddings=True)
    torch.manual_seed(1)
    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(config).save_pretrained(folder, max_shard_size="100KB")
    tokenizer.save_pretrained(folder)
    assert (folder / "model.safetensors.index.json").is_file()
    ranks = sharded_start(runs, tmp_path, {"model_name_or_path": str(folder)}, max_file_bytes=100_000)
    cfg = load_config(["--config", CONFIG, "--fsdp", "full_shard", "--model_name_or_path", str(folder)])
    assert_same_start(ranks, build_model(cfg, model_config(cfg, load_tokenizer(cfg))), tmp_path / "final", indexed=True)
